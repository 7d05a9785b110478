"""Chunker: properties over any text, structure handling, the encoding, split_in_two."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import tracemalloc
import types
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quarry import _pieces as pieces_module
from quarry import chunking
from quarry.chunking import (
    CHUNKER_VERSION,
    Chunker,
    count_tokens,
    get_encoding,
    markup_for,
    split_in_two,
)
from quarry.documents import Chunk, Document

# ---------------------------------------------------------------------------
# Strategies: arbitrary Unicode, and text built from the pieces that steer the
# splitter (headings, fences, lists, sentences, odd whitespace, CJK, emoji).

PIECES = [
    "word ",
    "The ",
    "cat sat. ",
    "Done! ",
    "e.g. x ",
    "\n",
    "\n\n",
    "\n\n\n  ",
    "# Title\n",
    "## Sub\n",
    "Heading\n=======\n",
    "Part\n----\n",
    "****\nOver\n****\n",
    "```\n# not a heading\ncode()\n```\n",
    "~~~\n",
    "- item\n",
    "1. first\n",
    "    indented\n",
    "\t",
    "  ",
    "é",
    "日本語。",
    "他说。",
    "“好”",
    "😀",
    "\r\n",
    "\r",
    "\u3000",
    "\x0c",
    "\x85",
    "'s ",
    "12345 ",
    "a" * 40,
    "https://example.com/a/b?c=d ",
    "<|endoftext|>",
    ".",
    "::\n",
    ".. note::\n",
    "def f():\n",
    "}\n",
]

structured_text = st.lists(st.sampled_from(PIECES), max_size=120).map("".join)
any_text = st.text(max_size=1500)
# Mostly characters that quarry counts piece by piece (quarry._pieces): ASCII,
# Latin, Greek, Cyrillic, punctuation, symbols; now and then one it encodes.
countable_text = st.text(
    alphabet=st.one_of(
        st.characters(max_codepoint=0x7FF),
        st.characters(min_codepoint=0x2000, max_codepoint=0x2BFF),
        st.sampled_from(["日", "😀", "\u017f"]),
    ),
    max_size=1500,
)
texts = st.one_of(structured_text, any_text, countable_text)
limits = st.sampled_from([4, 5, 8, 16, 32, 64, 256])
markups = st.sampled_from(["markdown", "rst", "text", "code"])

PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def chunk_args(draw: st.DrawFn) -> tuple[str, int, int, str]:
    text = draw(texts)
    max_tokens = draw(limits)
    overlap = draw(st.integers(min_value=0, max_value=max_tokens - 1))
    return text, max_tokens, overlap, draw(markups)


def tiktoken_count(text: str) -> int:
    """The oracle: tiktoken's own encoding (quarry's count_tokens takes a faster path)."""
    return len(get_encoding().encode_ordinary(text))


def chunks_of(text: str, max_tokens: int, overlap: int, markup: str = "markdown") -> list[Chunk]:
    return list(Chunker(max_tokens, overlap).chunk_text(text, "doc", markup=markup))  # type: ignore[arg-type]


def reset_counting() -> None:
    """Make chunking set up its piece counting again on next use."""
    chunking._compiled_counts.cache_clear()
    chunking._piece_counts.cache_clear()


@contextlib.contextmanager
def counted_by(mode: str) -> Iterator[list[str]]:
    """Chunk with another way of counting, and yield the texts the splitter was given.

    ``regex``: as where quarry._cpieces is not built (the regex splits, a dict
    counts). ``encoding``: no piece counting at all, every unit encoded with
    tiktoken (the chunker before quarry._pieces, version 1). Patches module
    globals and the cached set-up, which a chunking module compiled by mypyc
    reads at run time too.
    """
    calls: list[str] = []

    def regex_split(text: str) -> list[str] | None:
        calls.append(text)
        return None if mode == "encoding" else pieces_module.regex_pretokenize(text)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pieces_module, "_configured", lambda: False)
        patch.setattr(chunking, "pretokenize", regex_split)
        reset_counting()
        try:
            # The switch took effect, in this module compiled or not: counting goes
            # through the patched splitter.
            assert chunking._compiled_counter() is None
            chunking.count_tokens("switched")
            assert calls == ["switched"]
            calls.clear()
            yield calls
        finally:
            reset_counting()


@functools.cache
def source_chunking() -> types.ModuleType:
    """quarry/chunking.py run as plain Python, beside the module mypyc compiled from it."""
    path = Path(pieces_module.__file__).with_name("chunking.py")
    spec = importlib.util.spec_from_file_location("quarry_chunking_source", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_install_compiles_the_chunker() -> None:
    # hatch_build.py compiles it with mypyc; a silent failure would halve chunking's speed
    # with every other test still passing.
    if os.environ.get("QUARRY_BUILD_EXTENSION") == "0":
        pytest.skip("built without extensions on purpose")
    assert chunking.__file__ is not None and not chunking.__file__.endswith(".py")
    assert source_chunking().__file__.endswith("chunking.py")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_args())
def test_the_compiled_chunker_gives_the_chunks_its_source_gives(
    args: tuple[str, int, int, str],
) -> None:
    text, max_tokens, overlap, markup = args
    plain = source_chunking().Chunker(max_tokens, overlap)
    expected = list(plain.chunk_text(text, "doc", markup=markup))
    assert chunks_of(text, max_tokens, overlap, markup) == expected


# ---------------------------------------------------------------------------
# Properties


@PROPERTY_SETTINGS
@given(chunk_args())
def test_no_chunk_exceeds_the_limit(args: tuple[str, int, int, str]) -> None:
    text, max_tokens, overlap, markup = args
    for chunk in chunks_of(text, max_tokens, overlap, markup):
        real = tiktoken_count(chunk.text)
        assert real <= max_tokens
        assert chunk.token_count == real


@PROPERTY_SETTINGS
@given(chunk_args())
def test_offsets_cover_the_text_and_only_overlap_repeats(args: tuple[str, int, int, str]) -> None:
    text, max_tokens, overlap, markup = args
    chunks = chunks_of(text, max_tokens, overlap, markup)
    if not text.strip():
        assert chunks == []
        return
    # Only whitespace is left out: before the first chunk, after the last, and where a
    # run of it would have been a chunk of its own.
    assert not text[: chunks[0].char_start].strip()
    assert not text[chunks[-1].char_end :].strip()
    for chunk in chunks:
        assert chunk.text.strip()
    for before, after in itertools.pairwise(chunks):
        # Strictly moving forward, and what two chunks share is at most `overlap`
        # tokens (the repeated tail), never a whole chunk.
        assert before.char_start < after.char_start and before.char_end < after.char_end
        assert not text[before.char_end : after.char_start].strip()
        assert tiktoken_count(text[after.char_start : before.char_end]) <= overlap
    if overlap == 0:
        gaps = [text[b.char_end : a.char_start] for b, a in itertools.pairwise(chunks)]
        rebuilt = "".join(c.text + gap for c, gap in zip(chunks, [*gaps, ""], strict=True))
        assert rebuilt == text[chunks[0].char_start : chunks[-1].char_end]


@PROPERTY_SETTINGS
@given(chunk_args())
def test_same_input_same_chunks(args: tuple[str, int, int, str]) -> None:
    text, max_tokens, overlap, markup = args
    first = chunks_of(text, max_tokens, overlap, markup)
    again = chunks_of(text, max_tokens, overlap, markup)
    assert first == again


@PROPERTY_SETTINGS
@given(chunk_args())
def test_counting_by_pieces_gives_the_chunks_that_encoding_gives(
    args: tuple[str, int, int, str],
) -> None:
    # With pretokenize refusing every text, each unit is encoded with tiktoken (the
    # chunker before quarry._pieces, version 1): the chunks must not change.
    text, max_tokens, overlap, markup = args
    by_pieces = chunks_of(text, max_tokens, overlap, markup)
    with counted_by("encoding"):
        by_tokens = chunks_of(text, max_tokens, overlap, markup)
    with counted_by("regex"):
        by_regex = chunks_of(text, max_tokens, overlap, markup)
    assert by_pieces == by_tokens
    assert by_regex == by_tokens


@PROPERTY_SETTINGS
@given(chunk_args())
def test_offsets_point_at_the_chunk_text(args: tuple[str, int, int, str]) -> None:
    text, max_tokens, overlap, markup = args
    for number, chunk in enumerate(chunks_of(text, max_tokens, overlap, markup)):
        assert chunk.index == number
        assert chunk.doc_id == "doc"
        assert chunk.text == text[chunk.char_start : chunk.char_end]
        assert chunk.text


# ---------------------------------------------------------------------------
# Structure

MARKDOWN = """# Guide

