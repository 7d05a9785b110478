"""The real openai SDK (v3) against the local service: its default is base64."""

from __future__ import annotations

import json

import httpx2
import numpy as np
import openai
import pytest
from local_tei_support import StartServer, http_client

from quarry.local_tei import LocalTEIServer

TEXTS = ["embeddings for everyone", "a second input"]


def _sdk(
    server: LocalTEIServer, api_key: str = "x"
) -> tuple[openai.OpenAI, list[dict[str, object]]]:
    sent: list[dict[str, object]] = []

    def record(request: httpx2.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx2.Client(verify=False, event_hooks={"request": [record]})
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key=api_key, max_retries=0, http_client=http
    )
    return client, sent


def test_sdk_default_base64_round_trips(start_server: StartServer) -> None:
    server = start_server()
    client, sent = _sdk(server)
    result = client.embeddings.create(model="quarry/hash-embedding-384d", input=TEXTS)
    assert sent[0]["encoding_format"] == "base64"
    assert result.model == "quarry/hash-embedding-384d"
    assert [d.index for d in result.data] == [0, 1]
    vectors = np.array([d.embedding for d in result.data])
    with http_client(server.url) as http:
        expected = np.array(http.post("/embed", json={"inputs": TEXTS}).json())
    np.testing.assert_allclose(vectors, expected, atol=1e-7)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0


def test_sdk_float_format(start_server: StartServer) -> None:
    client, sent = _sdk(start_server())
    result = client.embeddings.create(model="m", input=TEXTS[0], encoding_format="float")
    assert sent[0]["encoding_format"] == "float"
    assert len(result.data[0].embedding) == 384


def test_sdk_sees_teis_errors_as_its_own(start_server: StartServer) -> None:
    server = start_server(api_key="k", max_concurrent_requests=1, max_input_length=8)
    with pytest.raises(openai.AuthenticationError):
        _sdk(server, api_key="wrong")[0].embeddings.create(model="m", input="a")
    client, _ = _sdk(server, api_key="k")
    assert len(client.embeddings.create(model="m", input="a").data) == 1
    with pytest.raises(openai.RateLimitError):
        client.embeddings.create(model="m", input=["a", "b"])
    with pytest.raises(openai.UnprocessableEntityError) as too_long:
        client.embeddings.create(model="m", input=" ".join(["w"] * 20))
    assert too_long.value.status_code == 422
