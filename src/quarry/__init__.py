"""quarry: a RAG indexing pipeline that knows which model made every vector."""

__version__ = "0.1.0"