Intro text that says what the guide is about.

## Install

Run the installer. Then check the version.

```python
# a comment, not a heading
print("hi")
```

Usage
-----

- one item
- another item
"""


def test_markdown_breadcrumbs_follow_atx_and_setext_headings() -> None:
    chunks = chunks_of(MARKDOWN, 32, 0)
    by_text = {c.text.split("\n", 1)[0]: c.headings for c in chunks}
    assert by_text["# Guide"] == ("Guide",)
    assert ("Guide", "Install") in by_text.values()
    assert ("Guide", "Usage") in by_text.values()
    assert all("a comment, not a heading" not in h for c in chunks for h in c.headings)


def test_a_chunk_spanning_sections_carries_their_common_headings() -> None:
    intro = "Introductory text that fills most of a chunk on its own. " * 10
    detail = "Details that go on for a while in this part. " * 6
    text = f"# A\n\n{intro}\n\n## B\n\nShort.\n\n## C\n\n{detail}\n"
    chunks = chunks_of(text, 256, 0)
    last = chunks[-1]
    assert last.text.startswith("## B")
    assert "## C" in last.text
    assert last.headings == ("A",)  # B and C both lie under A, neither encloses the chunk
    assert chunks[0].headings == ("A",)


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@st.composite
def sectioned_markdown(draw: st.DrawFn) -> str:
    """ATX headings of any level between paragraphs of 3 to 400 words."""
    parts = []
    for k in range(draw(st.integers(3, 30))):
        if draw(st.booleans()) and draw(st.booleans()):
            parts.append("#" * draw(st.integers(1, 4)) + f" H{k}\n\n")
        else:
            n = draw(st.sampled_from([3, 10, 40, 150, 400]))
            parts.append(" ".join(draw(st.sampled_from(WORDS)) for _ in range(n)) + ".\n\n")
    return "".join(parts)


def breadcrumbs_by_place(text: str) -> list[tuple[int, tuple[str, ...]]]:
    """Each ATX heading's line start, with the breadcrumb in force from there on."""
    places, stack = [], []
    for m in re.finditer(r"^(#{1,6}) (.*)$", text, re.M):
        level = len(m.group(1))
        stack = [(lv, title) for lv, title in stack if lv < level] + [(level, m.group(2))]
        places.append((m.start(), tuple(title for _, title in stack)))
    return places


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sectioned_markdown(), st.sampled_from([(256, 32), (256, 64), (64, 32), (32, 8)]))
def test_a_chunks_headings_enclose_all_of_its_text_its_overlap_included(
    text: str, limits: tuple[int, int]
) -> None:
    # Review (fuzzing): an overlap reached back over a heading, so a chunk began with
    # another section's text and was labelled with the next section only.
    places = breadcrumbs_by_place(text)

    def at(pos: int) -> tuple[str, ...]:
        crumb: tuple[str, ...] = ()
        for start, here in places:
            if start > pos:
                break
            crumb = here
        return crumb

    for chunk in chunks_of(text, *limits):
        first = chunk.char_start + len(chunk.text) - len(chunk.text.lstrip())
        crumbs = [at(first)] + [at(p) for p, _ in places if first < p < chunk.char_end]
        common = crumbs[0]
        for crumb in crumbs[1:]:
            while crumb[: len(common)] != common:
                common = common[:-1]
        assert chunk.headings == common, (chunk.char_start, chunk.text[:60])


