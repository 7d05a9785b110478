"""``make demo``: index quarry's own docs on the embedded default, then ask three questions.

Everything runs on this machine: local-mode Qdrant under ``QUARRY_DATA_DIR``,
ephemeral Prefect, and the local TEI-compatible service with all-MiniLM-L6-v2.
A second run embeds nothing: unchanged files are skipped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from quarry.config import get_settings

QUESTIONS = (
    "What happens when the embedding model changes?",
    "How does quarry handle a chunk that is too long for the model?",
    "Which setting points quarry at a Qdrant server?",
)


def main() -> int:
    """Run the demo; returns the process exit code."""
    settings = get_settings()
    docs = Path(__file__).resolve().parents[2] / "docs"
    if not docs.is_dir():
        print(f"quarry demo: {docs} not found (run it from a quarry checkout)", file=sys.stderr)
        return 2

    from flows import configure_prefect_environment, embedded_flow_runs

    configure_prefect_environment(settings.data_dir)
    from flows.ingest import ingest_flow
    from quarry.cli import print_response
    from quarry.search import Searcher
    from quarry.services import open_services, start_local_tei_if_needed

    # One embedding service for both halves: the model loads once.
    with start_local_tei_if_needed(settings) as embed_url:
        os.environ["QUARRY_EMBED_URL"] = embed_url
        settings = get_settings(embed_url=embed_url)
        print(f"== Indexing {docs} into collection {settings.collection!r}", flush=True)
        with embedded_flow_runs():
            summary = ingest_flow(sources=[str(docs)], collection=settings.collection)
        requests = summary["embedding_requests"]
        # The canary is embedded only when something else is: a rerun sends nothing.
        spent = (
            f"{requests} embedding requests, one of them the fingerprint's canary"
            if requests
            else "no embedding request"
        )
        print(
            f"   {summary['documents_seen']} documents: {summary['documents_embedded']} embedded "
            f"({summary['chunks_embedded']} chunks, {spent}), "
            f"{summary['documents_skipped']} unchanged and skipped, "
            f"{summary['documents_failed']} failed",
            flush=True,
        )
        with open_services(settings) as services:
            searcher = Searcher(
                services.store,
                services.embedder,
                services.reranker,
                threshold=settings.rerank_threshold,
            )
            for question in QUESTIONS:
                print(f"\n== {question}", flush=True)
                print_response(searcher.search(question, top_k=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
