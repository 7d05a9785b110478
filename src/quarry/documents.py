"""Value types that flow through the pipeline: sources, documents, chunks."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
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


# The keys of a FileStamp in a document's (volatile) metadata.
STAMP_FIELDS = ("mtime", "size", "loaded_at", "loader", "parts")


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What a file looked like when it was loaded: enough to tell, without reading it
    again, that it has not changed since (as rsync and make tell)."""

    mtime: str  # the file's mtime, ISO 8601 UTC
    size: int  # bytes
    loaded_at: str  # when it was opened, ISO 8601 UTC
    loader: int  # quarry.sources.LOADER_VERSION at the time
    parts: int = 1  # documents the file was loaded as (PDF pages with text)
    decoder: str = ""  # the encoding its source declared for text not in UTF-8; "" detects

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> FileStamp | None:
        """The stamp recorded in a document's metadata, or None (older points, no file)."""
        try:
            return cls(
                str(metadata["mtime"]),
                int(metadata["size"]),
                str(metadata["loaded_at"]),
                int(metadata["loader"]),
                int(metadata["parts"]),
                str(metadata.get("decoder", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def to_metadata(self) -> dict[str, Any]:
        """The stamp as volatile metadata (stored with the points, not hashed)."""
        stamp = {key: getattr(self, key) for key in STAMP_FIELDS}
        if self.decoder:  # kept out of the points of the many sources that declare none
            stamp["decoder"] = self.decoder
        return stamp

    def vouches_for(self, mtime: str, size: int, loader: int, decoder: str = "") -> bool:
        """True when a file whose mtime and size are now these is the file loaded then,
        by the same loader and declared encoding (``decoder``).

        A change made within one timestamp tick of the change before it keeps the
        mtime, so a stamp vouches only for a file that had been still for a margin
        before it was read (git's "racily clean" rule): 2 s where mtimes are whole
        seconds (FAT, some network file systems), 50 ms otherwise.
        """
        if (self.mtime, self.size, self.loader, self.decoder) != (mtime, size, loader, decoder):
            return False
        margin = 0.05 if "." in self.mtime else 2.0
        try:
            still = datetime.fromisoformat(self.loaded_at) - datetime.fromisoformat(self.mtime)
        except ValueError:
            return False
        return still.total_seconds() > margin


def doc_id_for(uri: str) -> str:
    """The document id for a uri: a short, stable hash (uris can be long or awkward)."""
    return hashlib.sha256(uri.encode("utf-8")).hexdigest()[:32]


def point_id(doc_id: str, index: int) -> str:
    """Deterministic Qdrant point id, so a retry or rerun overwrites instead of duplicating."""
    return str(uuid.uuid5(POINT_NAMESPACE, f"{doc_id}\x1f{index}"))