def test_an_overlap_starts_at_a_heading_rather_than_before_it() -> None:
    # The smallest case the fuzzing found: the chunk before ends with the heading and
    # its short paragraph, and the next one's overlap reached back into the paragraph
    # above the heading while the chunk was labelled with that heading.
    words = itertools.cycle(WORDS)

    def paragraph(n: int) -> str:
        return " ".join(next(words) for _ in range(n)) + ".\n\n"

    text = paragraph(40) + paragraph(400) + "### Three\n\n" + paragraph(5) + paragraph(150)
    heading = text.index("### Three")
    chunks = chunks_of(text, 256, 32)
    under = [c for c in chunks if c.headings == ("Three",)]
    assert under and all(c.char_start >= heading for c in under)
    assert under[0].text.startswith("### Three")  # the whole heading line, not a piece
    assert all(c.headings == () for c in chunks if c.char_start < heading)


@pytest.mark.parametrize(
    "heading",
    ["### Three\n\n", "  ### Three\n\n", "Überblick\n=========\n\n", "Three\n=====\n\n"],
    ids=["atx", "indented-atx", "non-ascii-setext", "setext"],
)
def test_an_overlap_from_a_heading_is_the_same_however_tokens_are_counted(heading: str) -> None:
    # Review: the token path started an overlap at any heading's line, the piece path
    # only at one beginning with a printable ASCII character, so an indented heading or
    # one in another script gave other chunks where quarry._cpieces is not built.
    words = itertools.cycle(WORDS)

    def paragraph(n: int) -> str:
        return " ".join(next(words) for _ in range(n)) + ".\n\n"

    text = paragraph(40) + paragraph(400) + heading + paragraph(5) + paragraph(150)
    by_pieces = chunks_of(text, 256, 32)
    with counted_by("encoding"):
        assert chunks_of(text, 256, 32) == by_pieces
    with counted_by("regex"):
        assert chunks_of(text, 256, 32) == by_pieces


def test_yaml_front_matter_holds_no_heading() -> None:
    body = " ".join(WORDS * 40)
    text = f"---\n# generated by a tool\ntitle: Guide\n---\n\n{body}.\n\n## Install\n\n{body}.\n"
    chunks = chunks_of(text, 64, 8)
    assert {c.headings for c in chunks} == {(), ("Install",)}
    assert "title: Guide" in chunks[0].text  # kept as text all the same
    unclosed = chunks_of(f"---\n# Real\n\n{body}.\n", 64, 8)
    assert unclosed[-1].headings == ("Real",)  # no closing line: no front matter
    # A rule, then a blank line, is no front matter (slides): each heading counts.
    slides = f"---\n\n# Slide one\n\n{body}.\n\n---\n\n# Slide two\n\n{body}.\n"
    assert {("Slide one",), ("Slide two",)} <= {c.headings for c in chunks_of(slides, 64, 8)}
    # Closed only past line 200, on a line that merely starts with "---": none either.
    late = "---\n# Top\n" + "key: value\n" * 198 + "----------\n---\n\n" + body + "\n"
    assert chunks_of(late, 64, 8)[-1].headings == ("Top",)


def test_heading_lines_inside_an_html_comment_are_ignored() -> None:
    body = " ".join(WORDS * 40)
    text = (
        f"# Guide\n\n<!--\n# TODO old section\n\n-->\n\n{body}.\n\n<!-- x -->\n## Sub\n\n{body}.\n"
    )
    chunks = chunks_of(text, 64, 8)
    assert {c.headings for c in chunks} == {("Guide",), ("Guide", "Sub")}
    assert "# TODO old section" in chunks[0].text
    # <!--> closes itself (CommonMark), and a comment never closed hides nothing.
    for opener, after in (
        ("<!-->", "<!-- x -->\n"),
        ("<!--->", "<!-- x -->\n"),
        ("<!-- no end", ""),
    ):
        text = f"# Guide\n\n{opener}\n\n# Real\n\n{body}.\n\n{after}"
        assert chunks_of(text, 64, 8)[-1].headings == ("Real",), opener


def test_a_run_of_whitespace_makes_no_chunk() -> None:
    # Review: 20,000 tabs or blank lines became chunks of whitespace alone, embedded
    # and stored, which a search could return as an empty passage.
    for text in ("\t" * 20000 + "x\n", "# Notes\n\nfirst.\n" + "\n" * 20000 + "last.\n"):
        chunks = chunks_of(text, 256, 32)
        assert chunks and all(c.text.strip() for c in chunks)
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert "".join(c.text for c in chunks).split() == text.split()


