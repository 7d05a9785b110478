"""Contract tests: the local service answers like TEI 1.9.3 (hash backend over real HTTP)."""

from __future__ import annotations

import base64
import json

import httpx2
import numpy as np
import pytest
from local_tei_support import HASH_CONFIG, StartServer, TEISchemas, http_client

from quarry.local_tei import LocalTEIConfig, LocalTEIServer

MAX_LEN = HASH_CONFIG.effective_max_input_length
MAX_BATCH = HASH_CONFIG.max_client_batch_size
TEXTS = ["the cat sat on the mat", "a dog barked at the mailman", "stock markets fell today"]


def _words(n: int) -> str:
    # The hash tokenizer makes one token per word, plus [CLS] and [SEP].
    return " ".join(f"w{i}" for i in range(n))


# ------------------------------------------------------------------------------ health, info


def test_health_is_200_with_an_empty_body(client: httpx2.Client, tei_schemas: TEISchemas) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    assert tei_schemas.check_response("/health", "GET", response) is None


def test_info_matches_the_schema_and_the_configuration(
    client: httpx2.Client, tei_schemas: TEISchemas
) -> None:
    info = tei_schemas.check_response("/info", "GET", client.get("/info"))
    assert info["model_id"] == "quarry/hash-embedding-384d"
    assert info["served_model_name"] == info["model_id"]
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "float32"
    assert info["max_input_length"] == MAX_LEN
    assert info["max_client_batch_size"] == MAX_BATCH
    assert info["max_batch_tokens"] == HASH_CONFIG.max_batch_tokens
    assert info["max_concurrent_requests"] == HASH_CONFIG.max_concurrent_requests
    assert info["auto_truncate"] is False
    assert info["version"] == "1.9.3"
    assert len(info["model_sha"]) == 40
    assert "not a cross-encoder" in info["rerank_model_id"]


def test_engine_version_is_reported(start_server: StartServer) -> None:
    server = start_server(engine_version="1.9.4")
    with http_client(server.url) as http:
        assert http.get("/info").json()["version"] == "1.9.4"


# ------------------------------------------------------------------------------------ /embed


def test_embed_batch_returns_unit_vectors(client: httpx2.Client, tei_schemas: TEISchemas) -> None:
    response = client.post("/embed", json={"inputs": TEXTS})
    assert response.status_code == 200
    vectors = np.array(tei_schemas.check_response("/embed", "POST", response))
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert int(response.headers["x-compute-tokens"]) == sum(len(t.split()) + 2 for t in TEXTS)


def test_embed_single_string_is_a_batch_of_one(client: httpx2.Client) -> None:
    single = client.post("/embed", json={"inputs": TEXTS[0]}).json()
    batch = client.post("/embed", json={"inputs": [TEXTS[0]]}).json()
    assert len(single) == 1
    assert single == batch


def test_embed_normalize_false_and_dimensions(client: httpx2.Client) -> None:
    raw = np.array(client.post("/embed", json={"inputs": TEXTS[0], "normalize": False}).json()[0])
    unit = np.array(client.post("/embed", json={"inputs": TEXTS[0]}).json()[0])
    np.testing.assert_allclose(raw / np.linalg.norm(raw), unit, atol=1e-6)
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-4  # the pooled vector is not normalised
    short = np.array(client.post("/embed", json={"inputs": TEXTS[0], "dimensions": 64}).json()[0])
    assert short.shape == (64,)
    np.testing.assert_allclose(short, raw[:64] / np.linalg.norm(raw[:64]), atol=1e-6)


def test_embed_token_ids_input(client: httpx2.Client) -> None:
    ids = [t["id"] for t in client.post("/tokenize", json={"inputs": TEXTS[0]}).json()[0]]
    by_ids = client.post("/embed", json={"inputs": [ids]})
    assert by_ids.status_code == 200
    assert np.array(by_ids.json()).shape == (1, 384)


