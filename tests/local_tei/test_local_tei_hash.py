"""The hash backend: a deterministic "model" whose seed and size are its identity."""

from __future__ import annotations

import numpy as np
from local_tei_support import StartServer, http_client

from quarry.local_tei import LocalTEIServer


def _embed(server: LocalTEIServer, texts: list[str]) -> np.ndarray:
    with http_client(server.url) as http:
        response = http.post("/embed", json={"inputs": texts})
        assert response.status_code == 200
        return np.array(response.json())


def _info(server: LocalTEIServer) -> dict[str, object]:
    with http_client(server.url) as http:
        info: dict[str, object] = http.get("/info").json()
        return info


def test_same_text_same_vector_whatever_the_batch(start_server: StartServer) -> None:
    one, other = start_server(), start_server()
    alone = _embed(one, ["the same text"])[0]
    in_batch = _embed(one, ["first", "the same text", "last"])[1]
    elsewhere = _embed(other, ["the same text"])[0]
    np.testing.assert_array_equal(alone, in_batch)
    np.testing.assert_array_equal(alone, elsewhere)
    assert _info(one)["model_sha"] == _info(other)["model_sha"]


def test_other_text_other_vector(start_server: StartServer) -> None:
    a, b, c = _embed(start_server(), ["alpha beta", "beta alpha", "Alpha beta"])
    assert not np.allclose(a, b)  # same words, other text
    assert not np.allclose(a, c)


def test_another_seed_is_another_model(start_server: StartServer) -> None:
    base, reseeded = start_server(seed=0), start_server(seed=1)
    texts = ["a text about rivers", "another about mountains"]
    cosines = np.sum(_embed(base, texts) * _embed(reseeded, texts), axis=1)
    assert np.all(np.abs(cosines) < 0.5)
    assert _info(base)["model_sha"] != _info(reseeded)["model_sha"]
    assert _info(base)["model_id"] == _info(reseeded)["model_id"]


def test_dims_set_the_size_and_the_identity(start_server: StartServer) -> None:
    small = start_server(dims=64)
    assert _embed(small, ["x"]).shape == (1, 64)
    assert _info(small)["model_id"] == "quarry/hash-embedding-64d"
    assert _info(small)["model_sha"] != _info(start_server(dims=65))["model_sha"]


def test_shared_words_make_vectors_similar(start_server: StartServer) -> None:
    query, related, unrelated = _embed(
        start_server(),
        [
            "how do glaciers carve valleys",
            "glaciers carve deep valleys into mountains over time",
            "the quarterly earnings report beat expectations",
        ],
    )
    assert query @ related > 0.3
    assert query @ related > query @ unrelated + 0.2