def test_heading_lines_inside_code_fences_are_ignored() -> None:
    text = "# Top\n\n```\n# inside\n## also inside\n```\n\nafter the fence\n"
    chunks = chunks_of(text, 8, 0)
    assert all(c.headings in {("Top",), ()} for c in chunks)
    assert any("after the fence" in c.text for c in chunks)


def test_rst_underlined_and_overlined_titles() -> None:
    text = (
        "=======\nManual\n=======\n\nPreface text.\n\n"
        "Setup\n=====\n\nSetup text here.\n\n"
        "Details\n-------\n\nDetail text.\n\n"
        "Other\n=====\n\nOther text.\n"
    )
    chunks = chunks_of(text, 8, 0, "rst")
    crumbs = {c.text.strip().split("\n")[-1]: c.headings for c in chunks}
    assert crumbs["Preface text."] == ("Manual",)
    assert crumbs["Setup text here."] == ("Manual", "Setup")
    assert crumbs["Detail text."] == ("Manual", "Setup", "Details")
    assert crumbs["Other text."] == ("Manual", "Other")


def test_code_markup_has_no_headings() -> None:
    text = "# comment\nx = 1\n\n# another\ny = 2\n"
    assert all(c.headings == () for c in chunks_of(text, 4, 0, "code"))


def test_a_list_item_above_a_rule_is_not_a_heading() -> None:
    # CommonMark: "- item" then "---" is a list and a thematic break, not a setext title.
    body = " ".join(f"Sentence {i} is about the install." for i in range(40))
    for rule in ("---", "==="):
        text = (
            f"# Handbook\n\n## Install\n\nYou need:\n\n- Python\n- a C compiler\n{rule}\n\n{body}\n"
        )
        chunks = chunks_of(text, 64, 8)
        assert len(chunks) > 2
        assert all(c.headings == ("Handbook", "Install") for c in chunks[1:])


_HANDLER = '''def handler_{n}(request, context):
    """Handle request {n} for the account service.

    The account and the context are checked before anything is written,
    and every failure is logged with the request id.
    """
    account = context.accounts.get(request.account_id)

    if account is None:
        raise NotFound(request.account_id)
    result = account.apply(request.change)

    return result
'''


def test_code_chunks_end_between_top_level_blocks() -> None:
    # Blank lines inside a function are weaker boundaries than those before the next one.
    text = "\n\n".join(_HANDLER.format(n=n) for n in range(8))
    assert 80 < tiktoken_count(_HANDLER) < 120
    chunks = chunks_of(text, 256, 0, "code")
    assert len(chunks) >= 3
    for chunk in chunks[:-1]:
        assert text[chunk.char_end :].lstrip().startswith("def handler_")


def test_an_rst_literal_block_or_directive_that_fits_is_kept_whole_with_its_lead_in() -> None:
    code = "\n\n".join(
        f"    def step_{i}(ctx):\n        ctx.result_{i} = compute({i})\n        return ctx"
        for i in range(8)
    )
    intro = " ".join(f"Sentence {i} explains the deploy." for i in range(12))
    for lead_in in ("Example::", ".. code-block:: python"):
        text = f"Deploy\n======\n\n{intro}\n\n{lead_in}\n\n{code}\n\nAfter the code.\n"
        assert 150 < tiktoken_count(code) < 200
        chunks = chunks_of(text, 256, 32, "rst")
        assert any(f"{lead_in}\n\n{code}" in c.text for c in chunks), lead_in
        assert all(c.headings == ("Deploy",) for c in chunks)
    # In a list item the block ends where the item's body goes on, at its text's column
    # (the structure scan: at these sizes the chunks come out the same either way).
    item = "- Item text::\n\n      code line\n      more\n\n  Item body goes on.\n\n- Second\n"
    units = [(e.pos, e.fence) for e in chunking._StructureScanner(item, "rst").events()]
    assert units == [(0, True), (item.index("  Item body"), False), (item.index("- Second"), False)]


def test_a_short_lead_in_ending_with_a_colon_stays_with_its_fence() -> None:
    intro = " ".join(f"Sentence {i} is about encoding." for i in range(30))
    fence = "```\n" + "\n".join(f"json.dumps(obj_{i})" for i in range(20)) + "\n```"
    lead = "Encoding basic Python object hierarchies:"
    text = f"# JSON\n\n{intro}\n\n{lead}\n\n{fence}\n\nAfter.\n"
    chunks = chunks_of(text, 256, 32)
    assert any(f"{lead}\n\n{fence}" in c.text for c in chunks)
    assert not any(c.text.rstrip().endswith(lead) for c in chunks)  # not cut from its code
    # Without the colon it is an ordinary paragraph, packed with the text before it.
    plain = text.replace(lead, lead.rstrip(":") + ".")
    assert any(c.text.rstrip().endswith(lead.rstrip(":") + ".") for c in chunks_of(plain, 256, 32))


def test_a_code_fence_that_fits_is_kept_whole() -> None:
    fence = "```\n" + "\n".join(f"line_{i} = {i}" for i in range(12)) + "\n```\n"
    text = "Before the code. " * 6 + "\n\n" + fence + "\nAfter the code. " * 6
    assert tiktoken_count(fence) < 100
    chunks = chunks_of(text, 100, 10)
    assert any(fence in c.text for c in chunks)


def test_a_heading_starts_a_chunk_once_the_chunk_has_some_content() -> None:
    body = "A sentence of body text that goes on. " * 8
    text = f"# One\n\n{body}\n\n# Two\n\n{body}\n"
    chunks = chunks_of(text, 256, 32)
    assert [c.text.split("\n", 1)[0] for c in chunks] == ["# One", "# Two"]
    assert chunks[1].char_start == text.index("# Two")  # no overlap across a heading


