"""``python -m quarry.local_tei``: run the local TEI-compatible service in the foreground."""

from __future__ import annotations

import argparse
import errno
from collections.abc import Sequence

from ._config import LocalTEIConfig
from ._server import serve


def _parser() -> argparse.ArgumentParser:
    defaults = LocalTEIConfig(backend="hash")
    p = argparse.ArgumentParser(
        prog="python -m quarry.local_tei",
        description="Serve Text Embeddings Inference 1.9.3's HTTP API locally.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend",
        choices=["minilm", "hash"],
        default="minilm",
        help="the bundled all-MiniLM-L6-v2, or a model-free hash stand-in (another model)",
    )
    p.add_argument("--host", default=defaults.host, help="address to listen on")
    p.add_argument("--port", type=int, default=defaults.port, help="0 picks a free port")
    p.add_argument("--dims", type=int, default=defaults.dims, help="hash backend only")
    p.add_argument("--seed", type=int, default=defaults.seed, help="hash backend only")
    p.add_argument(
        "--max-input-length",
        type=int,
        default=None,
        help="tokens an input may have (None: the model's own limit)",
    )
    p.add_argument(
        "--max-client-batch-size",
        type=int,
        default=defaults.max_client_batch_size,
        help="inputs per request",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_batch_tokens,
        help="tokens per request, all inputs together",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=defaults.max_concurrent_requests,
        help="inputs in flight before it answers 429",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=defaults.latency_ms,
        help="added to every request, to act like a remote GPU service",
    )
    p.add_argument(
        "--per-token-us",
        type=float,
        default=defaults.per_token_us,
        help="added per input token (a GPU's capacity)",
    )
    p.add_argument(
        "--fault-rate",
        type=float,
        default=defaults.fault_rate,
        help="share of requests answered with a 429 or a 503, for trials of retries",
    )
    p.add_argument(
        "--payload-limit",
        type=int,
        default=defaults.payload_limit,
        help="request body limit in bytes (413 above it)",
    )
    p.add_argument(
        "--engine-version", default=defaults.engine_version, help="the version /info reports"
    )
    p.add_argument("--api-key", default=None, help="require this bearer key")
    p.add_argument(
        "--rerank-dialect",
        choices=["tei", "cohere"],
        default="tei",
        help="TEI's /rerank, or the Cohere-style /v1/rerank",
    )
    p.add_argument(
        "--auto-truncate",
        choices=["true", "false"],
        default="false",
        help="cut over-long inputs instead of refusing them (TEI's own default is true; "
        "quarry's stack runs TEI with false, as this does by default)",
    )
    p.add_argument(
        "--embedding-cache",
        type=int,
        default=defaults.embedding_cache,
        help="minilm backend: vectors kept of inputs seen before, so that reranking "
        "passages it embedded costs no forward pass (about 1.7 KB each; 0: none)",
    )
    return p


def main(
    argv: Sequence[str] | None = None, prog: str | None = None, port: int | None = None
) -> None:
    """Parse the command line and serve until interrupted (``port``: the default port)."""
    parser = _parser()
    if prog is not None:
        parser.prog = prog
    if port is not None:
        parser.set_defaults(port=port)
    args = parser.parse_args(argv)
    try:
        config = LocalTEIConfig(
            backend=args.backend,
            host=args.host,
            port=args.port,
            dims=args.dims,
            seed=args.seed,
            max_input_length=args.max_input_length,
            max_client_batch_size=args.max_client_batch_size,
            max_batch_tokens=args.max_batch_tokens,
            max_concurrent_requests=args.max_concurrent_requests,
            latency_ms=args.latency_ms,
            per_token_us=args.per_token_us,
            fault_rate=args.fault_rate,
            payload_limit=args.payload_limit,
            engine_version=args.engine_version,
            api_key=args.api_key,
            rerank_dialect=args.rerank_dialect,
            auto_truncate=args.auto_truncate == "true",
            embedding_cache=args.embedding_cache,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        serve(config)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        parser.exit(1, f"{parser.prog}: cannot listen on {args.host}:{args.port}: {exc.strerror}\n")


if __name__ == "__main__":
    main()
