"""BEIR-format retrieval evaluation of the whole pipeline: nDCG@10, recall@10/100, MRR@10.

``quarry eval DATASET_DIR`` measures what quarry's own path does to retrieval
quality, not the model alone: the corpus is chunked, embedded and stored exactly
as ``quarry ingest`` would, and every judged query goes through the query path's
formatting and embedding. The figure to compare is the model applied directly
(MTEB/BEIR style); ``docs/evaluation.md`` records both for SciFact.

The dataset is in BEIR's layout::

    DATASET_DIR/corpus.jsonl        {"_id", "title", "text", ...} per line (streamed)
    DATASET_DIR/queries.jsonl       {"_id", "text", ...} per line
    DATASET_DIR/qrels/<split>.tsv   query-id <TAB> corpus-id <TAB> score (header optional)

How a run goes:

1. Each corpus entry becomes a :class:`~quarry.documents.Document` whose text is
   ``title + " " + text`` (as BEIR and MTEB embed it) and whose uri is
   ``<dataset>/<corpus id>``; the corpus id is also kept in the metadata.
2. The documents are synced into a collection of their own, named
   ``eval-<dataset>-<hash>``; the hash covers the corpus bytes, the model and
   serving identity and the chunking settings. A second run (say without
   rerank) finds every document current and embeds nothing; a run killed half
   way resumes where it stopped.
3. Each judged query is embedded with :meth:`EmbeddingClient.embed_query`; the
   nearest ``candidates`` chunks are fetched (more when they hold fewer than
   100 distinct documents besides the query's own id, so recall@100 is always
   measured over 100 documents)
   and aggregated to documents by their best chunk (max score). A document whose
   corpus id equals the query id is dropped from that query's ranking (BEIR's
   convention; it matters for ArguAna-like sets).
4. With rerank, every retrieved chunk of the first ``rerank_depth`` documents
   is scored by the reranker; those documents are ordered by their best rerank
   score and the rest follow in vector order. A query the reranker refuses
   (too long for it) keeps its vector order, with a warning naming it; an
   outage drops the reranked figures for the run. The rerank score threshold of
   ``quarry query`` is not applied: a ranking metric needs the whole ranking.
   The vector-only figures of the same run are reported beside them.
5. Metrics are averaged over the judged queries (those with at least one
   relevant document and a non-empty text in ``queries.jsonl``). A query too
   long for the embedding model is left out, with a warning naming it.

The dataset is checked before anything is embedded: a line that is not JSON, an
entry without a usable ``_id``, a duplicate id, a file that is not UTF-8 or a
corpus with no text stops the run with the file and line at fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quarry.config import Settings
from quarry.documents import Document
from quarry.errors import (
    InputTooLong,
    QuarryError,
    ServiceError,
    SourceNotFound,
    UnreadableDocument,
)

if TYPE_CHECKING:
    from qdrant_client import models
    from rich.table import Table

    from quarry.embeddings import EmbeddingClient
    from quarry.fingerprint import Fingerprint
    from quarry.ingest import IndexSync, IngestReport
    from quarry.rerank import RerankClient
    from quarry.services import Services
    from quarry.store import VectorStore

# Bump when the way BEIR entries become Documents changes: old eval collections are then unused.
DOCUMENT_FORMAT = "beir-v1"
METRICS = ("ndcg@10", "recall@10", "recall@100", "mrr@10")
DEFAULT_CANDIDATES = 300
DEFAULT_RERANK_DEPTH = 30
# Documents the ranking must hold: recall@100 needs 100 after the query's own id is dropped.
RANKING_DEPTH = 100
MAX_CANDIDATES = 10_000
INGEST_BATCH_DOCUMENTS = 64

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: ``stage`` is ``"corpus"`` or ``"queries"``."""


# ------------------------------------------------------------------------------- metrics


