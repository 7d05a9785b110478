"""The embedding and rerank clients against TEI's contract, faked at the transport."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2
import numpy as np
import pytest

from quarry._http import NO_WAIT, RetryPolicy
from quarry.embeddings import EmbeddingClient, EmbedFailure
from quarry.errors import (
    BadResponse,
    DialectMismatch,
    RequestRejected,
    ServiceUnavailable,
    VectorsOfAnotherSize,
)
from quarry.rerank import RerankClient

URL = "http://tei.test"


def _vector(text: str, dims: int = 8) -> list[float]:
    rng = np.random.default_rng(abs(hash(text)) % (2**32))
    v = rng.normal(size=dims)
    return (v / np.linalg.norm(v)).astype(np.float32).tolist()


@dataclass
class FakeTEI:
    """A scripted TEI: records every request; ``script`` can override answers."""

    max_chars: int = 10_000
    batch_limit: int = 4
    failures: list[int] = field(default_factory=list)  # status codes to answer first
    reject: set[str] = field(default_factory=set)  # inputs answered 400
    requests: list[tuple[str, object]] = field(default_factory=list)
    info_status: int = 200
    too_long_status: int = 422  # TEI before 1.9 answered 413
    script: Callable[[httpx2.Request], httpx2.Response | None] | None = None

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.url.path, body))
        if self.script and (answer := self.script(request)) is not None:
            return answer
        if request.url.path == "/info":
            if self.info_status != 200:
                return httpx2.Response(self.info_status)
            return httpx2.Response(
                200,
                json={
                    "model_id": "org/test-model",
                    "model_sha": "abc123",
                    "model_dtype": "float16",
                    "model_type": {"embedding": {"pooling": "mean"}},
                    "max_input_length": 512,
                    "max_batch_tokens": 16384,
                    "max_client_batch_size": self.batch_limit,
                    "max_concurrent_requests": 8,
                    "version": "1.9.3",
                },
            )
        if self.failures and request.url.path == "/v1/embeddings":
            status = self.failures.pop(0)
            return httpx2.Response(
                status,
                json={"error": "Model is overloaded", "error_type": "Overloaded"},
                headers={"Retry-After": "0"},
            )
        if request.url.path == "/v1/embeddings":
            inputs = body["input"]
            if len(inputs) > self.batch_limit:
                return _error(422, f"batch size {len(inputs)} > maximum allowed batch size 4")
            for text in inputs:
                if len(text) > self.max_chars:
                    return _error(
                        self.too_long_status,
                        f"`inputs` must have less than {self.max_chars} tokens. Given: 9999",
                    )
                if text in self.reject:
                    return _error(400, "bad input")
            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": base64.b64encode(
                        np.asarray(_vector(t), dtype="<f4").tobytes()
                    ).decode(),
                }
                for i, t in enumerate(inputs)
            ]
            return httpx2.Response(
                200,
                json={"object": "list", "data": data, "model": "m", "usage": {}},
            )
        if request.url.path == "/rerank":
            if "texts" not in body:
                return httpx2.Response(
                    422,
                    text="Failed to deserialize the JSON body into the target type: "
                    "missing field `texts` at line 1 column 40",
                )
            if len(body["texts"]) > self.batch_limit:
                return _error(422, "batch size too large")
            ranks = [
                {"index": i, "score": 1.0 / (1 + abs(len(t) - len(body["query"])))}
                for i, t in enumerate(body["texts"])
            ]
            return httpx2.Response(200, json=sorted(ranks, key=lambda r: -r["score"]))
        return httpx2.Response(404)

    def paths(self, path: str) -> list[object]:
        return [body for p, body in self.requests if p == path]


def _error(status: int, message: str) -> httpx2.Response:
    return httpx2.Response(status, json={"error": message, "error_type": "Validation"})


def _client(fake: FakeTEI, **kwargs: object) -> EmbeddingClient:
    options: dict[str, object] = {"retry": NO_WAIT, **kwargs}
    return EmbeddingClient(URL, transport=httpx2.MockTransport(fake), **options)  # type: ignore[arg-type]


def test_batches_never_exceed_max_client_batch_size() -> None:
    fake = FakeTEI(batch_limit=4)
    results = _client(fake).embed_passages([f"text {i}" for i in range(10)])
    sizes = [len(body["input"]) for body in fake.paths("/v1/embeddings")]  # type: ignore[index]
    assert sizes and max(sizes) <= 4
    assert sum(sizes) == 10
    assert [r[0].text for r in results] == [f"text {i}" for i in range(10)]  # type: ignore[index]


def test_embed_batch_size_setting_only_lowers_the_limit() -> None:
    fake = FakeTEI(batch_limit=4)
    assert _client(fake, batch_size=2).batch_size == 2
    assert _client(fake, batch_size=100).batch_size == 4


def test_vectors_come_back_in_input_order_decoded_from_base64() -> None:
    fake = FakeTEI()
    texts = ["alpha", "beta", "gamma"]
    results = _client(fake).embed_passages(texts)
    for text, result in zip(texts, results, strict=True):
        assert isinstance(result, list)
        assert result[0].vector == pytest.approx(_vector(text), abs=1e-6)


def _answer_with(rows: list[object]) -> Callable[[httpx2.Request], httpx2.Response | None]:
    """A script that answers every embedding request with ``rows``, as given."""

    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path != "/v1/embeddings":
            return None
        data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(rows)]
        return httpx2.Response(200, json={"object": "list", "data": data, "model": "m"})

    return script


def _b64(values: list[float]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def test_vectors_are_scaled_to_unit_length_whatever_the_service_sends() -> None:
    # Collections rank by dot product (store.py): a service that does not normalise
    # (float lists or base64) must still give unit vectors; a zero vector has no unit
    # vector and fails its input.
    fake = FakeTEI(script=_answer_with([[3.0, 4.0], _b64([0.0, 2.0]), [0.0, 0.0]]))
    results = _client(fake).embed_passages(["a", "b", "c"])
    vectors = [r[0].vector for r in results[:2]]  # type: ignore[index]
    assert vectors[0] == pytest.approx([0.6, 0.8], abs=1e-6)
    assert vectors[1] == pytest.approx([0.0, 1.0], abs=1e-6)
    assert isinstance(results[2], EmbedFailure)


def test_an_answer_with_no_usable_embedding_is_a_bad_response_naming_the_url() -> None:
    fake = FakeTEI(script=_answer_with([None, "not base64!"]))
    with pytest.raises(BadResponse, match="no embedding in the answer") as caught:
        _client(fake).embed_passages(["a", "b"], documents=["docs/a.md", "docs/b.md"])
    assert URL in str(caught.value) and "docs/a.md" in str(caught.value)


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (
            httpx2.Response(200, text="not json", headers={"content-type": "application/json"}),
            "answer is not JSON: 'not json'",
        ),
        (
            httpx2.Response(200, json={"data": [{"index": "zero", "embedding": [1.0]}]}),
            "malformed embedding index 'zero'",
        ),
        (
            httpx2.Response(200, json={"data": [{"index": 7, "embedding": [1.0]}]}),
            "malformed embedding index 7",
        ),
    ],
)
def test_an_answer_that_is_not_an_embedding_list_is_a_bad_response_naming_the_url(
    answer: httpx2.Response, said: str
) -> None:
    def script(request: httpx2.Request) -> httpx2.Response | None:
        return answer if request.url.path == "/v1/embeddings" else None

    with pytest.raises(BadResponse, match=said) as caught:
        _client(FakeTEI(script=script)).embed_passages(["a"], documents=["docs/a.md"])
    assert URL in str(caught.value) and "docs/a.md" in str(caught.value)


def test_a_spent_retry_budget_says_how_many_attempts_in_how_long() -> None:
    from quarry._http import RetryPolicy, TransientFailure, call_with_retries

    calls = []

    def attempt() -> None:
        calls.append(1)
        # A Retry-After past the budget: no retry at all, and the message says so.
        raise TransientFailure(URL, "HTTP 503: busy", status=503, retry_after=60.0)

    with pytest.raises(ServiceUnavailable) as caught:
        call_with_retries(RetryPolicy(budget=5.0), URL, attempt)
    assert len(calls) == 1
    said = str(caught.value)
    assert "still failing after 1 attempt in 0.0s (retry budget 5s)" in said
    assert said.endswith("HTTP 503: busy")


def test_transient_failures_are_retried_then_succeed() -> None:
    fake = FakeTEI(failures=[429, 503, 424])
    results = _client(fake).embed_passages(["one"])
    assert isinstance(results[0], list)
    assert len(fake.paths("/v1/embeddings")) == 4


@pytest.mark.parametrize("retry_after", ["soon", "Fri, 99 Foo 2026", "-"])
def test_a_retry_after_quarry_cannot_read_is_as_none(retry_after: str) -> None:
    # Fault trial: a 503 with "Retry-After: soon" crashed the ingest, exit 2 "invalid
    # setting", instead of being retried as any 503.
    answered: list[int] = []

    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path == "/v1/embeddings" and not answered:
            answered.append(503)
            return httpx2.Response(503, text="busy", headers={"Retry-After": retry_after})
        return None

    fake = FakeTEI(script=script)
    assert isinstance(_client(fake).embed_passages(["one"])[0], list)
    assert len(fake.paths("/v1/embeddings")) == 2


def test_an_info_page_that_is_not_json_is_a_bad_response_naming_it() -> None:
    # Fault trial: a gateway's login page at /info (200, HTML) ended the run with
    # "invalid setting: Expecting value", exit 2.
    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path == "/info":
            return httpx2.Response(200, text="<html><title>Login</title></html>")
        return None

    with pytest.raises(BadResponse, match=r"/info.*not JSON.*Login"):
        _client(FakeTEI(script=script)).embed_passages(["one"])


def test_an_info_whose_model_id_is_not_text_is_a_bad_response() -> None:
    # Fault trial: /info answering {"model_id": 5} created a collection for a model
    # named "5", and the healthy service was then refused until a reindex.
    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path == "/info":
            return httpx2.Response(200, json={"model_id": 5, "max_input_length": "x"})
        return None

    with pytest.raises(BadResponse, match=r"/info.*model_id is 5, not a model name"):
        _client(FakeTEI(script=script)).embed_passages(["one"])


def test_a_batch_of_vectors_not_of_the_models_size_is_a_bad_response() -> None:
    # Fault trial: one batch answered at 24 of 384 dimensions reached Qdrant, whose
    # refusal was reported as a write failure; the service was never named.
    client = _client(FakeTEI())
    client.dimensions = 4  # as IndexSync.prepare sets it from the index's fingerprint
    with pytest.raises(BadResponse) as caught:
        client.embed_passages(["one", "two"], documents=["docs/a.md", "docs/b.md"])
    message = str(caught.value)
    assert f"{URL}/v1/embeddings" in message and "docs/a.md" in message
    assert "vectors of 8 dimensions, where the model's have 4" in message
    # The canary and probes are judged by the fingerprint, which names another model.
    assert len(client.embed_raw(["canary"])[0]) == 8
    client.dimensions = 8
    assert all(isinstance(r, list) for r in client.embed_passages(["one", "two"]))
    # Nor when another vector of the batch is unusable (the rest were kept as they were).
    salvaged = _client(FakeTEI(script=_answer_with([[0.0, 0.0], [3.0, 4.0]])))
    salvaged.dimensions = 4
    with pytest.raises(VectorsOfAnotherSize, match="vectors of 2 dimensions"):
        salvaged.embed_passages(["zero", "two"])


def test_retry_budget_spent_names_the_url_and_documents() -> None:
    fake = FakeTEI(failures=[503] * 1000)
    client = _client(fake, retry=RetryPolicy(budget=0.3, initial=0.01, maximum=0.02))
    with pytest.raises(ServiceUnavailable) as caught:
        client.embed_passages(["one"], documents=["docs/a.md"])
    assert f"{URL}/v1/embeddings" in str(caught.value)
    assert "docs/a.md" in str(caught.value)


@pytest.mark.parametrize("status", [400, 413, 422])
def test_rejections_are_never_retried_as_they_are(status: int) -> None:
    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path == "/v1/embeddings":
            return _error(status, "you sent something wrong")
        return None

    fake = FakeTEI(script=script)
    results = _client(fake).embed_passages(["only one input"])
    assert isinstance(results[0], EmbedFailure)
    assert isinstance(results[0].error, RequestRejected)
    assert len(fake.paths("/v1/embeddings")) == 1


@pytest.mark.parametrize("status", [422, 413])
def test_over_long_input_is_split_not_truncated(status: int) -> None:
    fake = FakeTEI(max_chars=60, too_long_status=status)
    long_text = " ".join(f"Sentence number {i} is here." for i in range(12))
    results = _client(fake).embed_passages([long_text, "short"])
    parts = results[0]
    assert isinstance(parts, list) and len(parts) > 1
    assert "".join(part.text for part in parts) == long_text
    assert all(len(part.text) <= 60 for part in parts)
    short = results[1]
    assert isinstance(short, list) and [part.text for part in short] == ["short"]
    assert list(short[0].vector) == pytest.approx(_vector("short"), abs=1e-6)


def test_one_bad_input_does_not_sink_its_batch() -> None:
    fake = FakeTEI(reject={"poison"})
    results = _client(fake).embed_passages(["a", "poison", "c", "d"], documents=list("wxyz"))
    assert isinstance(results[1], EmbedFailure)
    assert "x" in str(results[1].error)
    assert all(isinstance(results[i], list) for i in (0, 2, 3))


def test_query_is_formatted_by_the_profile_and_passages_are_not() -> None:
    fake = FakeTEI()

    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path == "/info":
            info = json.loads(FakeTEI()(request).content)
            info["model_id"] = "Qwen/Qwen3-Embedding-0.6B"
            return httpx2.Response(200, json=info)
        return None

    fake.script = script
    client = _client(fake, query_task="Find it")
    client.embed_query("where")
    client.embed_passages(["a passage"])
    sent = [body["input"] for body in fake.paths("/v1/embeddings")]  # type: ignore[index]
    assert sent == [["Instruct: Find it\nQuery:where"], ["a passage"]]


def test_connection_refused_fails_fast_naming_the_url() -> None:
    def refuse(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused", request=request)

    client = EmbeddingClient(
        URL,
        transport=httpx2.MockTransport(refuse),
        retry=RetryPolicy(budget=0.2, initial=0.01, maximum=0.02),
    )
    with pytest.raises(ServiceUnavailable, match=r"tei\.test"):
        _ = client.info


def test_bearer_token_is_sent_to_both_routes() -> None:
    seen: list[str | None] = []

    def script(request: httpx2.Request) -> httpx2.Response | None:
        seen.append(request.headers.get("authorization"))
        return None

    fake = FakeTEI(script=script)
    _client(fake, api_key="s3cret").embed_passages(["x"])
    assert seen and all(value == "Bearer s3cret" for value in seen)


def test_rerank_batches_and_merges_scores_in_input_order() -> None:
    fake = FakeTEI(batch_limit=4)
    reranker = RerankClient(URL, transport=httpx2.MockTransport(fake), retry=NO_WAIT)
    texts = ["x" * n for n in range(1, 11)]
    scores = reranker.score("xxxx", texts)
    assert len(scores) == 10
    assert max(range(10), key=lambda i: scores[i]) == 3
    assert all(len(body["texts"]) <= 4 for body in fake.paths("/rerank"))  # type: ignore[index]


def test_rerank_dialect_mismatch_names_the_setting() -> None:
    fake = FakeTEI()
    reranker = RerankClient(
        URL, transport=httpx2.MockTransport(fake), retry=NO_WAIT, dialect="cohere"
    )

    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path == "/v1/rerank":
            return httpx2.Response(
                422,
                text="Failed to deserialize the JSON body into the target type: "
                "missing field `texts` at line 1 column 40",
            )
        return None

    fake.script = script
    with pytest.raises(DialectMismatch, match="QUARRY_RERANK_DIALECT=tei"):
        reranker.score("q", ["a"])


@pytest.mark.parametrize(
    "broken",
    [
        "[0.6, null, 0.8]",
        "[0.6, NaN, 0.8]",  # json reads NaN and Infinity as floats
        "[0.6, Infinity, 0.8]",
        "null",
        "[0.6, 0.8]",  # another length than the model's
        "[0, 0, 0]",  # no direction: it would score 0 against every query
        '"abc"',  # not base64
        '{"x": 1}',
    ],
)
def test_an_unusable_embedding_fails_its_document_alone(broken: str) -> None:
    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path != "/v1/embeddings":
            return None
        good = '{"index": 0, "embedding": [0.6, 0.8, 0.0]}, {"index": 2, "embedding": [0, 0, 1]}'
        bad = '{"index": 1, "embedding": ' + broken + "}"
        body = '{"object": "list", "data": [' + good + ", " + bad + "]}"
        return httpx2.Response(200, content=body.encode())

    client = _client(FakeTEI(script=script))
    names = ["docs/a.md", "docs/b.md", "docs/c.md"]
    results = client.embed_passages(["x", "y", "z"], documents=names)
    # The inputs answered well are kept; the broken one fails alone, naming its document.
    assert isinstance(results[0], list) and results[0][0].vector == pytest.approx([0.6, 0.8, 0])
    assert isinstance(results[2], list) and results[2][0].vector == pytest.approx([0, 0, 1])
    assert isinstance(results[1], EmbedFailure)
    message = str(results[1].error)
    assert "embedding for it is unusable" in message and URL in message
    assert "docs/b.md" in message and "docs/a.md" not in message
    with pytest.raises(BadResponse, match="unusable"):
        client.embed_raw(["x", "y", "z"])  # probes and the canary have no document to fail alone


def test_the_canary_keeps_the_services_scale_so_the_fingerprint_sees_normalisation() -> None:
    # embed_raw (the canary) is not scaled: a service that does not normalise keeps
    # normalized=False in its fingerprint, so indexes it built keep their model_key.
    from quarry.fingerprint import read_fingerprint

    raw = FakeTEI(script=_answer_with([[3.0, 4.0]]))
    assert _client(raw).embed_raw(["c"]) == [[3.0, 4.0]]
    assert read_fingerprint(_client(raw)).model.normalized is False
    unit = FakeTEI(script=_answer_with([[0.6, 0.8]]))
    assert read_fingerprint(_client(unit)).model.normalized is True


def test_a_rerank_score_that_is_not_a_finite_number_is_a_bad_response() -> None:
    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path != "/rerank":
            return None
        body = '[{"index": 0, "score": 0.5}, {"index": 1, "score": NaN}]'
        return httpx2.Response(200, content=body.encode())

    fake = FakeTEI(script=script)
    reranker = RerankClient(URL, transport=httpx2.MockTransport(fake), retry=NO_WAIT)
    with pytest.raises(BadResponse, match="not a finite number") as caught:
        reranker.score("q", ["a", "b"])
    assert URL in str(caught.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[{"index": 1e999, "score": 1}, {"index": 0, "score": 1}]', "rerank index inf"),
        ('[{"index": 1.5, "score": 1}, {"index": 0, "score": 1}]', "rerank index 1.5"),
        ('[{"index": true, "score": 1}, {"index": 0, "score": 1}]', "rerank index True"),
        ('[{"score": 1}, {"index": 0, "score": 1}]', "rerank index None"),
        ('[{"index": 0, "score": 1}, {"index": 0, "score": 2}]', "scores index 0 twice"),
        ('[{"index": 0, "score": "high"}, {"index": 1, "score": 1}]', "score 'high' is not"),
        ('[{"index": 0, "score": [1]}, {"index": 1, "score": 1}]', r"score \[1\] is not"),
        ('[{"index": 0, "score": true}, {"index": 1, "score": 1}]', "score True is not"),
        ("[0.5, 0.25]", "rerank item 0.5 is not an object"),
        ('[{"index": 0, "score": 1}]', "no score for 1 of 2 texts"),
    ],
)
def test_a_malformed_rerank_answer_is_a_bad_response_saying_what_is_wrong(
    body: str, message: str
) -> None:
    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path != "/rerank":
            return None
        return httpx2.Response(200, content=body.encode())

    fake = FakeTEI(script=script)
    reranker = RerankClient(URL, transport=httpx2.MockTransport(fake), retry=NO_WAIT)
    with pytest.raises(BadResponse, match=message):
        reranker.score("q", ["a", "b"])


def test_no_retry_waits_past_the_budget_even_when_the_server_asks() -> None:
    from quarry._http import TransientFailure

    attempts: list[int] = []
    sleeps: list[float] = []

    def busy() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise TransientFailure(URL, "HTTP 503", status=503, retry_after=20.0)
        return "answered"

    retrying = RetryPolicy(budget=1.0).retrying().copy(sleep=sleeps.append)
    # A 20 s Retry-After against a 1 s budget: give up now, not after 20 s.
    with pytest.raises(TransientFailure):
        retrying(busy)
    assert attempts == [1] and sleeps == []


@pytest.mark.parametrize("dialect", ["openai", "tei"])
def test_a_request_on_a_closed_client_is_abandoned_not_retried_as_cannot_connect(
    dialect: str,
) -> None:
    # A stopping run closes its clients under requests still in flight: their retries
    # must not spend the retry budget warning "cannot connect" about a healthy service.
    from concurrent.futures import CancelledError

    retried: list[BaseException | None] = []
    policy = RetryPolicy(budget=5.0, initial=0.0, maximum=0.0, jitter=0.0, on_retry=retried.append)
    client = _client(FakeTEI(), retry=policy, dialect=dialect)
    assert client.batch_size > 0  # /info read, as before any passage is embedded
    client.close()
    with pytest.raises(CancelledError):
        client.embed_raw(["passage"])
    assert retried == []


def test_an_html_error_page_is_reported_by_its_title_not_its_markup() -> None:
    page = (
        "<html>\r\n<head><title>502 Bad&nbsp;Gateway</title></head>\r\n<body>"
        "<center><h1>502 Bad Gateway</h1></center><hr><center>edge-7.internal.example"
        "</center></body></html>"
    )

    def script(request: httpx2.Request) -> httpx2.Response | None:
        if request.url.path != "/rerank":
            return None
        return httpx2.Response(400, text=page, headers={"content-type": "text/html"})

    fake = FakeTEI(script=script)
    reranker = RerankClient(URL, transport=httpx2.MockTransport(fake), retry=NO_WAIT)
    with pytest.raises(RequestRejected) as caught:
        reranker.score("q", ["a"])
    message = str(caught.value)
    assert "HTTP 400: an HTML page ('502 Bad Gateway'), from a proxy or gateway" in message
    assert "internal.example" not in message and "<" not in message