def test_a_heading_is_never_left_at_the_end_of_a_chunk() -> None:
    body = "Words and more words to fill the space here. " * 3
    text = "".join(f"## Part {i}\n\n{body}\n\n" for i in range(12))
    for chunk in chunks_of(text, 64, 8):
        last_line = chunk.text.rstrip().rsplit("\n", 1)[-1]
        assert not last_line.startswith("#")


@pytest.mark.parametrize(("overlap", "steps", "longer"), [(0, 28, 0), (32, 24, 40)])
def test_a_heading_whose_paragraph_does_not_fit_beside_it_is_not_a_chunk_alone(
    overlap: int, steps: int, longer: int
) -> None:
    # Mixed-documents trial: the heading became a chunk of its own and the paragraph
    # (one unit: it fits a chunk on its own) the next one. With overlap, it takes a
    # heading longer than the overlap.
    para = " ".join(["Intro words that go on for a while here."] * 10)
    long = " ".join(f"Step {i} configures the service carefully." for i in range(steps))
    heading = "## Setup and configuration of the production deployment" + " again" * longer
    text = f"# Guide\n\n{para}\n\n{heading}\n\n{long}\n"
    assert tiktoken_count(heading) + tiktoken_count(long) > 256
    assert tiktoken_count(long) <= 256 - overlap
    chunks = chunks_of(text, 256, overlap)
    first = next(c for c in chunks if heading in c.text)
    assert tiktoken_count(first.text) > tiktoken_count(heading) + 32
    assert "Step 0 configures" in first.text


def test_sentences_are_the_cut_inside_a_long_paragraph() -> None:
    sentences = [f"Sentence number {i} says something quite ordinary." for i in range(40)]
    text = " ".join(sentences)
    chunks = chunks_of(text, 64, 0)
    assert len(chunks) > 3
    for chunk in chunks[:-1]:
        assert chunk.text.rstrip().endswith(".")


def test_overlap_repeats_the_tail_of_the_previous_chunk() -> None:
    text = " ".join(f"Sentence {i} is here." for i in range(200))
    chunks = chunks_of(text, 64, 16)
    shared = [before.char_end - after.char_start for before, after in itertools.pairwise(chunks)]
    assert all(s > 0 for s in shared)
    for before, after in itertools.pairwise(chunks):
        tail = text[after.char_start : before.char_end]
        assert 0 < tiktoken_count(tail) <= 16
        assert before.text.endswith(tail)
        # The overlap starts between words: at the space after one (where the
        # tokenizer cuts too, so its count is exact) or at a line start.
        starts_at_space = tail[0] in " \t" and not text[after.char_start - 1].isspace()
        assert starts_at_space or text[after.char_start - 1] == "\n"


@pytest.mark.parametrize("counted", ["pieces", "regex", "encoding"])
def test_overlap_starts_at_a_line_start_when_one_keeps_half_of_it(counted: str) -> None:
    # A table's rows, or hard-wrapped lines: an overlap from the last word start
    # that fits began each chunk with a fragment of a row (" 4 | a fairly long...").
    with contextlib.ExitStack() as stack:
        if counted != "pieces":
            stack.enter_context(counted_by(counted))
        overlap_starts_at_a_line_start()


def overlap_starts_at_a_line_start() -> None:
    rows = [f"| {i} | item {i} | a fairly long description of item {i} |" for i in range(80)]
    text = "| id | name | description |\n|---|---|---|\n" + "\n".join(rows) + "\n"
    chunks = chunks_of(text, 128, 32)
    assert len(chunks) > 5
    for before, after in itertools.pairwise(chunks):
        assert after.char_start < before.char_end  # they overlap
        assert text[after.char_start - 1] == "\n", repr(after.text[:40])
        assert after.text.startswith("| ")
        assert tiktoken_count(text[after.char_start : before.char_end]) >= 16
    # Review: the same when a row's tokens are estimated (a CJK stop inside it).
    cjk_rows = [f"| {i} | 東京。大阪 | a fairly long description of item {i} |" for i in range(80)]
    cjk_text = "\n".join(cjk_rows) + "\n"
    later = chunks_of(cjk_text, 128, 32)[1:]
    assert len(later) > 4 and all(c.text.startswith("| ") for c in later)
    # Prose has no line start in its tail: the overlap still starts at a word.
    prose = " ".join(f"Sentence {i} is here." for i in range(200))
    assert all(c.text.startswith(" ") for c in chunks_of(prose, 64, 32)[1:])


def test_a_chunk_that_closed_early_is_not_repeated_whole_by_the_next() -> None:
    # The notes close a small chunk (the long paragraph after them does not fit); the
    # next chunk's overlap used to take nearly all of the notes again.
    alpha = " ".join(f"Alpha sentence {i} describes the first topic at length." for i in range(20))
    notes = "\n\n".join(f"Note {j}: supported on Linux." for j in range(5))
    gamma = " ".join(f"Gamma sentence {i} covers the third topic here." for i in range(20))
    text = f"# Notes\n\n{alpha}\n\n{notes}\n\n{gamma}\n"
    chunks = chunks_of(text, 256, 32)
    assert len(chunks) == 3
    for index, (chunk, after) in enumerate(itertools.pairwise(chunks)):
        own_start = chunks[index - 1].char_end if index else chunk.char_start
        own = tiktoken_count(text[own_start : chunk.char_end])
        lent = tiktoken_count(text[after.char_start : chunk.char_end])
        assert 0 < lent <= own // 2 + 1


