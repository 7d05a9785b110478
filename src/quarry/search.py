"""The query path: format -> embed -> search -> rerank -> threshold.

Used by ``quarry query`` and, through its async twin in the API, by
applications. The index's fingerprint is checked against the live embedding
service once, before the first query: a query is never answered from vectors
another model made.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from qdrant_client import models

from quarry.embeddings import EmbeddingClient
from quarry.errors import FingerprintMismatch, InputTooLong, QueryTooLong, ServiceError
from quarry.fingerprint import (
    Fingerprint,
    check_compatible,
    query_task_changed,
    read_fingerprint,
)
from quarry.rerank import RerankClient
from quarry.store import META_ACCEPTED_SERVING, VectorStore

Collapse = Literal["none", "doc"]


@dataclass(frozen=True, slots=True)
class SearchFilter:
    """Restrict candidates: a folder or file uri prefix, document ids, metadata values."""

    uri_prefix: str | None = None
    doc_ids: Sequence[str] | None = None
    metadata: Mapping[str, Any] | None = None

    def to_qdrant(self) -> models.Filter | None:
        """The equivalent Qdrant filter, or None when nothing is restricted."""
        must: list[models.Condition] = []
        if self.uri_prefix:
            prefix = self.uri_prefix
            must.append(
                models.Filter(
                    should=[
                        models.FieldCondition(key="uri", match=models.MatchValue(value=prefix)),
                        models.FieldCondition(
                            key="path_prefixes",
                            match=models.MatchAny(any=[prefix.rstrip("/") + "/", prefix]),
                        ),
                    ]
                )
            )
        if self.doc_ids:
            must.append(
                models.FieldCondition(key="doc_id", match=models.MatchAny(any=list(self.doc_ids)))
            )
        for key, value in (self.metadata or {}).items():
            must.append(
                models.FieldCondition(key=f"metadata.{key}", match=models.MatchValue(value=value))
            )
        return models.Filter(must=must) if must else None


@dataclass(frozen=True, slots=True)
class SearchResult:
    """One passage in an answer."""

    text: str
    score: float
    vector_score: float
    rerank_score: float | None
    uri: str
    doc_id: str
    chunk_index: int
    headings: list[str]
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SearchResponse:
    """The answer to one query; ``to_dict`` is the ``--json`` shape."""

    results: list[SearchResult]
    reranked: bool
    model: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "results": [asdict(result) for result in self.results],
            "reranked": self.reranked,
            "model": self.model,
            "warnings": self.warnings,
            "timings_ms": self.timings_ms,
        }


def result_from_point(point: models.ScoredPoint, rerank_score: float | None) -> SearchResult:
    """A SearchResult from a Qdrant hit and an optional rerank score.

    Payload fields of the wrong type (a collection another tool wrote) are read
    as empty, never trusted: a hit with ``chunk_index: "first"`` is still a hit.
    """
    payload = point.payload or {}
    headings = payload.get("headings")
    metadata = payload.get("metadata")
    return SearchResult(
        text=_text(payload.get("text")),
        score=rerank_score if rerank_score is not None else float(point.score),
        vector_score=float(point.score),
        rerank_score=rerank_score,
        uri=_text(payload.get("uri")),
        doc_id=_text(payload.get("doc_id")),
        chunk_index=_index(payload.get("chunk_index")),
        headings=[str(h) for h in headings] if isinstance(headings, list) else [],
        title=_text(payload.get("title")),
        metadata=dict(metadata) if isinstance(metadata, dict) else {},
    )


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _index(value: object) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return 0
    return 0


RerankOutcome = Literal["reranked", "skipped", "failed"]
"""What became of the rerank step: scores came back, it was not asked for, or it failed."""


def is_blank_query(query: str) -> bool:
    """Whether ``query`` asks nothing: only whitespace, controls or format characters
    (NUL, a zero-width space or joiner, a tag character)."""
    return all(c.isspace() or unicodedata.category(c)[0] == "C" for c in query)


def rerank_texts(hits: Sequence[models.ScoredPoint]) -> list[str]:
    """The passage texts of Qdrant hits, in order, as the reranker scores them."""
    return [str((hit.payload or {}).get("text", "")) for hit in hits]


def rerank_fallback_warning(reason: object) -> str:
    """The warning given when the reranker failed and vector scores answer instead."""
    return f"rerank failed, answering from vector scores: {reason}"


def score_threshold(
    outcome: RerankOutcome, requested: float | None, default: float
) -> float | None:
    """The score under which results are dropped, or None for no cut.

    Rerank scores are cut at the requested threshold, else the configured one;
    vector scores only at an explicitly requested one; and a fallback to vector
    scores after a failed rerank is not cut (the threshold is on the rerank scale).
    """
    if outcome == "reranked":
        return default if requested is None else requested
    if outcome == "failed":
        return None
    return requested


def rank_results(
    hits: Sequence[models.ScoredPoint],
    rerank_scores: Sequence[float] | None,
    *,
    threshold: float | None,
    collapse: Collapse,
    top_k: int,
) -> list[SearchResult]:
    """The answer from Qdrant hits and optional rerank scores (one per hit).

    Drops results under ``threshold``, sorts best first (stable, so ties keep
    Qdrant's order), collapses to one passage per document when asked, and keeps
    ``top_k``.
    """
    if rerank_scores is None:
        scores = [float(hit.score) for hit in hits]
    else:
        scores = [float(score) for score in rerank_scores]
        if len(scores) != len(hits):
            raise ValueError(f"{len(scores)} rerank scores for {len(hits)} hits")
    # Order and cut on the scores alone, and build results only for what is kept:
    # a result costs ~15 us, and an answer keeps top_k of the candidates (10 of 50).
    # Cut before sorting: a score the cut drops (NaN included) never reaches the sort.
    kept = (
        range(len(hits))
        if threshold is None
        else [i for i in range(len(hits)) if scores[i] >= threshold]
    )
    order = sorted(kept, key=scores.__getitem__, reverse=True)  # stable
    if collapse == "doc":
        seen: set[str] = set()
        best: list[int] = []
        for i in order:
            doc_id = _text((hits[i].payload or {}).get("doc_id"))
            if doc_id not in seen:
                seen.add(doc_id)
                best.append(i)
            if len(best) == top_k:
                break
        order = best
    return [
        result_from_point(hits[i], None if rerank_scores is None else scores[i])
        for i in order[:top_k]
    ]


def model_summary(fingerprint: Fingerprint) -> dict[str, str]:
    """``{"model_id", "model_key"}`` of the model that built the index, for answers."""
    return {"model_id": fingerprint.model.model_id, "model_key": fingerprint.model_key}


def verify_fingerprint(
    stored: Fingerprint | None,
    live: Fingerprint,
    metadata: Mapping[str, Any],
    *,
    collection: str,
    vector_size: int | None = None,
    allow_serving_change: bool = False,
    canary_min_cosine: float = 0.999,
) -> Fingerprint:
    """The fingerprint queries run under, once the live service is shown to have built the index.

    ``metadata`` is the collection's (for the accepted serving changes). Raises
    Refused when the live service cannot produce comparable vectors; a
    collection quarry did not create (no stored fingerprint) runs under ``live``
    unless its ``vector_size`` shows another model made it.
    """
    if stored is None:
        if vector_size is not None and vector_size != live.model.dimensions:
            raise FingerprintMismatch(
                f"collection {collection!r} holds {vector_size}-dimensional vectors, but the "
                f"embedding service now serves {live.model.describe()}: vectors of another "
                "size cannot be searched. Point QUARRY_EMBED_URL at the model that built it, "
                "or rebuild it with `quarry reindex`."
            )
        return live
    check_compatible(
        stored,
        live,
        collection=collection,
        accepted_serving=metadata.get(META_ACCEPTED_SERVING) or [],
        allow_serving_change=allow_serving_change,
        min_canary_cosine=canary_min_cosine,
    )
    return stored


def query_task_warning(
    recorded: Fingerprint | None, live: Fingerprint, collection: str
) -> str | None:
    """What to tell whoever set QUARRY_QUERY_TASK when ``collection`` records another task
    (queries keep the recorded one, which its index was evaluated with), else None (also
    for a collection that records no fingerprint: it is queried with the live one)."""
    if recorded is None or not query_task_changed(recorded, live):
        return None
    return (
        f"queries of {collection!r} use the task its index records "
        f"({recorded.query_task!r}), not QUARRY_QUERY_TASK ({live.query_task!r}); "
        "`quarry reindex` records the new one"
    )


class Searcher:
    """Answers queries against one collection."""

    def __init__(
        self,
        store: VectorStore,
        embedder: EmbeddingClient,
        reranker: RerankClient | None,
        *,
        threshold: float = 0.3,
        rerank_required: bool = False,
        allow_serving_change: bool = False,
        canary_min_cosine: float = 0.999,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.reranker = reranker
        self.threshold = threshold
        self.rerank_required = rerank_required
        self.allow_serving_change = allow_serving_change
        self.canary_min_cosine = canary_min_cosine
        self._checked: Fingerprint | None = None
        self._task_warning: str | None = None

    def check(self) -> Fingerprint:
        """Verify once that the live embedding service built this index; raise Refused if not."""
        if self._checked is None:
            stored = self.store.fingerprint()
            live = read_fingerprint(self.embedder)
            self._task_warning = query_task_warning(stored, live, self.store.alias)
            self._checked = verify_fingerprint(
                stored,
                live,
                self.store.metadata() if stored is not None else {},
                collection=self.store.alias,
                vector_size=self.store.vector_size() if stored is None else None,
                allow_serving_change=self.allow_serving_change,
                canary_min_cosine=self.canary_min_cosine,
            )
        return self._checked

    def search(
        self,
        query: str,
        *,
        top_k: int = 10,
        candidates: int = 50,
        rerank: bool = True,
        threshold: float | None = None,
        search_filter: SearchFilter | None = None,
        collapse: Collapse = "none",
    ) -> SearchResponse:
        """Answer ``query`` with up to ``top_k`` passages, best first."""
        fingerprint = self.check()
        timings: dict[str, float] = {}
        started = time.perf_counter()
        try:
            vector = self.embedder.embed_query(query, task=fingerprint.query_task or None)
        except QueryTooLong:
            raise
        except InputTooLong as error:
            reason = str(error).removeprefix(f"{error.url}: ")
            raise QueryTooLong(
                error.url,
                f"the query is too long for the model that embeds it ({reason}); shorten it",
            ) from error
        timings["embed"] = _ms_since(started)

        started = time.perf_counter()
        query_filter = search_filter.to_qdrant() if search_filter else None
        hits = self.store.search(vector, max(candidates, top_k), query_filter)
        timings["search"] = _ms_since(started)

        warnings = [self._task_warning] if self._task_warning else []
        scores: list[float] | None = None
        outcome: RerankOutcome = "skipped"
        if rerank and self.reranker is not None and hits:
            started = time.perf_counter()
            try:
                scores = self.reranker.score(query, rerank_texts(hits))
                outcome = "reranked"
            except QueryTooLong:
                raise  # the question's fault, as the API's 422: no fallback hides it
            except ServiceError as error:
                if self.rerank_required:
                    raise
                warnings.append(rerank_fallback_warning(error))
                outcome = "failed"
            timings["rerank"] = _ms_since(started)
        results = rank_results(
            hits,
            scores,
            threshold=score_threshold(outcome, threshold, self.threshold),
            collapse=collapse,
            top_k=top_k,
        )
        return SearchResponse(
            results=results,
            reranked=outcome == "reranked",
            model=model_summary(fingerprint),
            warnings=warnings,
            timings_ms=timings,
        )


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
