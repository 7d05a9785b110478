"""BEIR evaluation: metrics against hand-computed cases, the loader, and a whole run.

The end-to-end runs use local_tei's deterministic hash backend on
``tests/data/beir_tiny``: several queries there are exactly a document's
``title + " " + text``, so that document must rank first.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from quarry.config import Settings
from quarry.errors import QuarryError, SourceNotFound, UnreadableDocument
from quarry.evaluate import (
    METRICS,
    format_table,
    iter_corpus,
    load_beir,
    mean_metrics,
    mrr_at_k,
    ndcg_at_k,
    query_metrics,
    rank_documents,
    recall_at_k,
    run_evaluation,
)
from quarry.local_tei import LocalTEIConfig, LocalTEIServer

TINY = Path(__file__).parent / "data" / "beir_tiny"
LOG2_3 = math.log2(3)


# ------------------------------------------------------------------------------ metrics


def test_ndcg_graded_relevance_by_hand() -> None:
    # gains 2^rel - 1: a(1) -> 1 at rank 1, c(2) -> 3 at rank 3; b is not judged.
    dcg = 1 / 1 + 0 + 3 / 2
    # ideal order of grades (2, 1, 1): 3/1 + 1/log2(3) + 1/2
    idcg = 3 + 1 / LOG2_3 + 0.5
    relevance = {"a": 1, "c": 2, "d": 1}
    assert ndcg_at_k(["a", "b", "c"], relevance) == pytest.approx(dcg / idcg)
    assert ndcg_at_k(["a", "b", "c"], relevance) == pytest.approx(0.605190, abs=1e-6)
    assert ndcg_at_k(["c", "a", "d"], relevance) == pytest.approx(1.0)


def test_ndcg_ties_in_grades_and_k_cut() -> None:
    # Two documents of equal grade in either order are both ideal.
    assert ndcg_at_k(["b", "a"], {"a": 1, "b": 1}) == pytest.approx(1.0)
    # The only relevant document at rank 11 is outside nDCG@10.
    ranked = [f"x{i}" for i in range(10)] + ["hit"]
    assert ndcg_at_k(ranked, {"hit": 1}) == 0.0
    assert ndcg_at_k(ranked, {"hit": 1}, k=11) == pytest.approx(1 / math.log2(12))
    # Binary relevance at rank 2: 1/log2(3).
    assert ndcg_at_k(["x", "hit"], {"hit": 1}) == pytest.approx(1 / LOG2_3)


def test_ideal_dcg_is_cut_at_k_too() -> None:
    relevance = {f"r{i}": 1 for i in range(12)}
    # Ten relevant documents in the first ten places is a perfect nDCG@10.
    assert ndcg_at_k([f"r{i}" for i in range(10)], relevance) == pytest.approx(1.0)


def test_no_relevant_document_retrieved_scores_zero() -> None:
    relevance = {"gold": 1}
    ranked = ["a", "b", "c"]
    assert ndcg_at_k(ranked, relevance) == 0.0
    assert recall_at_k(ranked, relevance, 10) == 0.0
    assert mrr_at_k(ranked, relevance) == 0.0
    # Grade 0 is "judged not relevant", and an empty judgement scores 0, not a division error.
    assert ndcg_at_k(["a"], {"a": 0}) == 0.0
    assert recall_at_k(["a"], {}, 10) == 0.0


def test_recall_by_hand() -> None:
    relevance = {"a": 1, "b": 2, "c": 1}
    assert recall_at_k(["a", "x", "b"], relevance, 10) == pytest.approx(2 / 3)
    assert recall_at_k(["a", "x", "b"], relevance, 2) == pytest.approx(1 / 3)
    ranked = [f"x{i}" for i in range(50)] + ["c"]
    assert recall_at_k(ranked, relevance, 10) == 0.0
    assert recall_at_k(ranked, relevance, 100) == pytest.approx(1 / 3)


def test_mrr_by_hand() -> None:
    assert mrr_at_k(["x", "y", "a", "b"], {"a": 1, "b": 2}) == pytest.approx(1 / 3)
    assert mrr_at_k(["a"], {"a": 3}) == 1.0
    ranked = [f"x{i}" for i in range(10)] + ["a"]
    assert mrr_at_k(ranked, {"a": 1}) == 0.0
    assert mrr_at_k(ranked, {"a": 1}, k=11) == pytest.approx(1 / 11)


def test_rank_documents_takes_the_best_chunk_breaks_ties_by_id_and_excludes_own_id() -> None:
    hits = [("b", 0.5), ("a", 0.7), ("b", 0.9), ("c", 0.7), ("self", 1.0), ("a", 0.2)]
    ranking = rank_documents(hits, exclude="self")
    assert ranking == [("b", 0.9), ("a", 0.7), ("c", 0.7)]
    # Equal scores in the other input order give the same ranking.
    assert rank_documents(reversed(hits), exclude="self") == ranking
    assert rank_documents(hits)[0] == ("self", 1.0)


def test_own_id_exclusion_changes_the_metrics() -> None:
    hits = [("q7", 0.99), ("gold", 0.8), ("other", 0.5)]
    relevance = {"gold": 1}
    kept = [doc for doc, _ in rank_documents(hits)]
    dropped = [doc for doc, _ in rank_documents(hits, exclude="q7")]
    assert mrr_at_k(kept, relevance) == 0.5
    assert mrr_at_k(dropped, relevance) == 1.0


def test_query_metrics_and_mean() -> None:
    row = query_metrics(["a", "x"], {"a": 1, "b": 1})
    assert row == {
        "ndcg@10": pytest.approx(1 / (1 + 1 / LOG2_3)),
        "recall@10": 0.5,
        "recall@100": 0.5,
        "mrr@10": 1.0,
    }
    mean = mean_metrics([row, query_metrics(["x"], {"a": 1})])
    assert mean["recall@10"] == 0.25
    assert mean["mrr@10"] == 0.5
    assert mean_metrics([]) == dict.fromkeys(METRICS, 0.0)


# ------------------------------------------------------------------------------- loader


def test_loader_reads_judged_queries_and_graded_qrels() -> None:
    dataset = load_beir(TINY)
    assert dataset.name == "beir_tiny"
    # q6 has no judgement, q9 has no text, q5's grade-0 pair is not relevant.
    assert sorted(dataset.queries) == ["d4", "q1", "q2", "q4", "q5"]
    assert dataset.skipped_queries == 1
    assert dataset.qrels["q1"] == {"d1": 2, "d3": 1}
    assert dataset.qrels["q5"] == {"d6": 1}
    assert (dataset.corpus_entries, dataset.empty_entries) == (8, 0)


def test_corpus_passages_join_title_and_text_as_beir_does() -> None:
    entries = {entry.doc_id: entry for entry in iter_corpus(TINY / "corpus.jsonl")}
    assert len(entries) == 8
    assert entries["d1"].passage == (
        "Granite quarries Granite is cut from open pits in terraces and polished for "
        "kitchen counters."
    )
    assert entries["d2"].title == ""
    assert entries["d2"].passage == entries["d2"].text


def test_loader_other_split_and_missing_split(tmp_path: Path) -> None:
    assert sorted(load_beir(TINY, "dev").queries) == ["q2"]
    with pytest.raises(SourceNotFound, match=r"splits here: dev, test"):
        load_beir(TINY, "train")
    with pytest.raises(SourceNotFound, match="no such dataset folder"):
        load_beir(tmp_path / "absent")


def test_loader_names_the_bad_line(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").write_text('{"_id": "a", "text": "ok"}\n{not json\n')
    with pytest.raises(UnreadableDocument, match=r"corpus\.jsonl:2"):
        list(iter_corpus(tmp_path / "corpus.jsonl"))


def _dataset(
    root: Path,
    corpus: str | bytes = '{"_id": "d1", "text": "granite"}\n{"_id": "d2", "text": "basalt"}\n',
    queries: str | bytes = '{"_id": "q1", "text": "granite"}\n',
    qrels: str | bytes = "q1\td1\t1\n",
) -> Path:
    (root / "qrels").mkdir(parents=True)
    for name, content in (
        ("corpus.jsonl", corpus),
        ("queries.jsonl", queries),
        ("qrels/test.tsv", qrels),
    ):
        data = content.encode("utf-8") if isinstance(content, str) else content
        (root / name).write_bytes(data)
    return root


@pytest.mark.parametrize(
    ("files", "where", "says"),
    [
        (
            {
                "corpus": '{"_id": "a", "text": "x"}\n{"_id": "b", "text": "y"}\n{"_id": "a", "text": "z"}\n'
            },
            r"corpus\.jsonl:3",
            r"'a' is repeated \(first on line 1\)",
        ),
        (
            {"queries": '{"_id": "q1", "text": "a"}\n{"_id": "q1", "text": "b"}\n'},
            r"queries\.jsonl:2",
            "repeated",
        ),
        ({"corpus": '{"_id": null, "text": "x"}\n'}, r"corpus\.jsonl:1", "non-empty string"),
        ({"corpus": '{"_id": "", "text": "x"}\n'}, r"corpus\.jsonl:1", "non-empty string"),
        (
            {"corpus": '{"_id": "a", "title": ["x"], "text": "y"}\n'},
            r"corpus\.jsonl:1",
            "'title' is not a string",
        ),
        ({"corpus": b'{"_id": "a", "text": "caf\xe9"}\n'}, r"corpus\.jsonl:1", "not UTF-8"),
        ({"qrels": b"q1\td1\t1\nq\xe9\td1\t1\n"}, r"test\.tsv:2", "not UTF-8"),
        ({"qrels": "q1\td1\t1\nq1\td2\tinf\n"}, r"test\.tsv:2", "not a finite number"),
        ({"qrels": "q1\td1\n"}, r"test\.tsv:1", "got 2 columns"),
        ({"qrels": "q1\td1\t0\n"}, r"test\.tsv", "no document relevant"),
        ({"corpus": ""}, r"corpus\.jsonl", "no entry with a title or text"),
        ({"qrels": "q1\tD1\t1\n"}, r"test\.tsv", r"none of the 1 documents .* 'D1'"),
        ({"corpus": '{"_id": "a", "text": " "}\n'}, r"corpus\.jsonl", "no entry with a title"),
    ],
)
def test_a_malformed_dataset_is_refused_naming_file_and_line(
    tmp_path: Path, files: dict[str, str | bytes], where: str, says: str
) -> None:
    root = _dataset(tmp_path / "ds", **files)
    with pytest.raises(UnreadableDocument, match=where) as caught:
        load_beir(root)
    assert caught.match(says)


def test_qrels_forms_byte_order_mark_trec_columns_and_regrading(tmp_path: Path) -> None:
    qrels = "\ufeffq1\t0\td1\t1\nq2 0 d2 2\nq3\td1\t1\nq3\td1\t0\nq2\td2\t1\n"
    queries = "".join(f'{{"_id": "q{n}", "text": "query {n}"}}\n' for n in (1, 2, 3))
    dataset = load_beir(_dataset(tmp_path / "ds", queries=queries, qrels=qrels))
    # The BOM does not hide q1; TREC's iteration column is not a corpus id; the last
    # grade of a pair stands, so q3's relevant pair was withdrawn.
    assert dataset.qrels == {"q1": {"d1": 1}, "q2": {"d2": 1}}


def test_qrels_trailing_tabs_and_padded_ids_are_read(tmp_path: Path) -> None:
    # A spreadsheet export's trailing tab is no TREC column; padding is not part of an id.
    qrels = "query-id\tcorpus-id\tscore\nq1\td1\t1\t\nq2 \t d2\t 1\n"
    queries = "".join(f'{{"_id": "q{n}", "text": "query {n}"}}\n' for n in (1, 2))
    dataset = load_beir(_dataset(tmp_path / "ds", queries=queries, qrels=qrels))
    assert dataset.qrels == {"q1": {"d1": 1}, "q2": {"d2": 1}}


def test_a_fractional_grade_is_refused_not_truncated(tmp_path: Path) -> None:
    # int(0.5) is 0: the judgement (and here the query) would vanish without a word.
    qrels = "query-id\tcorpus-id\tscore\nq1\td1\t2.0\nq1\td2\t0.5\n"
    with pytest.raises(UnreadableDocument, match=r"test\.tsv:3: score '0\.5' is not an integer"):
        load_beir(_dataset(tmp_path / "ds", qrels=qrels))


def test_relevant_documents_missing_from_the_corpus_are_counted(tmp_path: Path) -> None:
    # A header after a blank line is still a header.
    qrels = "\nquery-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td9\t1\n"
    dataset = load_beir(_dataset(tmp_path / "ds", qrels=qrels))
    assert dataset.qrels == {"q1": {"d1": 1, "d9": 1}}
    assert dataset.missing_relevant == ("d9",)


def test_judged_queries_without_text_and_empty_entries_are_counted(tmp_path: Path) -> None:
    root = _dataset(
        tmp_path / "ds",
        corpus='{"_id": "d1", "text": "granite"}\n{"_id": "d2", "title": "", "text": ""}\n',
        queries='{"_id": "q1", "text": "granite"}\n{"_id": "q2", "text": "  "}\n{"_id": "q3"}\n',
        qrels="q1\td1\t1\nq2\td1\t1\nq3\td1\t1\n",
    )
    dataset = load_beir(root)
    assert list(dataset.queries) == ["q1"]
    assert dataset.skipped_queries == 2
    assert (dataset.corpus_entries, dataset.empty_entries) == (2, 1)


# ------------------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def tei() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32)) as server:
        yield server


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch, tei: LocalTEIServer, tmp_path: Path) -> Settings:
    monkeypatch.setenv("QUARRY_EMBED_URL", tei.url)
    # Small chunks, so the long document d6 is several chunks aggregated back to one.
    return Settings(data_dir=tmp_path / "data", chunk_tokens=32, chunk_overlap=4)


def test_a_relevant_document_missing_from_the_corpus_is_warned_about(
    settings: Settings, tmp_path: Path
) -> None:
    root = _dataset(tmp_path / "ds", qrels="q1\td1\t1\nq1\tD2\t1\n")
    result = run_evaluation(root, settings=settings, rerank=False)
    [warning] = [w for w in result["warnings"] if "not in corpus.jsonl" in w]
    assert warning.startswith("1 documents the qrels judge relevant") and "'D2'" in warning
    assert result["recall@10"] == 0.5  # d1 found, D2 cannot be


def test_run_evaluation_end_to_end(settings: Settings) -> None:
    stages: list[tuple[str, int, int]] = []
    result = run_evaluation(
        TINY,
        settings=settings,
        details=True,
        progress=lambda stage, done, total: stages.append((stage, done, total)),
    )
    json.dumps(result)  # JSON-ready
    for key in ("dataset", "queries", *METRICS, "reranked"):
        assert key in result
    assert result["dataset"] == "beir_tiny"
    assert result["queries"] == 5
    assert result["reranked"] is True
    assert set(result["without_rerank"]) == set(METRICS)
    assert result["collection"].startswith("eval-beir_tiny-")
    assert result["ingest"]["documents_embedded"] == 8
    assert result["ingest"]["points"] > 8  # d6 is several chunks
    assert any("no text" in warning for warning in result["warnings"])
    for value in (*(result[m] for m in METRICS), *result["without_rerank"].values()):
        assert 0.0 <= value <= 1.0

    per_query = result["per_query"]
    # A query that is exactly a document's "title text" finds it first.
    assert per_query["q1"]["top"][0] == "d1"
    assert per_query["q2"]["top"][0] == "d2"
    assert per_query["q2"]["vector"]["ndcg@10"] == 1.0
    # The query with id "d4" is d4's text, but d4 itself is not allowed in its ranking.
    assert "d4" not in per_query["d4"]["top"]
    assert per_query["d4"]["top"][0] == "d5"
    # A sentence from the middle of d6 finds d6, whose chunks are aggregated to one entry.
    assert per_query["q5"]["top"][0] == "d6"
    assert per_query["q5"]["top"].count("d6") == 1
    # Every document is retrieved from a corpus this small.
    assert result["recall@100"] == 1.0
    # mean of the per-query figures is the headline
    mean = sum(row["ndcg@10"] for row in per_query.values()) / 5
    assert result["ndcg@10"] == pytest.approx(mean, abs=1e-5)

    assert ("corpus", 8, 8) in stages
    assert stages[-1] == ("queries", 5, 5)
    console = Console(record=True, width=120)
    console.print(format_table(result))
    rendered = console.export_text()
    assert "vector" in rendered and "reranked" in rendered
    assert f"{result['ndcg@10']:.4f}" in rendered


def test_second_run_reuses_the_collection_and_embeds_nothing(
    settings: Settings, tei: LocalTEIServer
) -> None:
    first = run_evaluation(TINY, settings=settings, rerank=True)
    tei.stats.reset()
    second = run_evaluation(TINY, settings=settings, rerank=False)
    assert second["collection"] == first["collection"]
    assert second["ingest"]["documents_skipped"] == 8
    assert second["ingest"]["documents_embedded"] == 0
    assert second["reranked"] is False
    assert second["ndcg@10"] == first["without_rerank"]["ndcg@10"]
    assert not any("rerank" in path for (_method, path) in tei.stats.requests)
    # Query embeddings plus the fingerprint canaries: no passage was embedded again.
    embed_requests = sum(n for (_m, path), n in tei.stats.requests.items() if "embed" in path)
    assert embed_requests <= second["queries"] + 3


def test_other_chunking_gets_its_own_collection(settings: Settings) -> None:
    first = run_evaluation(TINY, settings=settings, rerank=False)
    other = settings.model_copy(update={"chunk_tokens": 64})
    second = run_evaluation(TINY, settings=other, rerank=False)
    assert second["collection"] != first["collection"]
    assert second["ingest"]["documents_embedded"] == 8


def test_cli_function_prints_table_and_json(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    from quarry.evaluate import eval_command

    result: dict[str, Any] = eval_command(TINY, settings=settings, rerank=False, as_json=True)
    out, err = capsys.readouterr()
    assert json.loads(out)["ndcg@10"] == result["ndcg@10"]
    assert "ndcg@10" in err and "vector" in err
    eval_command(TINY, settings=settings, rerank=False, as_json=False)
    out, _ = capsys.readouterr()
    assert "vector" in out and f"{result['ndcg@10']:.4f}" in out
    # Not a terminal (a log, a pipe): the summary line is one line, not cut at 80 columns.
    [summary] = [line for line in out.splitlines() if line.startswith("collection ")]
    assert summary.endswith(" s") and "documents embedded this run" in summary


def test_runs_on_services_it_is_given(settings: Settings) -> None:
    """The reindex flow evaluates inside its own open_services: local Qdrant allows one client."""
    from quarry.services import open_services

    with open_services(settings, quiet=True) as services:
        result = run_evaluation(TINY, settings=settings, rerank=False, services=services)
        assert services.store.client.collection_exists(result["collection"])
    assert result["ingest"]["documents_embedded"] == 8


def test_a_query_too_long_for_the_embedding_model_is_left_out_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_query = " ".join(["granite quarries polished terraces"] * 25)
    root = _dataset(
        tmp_path / "ds",
        queries=f'{{"_id": "q1", "text": "granite"}}\n{{"_id": "q2", "text": "{long_query}"}}\n',
        qrels="q1\td1\t1\nq2\td1\t1\n",
    )
    # 64 tokens: q2 alone is over it, q1 with a 16-token passage is not.
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32, max_input_length=64)) as short:
        monkeypatch.setenv("QUARRY_EMBED_URL", short.url)
        settings = Settings(data_dir=tmp_path / "data", chunk_tokens=16, chunk_overlap=2)
        result = run_evaluation(root, settings=settings, details=True)
        assert result["reranked"] is True  # q1 was reranked: no outage
        assert result["queries"] == 1  # q2 is too long for the embedding model too: left out
        [warning] = [w for w in result["warnings"] if "too long" in w]
        assert "q2" in warning and "embedding model" in warning
        # With no query left to measure, the run fails instead of scoring 0.0.
        only_long = _dataset(
            tmp_path / "long",
            queries=f'{{"_id": "q2", "text": "{long_query}"}}\n',
            qrels="q2\td1\t1\n",
        )
        with pytest.raises(QuarryError, match="none of the 1 judged queries could be embedded"):
            run_evaluation(only_long, settings=settings)


def test_rerank_refusal_of_one_query_is_not_an_outage(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quarry.errors import QueryTooLong
    from quarry.rerank import RerankClient

    score = RerankClient.score

    def refuse_q1(self: RerankClient, query: str, texts: list[str], **kwargs: Any) -> list[float]:
        if query.startswith("Granite quarries"):
            raise QueryTooLong("http://reranker/rerank", "the query alone is over max_input_length")
        return score(self, query, texts, **kwargs)

    monkeypatch.setattr(RerankClient, "score", refuse_q1)
    result = run_evaluation(TINY, settings=settings, details=True)
    assert result["reranked"] is True
    rows = result["per_query"]
    assert rows["q1"]["ndcg@10"] == rows["q1"]["vector"]["ndcg@10"]
    [warning] = [w for w in result["warnings"] if "refused" in w]
    assert "q1" in warning and "q2" not in warning


def test_an_eval_collection_of_vectors_the_live_service_no_longer_makes_is_rebuilt(
    settings: Settings, tei: LocalTEIServer
) -> None:
    """Operator trial: a tag re-pulled behind the same /info embeds otherwise; with every
    document current, eval scored the new model's queries against the old one's vectors."""
    import httpx2

    from quarry.embeddings import EmbeddingClient
    from quarry.services import open_services

    honest = run_evaluation(TINY, settings=settings, rerank=False)
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32, seed=7)) as other:
        upstream = httpx2.Client()

        def info_from_one_vectors_from_other(request: httpx2.Request) -> httpx2.Response:
            target = tei.url if request.url.path == "/info" else other.url
            answer = upstream.request(
                request.method,
                target + request.url.path,
                content=request.content,
                headers={"content-type": request.headers.get("content-type", "")},
            )
            return httpx2.Response(answer.status_code, content=answer.content)

        transport = httpx2.MockTransport(info_from_one_vectors_from_other)
        try:
            with open_services(settings, quiet=True) as services:
                swapped = EmbeddingClient(tei.url, transport=transport)
                services = dataclasses.replace(services, embedder=swapped)
                mixed = run_evaluation(TINY, settings=settings, rerank=False, services=services)
                swapped.close()
        finally:
            upstream.close()
        # The same vectors, from the service that makes them, in a data dir of its own.
        alone = settings.model_copy(
            update={"data_dir": settings.data_dir.parent / "alone", "embed_url": other.url}
        )
        truth = run_evaluation(TINY, settings=alone, rerank=False)
    assert mixed["collection"] == honest["collection"]  # the same identity: the same name
    assert mixed["ingest"]["documents_embedded"] == 8  # rebuilt, not reused
    assert any("embeds the canary text differently" in w for w in mixed["warnings"])
    # The figures are those of the vectors the live service makes, every one its own.
    assert mixed["ndcg@10"] == pytest.approx(truth["ndcg@10"])
    again = run_evaluation(TINY, settings=settings, rerank=False)  # the first service back
    assert again["ingest"]["documents_embedded"] == 8
    assert again["ndcg@10"] == pytest.approx(honest["ndcg@10"])