def test_small_tail_is_merged_into_its_neighbour() -> None:
    # Greedy packing would end with a chunk of 3 tokens ("Tiny end."): the last
    # two chunks are rebalanced at a sentence instead.
    body = " ".join(f"Sentence {i} has a few more words in it." for i in range(25))
    text = body + "\n\nTiny end.\n"
    chunks = chunks_of(text, 100, 0)
    assert all(c.token_count >= 100 // 4 for c in chunks)
    assert chunks[-1].text.endswith("Tiny end.\n")
    # And a tail that fits is simply merged.
    short = chunks_of("Some words here. " * 30 + "\n\nEnd.\n", 400, 0)
    assert len(short) == 1


def test_cjk_sentence_cuts_are_recounted() -> None:
    # A cut right after 。 is not a tokenizer piece boundary when a letter or an
    # opening quote follows: counts must be taken again, not added up.
    text = "他说。“好”" * 60
    for chunk in chunks_of(text, 8, 0):
        assert chunk.token_count == tiktoken_count(chunk.text) <= 8


def test_long_run_without_whitespace_is_cut_by_tokens() -> None:
    text = "x" * 5000 + " end"
    chunks = chunks_of(text, 32, 4)
    assert all(c.token_count <= 32 for c in chunks)
    assert chunks[-1].char_end == len(text)


# Text written without spaces: Japanese and Chinese sentences end in 。！？ and the
# next one follows at once.
JA_SUBJECTS = (
    "検索システムは",
    "この文書は",
    "私たちのチームは",
    "新しいモデルは",
    "利用者は",
    "東京の会社は",
)
JA_PREDICATES = (
    "文書を小さな単位に分割します",
    "結果を順番に並べます",
    "質問に答えを返します",
    "大量のデータを処理します",
    "毎日新しい情報を集めます",
    "ベクトルを計算して保存します",
    "重要な部分を見つけます",
)
ZH_SUBJECTS = ("检索系统", "这个模型", "我们的团队", "用户", "数据库")
ZH_PREDICATES = (
    "把文档切成小块",
    "计算向量并保存",
    "回答用户的问题",
    "每天收集新的资料",
    "按顺序排列结果",
)
STOPS = ("。", "！", "？", "。", "。")


def spaceless_sentences(subjects: tuple[str, ...], predicates: tuple[str, ...], n: int) -> str:
    pairs = itertools.cycle(itertools.product(subjects, predicates))
    return "".join(
        s + p + STOPS[i % len(STOPS)] for i, (s, p) in zip(range(n), pairs, strict=False)
    )


def overlap_tokens(text: str, before: Chunk, after: Chunk) -> int:
    return tiktoken_count(text[after.char_start : before.char_end])


@pytest.mark.parametrize(("max_tokens", "overlap"), [(256, 32), (100, 16)])
@pytest.mark.parametrize(
    "text",
    [
        spaceless_sentences(JA_SUBJECTS, JA_PREDICATES, 300),
        spaceless_sentences(ZH_SUBJECTS, ZH_PREDICATES, 300),
    ],
    ids=["japanese", "chinese"],
)
def test_cjk_text_is_cut_at_sentence_ends_and_overlaps(
    text: str, max_tokens: int, overlap: int
) -> None:
    chunks = chunks_of(text, max_tokens, overlap, "text")
    assert len(chunks) > 3
    assert chunks[0].char_start == 0 and chunks[-1].char_end == len(text)
    for chunk in chunks:
        assert chunk.token_count == tiktoken_count(chunk.text) <= max_tokens
    # Sentences are far shorter than a chunk: every chunk but the last ends one,
    # never inside a word.
    for chunk in chunks[:-1]:
        assert chunk.text.endswith(("。", "！", "？")), chunk.text[-12:]
    shared = []
    for before, after in itertools.pairwise(chunks):
        assert before.char_start < after.char_start < before.char_end < after.char_end
        count = overlap_tokens(text, before, after)
        assert 0 < count <= overlap
        shared.append(count)
    assert sum(shared) / len(shared) >= overlap / 2  # about what was asked, not a token or two


def test_closing_brackets_stay_with_their_cjk_sentence() -> None:
    text = "「これは引用です。」と彼は言った。３．５倍になりました．" * 120
    chunks = chunks_of(text, 64, 8, "text")
    assert len(chunks) > 3
    for chunk in chunks[:-1]:
        assert chunk.text.endswith(("」", "った。", "した．")), chunk.text[-12:]
        assert chunk.token_count == tiktoken_count(chunk.text) <= 64


def spaceless_line(n: int) -> str:
    """``n`` characters of base64: no space, no line break, no sentence end."""
    parts, block = [], b"quarry"
    while sum(map(len, parts)) < n:
        block = hashlib.sha256(block).digest()
        parts.append(base64.b64encode(block).decode("ascii").rstrip("="))
    return "".join(parts)[:n]


@pytest.mark.parametrize(
    "text",
    [
        spaceless_line(60_000),
        "検索システムは文書を小さな単位に分割して、" * 400,  # no sentence end at all
        "👍\U0001f3fd\U0001f1ef\U0001f1f5😀👨\u200d👩\u200d👧e\u0301\u0300" * 500,
    ],
    ids=["base64", "cjk-without-stops", "emoji"],
)
def test_text_without_spaces_gets_overlap(text: str) -> None:
    chunks = chunks_of(text, 256, 32, "text")
    assert len(chunks) > 3
    assert chunks[0].char_start == 0 and chunks[-1].char_end == len(text)
    for chunk in chunks:
        assert chunk.text == text[chunk.char_start : chunk.char_end]
        assert chunk.token_count == tiktoken_count(chunk.text) <= 256
    for before, after in itertools.pairwise(chunks):
        assert before.char_start < after.char_start < before.char_end < after.char_end
        assert 0 < overlap_tokens(text, before, after) <= 32
        # The overlap starts at a character of its own, not a modifier, joiner or
        # mark of the one before, nor between the two letters of a flag.
        start, previous = text[after.char_start], text[after.char_start - 1]
        assert start not in "\u0300\u0301\u200d\U0001f3fd" and previous != "\u200d"
        assert not (
            "\U0001f1e6" <= start <= "\U0001f1ff" and "\U0001f1e6" <= previous <= "\U0001f1ff"
        )


# A grapheme cluster's later parts that are letters, not marks: Thai SARA AM (น้ำ),
# conjoining Hangul jamo (Korean in NFD, as macOS writes file names), a conjunct.
THAI = "น้ำท่วมกรุงเทพมหานครทำให้ประชาชนจำนวนมากต้องอพยพ"
HANGUL_NFD = unicodedata.normalize("NFD", "대한민국의수도는서울입니다")


@pytest.mark.parametrize(("max_tokens", "overlap"), [(256, 32), (64, 16), (16, 8)])
@pytest.mark.parametrize("text", [THAI * 40, HANGUL_NFD * 40], ids=["thai", "hangul-nfd"])
def test_overlap_never_starts_inside_a_grapheme_cluster(
    text: str, max_tokens: int, overlap: int
) -> None:
    chunks = chunks_of(text, max_tokens, overlap, "text")
    overlapping = [a for b, a in itertools.pairwise(chunks) if a.char_start < b.char_end]
    assert len(overlapping) > 3
    for chunk in overlapping:
        start, before = text[chunk.char_start], text[chunk.char_start - 1]
        assert start not in "\u0e33\u0eb3", chunk.char_start
        assert unicodedata.category(start) != "Mn", chunk.char_start
        assert not ("\u1161" <= start <= "\u11ff" and "\u1100" <= before <= "\u11ff"), (
            chunk.char_start
        )


def _starts_a_cluster(text: str, pos: int) -> bool:
    """Whether a chunk may start or end at ``pos``: not after a joiner, not before a mark,
    a modifier or a conjoining jamo, not between the two indicators of a flag."""
    if pos in (0, len(text)):
        return True
    char, before = text[pos], text[pos - 1]
    if before == "\u200d" or unicodedata.category(char) in ("Mn", "Me"):
        return False
    if "\U0001f3fb" <= char <= "\U0001f3ff" or char in "\u200d\u0e33\u0eb3":
        return False
    if "\u1161" <= char <= "\u11ff" and "\u1100" <= before <= "\u11ff":
        return False
    run = 0  # regional indicators before pos, in one run (counted: tests need no speed)
    while run < pos and "\U0001f1e6" <= text[pos - 1 - run] <= "\U0001f1ff":
        run += 1
    return not ("\U0001f1e6" <= char <= "\U0001f1ff" and run % 2)


@pytest.mark.parametrize("overlap", [0, 32])
@pytest.mark.parametrize(
    "text",
    [
        "👨\u200d👩\u200d👧\u200d👦" * 600,
        ("e" + "\u0301\u0323\u0308" * 5) * 400,
        "\u1112\u1161\u11ab\u1100\u1173\u11af" * 800,
        THAI * 40,
        "🇩🇪🇫🇷🇯🇵🇰🇷🇨🇳" * 60,
        # Review: past a window of 16,384 characters with no boundary at all, cut by
        # characters; and flags past 4,096 indicators from one character in.
        "👨\u200d👩\u200d👧\u200d👦" * 2436,
        "x" + "🇩🇪" * 12000,
    ],
    ids=["family-emoji", "stacked-marks", "jamo", "thai", "flags", "long-family", "long-flags"],
)
def test_chunks_without_spaces_start_and_end_between_characters(text: str, overlap: int) -> None:
    # Cut by token windows: the cut landed on a bare joiner, mark or jamo, or split a flag.
    chunks = chunks_of(text, 256, overlap, "text")
    assert len(chunks) > 3
    for chunk in chunks:
        assert _starts_a_cluster(text, chunk.char_start), (chunk.char_start, chunk.text[:3])
        assert _starts_a_cluster(text, chunk.char_end), (chunk.char_end, chunk.text[-3:])
        assert chunk.token_count == tiktoken_count(chunk.text) <= 256


def test_split_in_two_pairs_flags_from_the_start_of_their_run() -> None:
    a, b = split_in_two("🇩🇪🇫🇷🇯🇵🇰🇷🇨🇳" * 3)
    assert len(a) % 2 == 0 and len(b) % 2 == 0


@pytest.mark.parametrize(
    ("sentence", "stop"),
    [
        ("هل تتكلم اللغة العربية بطلاقة في العمل اليومي؟", "؟"),
        ("यह एक लंबा वाक्य है जो हिंदी में लिखा गया है।", "।"),
        ("Πού βρίσκεται η παλιά βιβλιοθήκη της πόλης\u037e", "\u037e"),
    ],
)
def test_non_latin_sentence_ends_are_cut_at(sentence: str, stop: str) -> None:
    text = " ".join([sentence] * 60)
    chunks = chunks_of(text, 60, 0, "text")
    assert len(chunks) > 3
    assert all(c.text.rstrip().endswith(stop) for c in chunks[:-1]), [c.text[-12:] for c in chunks]


def test_token_windows_encode_little_more_than_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # Text without spaces or sentence ends is cut by token windows; each window's
    # text is encoded to find its cut, so an oversized guess costs that much again.
    text = "検索システムは文書を小さな単位に分割して、" * 2000
    encoding = get_encoding()
    encoded = 0
    plain = encoding.encode_ordinary

    def counting(piece: str) -> list[int]:
        nonlocal encoded
        encoded += len(piece)
        return plain(piece)

    monkeypatch.setattr(encoding, "encode_ordinary", counting)
    assert len(chunks_of(text, 256, 32, "text")) > 100
    assert encoded < 12 * len(text)


def test_chunking_streams_instead_of_encoding_the_whole_text() -> None:
    paragraph = "Streaming text should be chunked window by window, never at once. " * 6
    text = "\n\n".join(f"## Section {i}\n\n{paragraph}" for i in range(3000))  # ~1.4M chars
    chunker = Chunker(256, 32)
    tracemalloc.start()
    try:
        count = 0
        for _ in chunker.chunk_text(text):
            count += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count >= 3000
    # One token list for the whole text would take ~10 MB here (300k tokens).
    assert peak < len(text) // 4


def test_chunk_uses_the_document_content_type() -> None:
    text = "Title\n*****\n\nBody text.\n"
    rst = Document.create("src/a.rst", text, "Title", {"content_type": "text/x-rst"})
    code = Document.create("src/a.py", "# Title\nx = 1\n", "a", {"content_type": "text/x-python"})
    assert Chunker().chunk(rst)[0].headings == ("Title",)
    assert Chunker().chunk(code)[0].headings == ()
    assert Chunker().chunk(rst)[0].doc_id == rst.doc_id
    assert markup_for("text/markdown; charset=utf-8") == "markdown"


# ---------------------------------------------------------------------------
# Settings and the encoding


def test_settings_are_recorded_with_the_collection() -> None:
    assert Chunker(300, 40).settings == {
        "encoding": "cl100k_base",
        "max_tokens": 300,
        "overlap": 40,
        "version": CHUNKER_VERSION,
    }


@pytest.mark.parametrize(("max_tokens", "overlap"), [(32, 32), (32, 40), (32, -1), (3, 0)])
def test_bad_settings_are_refused(max_tokens: int, overlap: int) -> None:
    with pytest.raises(ValueError):
        Chunker(max_tokens, overlap)


def test_encoding_is_cl100k_base_and_cached() -> None:
    enc = get_encoding()
    assert enc.name == "cl100k_base"
    assert enc is get_encoding()
    assert enc.encode("hello world") == [15339, 1917]
    assert count_tokens("hello world") == 2
    assert count_tokens("<|endoftext|>") > 1  # special-token text is plain text here


def test_encoding_loads_offline_without_touching_the_tiktoken_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    script = (
        "import socket\n"
        "def refuse(*a, **k):\n"
        "    raise RuntimeError('network used')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "from quarry.chunking import get_encoding\n"
        "print(len(get_encoding().encode('offline check')))\n"
    )
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2"
    assert list(cache.iterdir()) == []


# ---------------------------------------------------------------------------
# split_in_two


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=2, max_size=400))
def test_split_in_two_keeps_every_character(text: str) -> None:
    a, b = split_in_two(text)
    assert a and b
    assert a + b == text


