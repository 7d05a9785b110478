"""Reindex flow: an operator's ad-hoc blue/green rebuild after a model or engine change.

Builds a new physical collection with the live embedding service's fingerprint
(from the stored chunk texts, or from the sources), verifies it, optionally
gates it on an evaluation, and switches the alias atomically. The logic lives
in :mod:`quarry.reindex`; this flow holds the writer lock and reports.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows import quiet_quarry_tracebacks, take_back_sigterm
from flows.ingest import one_writer, source_specs
from quarry.chunking import Chunker
from quarry.config import get_settings
from quarry.errors import Refused
from quarry.ingest import IndexSync
from quarry.reindex import refuse_bad_parameters, reindex
from quarry.services import open_services
from quarry.store import VectorStore


@flow(name="quarry-reindex", log_prints=False)
def reindex_flow(
    collection: str | None = None,
    from_source: list[str] | None = None,
    eval_dataset: str | None = None,
    min_ndcg: float | None = None,
    eval_split: str = "test",
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    allow_mass_delete: bool = False,
    force: bool = False,
    encoding: str | None = None,
) -> dict[str, Any]:
    """Rebuild ``collection`` with the live embedding model and switch its alias to it.

    Args:
        collection: The alias to rebuild (default ``QUARRY_COLLECTION``).
        from_source: Re-read and re-chunk these paths instead of re-embedding stored chunks.
        eval_dataset: A BEIR-layout folder; evaluate the live model on it before switching.
        min_ndcg: With ``eval_dataset``: refuse to switch when nDCG@10 is below this.
        eval_split: With ``eval_dataset``: which ``qrels/<split>.tsv`` judges the queries.
        include: With ``from_source``: globs of files to index, as at ingest.
        exclude: With ``from_source``: globs of files to skip, besides the default ones.
        allow_mass_delete: Switch even when the new collection lacks more than
            ``QUARRY_MAX_DELETE_FRACTION`` of the documents the alias serves.
        force: Rebuild the stored chunks even when the live model, served as the
            collection's, and the chunk settings would only copy it.
        encoding: With ``from_source``: the encoding of text files not in UTF-8, as at
            ingest (default: detected).

    Returns:
        The reindex report (``ReindexReport.to_dict()``).
    """
    quiet_quarry_tracebacks()  # a deployment's log, as the CLI's: the error says it all
    take_back_sigterm()
    logger = get_run_logger()
    # Before the writer lock and any building: a deployment run is not checked by a CLI.
    refuse_bad_parameters(
        eval_dataset=eval_dataset,
        min_ndcg=min_ndcg,
        eval_split=eval_split,
        from_source=bool(from_source),
        include=include,
        exclude=exclude,
        encoding=encoding,
    )
    settings = get_settings(collection=collection)
    specs = source_specs(from_source or [], include, exclude, encoding=encoding)

    with one_writer(settings, settings.collection), open_services(settings) as services:

        def make_sync(store: VectorStore) -> IndexSync:
            return IndexSync(
                store,
                services.embedder,
                Chunker(settings.chunk_tokens, settings.chunk_overlap),
                embed_headings=settings.embed_headings,
                max_delete_fraction=1.0,
                allow_serving_change=True,
                canary_min_cosine=settings.canary_min_cosine,
            )

        def gate() -> dict[str, Any]:
            from quarry.evaluate import run_evaluation

            assert eval_dataset is not None
            # On these services: local-mode Qdrant admits one client per process.
            result = run_evaluation(
                eval_dataset,
                settings=settings,
                split=eval_split,
                rerank=False,
                services=services,
            )
            ndcg = float(result["ndcg@10"])
            logger.info("evaluation on %s: nDCG@10 %.4f", eval_dataset, ndcg)
            if min_ndcg is not None and ndcg < min_ndcg:
                raise Refused(
                    f"nDCG@10 {ndcg:.4f} on {eval_dataset} is below --min-ndcg {min_ndcg}; "
                    "the alias was not switched (the new collection is kept for inspection: "
                    "`quarry collections` lists it; `quarry prune --keep 2` removes it and "
                    "keeps the live collection and the one `quarry rollback` returns to, "
                    "`--keep 1` where there is none)"
                )
            return result

        report = reindex(
            services.store,
            make_sync,
            from_source=specs,
            max_file_bytes=settings.max_file_bytes,
            max_delete_fraction=settings.max_delete_fraction,
            allow_mass_delete=allow_mass_delete,
            gate=gate if eval_dataset else None,
            progress=logger.info,
            force=force,
            min_canary_cosine=settings.canary_min_cosine,
        )
    for note in report.notes:
        logger.warning(note)
    create_markdown_artifact(
        markdown=(
            f"# Reindex of `{report.alias}`\n\n"
            f"| | |\n|---|---|\n"
            f"| previous | `{report.previous}` |\n| new | `{report.collection}` |\n"
            f"| model | {report.model['model_id']} (key {report.model['model_key']}) |\n"
            f"| documents | {report.documents} |\n| points | {report.points} |\n"
            f"| verified sample | {report.verified_sample} "
            + (
                f"(min cosine {report.min_sample_cosine:.5f}) |\n"
                if report.min_sample_cosine is not None
                else "(nothing to re-embed) |\n"
            )
            + f"| failed (left out) | {len(report.failures)} |\n"
            f"| switched | {report.switched} |\n"
        ),
        key=f"reindex-{report.alias.lower().replace('_', '-')}",
        description=f"quarry reindex of {report.alias}",
    )
    return report.to_dict()