def test_embed_input_over_the_limit_is_refused_with_teis_message(
    client: httpx2.Client, tei_schemas: TEISchemas
) -> None:
    given = MAX_LEN + 1
    response = client.post("/embed", json={"inputs": ["short", _words(given - 2)]})
    assert response.status_code == 422
    body = tei_schemas.check_response("/embed", "POST", response)
    assert body == {
        "error": f"Input validation error: `inputs` must have less than {MAX_LEN} tokens. "
        f"Given: {given}",
        "error_type": "Validation",
    }


def test_embed_input_exactly_at_the_limit_is_accepted(client: httpx2.Client) -> None:
    response = client.post("/embed", json={"inputs": _words(MAX_LEN - 2)})
    assert response.status_code == 200
    assert response.headers["x-compute-tokens"] == str(MAX_LEN)


def test_truncate_true_accepts_and_cuts_to_the_limit(client: httpx2.Client) -> None:
    text = _words(MAX_LEN * 2)
    right = client.post("/embed", json={"inputs": text, "truncate": True})
    assert right.status_code == 200
    assert right.headers["x-compute-tokens"] == str(MAX_LEN)
    left = client.post(
        "/embed", json={"inputs": text, "truncate": True, "truncation_direction": "Left"}
    )
    assert left.status_code == 200
    assert right.json() != left.json()  # the other end of the text was kept
    kept = client.post("/embed", json={"inputs": _words(MAX_LEN - 2), "truncate": True})
    untouched = client.post("/embed", json={"inputs": _words(MAX_LEN - 2)})
    assert kept.json() == untouched.json()


def test_batch_over_max_client_batch_size_is_422(
    client: httpx2.Client, tei_schemas: TEISchemas
) -> None:
    response = client.post("/embed", json={"inputs": ["x"] * (MAX_BATCH + 1)})
    assert response.status_code == 422
    assert tei_schemas.check_response("/embed", "POST", response) == {
        "error": f"batch size {MAX_BATCH + 1} > maximum allowed batch size {MAX_BATCH}",
        "error_type": "Validation",
    }


@pytest.mark.parametrize(
    ("path", "inputs", "message"),
    [
        # serde reads [] as one empty list of token ids, which the tokenizer refuses.
        ("/embed", [], "Input validation error: `inputs` cannot be empty"),
        ("/embed", "", "Input validation error: `inputs` cannot be empty"),
        ("/embed", ["ok", ""], "Input validation error: `inputs` cannot be empty"),
        ("/tokenize", [], "`inputs` cannot be empty"),
        ("/tokenize", "", "Input validation error: `inputs` cannot be empty"),
    ],
)
def test_empty_input_is_400_empty(
    client: httpx2.Client, tei_schemas: TEISchemas, path: str, inputs: object, message: str
) -> None:
    response = client.post(path, json={"inputs": inputs})
    assert response.status_code == 400
    assert tei_schemas.check_response(path, "POST", response) == {
        "error": message,
        "error_type": "Empty",
    }


def test_prompt_name_without_prompts_is_refused(client: httpx2.Client) -> None:
    response = client.post("/embed", json={"inputs": "q", "prompt_name": "query"})
    assert response.status_code == 422
    assert "no prompts were found" in response.json()["error"]
    # An empty input is refused as empty first, as TEI's tokenizer does.
    for path in ("/embed", "/tokenize"):
        empty = client.post(path, json={"inputs": "", "prompt_name": "query"})
        assert (empty.status_code, empty.json()["error_type"]) == (400, "Empty")


# --------------------------------------------------------------------------- /v1/embeddings