def test_split_in_two_prefers_a_paragraph_near_the_middle() -> None:
    left = "First paragraph. It has sentences.\nAnd lines."
    right = "Second paragraph. Also sentences.\nMore lines."
    assert split_in_two(left + "\n\n" + right) == (left + "\n\n", right)
    # A paragraph break in the middle half wins over a space nearer the middle.
    text = "word " * 6 + "\n\n" + "word " * 10
    assert split_in_two(text) == ("word " * 6 + "\n\n", "word " * 10)


def test_split_in_two_falls_back_to_lines_sentences_words_chars() -> None:
    assert split_in_two("aaaa bbbb\ncccc dddd") == ("aaaa bbbb\n", "cccc dddd")
    assert split_in_two("one two three four\nfive six seven eight nine ten eleven") == (
        "one two three four\n",
        "five six seven eight nine ten eleven",
    )
    assert split_in_two("Alpha beta. Gamma delta epsilon zeta eta theta") == (
        "Alpha beta. ",
        "Gamma delta epsilon zeta eta theta",
    )
    assert split_in_two("alpha beta gamma delta") == ("alpha beta ", "gamma delta")
    assert split_in_two("abcdef") == ("abc", "def")
    # A boundary outside the middle half does not count.
    assert split_in_two("a\n" + "x" * 20) == ("a\nxxxxxxxxx", "x" * 11)


def test_split_in_two_cuts_cjk_after_a_stop_and_never_inside_a_character() -> None:
    # The service rejected a chunk as too long: its halves are embedded on their own.
    sentence = "検索システムは文書を分割します。"
    assert split_in_two(sentence * 3 + "😀") == (sentence, sentence * 2 + "😀")
    family = "👨\u200d👩\u200d👧"  # one emoji of five code points
    assert split_in_two(family * 3) == (family * 2, family)
    water = "น้ำ"  # Thai: the vowel after the tone mark is a letter of the same cluster
    assert split_in_two(water * 5) == (water * 3, water * 2)


@pytest.mark.parametrize("text", ["", "x"])
def test_split_in_two_refuses_tiny_text(text: str) -> None:
    with pytest.raises(ValueError):
        split_in_two(text)
