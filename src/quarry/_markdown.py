"""Markup line rules shared by the loader (a document's title) and the chunker (breadcrumbs)."""

from __future__ import annotations

import re

__all__ = ["atx_title", "front_matter_end", "rst_title"]

# YAML front matter: a first line of ``---`` with no blank line after it (else it is a
# thematic break, as Pandoc reads it), closed by ``---`` or ``...`` within
# _FRONT_MATTER_LINES lines.
_FRONT_MATTER_OPEN = re.compile(r"---[ \t]*\n(?=[ \t]*\S)")
_FRONT_MATTER_CLOSE = re.compile(r"\n(?:---|\.\.\.)[ \t]*(?=\n|$)")
_FRONT_MATTER_LINES = 200

# reST inline markup a section title carries: a role (:mod:`email`, :ref:`Text <target>`),
# an inline literal (``x``), a named reference (`Text`_, `Text <url>`_).
_RST_ROLE = re.compile(r":[\w.+-]+(?::[\w.+-]+)*:`([^`<]*?)\s*(?:<[^`>]*>)?`")
_RST_REFERENCE = re.compile(r"`([^`<]*?)\s*(?:<[^`>]*>)?`__?")
_RST_LITERAL = re.compile(r"``(.+?)``")


def atx_title(content: str) -> str:
    """The title of a markdown ATX heading, from what follows its opening ``#`` run.

    Surrounding whitespace and a closing run of ``#`` that follows whitespace are
    not part of the title (``## Setup ##`` is ``Setup``, ``# C#`` is ``C#``), as
    in CommonMark, except that a title of ``#`` alone stays (``# ##`` is ``##``,
    an empty heading in CommonMark): the regex this replaces read it so, and a
    title is in every chunk's breadcrumb. Linear in the line's length: that regex
    backtracked over a long run of spaces, quadratically (a 32 KB line took 14 s).
    """
    title = content.strip(" \t")
    bare = title.rstrip("#")
    if len(bare) < len(title) and bare[-1:] in (" ", "\t"):
        title = bare
    return title.strip()


def rst_title(line: str) -> str:
    """The text of a reStructuredText section title line, without its inline markup:
    ``:mod:`email` Package Architecture`` is ``email Package Architecture``."""
    title = line.strip()
    if "`" in title:
        title = _RST_LITERAL.sub(r"\1", title)
        title = _RST_ROLE.sub(r"\1", title)
        title = _RST_REFERENCE.sub(r"\1", title)
    return title


def front_matter_end(text: str) -> int:
    """Where a markdown text's YAML front matter ends (the end of its closing line), 0
    when it has none: nothing in it is a heading or any other structure."""
    opening = _FRONT_MATTER_OPEN.match(text)
    if opening is None:
        return 0
    end = 0
    for _ in range(_FRONT_MATTER_LINES):
        end = text.find("\n", end + 1)
        if end < 0:
            end = len(text)
            break
    closing = _FRONT_MATTER_CLOSE.search(text, opening.end() - 1, end)
    return 0 if closing is None else closing.end()
