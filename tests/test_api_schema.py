"""Schemathesis over the query API's own OpenAPI document, in-process (ASGI).

The app runs for real: a hash-backend local_tei and a small local-mode
collection. Every generated request, valid or not, must get an answer the
document describes (status code, content type, headers, body schema) and never
a 5xx. The number of examples is bounded so the whole run stays well under a
minute on two cores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis import GenerationMode, checks

from quarry._http import NO_WAIT
from quarry.api import create_app
from quarry.chunking import Chunker
from quarry.config import Settings
from quarry.embeddings import EmbeddingClient
from quarry.ingest import IndexSync, run_sync
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from quarry.sources import open_source
from quarry.store import VectorStore, open_client
from tests.conftest import write_corpus

KEY = "schema-key-0123456789"
CORPUS = {
    "guide.md": "# Guide\n\nRotate the keys every month. Backups run nightly. " * 6,
    "notes/faq.txt": "Quarry water is forty metres deep. The granite was cut in terraces. " * 6,
}


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    base = tmp_path_factory.mktemp("schema")
    corpus = write_corpus(base / "corpus", CORPUS)
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32)) as tei:
        settings = Settings(
            data_dir=base / "data",
            collection="test",
            embed_url=tei.url,
            api_key=SecretStr(KEY),
            retry_budget=0.0,
        )
        store = VectorStore(open_client(settings), "test")
        embedder = EmbeddingClient(tei.url, retry=NO_WAIT)
        try:
            run_sync(IndexSync(store, embedder, Chunker(48, 8)), [open_source(corpus)])
        finally:
            store.close()
            embedder.close()
        yield schemathesis.openapi.from_asgi("/openapi.json", create_app(settings))


CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_conforms_to_its_openapi_document(api_schema: schemathesis.BaseSchema) -> None:
    valid = api_schema.as_strategy(GenerationMode.POSITIVE)
    invalid = api_schema.as_strategy(GenerationMode.NEGATIVE)
    examples = [
        strategy
        for result in api_schema.get_all_operations()
        for strategy in api_schema.get_strategies_from_examples(result.ok())
    ]
    assert examples, "the OpenAPI document has no examples"
    calls: Counter[tuple[str, int]] = Counter()

    @given(case=st.one_of(*examples, valid, invalid))
    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: schemathesis.Case) -> None:
        response = case.call_and_validate(headers=AUTH, checks=CHECKS)
        calls[(case.operation.label, response.status_code)] += 1

    check()
    # The run reached every operation and got both answers and refusals from the query.
    assert {label for label, _ in calls} >= {
        "POST /v1/query",
        "GET /v1/collections",
        "GET /healthz",
        "GET /readyz",
    }
    assert calls[("POST /v1/query", 200)] and calls[("POST /v1/query", 422)]
