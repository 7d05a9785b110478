"""Exact ``cl100k_base`` token counts without running BPE on every word.

tiktoken encodes in two steps: a regex cuts the text into *pieces* (words with
their leading space, runs of punctuation, up to three digits, whitespace runs),
then byte-pair encoding runs inside each piece. No token crosses a piece, so
``count(text) == sum(count(piece) for piece in pretokenize(text))``, and a piece's
count depends on nothing but the piece. Real text repeats its words, so a cache
of per-piece counts turns most of the BPE work into dictionary lookups, and the
regex runs in CPython's own engine. On the Python documentation and SciFact
that counts text 2-3x faster than ``encode_ordinary``.

The regex is cl100k_base's pattern with its Unicode classes (``\\p{L}``,
``\\p{N}``, ``\\s``) written out for a fixed set of characters: ASCII, U+0080 to
U+07FF (Latin, Greek, Cyrillic, Hebrew, Arabic, combining marks) and U+2000 to
U+2BFF (punctuation, symbols, arrows, mathematical operators, box drawing),
less the code points this Python's Unicode database leaves unassigned (a newer
Unicode may assign them) and U+017F, which tiktoken's case-insensitive ``'s``
matches. Those classes are old and stable; the test suite checks every one of
those characters against the installed tiktoken. :func:`pretokenize` returns None
for text with any other character, and the caller encodes it.
"""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator

__all__ = ["PieceCounts", "countable_characters", "pretokenize"]

_BLOCKS = (range(0x80, 0x800), range(0x2000, 0x2C00))
_LONG_S = 0x17F
# White_Space (what Rust's \s means) among the blocks; ASCII's are written out below.
_WHITE_SPACE = (0x85, 0xA0, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F)


def countable_characters() -> Iterator[str]:
    """The non-ASCII characters whose text :func:`pretokenize` splits (see the module docstring)."""
    for cp in itertools.chain.from_iterable(_BLOCKS):
        if cp != _LONG_S and unicodedata.category(chr(cp)) != "Cn":
            yield chr(cp)


def _ranges(chars: Iterable[str]) -> str:
    """A regex character-class body for ``chars``, as ranges of escaped code points."""
    spans: list[list[int]] = []
    for cp in sorted(map(ord, chars)):
        if spans and spans[-1][1] == cp - 1:
            spans[-1][1] = cp
        else:
            spans.append([cp, cp])
    return "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in spans)


@functools.cache
def _patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(the piece pattern, a pattern that finds a character outside the countable set)."""
    extra = list(countable_characters())
    letters = "A-Za-z" + _ranges(c for c in extra if unicodedata.category(c)[0] == "L")
    numbers = "0-9" + _ranges(c for c in extra if unicodedata.category(c)[0] == "N")
    space = r"\t\n\x0b\x0c\r " + _ranges(map(chr, _WHITE_SPACE))
    # cl100k_base's pattern; ``$`` (end of text in Rust's regex) is ``\Z`` here,
    # and ``(?i:...)`` is written out (U+017F is not countable).
    piece = re.compile(
        r"'(?:[sdmtSDMT]|[lL][lL]|[vV][eE]|[rR][eE])"
        rf"|[^\r\n{letters}{numbers}]?+[{letters}]++"
        rf"|[{numbers}]{{1,3}}+"
        rf"| ?[^{space}{letters}{numbers}]++[\r\n]*+"
        rf"|[{space}]++\Z|[{space}]*[\r\n]|[{space}]+(?![^{space}])|[{space}]"
    )
    outside = re.compile(r"[^\x00-\x7f" + _ranges(extra) + "]")
    return piece, outside


def pretokenize(text: str) -> list[str] | None:
    """tiktoken's pre-tokenizer pieces of ``text``, in order (they concatenate to it).

    None when ``text`` has a character outside the countable set.
    """
    piece, outside = _patterns()
    if not text.isascii() and outside.search(text) is not None:
        return None
    return piece.findall(text)


# Longer pieces (a long identifier, a run of spaces in a table) are counted but
# not kept: they rarely repeat and would hold memory.
_MAX_CACHED_PIECE = 48


class PieceCounts(dict[str, int]):
    """Token count per piece, filled on first use; ``counts[piece]`` never misses.

    Bounded: once it holds ``max_entries`` pieces it starts again from empty, so
    a long-running worker's memory stays flat (about 100 bytes an entry).
    """

    def __init__(self, count: Callable[[str], int], max_entries: int = 200_000) -> None:
        """Count uncached pieces with ``count`` (the length of tiktoken's BPE of the piece)."""
        super().__init__()
        self._count = count
        self._max_entries = max_entries

    def __missing__(self, piece: str) -> int:
        if not piece:
            return 0  # tiktoken's single-piece BPE panics on an empty piece
        count = self._count(piece)
        if len(piece) <= _MAX_CACHED_PIECE:
            if len(self) >= self._max_entries:
                self.clear()
            self[piece] = count
        return count

    def total(self, pieces: Iterable[str]) -> int:
        """The token count of the text the pieces make up."""
        return sum(map(self.__getitem__, pieces))