def ndcg_at_k(ranked: Sequence[str], relevance: Mapping[str, int], k: int = 10) -> float:
    """Normalised discounted cumulative gain of the first ``k`` of ``ranked``.

    Gain ``2**rel - 1`` and discount ``log2(rank + 1)`` (rank from 1), as in
    BEIR's reference scripts with graded judgements; ``relevance`` maps document
    ids to grades and grades <= 0 count as not relevant. ``ranked`` holds
    distinct ids, best first. 0.0 when nothing is relevant.
    """
    dcg = 0.0
    for position, doc_id in enumerate(ranked[:k]):
        grade = relevance.get(doc_id, 0)
        if grade > 0:
            dcg += (2**grade - 1) / math.log2(position + 2)
    ideal = sorted((grade for grade in relevance.values() if grade > 0), reverse=True)[:k]
    idcg = sum((2**grade - 1) / math.log2(position + 2) for position, grade in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at_k(ranked: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    """Share of the relevant documents (grade > 0) found in the first ``k`` of ``ranked``.

    0.0 when nothing is relevant.
    """
    relevant = {doc_id for doc_id, grade in relevance.items() if grade > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranked[:k])) / len(relevant)


def mrr_at_k(ranked: Sequence[str], relevance: Mapping[str, int], k: int = 10) -> float:
    """Reciprocal rank of the first relevant document (grade > 0) in the first ``k``; else 0.0."""
    for position, doc_id in enumerate(ranked[:k]):
        if relevance.get(doc_id, 0) > 0:
            return 1.0 / (position + 1)
    return 0.0


def query_metrics(ranked: Sequence[str], relevance: Mapping[str, int]) -> dict[str, float]:
    """nDCG@10, recall@10, recall@100 and MRR@10 of one query's ranking."""
    return {
        "ndcg@10": ndcg_at_k(ranked, relevance, 10),
        "recall@10": recall_at_k(ranked, relevance, 10),
        "recall@100": recall_at_k(ranked, relevance, 100),
        "mrr@10": mrr_at_k(ranked, relevance, 10),
    }


def mean_metrics(per_query: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each metric over queries, rounded to 5 places (0.0 for no query)."""
    rows = list(per_query)
    if not rows:
        return dict.fromkeys(METRICS, 0.0)
    return {name: round(sum(row[name] for row in rows) / len(rows), 5) for name in METRICS}


def rank_documents(
    hits: Iterable[tuple[str, float]], *, exclude: str | None = None
) -> list[tuple[str, float]]:
    """Aggregate scored chunk hits to documents by their best score; best first.

    ``hits`` are ``(document id, score)`` pairs in any order, several per document
    allowed. Equal scores are ordered by document id so a ranking is
    deterministic. ``exclude`` (a query's own id) is left out.
    """
    best: dict[str, float] = {}
    for doc_id, score in hits:
        if doc_id == exclude:
            continue
        if doc_id not in best or score > best[doc_id]:
            best[doc_id] = score
    return sorted(best.items(), key=lambda item: (-item[1], item[0]))


# --------------------------------------------------------------------------- BEIR loader


@dataclass(frozen=True, slots=True)
class CorpusEntry:
    """One corpus line: its BEIR id, title and text."""

    doc_id: str
    title: str
    text: str

    @property
    def passage(self) -> str:
        """What is embedded: ``title + " " + text`` when there is a title (BEIR/MTEB)."""
        return f"{self.title} {self.text}" if self.title else self.text


@dataclass(frozen=True, slots=True)
class BeirDataset:
    """A BEIR-layout dataset: judged queries and qrels in memory, the corpus streamed."""

    root: Path
    name: str
    split: str
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    skipped_queries: int = 0
    corpus_entries: int = 0
    empty_entries: int = 0
    corpus_sha256: str = ""  # taken while the corpus was checked
    # Judged relevant but not in the corpus: no run can find them (scores are lower).
    missing_relevant: tuple[str, ...] = ()

    @property
    def corpus_path(self) -> Path:
        """``corpus.jsonl``."""
        return self.root / "corpus.jsonl"

    def iter_corpus(self) -> Iterator[CorpusEntry]:
        """The corpus entries in file order, one line at a time."""
        return iter_corpus(self.corpus_path)

    def corpus_digest(self) -> str:
        """sha256 of ``corpus.jsonl``'s bytes (read again only if the check did not take it)."""
        if self.corpus_sha256:
            return self.corpus_sha256
        digest = hashlib.sha256()
        with self.corpus_path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()


def _text_lines(path: Path, digest: Any = None) -> Iterator[tuple[int, str]]:
    """Non-blank lines of a UTF-8 file (a leading byte order mark dropped), numbered from 1.

    ``digest`` (a hashlib object), if given, is fed every byte of the file on the way.
    """
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if digest is not None:
                digest.update(raw)
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise UnreadableDocument(f"{path}:{number}", f"not UTF-8: {error}") from None
            if line.strip():
                yield number, line


def _json_lines(path: Path, digest: Any = None) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """``(line number, id, object)`` per line; the id is a non-empty string or integer."""
    for number, line in _text_lines(path, digest):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise UnreadableDocument(f"{path}:{number}", f"not JSON: {error}") from error
        if not isinstance(item, dict) or "_id" not in item:
            raise UnreadableDocument(f"{path}:{number}", "expected an object with '_id'")
        raw_id = item["_id"]
        if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or str(raw_id) == "":
            raise UnreadableDocument(
                f"{path}:{number}", f"'_id' must be a non-empty string or integer, not {raw_id!r}"
            )
        yield number, str(raw_id), item


def _corpus_entry(path: Path, number: int, doc_id: str, item: dict[str, Any]) -> CorpusEntry:
    text, title = item.get("text"), item.get("title")
    if not isinstance(text, str):
        raise UnreadableDocument(f"{path}:{number}", "'text' is missing or not a string")
    if title is not None and not isinstance(title, str):
        raise UnreadableDocument(f"{path}:{number}", f"'title' is not a string: {title!r}")
    return CorpusEntry(doc_id, (title or "").strip(), text)


def iter_corpus(path: Path) -> Iterator[CorpusEntry]:
    """Stream ``corpus.jsonl``: one :class:`CorpusEntry` per line, in file order."""
    for number, doc_id, item in _json_lines(path):
        yield _corpus_entry(path, number, doc_id, item)


def _unique_json_lines(path: Path, digest: Any = None) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """:func:`_json_lines`, refusing an id seen on an earlier line (it would overwrite it)."""
    first_line: dict[str, int] = {}
    for number, item_id, item in _json_lines(path, digest):
        seen = first_line.setdefault(item_id, number)
        if seen != number:
            raise UnreadableDocument(
                f"{path}:{number}", f"_id {item_id!r} is repeated (first on line {seen})"
            )
        yield number, item_id, item


def check_corpus(path: Path, judged: Collection[str] = ()) -> tuple[int, int, str, set[str]]:
    """Read ``corpus.jsonl`` once before anything is embedded.

    Returns ``(entries, entries without text, sha256 of the file, the ids of
    ``judged`` found in it)``. UnreadableDocument names the line of the first
    malformed entry or repeated id.
    """
    digest = hashlib.sha256()
    entries = empty = 0
    found: set[str] = set()
    for number, doc_id, item in _unique_json_lines(path, digest):
        entry = _corpus_entry(path, number, doc_id, item)
        entries += 1
        empty += not entry.passage.strip()
        if doc_id in judged:
            found.add(doc_id)
    return entries, empty, digest.hexdigest(), found


def load_queries(path: Path) -> dict[str, str]:
    """``queries.jsonl`` as ``{query id: text}`` (a repeated id is an UnreadableDocument)."""
    queries: dict[str, str] = {}
    for _number, query_id, item in _unique_json_lines(path):
        text = item.get("text")
        queries[query_id] = text if isinstance(text, str) else ""
    return queries


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    """``qrels/<split>.tsv`` as ``{query id: {corpus id: grade}}``, grades > 0 only.

    Lines are ``query-id corpus-id score`` (BEIR, tab-separated) or TREC's
    ``query-id iteration corpus-id score``; columns are split at tabs, or at
    whitespace in a line without tabs. A first (non-blank) line whose score is
    not a number is a header and skipped. A pair judged twice takes its last grade (as
    pytrec_eval does).
    """
    qrels: dict[str, dict[str, int]] = {}
    for position, (number, line) in enumerate(_text_lines(path)):
        # strip(): a trailing tab (spreadsheet exports) is no fifth column; ids keep no padding.
        text = line.strip()
        fields = [part.strip() for part in text.split("\t")] if "\t" in text else text.split()
        if len(fields) not in (3, 4):
            raise UnreadableDocument(
                f"{path}:{number}",
                "expected query-id, corpus-id, score (or TREC's query-id, iteration, "
                f"corpus-id, score), got {len(fields)} columns",
            )
        query_id, doc_id, score = fields[0], fields[-2], fields[-1]
        try:
            value = float(score)
        except ValueError:
            if position == 0:  # the first line that is not blank: a header
                continue
            raise UnreadableDocument(
                f"{path}:{number}", f"score {score!r} is not a number"
            ) from None
        if not math.isfinite(value):
            raise UnreadableDocument(f"{path}:{number}", f"score {score!r} is not a finite number")
        if value != int(value):
            # int() would make 0.5 a 0 and drop the judgement without a word.
            raise UnreadableDocument(f"{path}:{number}", f"score {score!r} is not an integer grade")
        judged = qrels.setdefault(query_id, {})
        if int(value) > 0:
            judged[doc_id] = int(value)
        else:
            judged.pop(doc_id, None)
    return {query_id: judged for query_id, judged in qrels.items() if judged}


def load_beir(dataset_dir: str | Path, split: str = "test") -> BeirDataset:
    """Read a BEIR-layout folder's queries and ``split`` qrels; the corpus is only checked.

    Only judged queries are kept: those with a relevant document in the qrels and
    a text in ``queries.jsonl``. SourceNotFound names a missing file.
    """
    root = Path(dataset_dir).expanduser()
    if not root.is_dir():
        raise SourceNotFound(str(root), "no such dataset folder")
    qrels_path = root / "qrels" / f"{split}.tsv"
    for required in (root / "corpus.jsonl", root / "queries.jsonl", qrels_path):
        if not required.is_file():
            hint = ""
            if required == qrels_path and (root / "qrels").is_dir():
                splits = sorted(p.stem for p in (root / "qrels").glob("*.tsv"))
                hint = f" (splits here: {', '.join(splits) or 'none'})"
            raise SourceNotFound(str(required), f"missing from the BEIR dataset{hint}")
    queries = load_queries(root / "queries.jsonl")
    qrels = load_qrels(qrels_path)
    if not qrels:
        raise UnreadableDocument(
            str(qrels_path), "judges no document relevant (no score above 0): nothing to measure"
        )
    judged = {qid: queries[qid] for qid in qrels if queries.get(qid, "").strip()}
    relevant = {doc_id for qid in judged for doc_id in qrels[qid]}
    entries, empty, sha256, found = check_corpus(root / "corpus.jsonl", relevant)
    if entries == empty:
        raise UnreadableDocument(
            str(root / "corpus.jsonl"), "has no entry with a title or text: nothing to index"
        )
    missing = sorted(relevant - found)
    if relevant and not found:
        # Every score would be 0: ids that differ in form (case, a prefix) from the corpus's.
        raise UnreadableDocument(
            str(qrels_path),
            f"none of the {len(relevant)} documents it judges relevant is in corpus.jsonl "
            f"(such as {', '.join(repr(i) for i in missing[:3])}; ids must match exactly)",
        )
    name = root.resolve().name or "dataset"
    return BeirDataset(
        root=root,
        name=name,
        split=split,
        queries=judged,
        qrels={qid: qrels[qid] for qid in judged},
        skipped_queries=len(qrels) - len(judged),
        corpus_entries=entries,
        empty_entries=empty,
        corpus_sha256=sha256,
        missing_relevant=tuple(missing),
    )


# ------------------------------------------------------------------------------ the run


@dataclass(slots=True)
class _Run:
    """State of one evaluation while it runs."""

    dataset: BeirDataset
    store: VectorStore
    embedder: EmbeddingClient
    reranker: RerankClient | None
    candidates: int
    rerank_depth: int
    progress: Progress | None
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def collection_name(
    dataset: BeirDataset,
    *,
    identity: Mapping[str, Any],
    chunking: Mapping[str, Any],
    embed_headings: bool,
) -> str:
    """``eval-<dataset>-<hash>``: one collection per corpus, model, serving stack and chunking.

    ``identity`` is the live service's model and serving identity, ``chunking``
    the chunker's recorded settings (encoding, sizes, version).
    """
    key = {
        "format": DOCUMENT_FORMAT,
        "corpus": dataset.corpus_digest(),
        "identity": dict(identity),
        "chunking": dict(chunking),
        "embed_headings": embed_headings,
    }
    blob = json.dumps(key, sort_keys=True, default=str).encode("utf-8")
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", dataset.name).strip("-")[:40] or "dataset"
    return f"eval-{slug}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _canary_moved(store: VectorStore, live: Fingerprint, min_cosine: float) -> float | None:
    """The canary's cosine when the eval collection ``store`` holds vectors of a service
    that embeds differently than ``live`` (a tag re-pulled behind the same ``/info``);
    None when it is the live service's or does not exist yet.

    Its name covers the model and serving identity, not the vectors: without this, a
    run with every document current would score new query vectors against old ones.
    """
    from quarry.fingerprint import cosine

    stored = store.fingerprint() if store.exists() else None
    if stored is None:
        return None
    similarity = cosine(stored.canary, live.canary)
    return similarity if similarity < min_cosine else None


def _documents(dataset: BeirDataset) -> Iterator[Document]:
    """The corpus as quarry documents, uri ``<dataset>/<corpus id>``; empty entries left out."""
    for entry in dataset.iter_corpus():
        passage = entry.passage
        if not passage.strip():
            continue
        yield Document.create(
            f"{dataset.name}/{entry.doc_id}",
            passage,
            title=entry.title,
            metadata={"beir_id": entry.doc_id},
        )


def _ingest(run: _Run, sync: IndexSync) -> IngestReport:
    """Sync the corpus into the eval collection; current documents are skipped."""
    from quarry.ingest import IngestReport

    report = IngestReport(collection=run.store.alias)
    sync.prepare(report)
    state = sync.plan_documents(run.dataset.name)
    total = run.dataset.corpus_entries - run.dataset.empty_entries
    done = shown = 0

    def show() -> None:
        nonlocal shown
        if run.progress and (done == 0 or done != shown):
            run.progress("corpus", done, total)
            shown = done

    show()

    def flush(batch: list[Document]) -> None:
        nonlocal done
        report.add(sync.write_batch(batch))
        done += len(batch)
        show()

    batch: list[Document] = []
    for document in _documents(run.dataset):
        report.documents_seen += 1
        current = state.get(document.doc_id)
        if sync.document_is_current(current, document.doc_hash):
            report.documents_skipped += 1
            done += 1
            if done % 512 == 0:
                show()
            continue
        batch.append(document)
        if len(batch) >= INGEST_BATCH_DOCUMENTS:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    show()
    sync.finish(report)
    return report


def _search(run: _Run, vector: Sequence[float], exclude: str) -> list[models.ScoredPoint]:
    """Chunk hits covering at least RANKING_DEPTH documents other than ``exclude`` (if any)."""
    limit = run.candidates
    while True:
        hits = run.store.search(vector, limit)
        ids = {_beir_id(hit) for hit in hits}
        ids.discard(exclude)
        if len(ids) >= RANKING_DEPTH or len(hits) < limit or limit >= MAX_CANDIDATES:
            return hits
        limit = min(limit * 2, MAX_CANDIDATES)


def _beir_id(hit: models.ScoredPoint) -> str:
    payload = hit.payload or {}
    metadata = payload.get("metadata") or {}
    if "beir_id" in metadata:
        return str(metadata["beir_id"])
    return str(payload.get("uri", "")).split("/", 1)[-1]


def _rerank(
    run: _Run,
    query: str,
    hits: Sequence[models.ScoredPoint],
    vector_ranking: Sequence[tuple[str, float]],
    exclude: str,
) -> list[str]:
    """Rerank the chunks of the first ``rerank_depth`` documents; the rest keep vector order."""
    assert run.reranker is not None
    head = {doc_id for doc_id, _ in vector_ranking[: run.rerank_depth]}
    chosen = [hit for hit in hits if _beir_id(hit) in head]
    scores = run.reranker.score(query, [str((h.payload or {}).get("text", "")) for h in chosen])
    reranked = rank_documents(
        ((_beir_id(hit), score) for hit, score in zip(chosen, scores, strict=True)),
        exclude=exclude,
    )
    tail = [doc_id for doc_id, _ in vector_ranking[run.rerank_depth :]]
    return [doc_id for doc_id, _ in reranked] + tail


def _some(ids: Sequence[str], shown: int = 10) -> str:
    more = len(ids) - shown
    return ", ".join(ids[:shown]) + (f" and {more} more" if more > 0 else "")


def _evaluate_queries(run: _Run) -> dict[str, dict[str, Any]]:
    """Per query: the vector ranking's metrics and, with a reranker, the reranked ones."""
    per_query: dict[str, dict[str, Any]] = {}
    total = len(run.dataset.queries)
    search_s = rerank_s = 0.0
    if run.progress:
        run.progress("queries", 0, total)
    too_long: list[str] = []  # for the embedding model: left out
    unreranked: list[str] = []  # refused by the reranker: vector order
    for done, (query_id, text) in enumerate(run.dataset.queries.items(), start=1):
        relevance = run.dataset.qrels[query_id]
        started = time.perf_counter()
        try:
            vector = run.embedder.embed_query(text)
        except InputTooLong:
            too_long.append(query_id)
            if run.progress and done == total:
                run.progress("queries", done, total)
            continue
        hits = _search(run, vector, query_id)
        ranking = rank_documents(((_beir_id(h), float(h.score)) for h in hits), exclude=query_id)
        search_s += time.perf_counter() - started
        vector_ids = [doc_id for doc_id, _ in ranking[:RANKING_DEPTH]]
        row: dict[str, Any] = {"vector": query_metrics(vector_ids, relevance)}
        row["top"] = vector_ids[:10]
        if run.reranker is not None and not ranking:
            row["reranked"] = row["vector"]
        elif run.reranker is not None:
            started = time.perf_counter()
            try:
                reranked = _rerank(run, text, hits, ranking, query_id)[:RANKING_DEPTH]
            except InputTooLong:
                # This query (or a passage with it) is too long for the reranker: an
                # input problem of one query, not an outage.
                unreranked.append(query_id)
                row["reranked"] = row["vector"]
            except ServiceError as error:
                run.warnings.append(f"reranker failed, reporting vector scores only: {error}")
                run.reranker = None
                for earlier in per_query.values():
                    earlier.pop("reranked", None)
            else:
                row["reranked"] = query_metrics(reranked, relevance)
                row["top"] = reranked[:10]
            rerank_s += time.perf_counter() - started
        per_query[query_id] = row
        if run.progress and (done == total or done % 10 == 0):
            run.progress("queries", done, total)
    if too_long:
        run.warnings.append(
            f"{len(too_long)} judged queries are too long for the embedding model and are "
            f"left out of the figures: {_some(too_long)}"
        )
    if unreranked and run.reranker is not None:
        run.warnings.append(
            f"the reranker refused {len(unreranked)} queries as too long; their vector "
            f"ranking stands in the reranked figures: {_some(unreranked)}"
        )
    run.timings["search_s"] = round(search_s, 2)
    if rerank_s:
        run.timings["rerank_s"] = round(rerank_s, 2)
    return per_query


def run_evaluation(
    dataset_dir: str | Path,
    *,
    settings: Settings,
    split: str = "test",
    rerank: bool = True,
    candidates: int = DEFAULT_CANDIDATES,
    rerank_depth: int = DEFAULT_RERANK_DEPTH,
    progress: Progress | None = None,
    services: Services | None = None,
    details: bool = False,
) -> dict[str, Any]:
    """Evaluate quarry's retrieval on a BEIR-layout dataset; returns the ``--json`` dict.

    Args:
        dataset_dir: The BEIR folder (``corpus.jsonl``, ``queries.jsonl``, ``qrels/``).
        settings: Services, chunking and data dir, as for every command.
        split: Which ``qrels/<split>.tsv`` judges the queries.
        rerank: Rerank through the reranker; the vector-only figures are reported
            as well (``"without_rerank"``).
        candidates: Chunk hits fetched per query before aggregating to documents
            (raised per query until they cover 100 documents).
        rerank_depth: Documents of the vector ranking whose chunks are reranked.
        progress: Called as ``progress(stage, done, total)`` while corpus and queries run.
        services: Clients to use (the reindex flow passes its own: local-mode
            Qdrant admits one client per process); else opened from ``settings``.
        details: Add ``"per_query"`` (each query's metrics and top 10 ids).

    The result holds ``dataset, queries, ndcg@10, recall@10, recall@100, mrr@10,
    reranked`` (the headline: reranked when ``reranked`` is true), plus
    ``without_rerank``, ``split``, ``collection``, ``model``, ``ingest``,
    ``settings``, ``timings_s`` and ``warnings``.
    """
    if candidates < 1 or rerank_depth < 1:
        raise ValueError("candidates and rerank_depth must be at least 1")
    started = time.perf_counter()
    dataset = load_beir(dataset_dir, split)
    if not dataset.queries:
        raise QuarryError(
            f"{dataset.root}: no judged query in qrels/{split}.tsv has a text in queries.jsonl"
        )
    with ExitStack() as stack:
        if services is None:
            from quarry.services import open_services

            services = stack.enter_context(open_services(settings))
        return _run(
            dataset,
            services,
            settings,
            rerank=rerank,
            candidates=candidates,
            rerank_depth=rerank_depth,
            progress=progress,
            details=details,
            started=started,
        )


def _run(
    dataset: BeirDataset,
    services: Services,
    settings: Settings,
    *,
    rerank: bool,
    candidates: int,
    rerank_depth: int,
    progress: Progress | None,
    details: bool,
    started: float,
) -> dict[str, Any]:
    from dataclasses import asdict

    from quarry.chunking import Chunker
    from quarry.fingerprint import read_fingerprint
    from quarry.ingest import IndexSync
    from quarry.store import VectorStore

    live = read_fingerprint(services.embedder)
    identity = {"model": asdict(live.model), "serving": asdict(live.serving)}
    chunker = Chunker(settings.chunk_tokens, settings.chunk_overlap)
    name = collection_name(
        dataset,
        identity=identity,
        chunking=chunker.settings,
        embed_headings=settings.embed_headings,
    )
    store = VectorStore(services.store.client, name)
    moved = _canary_moved(store, live, settings.canary_min_cosine)
    run = _Run(
        dataset=dataset,
        store=store,
        embedder=services.embedder,
        reranker=services.reranker if rerank else None,
        candidates=candidates,
        rerank_depth=rerank_depth,
        progress=progress,
    )
    if moved is not None:
        store.discard()
        run.warnings.append(
            f"{name!r} was built by a service that embeds the canary text differently "
            f"(cosine {moved:.5f} < {settings.canary_min_cosine}) under the same model "
            "identity: rebuilt with the live service, so the figures are its own"
        )
    if dataset.skipped_queries:
        run.warnings.append(
            f"{dataset.skipped_queries} judged queries have no text in queries.jsonl: skipped"
        )
    if dataset.missing_relevant:
        examples = ", ".join(repr(i) for i in dataset.missing_relevant[:3])
        run.warnings.append(
            f"{len(dataset.missing_relevant)} documents the qrels judge relevant are not in "
            f"corpus.jsonl (such as {examples}): no ranking can find them, so every metric "
            "is lower than the model's"
        )
    if dataset.empty_entries:
        run.warnings.append(
            f"{dataset.empty_entries} corpus entries have no title or text: not indexed"
        )
    sync = IndexSync(
        store,
        services.embedder,
        chunker,
        embed_headings=settings.embed_headings,
        max_delete_fraction=1.0,
        canary_min_cosine=settings.canary_min_cosine,
    )
    phase = time.perf_counter()
    report = _ingest(run, sync)
    run.timings["ingest_s"] = round(time.perf_counter() - phase, 2)
    if report.documents_failed:
        shown = "; ".join(f"{f.uri}: {f.error}" for f in report.failures[:3])
        if report.documents_failed >= report.documents_seen:
            raise QuarryError(f"no document of {dataset.root} could be indexed: {shown}")
        run.warnings.append(
            f"{report.documents_failed} documents could not be indexed and cannot be "
            f"retrieved (first: {shown})"
        )

    per_query = _evaluate_queries(run)
    if not per_query:
        raise QuarryError(
            f"{dataset.root}: none of the {len(dataset.queries)} judged queries could be "
            f"embedded: {'; '.join(run.warnings[-1:])}"
        )
    vector = mean_metrics(row["vector"] for row in per_query.values())
    reranked = run.reranker is not None and all("reranked" in row for row in per_query.values())
    headline = mean_metrics(row["reranked"] for row in per_query.values()) if reranked else vector
    run.timings["total_s"] = round(time.perf_counter() - started, 2)

    result: dict[str, Any] = {
        "dataset": dataset.name,
        "split": dataset.split,
        "queries": len(per_query),
        **headline,
        "reranked": reranked,
        "without_rerank": vector,
        "collection": store.alias,
        "model": {"model_id": live.model.model_id, "model_key": live.model_key},
        "ingest": {
            "documents_seen": report.documents_seen,
            "documents_skipped": report.documents_skipped,
            "documents_embedded": report.documents_embedded,
            "documents_failed": report.documents_failed,
            "chunks_embedded": report.chunks_embedded,
            "points": store.count(),
        },
        "settings": {
            "chunk_tokens": settings.chunk_tokens,
            "chunk_overlap": settings.chunk_overlap,
            "candidates": candidates,
            "rerank_depth": rerank_depth if reranked else None,
        },
        "timings_s": run.timings,
        "warnings": run.warnings,
    }
    if details:
        result["per_query"] = {
            query_id: {
                **row.get("reranked", row["vector"]),
                "vector": row["vector"],
                "top": row["top"],
            }
            for query_id, row in per_query.items()
        }
    return result


# --------------------------------------------------------------------------- CLI face


def format_table(result: Mapping[str, Any]) -> Table:
    """A rich Table of the result: one row per ranking (vector, and reranked if any)."""
    from rich.table import Table

    table = Table(
        title=(
            f"{result['dataset']} ({result.get('split', 'test')}): {result['queries']} queries, "
            f"{result.get('model', {}).get('model_id', '?')}"
        )
    )
    table.add_column("ranking")
    for name in METRICS:
        table.add_column(name, justify="right")
    rows = [("vector", result["without_rerank"])]
    if result["reranked"]:
        rows.append(("reranked", {name: result[name] for name in METRICS}))
    for label, values in rows:
        table.add_row(label, *(f"{values[name]:.4f}" for name in METRICS))
    return table


class _ProgressPrinter:
    """Progress on stderr: a rich bar on a terminal, a line every ~10% otherwise."""

    def __init__(self, stack: ExitStack) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.tasks: dict[str, Any] = {}
        self.last: dict[str, float] = {}
        self.bar: Any = None
        if self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = stack.enter_context(
                Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    console=self.console,
                    transient=True,
                )
            )

    def __call__(self, stage: str, done: int, total: int) -> None:
        label = {"corpus": "indexing corpus", "queries": "running queries"}.get(stage, stage)
        if self.bar is not None:
            if stage not in self.tasks:
                self.tasks[stage] = self.bar.add_task(label, total=total)
            self.bar.update(self.tasks[stage], completed=done, total=total)
            return
        share = done / total if total else 1.0
        if done in (0, total) or share - self.last.get(stage, -1.0) >= 0.1:
            self.last[stage] = share
            print(f"quarry eval: {label}: {done}/{total}", file=sys.stderr, flush=True)


def eval_command(
    dataset_dir: str | Path,
    *,
    settings: Settings,
    split: str = "test",
    rerank: bool = True,
    as_json: bool = False,
) -> dict[str, Any]:
    """``quarry eval``: run :func:`run_evaluation` with progress on stderr and print the result.

    Prints JSON on stdout with ``as_json`` (the table then goes to stderr), else
    the table and any warnings on stdout. Returns the result; quarry's errors
    propagate for the CLI to map to exit codes.
    """
    from rich.console import Console

    with ExitStack() as stack:
        printer = _ProgressPrinter(stack)
        result = run_evaluation(
            dataset_dir, settings=settings, split=split, rerank=rerank, progress=printer
        )
    console = Console(stderr=as_json)
    if not console.is_terminal:  # a log or a pipe: rich would wrap at 80 columns
        console = Console(stderr=as_json, width=240)
    console.print(format_table(result))
    for warning in result["warnings"]:
        console.print(f"warning: {warning}", style="yellow", markup=False, soft_wrap=True)
    timings = result["timings_s"]
    console.print(
        f"collection {result['collection']} ({result['ingest']['points']} points, "
        f"{result['ingest']['documents_embedded']} documents embedded this run); "
        f"{timings.get('total_s', 0):.1f} s",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if as_json:
        print(json.dumps(result, indent=2), flush=True)
    return result
