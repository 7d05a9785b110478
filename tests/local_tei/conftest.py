"""Fixtures for the local TEI service: running servers, clients, TEI's OpenAPI schemas."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
from local_tei_support import HASH_CONFIG, TEISchemas, http_client, load_schemas

from quarry.local_tei import LocalTEIConfig, LocalTEIServer


@pytest.fixture(scope="session")
def tei_schemas() -> TEISchemas:
    """TEI 1.9.3's response schemas, vendored under ``data/``."""
    return load_schemas()


@pytest.fixture(scope="module")
def hash_server() -> Iterator[LocalTEIServer]:
    """A hash-backend server shared by a test module."""
    with LocalTEIServer(HASH_CONFIG) as server:
        yield server


@pytest.fixture
def client(hash_server: LocalTEIServer) -> Iterator[httpx2.Client]:
    """A client of the shared hash server, whose counters start at zero."""
    hash_server.stats.reset()
    with http_client(hash_server.url) as http:
        yield http


@pytest.fixture
def start_server() -> Iterator[Callable[..., LocalTEIServer]]:
    """Start hash servers with custom settings; all are stopped after the test."""
    servers: list[LocalTEIServer] = []

    def start(**overrides: Any) -> LocalTEIServer:
        settings: dict[str, Any] = {"backend": "hash"} | overrides
        server = LocalTEIServer(LocalTEIConfig(**settings)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def minilm_server() -> Iterator[LocalTEIServer]:
    """The bundled all-MiniLM-L6-v2 behind the service (loads the model: seconds)."""
    with LocalTEIServer(LocalTEIConfig(backend="minilm")) as server:
        yield server
