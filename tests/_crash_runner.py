"""Run one ingest and kill the process hard at the N-th write to Qdrant.

Used by test_crash_safety.py as a subprocess: ``python _crash_runner.py DATA CORPUS URL N MODE``.
MODE ``before`` dies just before the N-th write reaches Qdrant, ``after`` just after it.
Nothing in quarry knows about this: the store's write methods are wrapped here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import quarry.ingest
from quarry._http import NO_WAIT
from quarry.chunking import Chunker
from quarry.config import Settings
from quarry.embeddings import EmbeddingClient
from quarry.ingest import IndexSync, run_sync
from quarry.sources import open_source
from quarry.store import VectorStore, open_client

CHUNK_TOKENS, CHUNK_OVERLAP, DOCS_PER_BATCH = 48, 8, 3


def main() -> None:
    data, corpus, url, limit, mode = sys.argv[1:6]
    writes = 0

    def wrap(original: Any) -> Any:
        def wrapped(self: VectorStore, *args: Any, **kwargs: Any) -> Any:
            nonlocal writes
            writes += 1
            if writes == int(limit) and mode == "before":
                os._exit(137)
            result = original(self, *args, **kwargs)
            if writes == int(limit) and mode == "after":
                os._exit(137)
            return result

        return wrapped

    VectorStore.upsert = wrap(VectorStore.upsert)  # type: ignore[method-assign]
    VectorStore._delete = wrap(VectorStore._delete)  # type: ignore[method-assign]
    quarry.ingest.BATCH_DOCUMENTS = DOCS_PER_BATCH
    run(Path(data), Path(corpus), url)
    print(f"finished after {writes} writes")


def run(data: Path, corpus: Path, url: str) -> None:
    """One ingest of ``corpus`` into collection ``crash`` under ``data``."""
    settings = Settings(data_dir=data, collection="crash")
    store = VectorStore(open_client(settings), "crash")
    embedder = EmbeddingClient(url, retry=NO_WAIT)
    try:
        sync = IndexSync(store, embedder, Chunker(CHUNK_TOKENS, CHUNK_OVERLAP))
        run_sync(sync, [open_source(corpus)], allow_mass_delete=True)
    finally:
        store.close()
        embedder.close()


if __name__ == "__main__":
    main()
