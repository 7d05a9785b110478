"""Engine/model parity: does a candidate service embed (and rerank) like the live one?

An engine upgrade, a dtype change or a move to another serving stack keeps the
``model_key`` but may still move the vectors. Parity re-embeds a sample of
stored passages with the candidate and compares them with the stored vectors,
compares retrieval with live vs candidate query vectors over the same index,
and for a reranker compares the top of the rankings. ``--accept`` records a
passing measurement so the candidate's serving identity is allowed.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from qdrant_client import models

from quarry.embeddings import EmbeddingClient
from quarry.errors import FingerprintMismatch, Refused
from quarry.fingerprint import cosine, read_fingerprint
from quarry.ingest import embedding_text, headings_by_key
from quarry.rerank import RerankClient
from quarry.store import META_ACCEPTED_SERVING, META_CHUNKING, META_PARITY, VectorStore

QUERY_WORDS = 12


@dataclass(slots=True)
class ParityReport:
    """A parity measurement; ``to_dict`` is the ``--json`` shape."""

    collection: str
    candidate_url: str
    candidate_serving: dict[str, Any]
    sample: int
    cosine_median: float
    cosine_min: float
    overlap_at_10: float
    queries: int
    rerank: dict[str, Any] | None = None
    passed: bool = False
    accepted: bool = False
    thresholds: dict[str, float] = field(default_factory=dict)
    measured_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _pseudo_query(text: str) -> str:
    """A query made from a passage's first words: a stand-in for real traffic."""
    return " ".join(text.split()[:QUERY_WORDS])


def measure_parity(
    store: VectorStore,
    live: EmbeddingClient,
    candidate: EmbeddingClient,
    *,
    sample: int = 200,
    live_reranker: RerankClient | None = None,
    candidate_reranker: RerankClient | None = None,
    rerank_threshold: float = 0.3,
    min_cosine: float = 0.999,
    min_overlap: float = 0.98,
    seed: int = 0,
) -> ParityReport:
    """Measure how closely ``candidate`` reproduces the index and the live service."""
    stored = store.fingerprint()
    if stored is not None:
        live_print = read_fingerprint(live)
        if stored.model_key != live_print.model_key:
            raise FingerprintMismatch(
                f"the live embedding service serves {live_print.model.describe()}, not the "
                f"index's {stored.model.describe()}: parity is measured against the stack "
                "that serves the index; point QUARRY_EMBED_URL back at it"
            )
    candidate_print = read_fingerprint(candidate)
    if stored is not None and stored.model_key != candidate_print.model_key:
        raise FingerprintMismatch(
            f"the candidate serves {candidate_print.model.describe()}, not the index's "
            f"{stored.model.describe()}: parity compares serving stacks of one model; "
            "a new model needs `quarry reindex`"
        )
    ids = [str(record.id) for record in store.scroll(fields=False)]
    chosen = random.Random(seed).sample(ids, min(sample, len(ids)))
    fields = ["text", "headings", "token_count", "chunking"]
    # Each stored vector was made from its chunk's text, with the heading breadcrumb
    # first where the settings that made it said so; a part of a split chunk (no
    # token_count) or a point of unknown settings has no text to compare with.
    with_headings = headings_by_key(store.metadata().get(META_CHUNKING))
    records: list[models.Record] = []
    embedded: list[str] = []
    texts: list[str] = []
    for record in store.retrieve(chosen, fields, with_vectors=True):
        payload = record.payload or {}
        headings_on = with_headings.get(payload.get("chunking"))
        if payload.get("token_count") is None or headings_on is None:
            continue
        text = str(payload.get("text", ""))
        records.append(record)
        texts.append(text)
        embedded.append(embedding_text(text, payload.get("headings") or (), headings_on))
    fresh = candidate.embed_raw([candidate.profile.format_passage(t) for t in embedded])
    cosines = [
        cosine(r.vector, v)  # type: ignore[arg-type]
        for r, v in zip(records, fresh, strict=True)
    ]

    queries = [_pseudo_query(t) for t in texts[: max(1, min(50, len(texts)))] if t.strip()]
    overlaps: list[float] = []
    top1 = top3 = crossings = judged = 0
    for query in queries:
        live_hits = store.search(live.embed_query(query), 10)
        cand_hits = store.search(candidate.embed_query(query), 10)
        live_ids = {str(h.id) for h in live_hits}
        cand_ids = {str(h.id) for h in cand_hits}
        overlaps.append(len(live_ids & cand_ids) / max(1, len(live_ids)))
        if live_reranker is not None and candidate_reranker is not None and live_hits:
            passages = [str((h.payload or {}).get("text", "")) for h in live_hits]
            a = live_reranker.score(query, passages)
            b = candidate_reranker.score(query, passages)
            order_a = sorted(range(len(a)), key=lambda i: -a[i])
            order_b = sorted(range(len(b)), key=lambda i: -b[i])
            top1 += order_a[0] == order_b[0]
            top3 += set(order_a[:3]) == set(order_b[:3])
            crossings += sum(
                (x >= rerank_threshold) != (y >= rerank_threshold)
                for x, y in zip(a, b, strict=True)
            )
            judged += 1

    report = ParityReport(
        collection=store.resolve() or store.alias,
        candidate_url=candidate.base_url,
        candidate_serving=asdict(candidate_print.serving),
        sample=len(cosines),
        cosine_median=statistics.median(cosines) if cosines else 0.0,
        cosine_min=min(cosines) if cosines else 0.0,
        overlap_at_10=statistics.fmean(overlaps) if overlaps else 0.0,
        queries=len(queries),
        thresholds={"min_cosine": min_cosine, "min_overlap": min_overlap},
    )
    if judged:
        report.rerank = {
            "queries": judged,
            "top1_agreement": top1 / judged,
            "top3_agreement": top3 / judged,
            "threshold_crossings": crossings,
        }
    report.passed = (
        bool(cosines) and report.cosine_median >= min_cosine and report.overlap_at_10 >= min_overlap
    )
    return report


def accept(store: VectorStore, report: ParityReport) -> None:
    """Record a passing measurement: the candidate's serving identity becomes allowed."""
    if not report.passed:
        raise Refused(
            f"parity not reached (cosine median {report.cosine_median:.5f}, "
            f"overlap@10 {report.overlap_at_10:.3f}; need >= {report.thresholds['min_cosine']} "
            f"and >= {report.thresholds['min_overlap']}); nothing recorded"
        )
    metadata = store.metadata()
    accepted = list(metadata.get(META_ACCEPTED_SERVING) or [])
    if report.candidate_serving not in accepted:
        accepted.append(report.candidate_serving)
    history = list(metadata.get(META_PARITY) or [])[-9:]
    report.accepted = True
    history.append(report.to_dict())
    store.update_metadata({META_ACCEPTED_SERVING: accepted, META_PARITY: history})
