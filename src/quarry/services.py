"""Building the clients from Settings: the one place that does.

``open_services`` is used by the CLI, the API and the flows. With no
``QUARRY_EMBED_URL`` it starts :mod:`quarry.local_tei` in this process on a free
loopback port (and says so on stderr), and stops it on exit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TypedDict

from quarry._async_clients import AsyncEmbeddingClient, AsyncRerankClient
from quarry._http import RetryPolicy
from quarry.config import Settings
from quarry.embeddings import EmbedDialect, EmbeddingClient
from quarry.prompts import ProfileName
from quarry.rerank import RerankClient, RerankDialect
from quarry.store import VectorStore, open_client


@dataclass(frozen=True, slots=True)
class Services:
    """The live clients one command works with."""

    settings: Settings
    embedder: EmbeddingClient
    reranker: RerankClient
    store: VectorStore
    embed_url: str
    rerank_url: str


def _secret(value: object) -> str | None:
    getter = getattr(value, "get_secret_value", None)
    return getter() if getter else None


@contextmanager
def start_local_tei_if_needed(
    settings: Settings, *, quiet: bool = False, preload: bool = False
) -> Iterator[str]:
    """Yield the embedding service URL, starting local_tei when none is configured.

    Its model loads on the first request that needs it, so a sync with nothing to
    embed, or a status, never starts torch; ``preload`` (a server that will answer
    queries under a deadline) loads it before this returns.
    """
    if settings.embed_url:
        yield settings.embed_url
        return
    from quarry.local_tei import LocalTEIConfig, LocalTEIServer

    server = LocalTEIServer(LocalTEIConfig(preload=preload))
    if not quiet:
        print(
            "quarry: QUARRY_EMBED_URL is not set; starting the local TEI-compatible service "
            "(all-MiniLM-L6-v2 on CPU) in this process...",
            file=sys.stderr,
        )
    server.start()
    if not quiet:
        print(f"quarry: local TEI-compatible service at {server.url}", file=sys.stderr)
    try:
        yield server.url
    finally:
        server.stop()


def retry_policy(settings: Settings) -> RetryPolicy:
    """The clients' retry policy from settings."""
    return RetryPolicy(budget=settings.retry_budget)


class _EmbeddingOptions(TypedDict):
    api_key: str | None
    model: str | None
    timeout: float
    retry: RetryPolicy
    prompt_profile: ProfileName | None
    query_task: str
    dialect: EmbedDialect


class _RerankOptions(TypedDict):
    api_key: str | None
    timeout: float
    retry: RetryPolicy
    dialect: RerankDialect


def _embedding_options(settings: Settings) -> _EmbeddingOptions:
    """What the sync and the async embedding client both take from settings."""
    return {
        "api_key": _secret(settings.embed_api_key),
        "model": settings.embed_model,
        "timeout": settings.embed_timeout,
        "retry": retry_policy(settings),
        "prompt_profile": settings.prompt_profile,
        "query_task": settings.query_task,
        "dialect": settings.embed_dialect,
    }


def _rerank_options(settings: Settings) -> _RerankOptions:
    """What both rerank clients take from settings: their own key, else the embedding service's."""
    return {
        "api_key": _secret(settings.rerank_api_key or settings.embed_api_key),
        "timeout": settings.embed_timeout,
        "retry": retry_policy(settings),
        "dialect": settings.rerank_dialect,
    }


def embedding_client(settings: Settings, url: str) -> EmbeddingClient:
    """An embedding client for ``url`` with the key, limits and profile the settings give."""
    return EmbeddingClient(
        url.rstrip("/"),
        batch_size=settings.embed_batch_size,
        concurrency=settings.embed_concurrency,
        **_embedding_options(settings),
    )


def rerank_client(
    settings: Settings, url: str, *, retry_cap: tuple[float, str] | None = None
) -> RerankClient:
    """A rerank client for ``url``: its own key, else the embedding service's. With
    ``retry_cap`` (seconds, what sets it), its retries stop at that budget."""
    options = _rerank_options(settings)
    if retry_cap is not None:
        options["retry"] = options["retry"].capped(*retry_cap)
    return RerankClient(url.rstrip("/"), **options)


def async_embedding_client(settings: Settings, url: str) -> AsyncEmbeddingClient:
    """:func:`embedding_client` for the query API's event loop (queries only: no batch limits)."""
    return AsyncEmbeddingClient(url.rstrip("/"), **_embedding_options(settings))


def async_rerank_client(settings: Settings, url: str) -> AsyncRerankClient:
    """:func:`rerank_client` for the query API's event loop."""
    return AsyncRerankClient(url.rstrip("/"), **_rerank_options(settings))


@contextmanager
def open_services(
    settings: Settings, *, quiet: bool = False, rerank_retry_cap: tuple[float, str] | None = None
) -> Iterator[Services]:
    """Clients for the embedding service, the reranker and Qdrant, closed on exit;
    ``rerank_retry_cap`` as :func:`rerank_client` takes it."""
    with ExitStack() as stack:
        embed_url = stack.enter_context(start_local_tei_if_needed(settings, quiet=quiet))
        embedder = embedding_client(settings, embed_url)
        stack.callback(embedder.close)
        rerank_url = settings.rerank_url or embed_url
        reranker = rerank_client(settings, rerank_url, retry_cap=rerank_retry_cap)
        stack.callback(reranker.close)
        store = VectorStore(open_client(settings), settings.collection)
        stack.callback(store.close)
        yield Services(
            settings=settings,
            embedder=embedder,
            reranker=reranker,
            store=store,
            embed_url=embed_url,
            rerank_url=rerank_url,
        )
