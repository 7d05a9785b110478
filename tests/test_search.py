"""rank_results: the order, cut and collapse of an answer, from hits and scores."""

from __future__ import annotations

import pytest
from qdrant_client import models

from quarry.search import rank_results


def _hit(n: int, doc: str, score: float) -> models.ScoredPoint:
    return models.ScoredPoint(
        id=n, version=0, score=score, payload={"doc_id": doc, "text": f"t{n}", "chunk_index": n}
    )


HITS = [_hit(0, "a", 0.9), _hit(1, "a", 0.8), _hit(2, "b", 0.7), _hit(3, "c", 0.6)]


def test_rerank_scores_order_the_answer_and_ties_keep_qdrant_order() -> None:
    results = rank_results(HITS, [0.1, 0.5, 0.5, 0.9], threshold=None, collapse="none", top_k=10)
    assert [r.text for r in results] == ["t3", "t1", "t2", "t0"]
    assert [r.rerank_score for r in results] == [0.9, 0.5, 0.5, 0.1]
    assert [r.vector_score for r in results] == [0.6, 0.8, 0.7, 0.9]


def test_threshold_then_top_k() -> None:
    results = rank_results(HITS, None, threshold=0.65, collapse="none", top_k=2)
    assert [r.text for r in results] == ["t0", "t1"]
    assert all(r.rerank_score is None and r.score == r.vector_score for r in results)
    assert rank_results(HITS, None, threshold=0.95, collapse="none", top_k=2) == []


def test_collapse_keeps_each_documents_best_and_fills_top_k_from_later_documents() -> None:
    results = rank_results(HITS, [0.2, 0.9, 0.3, 0.1], threshold=None, collapse="doc", top_k=2)
    assert [(r.doc_id, r.text) for r in results] == [("a", "t1"), ("b", "t2")]
    three = rank_results(HITS, None, threshold=None, collapse="doc", top_k=3)
    assert [r.doc_id for r in three] == ["a", "b", "c"]


def test_a_rerank_score_per_hit_is_required() -> None:
    with pytest.raises(ValueError, match="3 rerank scores for 4 hits"):
        rank_results(HITS, [0.1, 0.2, 0.3], threshold=None, collapse="none", top_k=10)


def test_a_nan_score_under_the_threshold_does_not_disturb_the_order() -> None:
    nan = float("nan")
    results = rank_results(HITS, [0.4, nan, 0.9, 0.6], threshold=0.3, collapse="none", top_k=10)
    assert [(r.text, r.score) for r in results] == [("t2", 0.9), ("t3", 0.6), ("t0", 0.4)]