def test_openai_embeddings_float_and_base64_agree(
    client: httpx2.Client, tei_schemas: TEISchemas
) -> None:
    as_float = client.post("/v1/embeddings", json={"input": TEXTS, "model": "anything"})
    as_b64 = client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
    floats = tei_schemas.check_response("/v1/embeddings", "POST", as_float)
    b64 = tei_schemas.check_response("/v1/embeddings", "POST", as_b64)
    assert floats["object"] == "list"
    assert floats["model"] == "quarry/hash-embedding-384d"
    assert [d["index"] for d in floats["data"]] == [0, 1, 2]
    tokens = sum(len(t.split()) + 2 for t in TEXTS)
    assert floats["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    for f, b in zip(floats["data"], b64["data"], strict=True):
        assert f["object"] == b["object"] == "embedding"
        assert isinstance(b["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], dtype=np.float32))
    embed = client.post("/embed", json={"inputs": TEXTS}).json()
    np.testing.assert_allclose([d["embedding"] for d in floats["data"]], embed, atol=1e-7)


def test_openai_embeddings_errors_use_the_openai_error_shape(
    client: httpx2.Client, tei_schemas: TEISchemas
) -> None:
    too_long = client.post("/v1/embeddings", json={"input": _words(MAX_LEN)})
    body = tei_schemas.check_response("/v1/embeddings", "POST", too_long)
    assert too_long.status_code == 422
    assert body["code"] == 422
    assert body["error_type"] == body["type"] == "Validation"
    assert body["message"].endswith(f"must have less than {MAX_LEN} tokens. Given: {MAX_LEN + 2}")
    too_many = client.post("/v1/embeddings", json={"input": ["x"] * (MAX_BATCH + 1)})
    assert too_many.status_code == 422
    tei_schemas.check_response("/v1/embeddings", "POST", too_many)


# -------------------------------------------------------------------------------- /tokenize


def test_tokenize_returns_tokens_with_byte_offsets(
    client: httpx2.Client, tei_schemas: TEISchemas
) -> None:
    text = "Héllo, wörld"
    response = client.post("/tokenize", json={"inputs": [text, "b"]})
    tokens = tei_schemas.check_response("/tokenize", "POST", response)
    first = tokens[0]
    assert [t["special"] for t in first] == [True, False, False, False, True]
    assert first[0]["text"] == "[CLS]" and first[0]["start"] is None
    raw = text.encode()
    for token in first[1:-1]:
        assert raw[token["start"] : token["stop"]].decode() == token["text"]
    assert [t["text"] for t in first[1:-1]] == ["Héllo", ",", "wörld"]
    plain = client.post("/tokenize", json={"inputs": text, "add_special_tokens": False}).json()
    assert [t["id"] for t in plain[0]] == [t["id"] for t in first[1:-1]]


def test_tokenize_counts_match_embed_validation(client: httpx2.Client) -> None:
    text = _words(MAX_LEN - 1)  # MAX_LEN + 1 tokens with the special tokens
    tokens = client.post("/tokenize", json={"inputs": text}).json()[0]
    assert len(tokens) == MAX_LEN + 1
    refused = client.post("/embed", json={"inputs": text})
    assert refused.json()["error"].endswith(f"Given: {len(tokens)}")


# ---------------------------------------------------------------------------------- /rerank


def test_rerank_is_sorted_by_score(client: httpx2.Client, tei_schemas: TEISchemas) -> None:
    texts = ["fish swim", "cats and dogs", "dogs bark"]
    response = client.post(
        "/rerank", json={"query": "cats and dogs", "texts": texts, "return_text": True}
    )
    ranks = tei_schemas.check_response("/rerank", "POST", response)
    assert [r["index"] for r in ranks] == [1, 2, 0]
    assert [r["text"] for r in ranks] == [texts[1], texts[2], texts[0]]
    scores = [r["score"] for r in ranks]
    assert scores == sorted(scores, reverse=True)
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert scores[-1] == 0.0  # no shared token


def test_rerank_raw_scores_and_no_text(client: httpx2.Client) -> None:
    body = {"query": "cats", "texts": ["cats", "dogs"]}
    ranks = client.post("/rerank", json=body).json()
    raw = client.post("/rerank", json=body | {"raw_scores": True}).json()
    assert all("text" not in r for r in ranks)
    assert [r["index"] for r in ranks] == [r["index"] for r in raw]
    assert raw[-1]["score"] < 0.0 <= ranks[-1]["score"]


def test_rerank_texts_count_against_max_client_batch_size(
    client: httpx2.Client, tei_schemas: TEISchemas
) -> None:
    response = client.post("/rerank", json={"query": "q", "texts": ["t"] * (MAX_BATCH + 1)})
    assert response.status_code == 422
    assert tei_schemas.check_response("/rerank", "POST", response)["error"] == (
        f"batch size {MAX_BATCH + 1} > maximum allowed batch size {MAX_BATCH}"
    )


def test_rerank_pair_length_counts_query_and_text(client: httpx2.Client) -> None:
    half = MAX_LEN // 2
    body = {"query": _words(half), "texts": [_words(half)]}
    refused = client.post("/rerank", json=body)
    assert refused.status_code == 422
    # [CLS] query [SEP] text [SEP]
    assert refused.json()["error"].endswith(f"Given: {2 * half + 3}")
    assert client.post("/rerank", json=body | {"truncate": True}).status_code == 200


def test_rerank_with_documents_is_a_plain_text_422_naming_texts(client: httpx2.Client) -> None:
    body = '{"query":"q","documents":["a"]}'
    response = client.post("/rerank", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("text/plain")
    # axum + serde_json report the position after the closing brace.
    assert response.text == (
        "Failed to deserialize the JSON body into the target type: "
        f"missing field `texts` at line 1 column {len(body)}"
    )


def test_deserialisation_error_position_counts_lines(client: httpx2.Client) -> None:
    body = '{\n  "query": "q",\n  "documents": ["a"]\n}'
    response = client.post("/rerank", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.text.endswith("missing field `texts` at line 4 column 1")


def test_rerank_empty_texts_is_400(client: httpx2.Client, tei_schemas: TEISchemas) -> None:
    response = client.post("/rerank", json={"query": "q", "texts": []})
    assert response.status_code == 400
    assert tei_schemas.check_response("/rerank", "POST", response) == {
        "error": "`texts` cannot be empty",
        "error_type": "Empty",
    }


def test_cohere_dialect_takes_documents_and_refuses_texts(start_server: StartServer) -> None:
    server = start_server(rerank_dialect="cohere")
    with http_client(server.url) as http:
        body = {"query": "cats", "documents": ["dogs", "cats", "cats dogs"], "top_n": 2}
        for path in ("/rerank", "/v1/rerank"):
            response = http.post(path, json=body | {"return_documents": True})
            assert response.status_code == 200
            results = response.json()["results"]
            assert [r["index"] for r in results] == [1, 2]
            assert results[0]["document"] == "cats"
            assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        refused = http.post("/rerank", json={"query": "q", "texts": ["a"]})
        assert refused.status_code == 422
        assert "missing field `documents`" in refused.text


# ----------------------------------------------------------------------- bodies and routing


def test_body_over_the_payload_limit_is_413_plain_text(client: httpx2.Client) -> None:
    big = json.dumps({"inputs": ["x" * 1000] * 200})
    assert len(big) > HASH_CONFIG.payload_limit
    response = client.post("/embed", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == "Failed to buffer the request body: length limit exceeded"
    assert client.get("/health").status_code == 200  # the connection is still usable


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        (b"{", 400, "Failed to parse the request body as JSON: "),
        (b'{"inputs": 5}', 422, "inputs: data did not match any variant of untagged enum Input"),
        (b'{"inputs": "a", "normalize": "yes"}', 422, "expected a boolean"),
        (b'{"inputs": "a", "truncation_direction": "up"}', 422, "unknown variant `up`"),
        (b"[]", 422, "invalid type: sequence, expected struct EmbedRequest"),
        (b"{}", 422, "missing field `inputs`"),
        (b'{"inputs": "a"} x', 400, "trailing characters at line 1 column 17"),
        (b'{"inputs": "a", "inputs": "b"}', 422, "duplicate field `inputs`"),
        # A repeated name inside the text, or in a nested object, is not a repeated field.
        (b'{"inputs": "say \\"inputs\\" twice"}', 200, ""),
    ],
)
def test_undeserialisable_bodies_get_axums_plain_text(
    client: httpx2.Client, body: bytes, status: int, text: str
) -> None:
    response = client.post("/embed", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    if status != 200:
        assert response.headers["content-type"].startswith("text/plain")
        assert text in response.text


def test_missing_json_content_type_is_415(client: httpx2.Client) -> None:
    response = client.post("/embed", content=b'{"inputs": "a"}')
    assert response.status_code == 415
    assert response.text == "Expected request with `Content-Type: application/json`"


def test_unknown_route_is_an_empty_404_and_a_trailing_slash_is_not_redirected(
    client: httpx2.Client,
) -> None:
    for path in ("/nowhere", "/embed/"):
        response = client.post(path, json={"inputs": "a"})
        assert response.status_code == 404, path
        assert response.content == b""


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/embed_sparse", "Model is not an embedding model with SPLADE pooling"),
        ("/predict", "Model is not a classifier model"),
    ],
)
def test_routes_of_other_model_kinds_are_424(
    client: httpx2.Client, path: str, message: str
) -> None:
    response = client.post(path, json={"inputs": "a"})
    assert response.status_code == 424
    assert response.json() == {
        "error": message,
        "error_type": "Backend",
    }


def test_timing_headers_are_teis(client: httpx2.Client) -> None:
    response = client.post("/embed", json={"inputs": "hello world"})
    assert response.headers["x-compute-type"] == "gpu+optimized"
    for name in ("time", "characters", "tokens"):
        assert response.headers[f"x-compute-{name}"].isdigit()
    for name in ("total", "tokenization", "queue", "inference"):
        assert response.headers[f"x-{name}-time"].isdigit()


def test_public_routes_answer_head_and_cors_without_the_key(start_server: StartServer) -> None:
    server = start_server(api_key="s3cret")
    with http_client(server.url) as http:
        assert http.head("/health").status_code == 200
        # Outside the key layer, a wrong method is the router's 405, not a 401.
        assert http.post("/health").status_code == 405
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert "te_request_success" in metrics.text
        preflight = http.options(
            "/embed",
            headers={"Origin": "http://app", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"


def test_auto_truncate_cuts_what_truncate_leaves_unset(start_server: StartServer) -> None:
    server = start_server(auto_truncate=True, max_input_length=16)
    with http_client(server.url) as http:
        assert http.get("/info").json()["auto_truncate"] is True
        cut = http.post("/embed", json={"inputs": _words(40)})
        assert cut.status_code == 200
        assert cut.headers["x-compute-tokens"] == "16"
        refused = http.post("/embed", json={"inputs": _words(40), "truncate": False})
        assert refused.status_code == 422
        openai = http.post("/v1/embeddings", json={"input": _words(40), "model": "m"})
        assert openai.status_code == 200
    # As TEI, a max_batch_tokens under the input limit lowers the limit instead of failing.
    assert (
        LocalTEIConfig(
            backend="hash", auto_truncate=True, max_batch_tokens=100
        ).effective_max_input_length
        == 100
    )


def test_api_key_is_required_except_on_health(start_server: StartServer) -> None:
    server = start_server(api_key="s3cret")
    with http_client(server.url) as http:
        assert http.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = http.post("/embed", json={"inputs": "a"}, headers=headers)
            assert refused.status_code == 401
            assert refused.content == b""
        assert http.get("/info").status_code == 401
        ok = http.post("/embed", json={"inputs": "a"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    assert server.stats.responses[401] == 4


def test_stats_count_requests_responses_and_inputs(
    hash_server: LocalTEIServer, client: httpx2.Client
) -> None:
    client.post("/embed", json={"inputs": TEXTS})
    client.post("/embed", json={"inputs": ["x"] * (MAX_BATCH + 1)})
    client.post("/rerank", json={"query": "q", "texts": ["a", "b"]})
    stats = hash_server.stats
    assert stats.requests[("POST", "/embed")] == 2
    assert stats.requests[("POST", "/rerank")] == 1
    assert stats.responses == {200: 2, 422: 1}
    assert stats.inputs_embedded == 3
    assert stats.pairs_reranked == 2
    stats.reset()
    assert stats.requests == {} and stats.inputs_embedded == 0
