"""Value types that flow through the pipeline: sources, documents, chunks."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Fixed namespace for point ids: changing it would orphan every existing index.
POINT_NAMESPACE = uuid.UUID("6f1c8a52-4d0e-5b7a-9c3e-2a9d41f07b18")


@dataclass(frozen=True, slots=True)
class SourceRef:
    """A stable id for a source document: ``<root name>/<relative path>``."""

    uri: str


@dataclass(frozen=True, slots=True)
class Document:
    """A loaded document: normalised text plus the metadata that is indexed.

    ``doc_hash`` covers the text and the indexed metadata, not volatile fields
    such as mtime, so touching a file re-embeds nothing.
    """

    doc_id: str
    uri: str
    text: str
    title: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    doc_hash: str = ""

    @classmethod
    def create(
        cls,
        uri: str,
        text: str,
        title: str = "",
        metadata: Mapping[str, Any] | None = None,
        volatile: Mapping[str, Any] | None = None,
    ) -> Document:
        """Build a document, deriving ``doc_id`` from the uri and ``doc_hash`` from the content.

        ``volatile`` metadata (mtime, size) is stored but does not enter the hash.
        """
        indexed = dict(metadata or {})
        digest = hashlib.sha256()
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")
        digest.update(title.encode("utf-8"))
        digest.update(b"\x00")
        digest.update(json.dumps(indexed, sort_keys=True, default=str).encode("utf-8"))
        return cls(
            doc_id=doc_id_for(uri),
            uri=uri,
            text=text,
            title=title,
            metadata={**indexed, **(volatile or {})},
            doc_hash=digest.hexdigest(),
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a document small enough to embed, with its place in the document."""

    doc_id: str
    index: int
    text: str
    token_count: int
    headings: tuple[str, ...] = ()
    char_start: int = 0
    char_end: int = 0


def doc_id_for(uri: str) -> str:
    """The document id for a uri: a short, stable hash (uris can be long or awkward)."""
    return hashlib.sha256(uri.encode("utf-8")).hexdigest()[:32]


def point_id(doc_id: str, index: int) -> str:
    """Deterministic Qdrant point id, so a retry or rerun overwrites instead of duplicating."""
    return str(uuid.uuid5(POINT_NAMESPACE, f"{doc_id}\x1f{index}"))
