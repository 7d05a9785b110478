"""Typed settings, read once from ``QUARRY_*`` environment variables.

Build them with :func:`get_settings` at the edge (CLI, API, flows) and pass them
down; no module keeps settings or clients at import time.
"""

from __future__ import annotations

import difflib
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from quarry.errors import ConfigError

DEFAULT_QUERY_TASK = "Given a web search query, retrieve relevant passages that answer the query"


class Settings(BaseSettings):
    """Every knob quarry has. Each field is ``QUARRY_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="QUARRY_", extra="ignore", frozen=True)

    # Where the embedded default keeps local-mode Qdrant, Prefect state and locks.
    data_dir: Path = Path(".quarry")
    collection: str = Field("quarry", pattern=r"^[A-Za-z0-9_-]+$")

    # Embedding service (TEI or an OpenAI-compatible gateway). Unset: local_tei in-process.
    embed_url: str | None = None
    embed_api_key: SecretStr | None = None
    embed_model: str | None = None
    embed_dialect: Literal["auto", "tei", "openai"] = "auto"
    embed_batch_size: int | None = Field(None, ge=1)
    embed_concurrency: int | None = Field(None, ge=1)
    embed_timeout: float = Field(60.0, gt=0)
    # Total seconds the clients keep retrying transient failures before giving up.
    retry_budget: float = Field(30.0, ge=0)

    # Reranker (TEI /rerank or Cohere-style /v1/rerank). Unset: the embedding service's.
    rerank_url: str | None = None
    rerank_api_key: SecretStr | None = None
    rerank_dialect: Literal["auto", "tei", "cohere"] = "auto"
    rerank_threshold: float = Field(0.3, allow_inf_nan=False)  # nan: every score under it
    rerank_required: bool = False

    # Qdrant. Unset: local mode under data_dir.
    qdrant_url: str | None = None
    qdrant_api_key: SecretStr | None = None

    # Chunking.
    chunk_tokens: int = Field(256, ge=16)
    chunk_overlap: int = Field(32, ge=0)
    embed_headings: bool = False
    max_file_bytes: int = Field(20 * 1024 * 1024, ge=1)

    # Query formatting.
    prompt_profile: Literal["qwen3", "e5-instruct", "e5", "bge-en", "none"] | None = None
    query_task: str = DEFAULT_QUERY_TASK

    # Ingestion.
    workers: int = Field(4, ge=1, le=64)
    max_delete_fraction: float = Field(0.3, ge=0, le=1)
    # Seconds an ingest or reindex waits for another writer of its collection to finish
    # before it gives up (StoreLocked); None waits as long as it takes.
    writer_wait: float | None = Field(None, ge=0)
    allow_serving_change: bool = False
    canary_min_cosine: float = Field(0.999, ge=-1, le=1)
    # Skip reading a file whose mtime and size are those its documents were indexed from.
    trust_file_stamps: bool = True

    # Query API.
    api_key: SecretStr | None = None
    api_auth: Literal["enabled", "disabled"] = "enabled"
    max_query_tokens: int = Field(512, ge=1)
    # A query body is a few kB; anything far bigger is refused before it is read.
    api_max_body_bytes: int = Field(1024 * 1024, ge=1024)
    # How often the API re-reads the live model's fingerprint while answering queries.
    fingerprint_recheck_seconds: float = Field(10.0, gt=0)
    # The most one query may take, all its calls together: a dependency that hangs
    # (rather than refusing) is then a 504 naming it, not a client held for minutes.
    query_timeout: float = Field(15.0, gt=0)
    # How long a query waits for the reranker (unless QUARRY_RERANK_REQUIRED) before it
    # answers from vector scores: a reranker that hangs must not hold every query.
    rerank_timeout: float = Field(5.0, gt=0)

    # Parity gates.
    parity_min_cosine: float = 0.999
    parity_min_overlap: float = 0.98

    @field_validator("embed_url", "rerank_url", "qdrant_url")
    @classmethod
    def _strip_trailing_slash(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        return http_url(value)

    @model_validator(mode="after")
    def _overlap_below_size(self) -> Settings:
        if self.chunk_overlap >= self.chunk_tokens:
            raise ValueError(
                f"the chunk overlap ({self.chunk_overlap}; --overlap or QUARRY_CHUNK_OVERLAP) "
                f"must be smaller than the chunk size ({self.chunk_tokens}; --max-tokens or "
                "QUARRY_CHUNK_TOKENS)"
            )
        return self

    @property
    def qdrant_path(self) -> Path:
        """Where local-mode Qdrant keeps its files."""
        return self.data_dir / "qdrant"


def make_data_folder(data_dir: Path, folder: Path, purpose: str) -> None:
    """Create ``folder`` (under ``data_dir``) and its parents; a ConfigError naming
    QUARRY_DATA_DIR when that cannot be done (a file in the way, no permission)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"QUARRY_DATA_DIR={data_dir}: cannot create {folder} for {purpose}: "
            f"{error.strerror or error}"
        ) from None


def http_url(value: str) -> str:
    """``value`` as a service URL (trimmed, no trailing slash); ValueError unless http(s)."""
    url = value.strip().rstrip("/")
    if not url.lower().startswith(("http://", "https://")):
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    # Checked here, so a bad host or port is a setting's error and names the variable
    # (review: the Qdrant client failed on it later, as if the service had).
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises for a port out of range or not a number
    except ValueError as error:
        raise ValueError(f"{url!r} is not a valid URL: {error}") from None
    if not parts.hostname or any(c.isspace() for c in parts.netloc):
        raise ValueError(f"{url!r} has no valid host")
    return url


def describe_invalid(error: ValidationError) -> str:
    """One line per problem of a failed Settings validation, naming the variable at fault."""
    lines = []
    for problem in error.errors():
        message = str(problem.get("msg", "invalid")).removeprefix("Value error, ")
        location = [str(part) for part in problem.get("loc", ())]
        if location:
            lines.append(f"QUARRY_{location[0].upper()}: {message}")
        else:
            lines.append(message)
    return "; ".join(lines)


# QUARRY_* variables that are no setting of quarry's but compose.yaml's and prefect.yaml's.
DEPLOYMENT_VARIABLES = frozenset({"QUARRY_GIT_REPO", "QUARRY_GIT_BRANCH", "QUARRY_SOURCES_DIR"})


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """What is wrong with each ``QUARRY_*`` name in ``environ`` that is no setting: a typo
    (``QUARRY_EMBED_ULR``) is otherwise ignored without a word. Names the nearest
    setting when one is close."""
    known = {f"QUARRY_{name.upper()}" for name in Settings.model_fields}
    problems = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("QUARRY_") or upper in known or upper in DEPLOYMENT_VARIABLES:
            continue
        near = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]}?)" if near else ""
        problems.append(f"{name} is not a quarry setting{hint}; ignored")
    return problems


def get_settings(**overrides: object) -> Settings:
    """Read settings from the environment; keyword overrides win (CLI flags)."""
    clean = {key: value for key, value in overrides.items() if value is not None}
    return Settings(**clean)  # type: ignore[arg-type]
