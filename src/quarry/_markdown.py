"""Markdown line rules shared by the loader (a document's title) and the chunker (breadcrumbs)."""

from __future__ import annotations

__all__ = ["atx_title"]


def atx_title(content: str) -> str:
    """The title of a markdown ATX heading, from what follows its opening ``#`` run.

    CommonMark's rule: surrounding whitespace and a closing run of ``#`` that
    follows whitespace are not part of the title (``## Setup ##`` is ``Setup``,
    ``# C#`` is ``C#``). Linear in the line's length: the regex this replaces
    backtracked over a long run of spaces, quadratically (a 32 KB line took 14 s).
    """
    title = content.strip(" \t")
    bare = title.rstrip("#")
    if len(bare) < len(title) and bare[-1:] in (" ", "\t"):
        title = bare
    return title.strip()
