"""Markup title rules: ATX headings (CommonMark's closing-run rule, in linear time), rst titles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quarry._markdown import atx_title, rst_title
from quarry.chunking import Chunker
from quarry.documents import Document
from quarry.sources import _markup_title, load_document, open_source

# The regex the loader and the chunker used before (quadratic over a run of spaces):
# the reference for what a title is, on lines short enough for it.
REFERENCE = re.compile(r"[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")


@pytest.mark.parametrize(
    ("content", "title"),
    [
        (" Setup", "Setup"),
        (" Setup ##", "Setup"),
        (" Setup ##  \t", "Setup"),
        (" C#", "C#"),
        (" Title#", "Title#"),
        (" Title ## ##", "Title ##"),
        (" #", "#"),
        (" ##", "##"),
        ("\tTabbed\t#", "Tabbed"),
    ],
)
def test_a_closing_run_after_whitespace_is_not_part_of_the_title(content: str, title: str) -> None:
    assert atx_title(content) == title


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=" \t#ab\r\u00a0\u2003", max_size=16).map(lambda s: " " + s))
def test_titles_are_those_the_old_regex_read(content: str) -> None:
    match = REFERENCE.match(content)
    assert match is not None
    assert atx_title(content) == match.group(1).strip()


@pytest.mark.timeout(60)
def test_a_heading_line_of_a_megabyte_of_spaces_is_read_at_once(tmp_path: Path) -> None:
    # The old regex needed hours for this line (4x per doubling: 14 s at 32 KB).
    line = "# a" + " " * 1_000_000 + "b ##\n\nSome text under it.\n"
    (tmp_path / "wide.md").write_text(line, encoding="utf-8")
    (document,) = load_document(tmp_path / "wide.md", open_source(tmp_path))
    assert document.title == "a" + " " * 1_000_000 + "b"
    chunks = list(Chunker(256, 32).chunk_text(line))
    assert chunks[0].headings == ("a" + " " * 1_000_000 + "b",)


@pytest.mark.parametrize(
    ("line", "title"),
    [
        (":mod:`email` Package Architecture", "email Package Architecture"),
        (":ref:`Install guide <install>`", "Install guide"),
        ("``asyncio`` --- Asynchronous I/O", "asyncio --- Asynchronous I/O"),
        ("`Python <https://python.org>`_ docs", "Python docs"),
        (":py:class:`Foo` and `bar`__  ", "Foo and bar"),
        ("A `lone backtick", "A `lone backtick"),
        ("  Plain title ", "Plain title"),
    ],
)
def test_rst_titles_lose_their_inline_markup(line: str, title: str) -> None:
    assert rst_title(line) == title


def test_rst_title_and_breadcrumb_read_the_same_without_roles() -> None:
    text = ":mod:`email` Package Architecture\n==================================\n\nBody.\n"
    doc = Document.create("a.rst", text, "", {"content_type": "text/x-rst"})
    assert _markup_title(text, rst=True) == "email Package Architecture"
    assert Chunker().chunk(doc)[0].headings == ("email Package Architecture",)
