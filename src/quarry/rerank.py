"""Rerank client for TEI's ``/rerank`` and the Cohere-style ``/v1/rerank``.

Candidates are sent in batches of at most the service's
``max_client_batch_size``, scores are merged across batches, and a candidate
too long for the reranker is split and scored by its best part (max-pooled),
never truncated.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, Literal

import httpx2

from quarry._http import RetryPolicy, http_client, request_json
from quarry.embeddings import ServiceInfo, fetch_info
from quarry.errors import BadResponse, InputTooLong, QueryTooLong

RerankDialect = Literal["auto", "tei", "cohere"]
DEFAULT_RERANK_BATCH = 32
# A text too long beside the query is halved at most this often (8 parts): a query
# that leaves a text almost no room would otherwise cost hundreds of requests.
MAX_SPLIT_DEPTH = 3

_HINT = {
    "tei": "This reranker seems to speak the Cohere-style API: set QUARRY_RERANK_DIALECT=cohere.",
    "cohere": "This reranker seems to speak TEI's API: set QUARRY_RERANK_DIALECT=tei.",
}


class RerankClient:
    """Scores (query, passage) pairs through a reranking service."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        transport: httpx2.BaseTransport | None = None,
        timeout: float = 60.0,
        retry: RetryPolicy = RetryPolicy(),
        dialect: RerankDialect = "auto",
        batch_size: int | None = None,
        model: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._retry = retry
        self._dialect = dialect
        self._batch_size = batch_size
        self._model = model
        self._http = http_client(transport=transport, timeout=timeout, api_key=api_key)
        self._info: ServiceInfo | None = None
        self._info_loaded = False
        self._lock = threading.Lock()

    @property
    def info(self) -> ServiceInfo | None:
        """TEI ``/info`` of the reranker, or None when it has none."""
        with self._lock:
            if not self._info_loaded:
                raw = fetch_info(self._http, self.base_url, self._retry)
                if raw is not None and "model_id" in raw:
                    self._info = ServiceInfo.from_tei(self.base_url, raw)
                self._info_loaded = True
            return self._info

    @property
    def dialect(self) -> Literal["tei", "cohere"]:
        """The API in use: as set, else TEI when ``/info`` answers, else Cohere-style."""
        if self._dialect != "auto":
            return self._dialect
        return "tei" if self.info is not None else "cohere"

    @property
    def batch_size(self) -> int:
        """Texts per request (rerank texts count against ``max_client_batch_size``)."""
        info = self.info
        limit = info.inputs_per_request(DEFAULT_RERANK_BATCH) if info else DEFAULT_RERANK_BATCH
        return min(limit, self._batch_size) if self._batch_size else limit

    def score(self, query: str, texts: Sequence[str]) -> list[float]:
        """One relevance score per text, in the order given.

        A text too long beside the query is scored in parts (its best part
        counts); a query too long on its own raises QueryTooLong at once.
        """
        scores: list[float] = []
        size = self.batch_size
        checked = [False]
        for start in range(0, len(texts), size):
            scores.extend(self._score_resilient(query, list(texts[start : start + size]), checked))
        return scores

    def _score_resilient(
        self, query: str, texts: list[str], checked: list[bool], depth: int = 0
    ) -> list[float]:
        try:
            return self._post(query, texts)
        except InputTooLong as error:
            if not checked[0]:
                checked[0] = True
                self._check_query(query)
            if len(texts) > 1:
                middle = len(texts) // 2
                return self._score_resilient(
                    query, texts[:middle], checked, depth
                ) + self._score_resilient(query, texts[middle:], checked, depth)
            return [self._score_split(query, texts[0], error, checked, depth)]

    def _score_split(
        self, query: str, text: str, error: InputTooLong, checked: list[bool], depth: int
    ) -> float:
        from quarry.chunking import split_in_two

        if len(text) < 2 or depth >= MAX_SPLIT_DEPTH:
            raise error
        return max(
            self._score_resilient(query, [part], checked, depth + 1)[0]
            for part in split_in_two(text)
        )

    def _check_query(self, query: str) -> None:
        """Raise QueryTooLong when the query does not fit even beside a one-character text."""
        try:
            self._post(query, ["."])
        except InputTooLong as error:
            raise query_too_long(error) from None

    def _post(self, query: str, texts: list[str]) -> list[float]:
        if not texts:
            return []
        dialect = self.dialect
        if dialect == "tei":
            url = f"{self.base_url}/rerank"
            body: dict[str, Any] = {
                "query": query,
                "texts": texts,
                "truncate": False,
                "raw_scores": False,
            }
        else:
            url = f"{self.base_url}/v1/rerank"
            body = {"query": query, "documents": texts, "top_n": len(texts)}
            if self._model:
                body["model"] = self._model
        answer = request_json(
            self._http, self._retry, "POST", url, json_body=body, dialect_hint=_HINT[dialect]
        )
        return _parse_scores(url, answer, len(texts))

    def close(self) -> None:
        """Release connections."""
        self._http.close()

    def __enter__(self) -> RerankClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def query_too_long(error: InputTooLong) -> QueryTooLong:
    """The QueryTooLong for a reranker that refused the query beside a one-character text."""
    return QueryTooLong(
        error.url,
        "the query alone is over the reranker's input limit (max_input_length); "
        "shorten it, or search without rerank (--no-rerank)",
        status=error.status,
    )


def _parse_scores(url: str, answer: Any, expected: int) -> list[float]:
    """Scores by input index from either ``[{index, score}]`` or ``{results: [...]}``.

    Anything else (an item that is not an object, an index that is not an integer
    in range or comes twice, a score that is not a finite number) is a
    BadResponse saying what was wrong, never a Python error from the parsing.
    """
    items = answer.get("results") if isinstance(answer, dict) else answer
    if not isinstance(items, list):
        raise BadResponse(url, "rerank answer is neither a list nor has 'results'")
    scores: list[float | None] = [None] * expected
    for item in items:
        if not isinstance(item, dict):
            raise BadResponse(url, f"rerank item {item!r:.60} is not an object")
        index = item.get("index")
        if type(index) is not int or not 0 <= index < expected:
            raise BadResponse(url, f"rerank index {index!r:.40} is not one of 0..{expected - 1}")
        if scores[index] is not None:
            raise BadResponse(url, f"rerank answer scores index {index} twice")
        value = item.get("score", item.get("relevance_score"))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadResponse(url, f"rerank score {value!r:.40} is not a number")
        score = float(value)
        if not math.isfinite(score):  # json reads NaN and Infinity; a ranking cannot use them
            raise BadResponse(url, f"rerank score {value!r} is not a finite number")
        scores[index] = score
    missing = sum(score is None for score in scores)
    if missing:
        raise BadResponse(url, f"rerank answer has no score for {missing} of {expected} texts")
    return [score for score in scores if score is not None]
