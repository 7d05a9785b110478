"""Types of quarry._cpieces, the C extension in _cpieces.c (see quarry._pieces)."""

from collections.abc import Callable

def configure(classes: bytes, /) -> None:
    """Give the character classes (quarry._pieces.character_classes)."""

def set_counter(count: Callable[[str], int], max_entries: int, max_cached_length: int, /) -> None:
    """Count unseen pieces with ``count``; a table of at most ``max_entries`` pieces."""

def count(text: str, start: int, end: int, /) -> int | None:
    """The token count of ``text[start:end]``; None when it has an uncountable character."""

def split(text: str, start: int, end: int, /) -> list[str] | None:
    """The pre-tokenizer pieces of ``text[start:end]``; None as for count."""

def piece(piece: str, /) -> int:
    """The token count of one piece, from the table."""

def clear() -> None:
    """Empty the table of per-piece counts."""

def size() -> int:
    """How many pieces the table holds."""
