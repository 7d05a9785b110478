"""Discover and load the files of a source: markdown, text, rst, HTML, PDF, and code on request.

A *source* is a directory (or one file) with include and exclude globs. Files
are found in a sorted, deterministic order; a symlink is followed only while
it stays inside the source root. Each file becomes one :class:`Document`
(a PDF: one per page), or a :class:`LoadFailure` that names the file and says
why: binary, over ``QUARRY_MAX_FILE_BYTES``, undecodable (with the encodings
tried), broken (a truncated PDF), or a symlink out of the root. A bad file
never stops a run.

Text is normalised for hashing and chunking: ``\\r\\n`` and lone ``\\r``
become ``\\n`` and a leading byte order mark is dropped; nothing else is
changed, so offsets into the text stay meaningful. HTML is reduced to its
title and main text (scripts, styles and navigation dropped) and written as
light markdown: ``#`` headings, ``-`` list items and fenced ``pre`` blocks, so
the chunker sees its structure.

Empty files (and files that are only whitespace) give no document and no
failure: there is nothing to index and nothing is wrong, and a file that
became empty should leave the index like a deleted one. A PDF that has pages
but no extractable text *is* reported (it is probably scanned: its content is
missing from the index).
"""

from __future__ import annotations

import codecs
import errno
import io
import logging
import os
import re
import threading
from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import Any

from quarry._markdown import atx_title, front_matter_end, rst_title
from quarry.documents import Document, FileStamp
from quarry.errors import ConfigError, SourceNotFound, UnreadableDocument

DEFAULT_INCLUDE: tuple[str, ...] = (
    "**/*.md",
    "**/*.markdown",
    "**/*.txt",
    "**/*.rst",
    "**/*.html",
    "**/*.htm",
    "**/*.pdf",
)
DEFAULT_EXCLUDE: tuple[str, ...] = (
    ".git/**",
    "**/.git/**",
    "**/node_modules/**",
    ".venv/**",
    "**/.venv/**",
    "**/__pycache__/**",
    ".quarry/**",
    "**/.quarry/**",
)
DEFAULT_MAX_FILE_BYTES = 20 * 1024 * 1024
# Bump when a loader change alters what an unchanged file loads as: file stamps
# recorded by an older loader then no longer vouch for their files.
# 2: UTF-8 with stray legacy bytes, BOM-less UTF-16, NULs past 8 KiB. 3: HTML code blocks
# keep their lines, table cells their words, paragraph text that reads as markup is escaped;
# cp1252 over a detected DOS or Mac code page, or over Latin-1 with C1 control bytes; a
# page without <main> loses its own banner, footer and sidebars; list items are one line
# apart, nested ones indented, <ol start> kept. 4: PDF words hyphenated at a line end
# are joined; ISO-2022 text read by its escapes; Greek and Hebrew code pages told apart
# by the letters they read; HTML ruby readings (<rt>) dropped; BOM-less UTF-16 of one
# script (Cyrillic, Greek) is text, not binary. 5: markdown titles skip headings in HTML
# comments, and front matter needs a non-blank line after its "---"; HTML in its declared
# charset, no BOM before the parser, an <h1> outside <main> as the title, lists indented
# 8 levels at most; a PDF page that will not decompress fails its file.
LOADER_VERSION = 5

# Content types by extension. A fixed table, not the mimetypes module: the
# content type is indexed metadata, so it must not depend on the machine.
_CONTENT_TYPES: dict[str, str] = {
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".txt": "text/plain",
    ".text": "text/plain",
    ".rst": "text/x-rst",
    ".html": "text/html",
    ".htm": "text/html",
    ".xhtml": "text/html",
    ".pdf": "application/pdf",
    ".py": "text/x-python",
    ".pyi": "text/x-python",
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".ts": "text/x-typescript",
    ".tsx": "text/x-typescript",
    ".jsx": "text/javascript",
    ".java": "text/x-java",
    ".kt": "text/x-kotlin",
    ".go": "text/x-go",
    ".rs": "text/x-rust",
    ".c": "text/x-c",
    ".h": "text/x-c",
    ".cc": "text/x-c++",
    ".cpp": "text/x-c++",
    ".hpp": "text/x-c++",
    ".cs": "text/x-csharp",
    ".rb": "text/x-ruby",
    ".php": "text/x-php",
    ".swift": "text/x-swift",
    ".scala": "text/x-scala",
    ".sh": "text/x-shellscript",
    ".bash": "text/x-shellscript",
    ".sql": "text/x-sql",
    ".css": "text/css",
    ".json": "application/json",
    ".yaml": "text/x-yaml",
    ".yml": "text/x-yaml",
    ".toml": "text/x-toml",
    ".ini": "text/x-ini",
    ".cfg": "text/x-config",
    ".conf": "text/x-config",
    ".env": "text/x-config",
    ".properties": "text/x-java-properties",
    ".xml": "text/xml",
    ".csv": "text/csv",
    ".tsv": "text/tab-separated-values",
    ".tf": "text/x-hcl",
    ".tfvars": "text/x-hcl",
    ".hcl": "text/x-hcl",
    ".r": "text/x-r",
    ".pl": "text/x-perl",
    ".pm": "text/x-perl",
    ".jl": "text/x-julia",
    ".ps1": "text/x-powershell",
    ".psm1": "text/x-powershell",
    ".lua": "text/x-lua",
    ".dart": "text/x-dart",
    ".ex": "text/x-elixir",
    ".exs": "text/x-elixir",
    ".erl": "text/x-erlang",
    ".hs": "text/x-haskell",
    ".clj": "text/x-clojure",
    ".zig": "text/x-zig",
    ".nim": "text/x-nim",
    ".vue": "text/x-vue",
    ".svelte": "text/x-svelte",
    ".scss": "text/x-scss",
    ".sass": "text/x-sass",
    ".less": "text/x-less",
    ".proto": "text/x-protobuf",
    ".graphql": "application/graphql",
    ".gql": "application/graphql",
    ".gradle": "text/x-groovy",
    ".groovy": "text/x-groovy",
    ".zsh": "text/x-shellscript",
    ".fish": "text/x-shellscript",
    ".mk": "text/x-makefile",
    ".cmake": "text/x-cmake",
    ".dockerfile": "text/x-dockerfile",
}
# Files known by their name: build and container files, where ``#`` starts a comment.
_NAMED_CONTENT_TYPES: dict[str, str] = {
    "dockerfile": "text/x-dockerfile",
    "containerfile": "text/x-dockerfile",
    "makefile": "text/x-makefile",
    "gnumakefile": "text/x-makefile",
    "makefile.am": "text/x-makefile",
    "makefile.in": "text/x-makefile",
    "cmakelists.txt": "text/x-cmake",
    "jenkinsfile": "text/x-groovy",
    "gemfile": "text/x-ruby",
    "rakefile": "text/x-ruby",
    "vagrantfile": "text/x-ruby",
    "justfile": "text/x-makefile",
    "procfile": "text/x-config",
}
_TEXT_FALLBACK = "text/plain"

_BINARY_SNIFF_BYTES = 8192
# High bytes UTF-16 text of one script besides ASCII shows, at most (Cyrillic: 0x00, 0x04;
# Japanese kana and kanji span more, and also 0x20 and 0x30 for punctuation).
_UTF16_SCRIPT_BLOCKS = 48
# Characters from ASCII (spaces, newlines, digits) any such text has: a line break every
# 50 characters of Japanese is 2%.
_UTF16_MIN_ASCII = 0.02
_PREFERRED = "cp1252"
_CHAOS_MARGIN = 0.05
# Detection reads a few accented letters in mostly ASCII text ("Ångström" in
# Latin-1) as CJK double-byte or BOM-less UTF-16 characters just as readily as
# Western ones. Real text in those encodings is mostly non-ASCII bytes, so a
# multi-byte verdict on text whose non-ASCII bytes are fewer than this share
# gives way to cp1252 when cp1252 reads every byte.
_MULTIBYTE_MIN_SHARE = 0.3
_HIGH_BYTES = bytes(range(0x80, 0x100))
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")
_WESTERN_PUNCTUATION = frozenset("‘’‚“”„–—…•€£©®°«»¿¡·™†‡‰‹›")
_MULTIBYTE = re.compile(r"big5|cp9[345]\d|gb|euc|hz|iso2022|johab|shift_jis|utf_(16|32)")
# DOS and classic Mac code pages: detection picks them for a cp1252 file with a few
# symbols (a "\x80" euro sign reads as cp437's "Ç"), and they are rarely what a file is.
_DOS_OR_MAC = re.compile(r"cp(?:437|7\d\d|8[5-6]\d)$|mac_")
# A byte of 0x80-0x9F between two letters: a DOS code page's accented letter (cp437's
# "R\x82sum\x82"), where cp1252 has punctuation there; but for ’ (don’t), œ, š and ž.
_INSIDE_WORDS = re.compile(rb"[A-Za-z][\x80-\x91\x93-\x99\x9b\x9d\x9f][A-Za-z]")
# Latin-1's C1 controls: text never means them; in cp1252 they are “quotes”, dashes, €.
_C1_BYTES = re.compile(rb"[\x80-\x9f]")
_BOMS_WIDE = (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff", b"\xff\xfe", b"\xfe\xff")
# ISO-2022 text is 7-bit, so it decodes as UTF-8 too: its escape sequences say what it is.
_ISO2022_ESCAPE = re.compile(rb"\x1b(?:\$[@B]|\$\(D|\(J|\(I|\$\)C)")
_ISO2022_CODECS = ("iso2022_jp", "iso2022_jp_2", "iso2022_jp_ext", "iso2022_kr")
# Single-byte siblings that detection confuses: the Windows and the ISO code page of one
# script, which place some letters (Greek Ά, Έ, Ή; Hebrew points) on each other's symbols.
_SIBLINGS = {
    "cp1253": "iso8859_7",
    "iso8859_7": "cp1253",
    "cp1255": "iso8859_8",
    "iso8859_8": "cp1255",
}


# ---------------------------------------------------------------------------
# Sources and globs


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Translate a glob to a regex over posix relative paths.

    ``**`` spans directories (``**/`` also matches no directory at all), ``*``
    and ``?`` stay inside one path segment, ``[...]`` is a character class.
    Matching ignores case, so ``*.pdf`` also finds ``REPORT.PDF``.
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            # As fnmatch: a "]" right after "[" or "[!" is part of the class, not its end.
            j = pattern.find("]", i + 3 if pattern.startswith("[!", i) else i + 2)
            if j < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1 : j]
                negate = body.startswith("!")
                if negate:
                    body = body[1:]
                body = body.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]")
                out.append("[" + ("^" if negate else "") + body + "]")
                i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out), re.IGNORECASE | re.DOTALL)


# Matches nothing: the glob set of a source that excludes nothing.
_NOTHING = re.compile(r"(?!)")


def _any_glob(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regex that fully matches what any of ``patterns`` matches (one scan per path).

    Raises ConfigError naming a glob that cannot be used (say, a class like ``[z-a]``).
    """
    if not patterns:
        return _NOTHING
    parts = []
    for pattern in patterns:
        try:
            parts.append(f"(?:{_glob_regex(pattern).pattern})")
        except re.error as error:
            raise ConfigError(f"glob {pattern!r} is not valid: {error}") from None
    return re.compile("|".join(parts), re.IGNORECASE | re.DOTALL)


def _escape_glob(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


# Text codecs Python has that are no character set a file is written in.
_NOT_CHARSETS = frozenset(
    {"undefined", "unicode-escape", "raw-unicode-escape", "idna", "punycode", "mbcs", "oem"}
)


def checked_encoding(name: str) -> str:
    """Python's name for the text encoding ``name`` (``CP1251`` is ``cp1251``); ConfigError
    for one Python does not know, or for a codec that is not a text encoding."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        raise ConfigError(
            f"unknown encoding {name!r}: give one Python knows, such as cp1251, shift_jis, "
            "gb18030 or iso8859_7"
        ) from None
    if not getattr(info, "_is_text_encoding", True) or info.name in _NOT_CHARSETS:
        raise ConfigError(f"{name!r} is not a text encoding")
    # The codec module's name (iso8859_7, koi8_r), as detection reports encodings.
    return info.name.replace("-", "_")


@dataclass(frozen=True)
class SourceSpec:
    """A source: a root directory, the globs that pick files under it, and its name.

    ``root`` is resolved (made absolute, symlinks resolved) on creation;
    ``name`` defaults to the root directory's name and prefixes every uri.
    """

    root: Path
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    name: str = ""
    # Set when the source is one file of a folder: its path relative to the root. A sync
    # of it then concerns that file's documents only, not the folder's other files.
    file: str | None = None
    # Set when the source is one subfolder of a folder that was indexed: its path relative
    # to the root, with a trailing "/". A sync concerns that subfolder's files only.
    within: str | None = None
    # The encoding of the source's text files that are not UTF-8 (None: detect it).
    encoding: str | None = None
    _include_re: re.Pattern[str] = field(init=False, repr=False, compare=False, default=_NOTHING)
    _exclude_re: re.Pattern[str] = field(init=False, repr=False, compare=False, default=_NOTHING)

    def __post_init__(self) -> None:
        root = Path(self.root).resolve()
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if not self.name:
            object.__setattr__(self, "name", root.name or "root")
        if self.encoding is not None:
            object.__setattr__(self, "encoding", checked_encoding(self.encoding))
        object.__setattr__(self, "_include_re", _any_glob(self.include))
        object.__setattr__(self, "_exclude_re", _any_glob(self.exclude))

    @property
    def descends(self) -> bool:
        """Whether a walk goes into subfolders: a glob without "/" or "**" only
        matches files directly under the root."""
        return any("/" in g or "**" in g for g in self.include)

    @property
    def uri_prefix(self) -> str:
        """What every uri of this source starts with: ``"<name>/"``."""
        return f"{self.name}/"

    @property
    def path(self) -> Path:
        """What the sync reads: the root, or its one file or subfolder."""
        part = self.file or self.within
        return self.root / part if part else self.root

    def includes(self, rel: str) -> bool:
        """Whether a file at posix path ``rel`` (relative to the root) is part of the source."""
        if self.file is not None:  # that file only, not one that differs in case
            return rel == self.file
        if self.within is not None and not rel.startswith(self.within):
            return False
        return self._include_re.fullmatch(rel) is not None and not self.excludes(rel)

    def excludes(self, rel: str) -> bool:
        """Whether ``rel`` (a file, or a directory given with a trailing ``/``) is excluded."""
        if self._exclude_re.fullmatch(rel) is not None:
            return True
        return rel.endswith("/") and self._exclude_re.fullmatch(rel[:-1]) is not None


def open_source(
    path: str | Path,
    include: tuple[str, ...] = DEFAULT_INCLUDE,
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
    *,
    missing_file_ok: bool = False,
    encoding: str | None = None,
) -> SourceSpec:
    """A source for a directory, or for one file (root = its directory, include = that file;
    a sync of it adds, updates or removes that file's documents only).

    Raises :class:`SourceNotFound` naming the path if it does not exist, unless
    ``missing_file_ok`` and its folder exists: then it is a one-file source whose
    file is gone (a sync of it removes that file's documents, if any were indexed).
    ``encoding`` is that of its files that are not UTF-8 (default: detected).
    """
    spec = _open_source(path, include, exclude, missing_file_ok=missing_file_ok)
    return spec if encoding is None else replace(spec, encoding=encoding)


def _open_source(
    path: str | Path,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    *,
    missing_file_ok: bool,
) -> SourceSpec:
    given = Path(path)
    if given.exists():
        resolved = given.resolve()
    elif missing_file_ok and given.parent.is_dir():
        resolved = given.parent.resolve() / given.name
    else:
        raise SourceNotFound(str(path), "no such file or directory")
    folder = given.is_dir()
    # The folder's name prefixes every uri (and a one-file source's file name ends it).
    names = (resolved.name,) if folder else (resolved.parent.name, resolved.name)
    if not all(map(_is_utf8, names)):
        raise SourceNotFound(
            _printable_name(str(path)), "the name is not valid UTF-8; rename it to index it"
        )
    if folder:
        return SourceSpec(given, tuple(include), tuple(exclude))
    if given.is_symlink() and not _inside(resolved, given.parent.resolve()):
        # A link out of its folder, given by name (a shell glob of the folder picks it):
        # reported as the folder's walk reports it, not indexed as a source of its own.
        return file_source(given.parent.resolve(), given.name)
    return file_source(resolved.parent, resolved.name)


def file_source(root: Path, relative: str, *, encoding: str | None = None) -> SourceSpec:
    """The one-file source of the file ``relative`` (a posix path) under the folder ``root``,
    named after ``root``: a sync of it concerns that file's documents only."""
    return SourceSpec(root, (_escape_glob(relative),), (), file=relative, encoding=encoding)


def subfolder_source(
    root: Path,
    within: str,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    *,
    encoding: str | None = None,
) -> SourceSpec:
    """The subfolder ``within`` (posix, relative to ``root``, with a trailing ``/``) of the
    folder source at ``root`` with the globs ``include`` and ``exclude`` (relative to
    ``root``): named after ``root``, its files get the uris a walk of ``root`` gives
    them, and a sync of it concerns the files under ``within`` only."""
    return SourceSpec(root, include, exclude, within=within, encoding=encoding)


def refuse_overlapping_sources(specs: Sequence[SourceSpec]) -> None:
    """Raise ConfigError for sources that would index one file twice or each other's away.

    A source's name prefixes its uris: two sources named alike in different folders
    would delete each other's documents, and a folder inside another source would
    have its files indexed twice, under both names.
    """
    roots: dict[str, Path] = {}
    for spec in specs:
        other = roots.setdefault(spec.name, spec.root)
        if other != spec.root:
            raise ConfigError(
                f"two sources are named {spec.name!r} ({other} and {spec.root}); a source "
                "is named after its folder, so their documents would replace each other. "
                "Ingest them into different collections (--collection)."
            )
    for spec in specs:
        path = spec.path
        for outer in specs:
            if outer.file is None and outer.root != spec.root and _takes_in(outer, path, spec):
                raise ConfigError(
                    f"{path} is inside the source {outer.root}: its files would be indexed "
                    f"twice, under {spec.name}/ and {outer.name}/. Give {outer.root} alone "
                    "(it takes in the other), or ingest them into different collections "
                    "(--collection)."
                )


def without_parts_taken_in(specs: Sequence[SourceSpec]) -> list[SourceSpec]:
    """``specs`` without the files and subfolders of a folder source among them that its
    walk reaches anyway (``docs docs/a.md``, ``docs docs/sub`` once ``docs`` is indexed):
    they would be synced, and counted, twice. A subfolder part with globs of its own
    is kept."""

    def taken_in(spec: SourceSpec) -> bool:
        if spec.file is None and spec.within is None:
            return False
        return any(
            outer.file is None
            and outer.within is None
            and outer.root == spec.root
            and (
                spec.file is not None
                or (outer.include, outer.exclude) == (spec.include, spec.exclude)
            )
            and _takes_in(outer, spec.path, spec)
            for outer in specs
        )

    return [spec for spec in specs if not taken_in(spec)]


def _takes_in(outer: SourceSpec, path: Path, inner: SourceSpec) -> bool:
    """Whether a walk of the folder source ``outer`` reaches ``path``, the file or folder
    of the source ``inner``: inside its root, not excluded, and picked by its globs."""
    if not path.is_relative_to(outer.root):
        return False
    rel = path.relative_to(outer.root).as_posix()
    if inner.file is not None:
        return (outer.descends or "/" not in rel) and outer.includes(rel)
    return outer.descends and _may_hold(outer, rel + "/")


@dataclass(frozen=True)
class LoadFailure:
    """A file that could not be indexed, and why (goes into the ingest summary's ``failures``).

    ``vanished``: the file was deleted or moved after the folder was listed, which is
    no fault of the file (a sync notes it, and the next one finds it gone).
    """

    uri: str
    error: str
    vanished: bool = False


def _relative(path: Path, spec: SourceSpec) -> str:
    candidate = path if path.is_absolute() else Path.cwd() / path
    try:
        return candidate.relative_to(spec.root).as_posix()
    except ValueError:
        pass
    # The caller may have passed a path through a symlinked parent: resolve the parent only.
    try:
        return (candidate.parent.resolve() / candidate.name).relative_to(spec.root).as_posix()
    except ValueError:
        raise ValueError(f"{path} is not under the source root {spec.root}") from None


def uri_for(path: Path, spec: SourceSpec) -> str:
    """The uri of a file: ``"<source name>/<posix path relative to the root>"``."""
    return f"{spec.name}/{_relative(Path(path), spec)}"


def _inside(target: Path, root: Path) -> bool:
    return target == root or target.is_relative_to(root)


_NOT_REGULAR = "not a regular file (a FIFO, socket or device); skipped"


@dataclass(frozen=True, slots=True)
class _Found:
    rel: str  # posix path relative to the root
    where: str  # the path as found under the root
    problem: str | None = None  # why it must be skipped
    # What to open: the path, or a symlink's target inside the root. Strings, not
    # Paths: a re-sync reads almost none of the files it lists, and building a Path
    # per file was a fifth of its walk.
    opens: str | None = None

    @property
    def path(self) -> Path:
        """The path as found under the root."""
        return Path(self.where)


def _walk(spec: SourceSpec) -> Iterator[_Found]:
    """Every candidate file, sorted by relative path.

    A file without a ``problem`` has ``opens`` set: a regular file inside the root
    (a symlink to one is resolved to it here).
    """
    root = spec.root
    descend = spec.descends
    found: list[_Found] = []
    visited: set[Path] = {root}
    # Each folder with its path as found and, when reached through a folder symlink,
    # its real one: an exclude names real folders, and a link must not lead around it.
    stack: list[tuple[Path, str, str]] = [(root, "", "")]
    while stack:
        folder, prefix, real_prefix = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError as exc:
            found.append(
                _Found(prefix, str(folder), f"cannot list directory: {exc.strerror or exc}")
            )
            continue
        for entry in entries:
            if not _is_utf8(entry.name):
                _report_undecodable_name(spec, entry, prefix, descend, found)
                continue
            rel = prefix + entry.name
            where = entry.path
            try:
                if entry.is_symlink():
                    path = Path(where)
                    try:
                        target = path.resolve()
                    except RuntimeError:  # Python 3.11 raises this for a loop, not OSError
                        if spec.includes(rel):
                            found.append(_Found(rel, where, "symlink loop; not followed"))
                        continue
                    if not target.exists():
                        if spec.includes(rel):
                            found.append(_Found(rel, where, "broken symlink"))
                        continue
                    if not _inside(target, root):
                        is_dir = target.is_dir()
                        if (is_dir and _may_hold(spec, rel + "/")) or (
                            not is_dir and spec.includes(rel)
                        ):
                            found.append(
                                _Found(
                                    rel,
                                    where,
                                    "symlink points outside the source root; not followed",
                                )
                            )
                        continue
                    if target.is_dir():
                        # A folder walked already (an ancestor: a loop; or a sibling):
                        # its files are indexed once, under the way it was first reached.
                        real_dir = target.relative_to(root).as_posix() + "/"
                        if (
                            not descend
                            or target in visited
                            or not _may_hold(spec, rel + "/")
                            or (spec.file is None and spec.excludes(real_dir))
                        ):
                            continue
                        visited.add(target)
                        stack.append((path, rel + "/", real_dir))
                        continue
                    if not target.is_file():
                        if spec.includes(rel):
                            found.append(_Found(rel, where, _NOT_REGULAR))
                        continue
                    # A link to an excluded file leaves it out; one to a file the globs
                    # pick anyway would index it twice: it is indexed under its own name.
                    real_rel = target.relative_to(root).as_posix()
                    if spec.file is None and (spec.excludes(real_rel) or spec.includes(real_rel)):
                        continue
                    opens = str(target)
                elif entry.is_dir(follow_symlinks=False):
                    real_dir = real_prefix + entry.name + "/"
                    if not descend or not _may_hold(spec, rel + "/"):
                        continue
                    if spec.file is None and real_dir != rel + "/" and spec.excludes(real_dir):
                        continue
                    path = Path(where)
                    real = path.resolve()
                    if real in visited:
                        continue
                    visited.add(real)
                    stack.append((path, rel + "/", real_dir))
                    continue
                elif not entry.is_file(follow_symlinks=False):
                    # A FIFO would block the read forever; sockets and devices are not text.
                    if spec.includes(rel):
                        found.append(_Found(rel, where, _NOT_REGULAR))
                    continue
                else:
                    if (
                        real_prefix != prefix
                        and spec.file is None
                        and spec.excludes(real_prefix + entry.name)
                    ):
                        continue
                    opens = where
            except OSError as exc:
                found.append(_Found(rel, where, f"cannot read: {exc.strerror or exc}"))
                continue
            if spec.includes(rel):
                found.append(_Found(rel, where, opens=opens))
    found.sort(key=lambda item: item.rel)
    yield from found


def _may_hold(spec: SourceSpec, folder: str) -> bool:
    """Whether the folder ``folder`` (relative, with its trailing ``/``) may hold a file
    of ``spec``: one that is not excluded, and for a one-file source only a folder on
    the file's path (one file synced under the folder that indexed it, see
    quarry.ingest.as_indexed, is not a walk of that folder's whole tree; nor is a
    subfolder synced as part of the folder that indexed it)."""
    if spec.file is not None:
        return spec.file.startswith(folder)
    if spec.within is not None and not (
        spec.within.startswith(folder) or folder.startswith(spec.within)
    ):
        return False  # off the subfolder's path
    return not spec.excludes(folder)


def _is_utf8(name: str) -> bool:
    """False for a name the OS gave as bytes that are not UTF-8 (Python holds them as
    surrogate escapes, which no uri, JSON log or payload can carry)."""
    if name.isascii():
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable_name(name: str) -> str:
    """A name that is not UTF-8, printable: each undecodable byte as U+FFFD."""
    return os.fsencode(name).decode("utf-8", "replace")


_UNDECODABLE_FILE = "file name is not valid UTF-8; skipped (rename the file to index it)"
_UNDECODABLE_FOLDER = (
    "folder name is not valid UTF-8; its files are skipped (rename the folder to index them)"
)


def _report_undecodable_name(
    spec: SourceSpec, entry: os.DirEntry[str], prefix: str, descend: bool, found: list[_Found]
) -> None:
    """Report a file or folder whose name is not UTF-8 (quarry cannot give it a uri)."""
    rel = prefix + _printable_name(entry.name)
    try:
        is_dir = entry.is_dir()
    except OSError:
        is_dir = False
    if is_dir:
        if descend and _may_hold(spec, rel + "/"):
            found.append(_Found(rel + "/", entry.path, _UNDECODABLE_FOLDER))
    elif spec.includes(rel):
        found.append(_Found(rel, entry.path, _UNDECODABLE_FILE))


def discover(spec: SourceSpec) -> Iterator[Path]:
    """The files of a source, sorted by relative path.

    Never follows a symlink out of the root (such links are left out; they are
    reported by :func:`iter_documents`) and never descends an excluded directory.
    """
    for found in _walk(spec):
        if found.problem is None:
            yield found.path


# ---------------------------------------------------------------------------
# Loading


def _fail(uri: str, message: str) -> UnreadableDocument:
    return UnreadableDocument(uri, message)


class _Vanished(UnreadableDocument):
    """A listed file that is no longer there when it is opened."""


def _content_type(path: Path) -> str:
    name = path.name.lower()
    if name in _NAMED_CONTENT_TYPES:
        return _NAMED_CONTENT_TYPES[name]
    if name.startswith(("dockerfile.", "containerfile.")):  # Dockerfile.dev
        return "text/x-dockerfile"
    if name == ".env" or name.startswith(".env."):  # no suffix to go by: .env, .env.local
        return "text/x-config"
    return _CONTENT_TYPES.get(path.suffix.lower(), _TEXT_FALLBACK)


def normalise_text(text: str) -> str:
    """Text as quarry hashes and chunks it: ``\\n`` newlines, no leading byte order mark."""
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _decodes(data: bytes, encoding: str) -> bool:
    try:
        data.decode(encoding)
    except UnicodeDecodeError:
        return False
    return True


def _mostly_ascii_western(data: bytes) -> bool:
    """Whether ``data`` reads as ASCII text with a few Western letters in cp1252.

    Few non-ASCII bytes (see _MULTIBYTE_MIN_SHARE), in runs of at most three
    characters (a CJK word in a double-byte encoding is a longer run), and
    nearly all of them letters or Western punctuation (a Big5 lead byte reads
    as a symbol such as ``§`` or ``¤``).
    """
    high = len(data) - len(data.translate(None, _HIGH_BYTES))
    if high >= _MULTIBYTE_MIN_SHARE * len(data):
        return False
    try:
        text = data.decode(_PREFERRED)
    except UnicodeDecodeError:
        return False
    runs = _NON_ASCII_RUN.findall(text)
    if any(len(run) > 3 for run in runs):
        return False
    chars = "".join(runs)
    western = sum(1 for c in chars if c.isalpha() or c in _WESTERN_PUNCTUATION)
    return western >= 0.8 * len(chars)


# UTF-8 text with a few stray bytes of another encoding (a cp1252 dash pasted in) is
# still UTF-8: real text in a legacy encoding forms almost no valid multi-byte UTF-8
# sequences (CJK double-byte text: at most about one per two bad bytes).
_UTF8_VALID_PER_BAD = 3
_UTF8_BOM = b"\xef\xbb\xbf"
# What "surrogateescape" decodes an undecodable byte to: U+DC80..U+DCFF.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _mostly_utf8(data: bytes) -> tuple[str, str] | None:
    """``data`` as UTF-8 with its few undecodable bytes read as cp1252 (latin-1 where
    cp1252 has no character), when valid non-ASCII UTF-8 characters outnumber them
    ``_UTF8_VALID_PER_BAD`` to one; else None. Linear in the file, whatever the bad
    bytes: they are counted from what an "ignore" decode keeps."""
    data = data.removeprefix(_UTF8_BOM)
    # No object per bad byte: a legacy file of 20 MB is millions of them.
    kept = data.decode("utf-8", "ignore")
    bad = len(data) - len(kept.encode("utf-8"))
    valid = len(kept) - len(kept.encode("ascii", "ignore"))
    if not bad or valid < _UTF8_VALID_PER_BAD * bad:
        return None
    text = data.decode("utf-8", "surrogateescape")
    return _ESCAPED_BYTE.sub(lambda m: _cp1252_byte(ord(m[0]) - 0xDC00), text), "utf-8+cp1252"


def _cp1252_byte(byte: int) -> str:
    try:
        return bytes((byte,)).decode("cp1252")
    except UnicodeDecodeError:
        return chr(byte)


def _bomless_utf16(data: bytes) -> tuple[str, str] | None:
    """``data`` as UTF-16 without a byte order mark, when it reads as text that way;
    else None.

    Either its NUL bytes are where the high bytes of mostly-ASCII UTF-16 fall (every
    other byte), or its high bytes come from a few blocks of one script (Cyrillic is
    ``0x04``, Greek ``0x03``) and ASCII's spaces and newlines (``0x00``), and it
    decodes to printable text. Binary
    data with NUL bytes fails both: its high bytes are all over, and pairs of them
    read as lone surrogates, which do not decode.
    """
    if len(data) < 4 or len(data) % 2:
        return None
    sample = data[: _BINARY_SNIFF_BYTES * 2]
    for encoding, high, low in (("utf-16-le", 1, 0), ("utf-16-be", 0, 1)):
        highs = sample[high::2]
        if 0 in sample[low::2] and highs.count(0) < 0.9 * len(highs):
            continue  # a NUL where a character's low byte is: not UTF-16 text
        ascii_share = highs.count(0) / len(highs)
        if ascii_share < 0.9 and (
            len(set(highs)) > _UTF16_SCRIPT_BLOCKS or ascii_share < _UTF16_MIN_ASCII
        ):
            continue  # not one script's text: it has no spaces, newlines or digits either
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError:
            continue
        if "\x00" in text:
            continue
        if ascii_share >= 0.9:
            return text, encoding  # mostly ASCII: its NULs are where they must be
        shown = sum(
            1 for char in text[:_BINARY_SNIFF_BYTES] if char.isprintable() or char in "\t\n\r\f"
        )
        if shown >= 0.98 * min(len(text), _BINARY_SNIFF_BYTES):
            return text, encoding
    return None


def _decode_declared(data: bytes, uri: str, declared: str) -> tuple[str, str]:
    """``data`` in the encoding its source declared; UnreadableDocument when it is not."""
    try:
        text = data.decode(declared)
    except UnicodeError as exc:
        where = f" at byte {exc.start}" if isinstance(exc, UnicodeDecodeError) else ""
        reason = exc.reason if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise _fail(
            uri,
            f"cannot decode text: tried utf-8, utf-8-sig and {declared} (the source's "
            f"encoding): {reason}{where}",
        ) from None
    if "\x00" in text:
        raise _fail(uri, f"binary file (NUL characters read as {declared}), skipped")
    return text, declared


def _more_letters(data: bytes, detected: str, sibling: str) -> str:
    """``sibling`` when it reads ``data`` with more letters than ``detected`` does."""
    try:
        other = data.decode(sibling)
    except UnicodeDecodeError:
        return detected
    letters = sum(1 for char in data.decode(detected, "replace") if char.isalpha())
    return sibling if sum(1 for char in other if char.isalpha()) > letters else detected


def decode_text(data: bytes, uri: str, *, declared: str | None = None) -> tuple[str, str]:
    """Decode file bytes: ISO-2022 when its escape sequences say so, utf-8, utf-8-sig,
    utf-8 with a few stray cp1252 bytes, then the ``declared`` encoding, else a detected
    one. Returns (text, encoding).

    Raises :class:`UnreadableDocument` for binary data (NUL bytes anywhere, unless a
    UTF-16/32 byte order mark or their places say UTF-16) or when nothing decodes it,
    naming what was tried.
    """
    wide_bom = data.startswith(_BOMS_WIDE)
    if not wide_bom and _ISO2022_ESCAPE.search(data):
        korean = b"\x1b$)C" in data  # ISO-2022-KR's designation, which JP-2 misreads
        for encoding in sorted(_ISO2022_CODECS, key=lambda name: korean != name.endswith("kr")):
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError:
                continue
            if "\x1b" not in text and "\x00" not in text:
                return text, encoding
    # A file of the source in UTF-16 or -32 has NUL bytes (the high bytes of ASCII, of
    # spaces and newlines); one without any is read as the source's other files are
    # (UTF-8, or detected): read as UTF-16 it would be CJK-looking nonsense.
    wide_declared = declared is not None and declared.startswith(("utf_16", "utf_32"))
    if wide_declared and not wide_bom and b"\x00" in data:
        assert declared is not None
        return _decode_declared(data, uri, declared)
    if not wide_bom and b"\x00" in data:
        wide = _bomless_utf16(data)
        if wide is not None:
            return wide
        raise _fail(uri, "binary file (NUL bytes), skipped")
    if not wide_bom:
        for encoding in ("utf-8", "utf-8-sig"):
            if encoding == "utf-8-sig" and not data.startswith(b"\xef\xbb\xbf"):
                continue
            try:
                return data.decode(encoding), encoding
            except UnicodeDecodeError:
                continue
        repaired = _mostly_utf8(data)
        if repaired is not None:
            return repaired
    if declared is not None and not wide_bom and not wide_declared:
        return _decode_declared(data, uri, declared)
    from charset_normalizer import from_bytes

    results = from_bytes(data)
    best = results.best()
    if best is None or best.encoding is None:
        tried = "utf-8, utf-8-sig" if not wide_bom else "byte order mark"
        raise _fail(
            uri, f"cannot decode text: tried {tried} and encoding detection (nothing plausible)"
        )
    encoding = best.encoding
    # Detection is unsure on short Western text (Baltic and Central European code
    # pages score alike): prefer cp1252, the common legacy encoding, when it is as plausible.
    for match in results:
        if match.chaos <= best.chaos + _CHAOS_MARGIN and _PREFERRED in match.could_be_from_charset:
            encoding = _PREFERRED
            break
    if not wide_bom and encoding != _PREFERRED:
        if (
            _MULTIBYTE.match(encoding)
            or (_DOS_OR_MAC.match(encoding) and not _INSIDE_WORDS.search(data))
        ) and _mostly_ascii_western(data):
            encoding = _PREFERRED
        elif encoding == "latin_1" and _C1_BYTES.search(data) and _decodes(data, _PREFERRED):
            encoding = _PREFERRED  # as browsers read a page labelled ISO-8859-1 (WHATWG)
        elif encoding in _SIBLINGS:
            encoding = _more_letters(data, encoding, _SIBLINGS[encoding])
    try:
        return data.decode(encoding), encoding
    except (UnicodeDecodeError, LookupError) as exc:
        raise _fail(
            uri, f"cannot decode text: tried utf-8, utf-8-sig and detected {encoding}: {exc}"
        ) from None


# The opening of an ATX heading; quarry._markdown.atx_title reads the title after it.
_MD_ATX = re.compile(r" {0,3}(#{1,6})[ \t](?=.)")
_UNDERLINE = re.compile(r"^([=\-`:'\"~^_*+#<>.])\1{2,}[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# A list item's line is never a setext title (CommonMark: "- a" then "---" is a rule).
_LIST_ITEM = re.compile(r"^ {0,3}(?:[-*+]|\d{1,9}[.)])(?:[ \t]|$)")
_FRONT_TITLE = re.compile(r"^title:[ \t]*(.*)$")
_COMMENT_OPEN = re.compile(r"[ ]{0,3}<!--")


def _yaml_scalar(value: str) -> str:
    """A one-line YAML scalar's text: quotes removed, a trailing comment dropped; '' for
    a block scalar (``|``, ``>-`` ...), whose text is on the lines below."""
    value = value.strip()
    if value[:1] in ("'", '"'):
        end = value.find(value[0], 1)
        return value[1:end].strip() if end > 0 else value[1:].strip()
    value = value.split(" #", 1)[0].strip()
    if value[:1] in ("|", ">"):
        return ""
    return value


def _markup_title(text: str, rst: bool) -> str:
    """The first top-level heading of markdown or rst text ('' if none).

    Markdown's YAML front matter gives its ``title:`` when it has one, and is
    never read as headings (its closing ``---`` is not a setext underline).
    """
    best: tuple[int, str] | None = None
    fence: str | None = None
    lines = text.split("\n", 2000)[:2000]
    styles: list[str] = []
    start = 0
    front = 0 if rst else front_matter_end(text)  # the chunker's rule
    if front:
        inside = text[:front].split("\n")[1:-1]
        for line in inside:
            m = _FRONT_TITLE.match(line)
            if m:
                title = _yaml_scalar(m.group(1))
                if title:
                    return title
        start = len(inside) + 2
    # An HTML comment hides its headings, as the chunker reads it: one that is never
    # closed (no "-->" on a later line) hides nothing.
    last_close = max((i for i, line in enumerate(lines) if "-->" in line), default=-1)
    in_comment = False
    for i, line in enumerate(lines[start:], start):
        if in_comment:
            in_comment = "-->" not in line
            continue
        if not rst and fence is None and (c := _COMMENT_OPEN.match(line)):
            in_comment = "-->" not in line[c.end() - 2 :] and last_close > i
            continue
        if not rst:
            f = _FENCE.match(line)
            if f:
                if fence is None:
                    fence = f.group(1)
                elif line.strip().startswith(fence[0] * len(fence)):
                    fence = None
                continue
            if fence is not None:
                continue
            m = _MD_ATX.match(line)
            if m:
                level, title = len(m.group(1)), atx_title(line[m.end() :])
                if level == 1:
                    return title
                if best is None or level < best[0]:
                    best = (level, title)
                continue
        u = _UNDERLINE.match(line)
        if (
            u
            and i > start
            and lines[i - 1].strip()
            and not _UNDERLINE.match(lines[i - 1])
            and (rst or not _LIST_ITEM.match(lines[i - 1]))
        ):
            title = rst_title(lines[i - 1]) if rst else lines[i - 1].strip()
            if rst:
                over = i > 1 and lines[i - 2].strip() == line.strip()
                style = u.group(1) + ("o" if over else "")
                if style not in styles:
                    styles.append(style)
                level = styles.index(style) + 1
            elif u.group(1) in "=-":
                level = 1 if u.group(1) == "=" else 2
            else:
                continue
            if level == 1:
                return title
            if best is None or level < best[0]:
                best = (level, title)
    return best[1] if best else ""


def file_mtime(stat: os.stat_result) -> str:
    """A file's mtime as stored in its documents' metadata (ISO 8601, UTC)."""
    return datetime.fromtimestamp(stat.st_mtime, tz=UTC).isoformat()


def load_document(
    path: Path, spec: SourceSpec, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> list[Document]:
    """Load one file as documents: one per file, one per page for a PDF (uri ``...#page=N``).

    Metadata: ``uri``, ``title``, ``content_type`` (and ``page``,
    ``page_count`` for PDF pages; ``encoding`` when it was not UTF-8) are
    indexed; the file's stamp (``mtime``, ``size``, ``loaded_at``, ``loader``:
    see :class:`~quarry.documents.FileStamp`) is volatile, so touching a file
    does not change ``doc_hash``. An empty or all-whitespace
    file gives ``[]`` (nothing to index, nothing wrong). Raises
    :class:`UnreadableDocument` naming the uri and why for a binary, too large,
    undecodable or broken file, or a symlink that leaves the source root.
    """
    path = Path(path)
    uri = uri_for(path, spec)
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise _fail(uri, f"cannot open: {getattr(exc, 'strerror', None) or exc}") from None
    if not _inside(real, spec.root):
        raise _fail(uri, "symlink points outside the source root; not followed")
    return _load_file(path, uri, max_file_bytes=max_file_bytes, encoding=spec.encoding)


def _load_file(
    path: Path,
    uri: str,
    *,
    name: Path | None = None,
    max_file_bytes: int,
    no_follow: bool = False,
    root: Path | None = None,
    encoding: str | None = None,
) -> list[Document]:
    """Load a file whose place in the source is settled; ``no_follow`` refuses a symlink;
    ``encoding`` decodes it when it is not UTF-8, instead of detection.

    ``name`` (default ``path``) gives the content type and the fallback title.

    The walk has already checked where its files are, so :func:`iter_documents`
    skips resolving each path again (one lstat per path component) and opens with
    ``O_NOFOLLOW`` instead, which also refuses a file swapped for a symlink since.
    """
    # O_NONBLOCK: a path swapped for a FIFO since the walk must not wait for a writer.
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if no_follow else 0)
    # Taken before the file is opened, so a change while it is read is never stamped as seen.
    loaded_at = datetime.now(UTC).isoformat()
    try:
        with open(os.open(path, flags), "rb") as handle:
            if root is not None and not _opened_inside(handle.fileno(), path, root):
                # O_NOFOLLOW guards the last component only: a folder on the path swapped
                # for a symlink since the walk would lead out of the root.
                raise _fail(uri, "a folder on its path became a symlink out of the source root")
            stat = os.fstat(handle.fileno())
            if S_ISDIR(stat.st_mode):
                raise _fail(uri, "is a directory")
            if not S_ISREG(stat.st_mode):
                raise _fail(uri, _NOT_REGULAR)
            if stat.st_size > max_file_bytes:
                raise _fail(
                    uri,
                    f"file is {stat.st_size} bytes, over the {max_file_bytes}-byte limit "
                    "(QUARRY_MAX_FILE_BYTES); skipped",
                )
            # Ask for what fstat says is there (plus one byte, to see growth), not the
            # limit: a 20 MB read buffer per small file costs more than reading it.
            data = handle.read(min(stat.st_size, max_file_bytes) + 1)
            if len(data) > stat.st_size:  # grew since fstat: read on, up to the limit
                data += handle.read(max_file_bytes + 1 - len(data))
    except OSError as exc:
        if no_follow and exc.errno == errno.ELOOP:
            raise _fail(uri, "became a symlink after the folder was listed; not followed") from None
        if root is not None and exc.errno == errno.ENOENT:
            raise _Vanished(uri, "was deleted or moved after the folder was listed") from None
        raise _fail(uri, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > max_file_bytes:
        raise _fail(uri, f"file is over the {max_file_bytes}-byte limit (QUARRY_MAX_FILE_BYTES)")
    path = name or path
    stamp = FileStamp(
        file_mtime(stat), len(data), loaded_at, LOADER_VERSION, parts=1, decoder=encoding or ""
    )
    volatile = stamp.to_metadata()
    if not data.strip():
        return []  # empty: nothing to index, nothing wrong (see the module docstring)
    content_type = _content_type(path)
    if content_type == "application/pdf":
        return _load_pdf(data, uri, path, stamp)
    hint = html_declared_charset(data) if encoding is None and content_type == "text/html" else None
    try:  # a page's own charset is a hint (templates mislabel): detection, if it fails
        raw, found = decode_text(data, uri, declared=encoding or hint)
    except UnreadableDocument:
        if hint is None:
            raise
        raw, found = decode_text(data, uri)
    extra: dict[str, Any] = {} if found in ("utf-8", "utf-8-sig") else {"encoding": found}
    if content_type == "text/html":
        try:
            title, text = html_to_text(raw)
        except Exception as exc:  # a parser failure is this file's problem, not the run's
            raise _fail(uri, f"cannot parse HTML: {exc}") from None
        text = normalise_text(text)
    else:
        text = normalise_text(raw)
        if content_type == "text/markdown":
            title = _markup_title(text, rst=False)
        elif content_type == "text/x-rst":
            title = _markup_title(text, rst=True)
        else:
            title = ""
    if not text.strip():
        return []
    title = title or path.stem
    metadata = {"uri": uri, "title": title, "content_type": content_type, **extra}
    return [Document.create(uri, text, title, metadata=metadata, volatile=volatile)]


def _opened_inside(fd: int, path: Path, root: Path) -> bool:
    """Whether the file open as ``fd`` is inside ``root`` (one readlink on Linux)."""
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        real = Path(os.path.realpath(path))
    return _inside(real, root)


# Page content streams of real PDFs decompress to a few bytes per byte of file (fonts
# and images make up the rest), and give fewer characters of text; a hundred of
# either is far past any of them.
_PDF_CONTENT_PER_BYTE = 100
_PDF_CONTENT_FLOOR = 1 << 20


class _TooMuchText(Exception):
    """A PDF's text ran past its budget while it was being extracted."""


def _bomb(what: str, size: int) -> str:
    return (
        f"PDF {what}, more than {_PDF_CONTENT_PER_BYTE} per byte of its {size}: "
        "a likely decompression bomb, skipped"
    )


# A word broken at a line end by the typesetter: its letters, a hyphen (ASCII, U+2010 or
# a soft hyphen), the line break, and the letters that start the next line (looked at,
# not taken: they may end with the next break).
_LINE_END_HYPHEN = re.compile(
    r"(?<![^\W\d_])([^\W\d_]+)([-\u2010\u00ad])[ \t]*\n[ \t]*(?=([^\W\d_]+))"
)
_HYPHENATED_WORD = re.compile(r"[^\W\d_]+-[^\W\d_]+")


def join_hyphenated_lines(text: str) -> str:
    """``text`` with the words a PDF's line breaks cut in two made whole again.

    ``exam-`` at a line's end and ``ple`` at the next line's start become
    ``example``, so that search finds the word and the model reads it. The line
    break goes but the hyphen stays when the text writes the word with a hyphen
    elsewhere (``well-known``); nothing changes when the next line starts with a
    capital (``Jean-`` / ``Pierre``) or the hyphen follows a digit (``10-`` / ``20``).
    A soft hyphen (U+00AD) always goes. Linear in the text.
    """
    if "\n" not in text:
        return text
    hyphenated: set[str] | None = None

    def join(match: re.Match[str]) -> str:
        nonlocal hyphenated
        before, hyphen, after = match.groups()
        if hyphen == "\u00ad":
            return before
        if not after[0].islower():
            return match.group()
        if hyphenated is None:
            hyphenated = {word.lower() for word in _HYPHENATED_WORD.findall(text)}
        return before + ("-" if f"{before}-{after}".lower() in hyphenated else "")

    return _LINE_END_HYPHEN.sub(join, text)


class _StreamErrors(logging.Handler):
    """pypdf's warnings, in this thread, that a stream would not decompress: pypdf then
    goes on with what it could recover (often nothing), and the page reads as empty."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # zlib's own errors only ("Error -3 while decompressing data: ..."): pypdf's other
        # warnings there (a missing end marker, odd parameters) lose nothing.
        message = record.getMessage()
        if record.thread in (self.thread, None) and message.startswith("Error -"):
            self.messages.append(message)


def _load_pdf(data: bytes, uri: str, path: Path, stamp: FileStamp) -> list[Document]:
    """A PDF's pages with text, one document each. A page whose content could not be
    decompressed fails the whole file (review: it read as an empty page, and the sync
    deleted what the index held of it)."""
    stream_errors = _StreamErrors()
    filters = logging.getLogger("pypdf.filters")
    if filters.getEffectiveLevel() > logging.WARNING:  # a quieter root would hide them
        filters.setLevel(logging.WARNING)
    filters.addHandler(stream_errors)
    try:
        return _read_pdf(data, uri, path, stamp, stream_errors.messages)
    finally:
        filters.removeHandler(stream_errors)


def _read_pdf(
    data: bytes, uri: str, path: Path, stamp: FileStamp, stream_errors: list[str]
) -> list[Document]:
    from pypdf import PdfReader

    # The marker ends the file, give or take trailing whitespace (some tools pad with it).
    end = len(data)
    while end and data[end - 1] in b" \t\r\n\x00\x0c":
        end -= 1
    if b"%%EOF" not in data[max(0, end - 65536) : end]:
        raise _fail(uri, "broken PDF (truncated: no %%EOF marker)")
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and not reader.decrypt(""):
            raise _fail(uri, "encrypted PDF, skipped")
        meta_title = ""
        try:
            info = reader.metadata
            if info is not None and info.title:
                meta_title = str(info.title).strip()
        except Exception:
            meta_title = ""
        pages: list[str] = []
        budget = max(_PDF_CONTENT_FLOOR, _PDF_CONTENT_PER_BYTE * len(data))
        content = extracted = 0

        def count_text(text: str, *_: Any) -> None:
            # Inside the extraction: a page can draw one compressed form (XObject)
            # a hundred thousand times, and its own content stream is then tiny.
            nonlocal extracted
            extracted += len(text)
            if extracted > budget:
                raise _TooMuchText

        for page in reader.pages:
            # Measured before the (slow) text extraction: a small file whose pages
            # share one huge compressed stream would otherwise cost minutes of CPU.
            stream = page.get_contents()
            content += len(stream.get_data()) if stream is not None else 0
            if content > budget:
                raise _fail(uri, _bomb(f"pages decompress to over {budget} bytes", len(data)))
            text = normalise_text(page.extract_text(visitor_text=count_text) or "")
            if stream_errors:
                raise _fail(uri, f"broken PDF (page {len(pages) + 1}: {stream_errors[0]})")
            pages.append(join_hyphenated_lines(text))
            if extracted > budget:  # pypdf logs and goes on after an error inside a form
                raise _TooMuchText
    except _TooMuchText:
        raise _fail(uri, _bomb(f"text runs past {budget} characters", len(data))) from None
    except UnreadableDocument:
        raise
    except Exception as exc:
        kind = type(exc).__name__
        raise _fail(uri, f"broken PDF ({kind}: {exc})") from None
    if not pages:
        raise _fail(uri, "PDF has no pages")
    if not any(page.strip() for page in pages):
        raise _fail(uri, f"PDF has {len(pages)} page(s) but no extractable text (scanned?)")
    title = meta_title or path.stem
    # One document per page with text; each records how many there are, so a page
    # that failed to index keeps the file from being skipped as unchanged.
    volatile = replace(stamp, parts=sum(1 for page in pages if page.strip())).to_metadata()
    documents = []
    for number, text in enumerate(pages, start=1):
        if not text.strip():
            continue
        page_uri = f"{uri}#page={number}"
        metadata = {
            "uri": page_uri,
            "title": title,
            "content_type": "application/pdf",
            "page": number,
            "page_count": len(pages),
        }
        documents.append(Document.create(page_uri, text, title, metadata, volatile))
    return documents


@dataclass(frozen=True)
class UnchangedFile:
    """A file not read because its stamp says it is as indexed (see ``iter_documents``)."""

    uri: str


# Called with a file's uri and the path to open; True means "do not read it".
UnchangedCheck = Callable[[str, str], bool]


def iter_documents(
    spec: SourceSpec,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    unchanged: UnchangedCheck | None = None,
    listing: Listing | None = None,
) -> Iterator[Document | LoadFailure | UnchangedFile]:
    """Every document of a source in discovery order, and a :class:`LoadFailure` per bad file.

    Never raises for a single file: binary, too large, undecodable, broken
    files and symlinks out of the root are reported and the walk goes on. A file
    for which ``unchanged`` answers True is not read: an :class:`UnchangedFile`
    stands for its documents. ``listing`` (from :func:`list_source`) spares a
    second walk of the folders.
    """
    for found in listing.found if listing is not None else _walk(spec):
        uri = f"{spec.name}/{found.rel}"
        if found.problem is not None or found.opens is None:
            yield LoadFailure(uri, found.problem or "cannot read")
            continue
        if unchanged is not None and unchanged(uri, found.opens):
            yield UnchangedFile(uri)
            continue
        try:
            yield from _load_file(
                Path(found.opens),
                uri,
                name=found.path,
                max_file_bytes=max_file_bytes,
                no_follow=True,
                root=spec.root,
                encoding=spec.encoding,
            )
        except UnreadableDocument as exc:
            yield LoadFailure(exc.uri, _message(exc), vanished=isinstance(exc, _Vanished))
        except Exception as exc:  # a bad file must never stop the run
            yield LoadFailure(uri, f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Listing:
    """One walk of a source (no file read): what :func:`iter_documents` will load.

    A sync lists a source once, checks the listing against the index (the
    mass-delete guard), then loads from the same listing.
    """

    spec: SourceSpec
    found: tuple[_Found, ...]

    def still_there(self) -> tuple[set[str], tuple[str, ...]]:
        """What may still exist: the uris of every file found (readable or not), and
        the uri prefixes of the folders that could not be listed (anything under them)."""
        name = self.spec.name
        found = {f"{name}/{f.rel}" for f in self.found}
        unlisted = tuple(uri for uri in found if uri.endswith("/"))
        return found, unlisted

    def files_to_index(self, indexed: Container[str]) -> int:
        """How many files found are not among the uris ``indexed`` and could be indexed:
        not empty, with no problem the walk saw (one found binary or blank only when
        read is counted all the same). A stat each."""
        name, count = self.spec.name, 0
        for found in self.found:
            if found.problem is not None or f"{name}/{found.rel}" in indexed:
                continue
            with suppress(OSError):  # gone since the walk
                count += os.stat(found.opens or found.where).st_size > 0
        return count


def list_source(spec: SourceSpec) -> Listing:
    """Walk ``spec`` once: its candidate files in order, with any reason to skip one."""
    return Listing(spec, tuple(_walk(spec)))


def _message(exc: UnreadableDocument) -> str:
    text = str(exc)
    prefix = f"{exc.uri}: "
    return text[len(prefix) :] if text.startswith(prefix) else text


def load_path(
    path: str | Path,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    encoding: str | None = None,
) -> list[Document]:
    """Load one file whatever its name (source code as text too), for ``quarry chunk FILE``;
    ``encoding`` is the file's when it is not UTF-8 (default: detected).

    Raises :class:`SourceNotFound` if it does not exist and
    :class:`UnreadableDocument` if it is a directory or cannot be read as text.
    """
    given = Path(path)
    if given.is_symlink() and not given.exists():
        raise UnreadableDocument(str(path), "broken symlink, or a symlink loop")
    if not given.exists():
        raise SourceNotFound(str(path), "no such file or directory")
    if given.is_dir():
        raise UnreadableDocument(str(path), "is a directory, not a file")
    if not given.is_file():  # opening a FIFO would wait for a writer forever
        raise UnreadableDocument(str(path), _NOT_REGULAR)
    spec = open_source(given, encoding=encoding)
    return load_document(given.resolve(), spec, max_file_bytes=max_file_bytes)


# ---------------------------------------------------------------------------
# HTML

_DROP_TAGS = frozenset(
    {
        "script",
        "style",
        "noscript",
        "template",
        "nav",
        "iframe",
        "svg",
        "canvas",
        "button",
        "select",
        "input",
        "textarea",
        "head",
        "object",
        "embed",
        "audio",
        "video",
        "map",
        "rt",  # a ruby annotation (furigana): the reading, not the text
        "rp",
    }
)
_DROP_ROLES = frozenset({"navigation", "search", "banner", "contentinfo", "menu", "menubar"})
_DROP_CLASSES = frozenset(
    {
        "headerlink",
        "sphinxsidebar",
        "related",
        "breadcrumb",
        "breadcrumbs",
        "skip-link",
        "toc",
        # Line numbers of highlighted code (Pygments, which Sphinx and MkDocs use; Rouge).
        "linenos",
        "linenodiv",
        "rouge-gutter",
    }
)
# Highlighted code with line numbers, laid out as a table of a numbers cell and a code cell.
_CODE_TABLE_CLASSES = frozenset({"highlighttable", "rouge-table"})
_HIDDEN_STYLE = re.compile(r"(?:^|;)\s*(?:display\s*:\s*none|visibility\s*:\s*hidden)\b", re.I)
_BLOCK_TAGS = frozenset(
    {
        "address",
        "article",
        "aside",
        "blockquote",
        "body",
        "caption",
        "dd",
        "details",
        "dialog",
        "div",
        "dl",
        "dt",
        "fieldset",
        "figcaption",
        "figure",
        "footer",
        "header",
        "hgroup",
        "hr",
        "html",
        "legend",
        "li",
        "main",
        "ol",
        "p",
        "section",
        "summary",
        "table",
        "tbody",
        "tfoot",
        "thead",
        "tr",
        "ul",
    }
)
_HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
# Inside a table cell these end a word; inline elements (<em>, <a>, <code>) do not.
_CELL_BREAKING = _BLOCK_TAGS | _HEADINGS.keys() | {"pre"}
_SPACE_RUN = re.compile(r"\s+")
_BREAK = "\x00"  # stands for <br> until whitespace is collapsed (HTML text holds no NUL)
# A line of paragraph text the chunker would read as markdown structure: an ATX heading,
# a code fence, a setext underline. Escaped, it stays text (a `#` in "# of users").
_READS_AS_MARKUP = re.compile(r"#{1,6}(?:[ \t]|$)|`{3}|~{3}|(?:=+|-+)[ \t]*$")


def _escape_markup(line: str) -> str:
    return "\\" + line if _READS_AS_MARKUP.match(line) else line


class _HtmlText:
    """Collects the text of an HTML tree as markdown-ish blocks."""

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.inline: list[str] = []
        self.prefix = ""
        self.items: set[int] = set()  # indices of blocks that start a list item
        self.apart: set[int] = set()  # ... and of those that start another list
        self.list_ended = False

    def flush(self) -> None:
        text = _SPACE_RUN.sub(" ", "".join(self.inline))
        if _BREAK in text:
            text = re.sub(f" ?{_BREAK} ?", "\n", text)
        text = text.strip()
        self.inline.clear()
        if text:
            lines = text.split("\n")
            # The first line follows a prefix of ours ("# ", "- ") when there is one.
            first = lines[0] if self.prefix else _escape_markup(lines[0])
            text = "\n".join([first, *map(_escape_markup, lines[1:])])
            if self.prefix and not self.prefix.startswith("#"):
                self.items.add(len(self.blocks))
            if self.list_ended:
                self.apart.add(len(self.blocks))
                self.list_ended = False
            self.blocks.append(self.prefix + text)
            self.prefix = ""

    def code(self, body: str) -> None:
        """A fenced block of ``body`` (the text of a ``<pre>``), when it holds anything."""
        self.flush()
        body = body.strip("\n")
        if body.strip():
            longest = max((len(m) for m in re.findall(r"`{3,}", body)), default=2)
            fence = "`" * max(3, longest + 1)
            self.blocks.append(f"{fence}\n{body}\n{fence}")

    def text(self) -> str:
        """The blocks, a blank line apart; items of a list one line apart, as written."""
        self.flush()
        parts = []
        for index, block in enumerate(self.blocks):
            if index:
                tight = index in self.items and index - 1 in self.items and index not in self.apart
                parts.append("\n" if tight else "\n\n")
            parts.append(block)
        return "".join(parts) + ("\n" if self.blocks else "")


def _dropped(node: Any) -> bool:
    tag = node.tag
    if tag in _DROP_TAGS:
        return True
    attrs = node.attributes
    if not attrs:
        return False
    role = attrs.get("role")
    if role and role.lower() in _DROP_ROLES:
        return True
    if attrs.get("aria-hidden") == "true" or "hidden" in attrs:
        return True
    style = attrs.get("style")
    if style and _HIDDEN_STYLE.search(style):
        return True
    classes = attrs.get("class")
    return bool(classes) and not _DROP_CLASSES.isdisjoint(classes.split())


_OL_START = re.compile(r"\s*([0-9]{1,9})\s*")  # ASCII digits: int() refuses "²", isdigit() not


def _list_start(node: Any) -> int:
    """The number of an ``<ol>``'s first item (its ``start``, else 1)."""
    found = _OL_START.fullmatch((node.attributes or {}).get("start") or "")
    return int(found.group(1)) if found else 1


def _classes(node: Any) -> set[str]:
    attrs = node.attributes
    return set((attrs.get("class") or "").split()) if attrs else set()


def _push_children(stack: list[tuple[Any, bool]], node: Any) -> None:
    """Push ``node``'s closing mark, then its children, so the first child pops first."""
    stack.append((node, True))
    children = []
    child = node.child
    while child is not None:
        children.append(child)
        child = child.next
    stack.extend((child, False) for child in reversed(children))


def _pre_text(pre: Any) -> str:
    """The text of a ``<pre>`` as it shows: ``<br>`` and block elements inside end lines."""
    parts: list[str] = []
    stack: list[tuple[Any, bool]] = [(pre, False)]
    while stack:
        node, closing = stack.pop()
        tag = node.tag
        if closing:
            if tag in _CELL_BREAKING and parts and not parts[-1].endswith("\n"):
                parts.append("\n")
            continue
        if tag == "-text":
            parts.append(node.text(deep=False) or "")
            continue
        if tag.startswith(("-", "!")) or (node is not pre and _dropped(node)):
            continue
        if tag == "br":
            parts.append("\n")
            continue
        if node is not pre and tag in _CELL_BREAKING and parts and not parts[-1].endswith("\n"):
            parts.append("\n")
        _push_children(stack, node)
    return "".join(parts)


def _code_table_text(table: Any) -> str:
    """The code of a line-numbered code table: its ``<pre>``s outside the numbers cell."""
    codes = []
    for pre in table.css("pre"):
        node, shown = pre, True
        while node is not None and node.mem_id != table.mem_id:
            if _dropped(node):
                shown = False
                break
            node = node.parent
        if shown:
            codes.append(_pre_text(pre).strip("\n"))
    return "\n".join(codes)


def _render(root: Any, out: _HtmlText, *, page_furniture: bool = False) -> None:
    """Walk the tree (iteratively: deep pages cannot hit the recursion limit) into ``out``.

    ``page_furniture`` drops the page's own ``<footer>`` and ``<aside>``, and a
    ``<header>`` without an ``<h1>``, outside any ``<article>``, ``<section>`` or
    ``<main>`` (a site banner and its copyright line, on a page without a main element).
    """
    stack: list[tuple[Any, bool]] = [(root, False)]
    lists: list[list[int]] = []  # per open list: [is_ordered, next number]
    rows: list[int] = []  # cells seen so far in each open table row
    cells = 0  # depth of open table cells: their blocks run inline
    sections = 0  # depth of open sectioning elements, whose header and footer are theirs
    while stack:
        node, closing = stack.pop()
        tag = node.tag
        if closing:
            if tag in _SECTIONING:
                sections -= 1
            if tag in ("td", "th"):
                cells -= 1
            elif tag == "tr":
                if rows:
                    rows.pop()
                if not cells:
                    out.flush()
            elif cells:
                if tag in _CELL_BREAKING:
                    out.inline.append(" ")
            elif tag in _HEADINGS or tag in _BLOCK_TAGS:
                out.flush()
                if tag in _HEADINGS or tag == "li":
                    out.prefix = ""  # an empty heading or item does not mark the next block
                if tag in ("ul", "ol") and lists:
                    lists.pop()
                    out.list_ended = out.list_ended or not lists
            continue
        if tag == "-text":
            out.inline.append(node.text(deep=False) or "")
            continue
        if tag.startswith(("-", "!")) or _dropped(node):
            continue
        if (
            page_furniture
            and not sections
            and tag in _FURNITURE
            and (tag != "header" or node.css_first("h1") is None)
        ):
            continue
        if tag in _SECTIONING:
            sections += 1
        if tag == "br":
            out.inline.append(_BREAK)
            continue
        if tag == "pre" and not cells:
            out.code(_pre_text(node))
            continue
        if tag == "table" and not cells and not _CODE_TABLE_CLASSES.isdisjoint(_classes(node)):
            out.code(_code_table_text(node))
            continue
        if tag in ("td", "th"):
            if rows:
                if rows[-1]:
                    out.inline.append(" | ")
                rows[-1] += 1
            cells += 1
        elif tag == "tr":
            if not cells:
                out.flush()
            rows.append(0)
        elif cells:
            if tag in _CELL_BREAKING:
                out.inline.append(" ")
        elif tag in _HEADINGS:
            out.flush()
            out.prefix = "#" * _HEADINGS[tag] + " "
        elif tag in _BLOCK_TAGS:
            out.flush()
            if tag in ("ul", "ol"):
                lists.append([1 if tag == "ol" else 0, _list_start(node) if tag == "ol" else 1])
            elif tag == "li":
                # A nested list is indented, up to _LIST_INDENT_LEVELS deep (review: 20,000
                # nested lists made 16 MB of spaces out of 76 KB, all to be embedded).
                depth = min(len(lists) - 1, _LIST_INDENT_LEVELS) if lists else 0
                indent = "  " * depth
                if lists and lists[-1][0]:
                    out.prefix = f"{indent}{lists[-1][1]}. "
                    lists[-1][1] += 1
                else:
                    out.prefix = f"{indent}- "
        _push_children(stack, node)


def _main_node(tree: Any) -> Any:
    """The element holding the page's main text: the first shown ``<main>`` or
    ``[role=main]``, else the page's one ``<article>``, else ``<body>``.

    Shown: neither it nor an element around it is dropped (hidden, navigation) or
    page furniture (``aside``, ``header``, ``footer``). Several articles (a blog's
    front page) are all kept, through the body.
    """
    ancestry = _Ancestry()
    for selector in ("main", "[role=main]"):
        for node in tree.css(selector):
            if ancestry.shown(node):
                return node
    outermost = [
        node
        for node in tree.css("article")
        if ancestry.shown(node) and not ancestry.inside_article(node)
    ]
    if len(outermost) == 1:
        return outermost[0]
    return tree.body


_FURNITURE = frozenset({"aside", "header", "footer"})
_SECTIONING = frozenset({"article", "section", "main"})


class _Ancestry:
    """What the elements around a node say of it, each element judged once.

    Walking up from every candidate anew was quadratic: 4,000 nested ``<article>``
    elements (78 KB) took 5 s. Verdicts are kept by ``mem_id``, the node's address:
    selectolax compares nodes by their HTML, not their identity.
    """

    def __init__(self) -> None:
        self._shown: dict[int, bool] = {}
        self._in_article: dict[int, bool] = {}

    def shown(self, node: Any) -> bool:
        """Neither ``node`` nor an element around it (below ``<body>``) is dropped or furniture."""
        path: list[int] = []
        verdict = True
        while node is not None and node.tag not in ("body", "html"):
            known = self._shown.get(node.mem_id)
            if known is not None:
                verdict = known
                break
            path.append(node.mem_id)
            if node.tag in _FURNITURE or _dropped(node):
                verdict = False
                break
            node = node.parent
        for key in path:
            self._shown[key] = verdict
        return verdict

    def inside_article(self, node: Any) -> bool:
        """Whether an ``<article>`` encloses ``node``."""
        path: list[int] = []  # elements below ``parent``: none of them is an article
        verdict = False
        parent = node.parent
        while parent is not None:
            if parent.tag == "article":
                verdict = True
                break
            known = self._in_article.get(parent.mem_id)
            if known is not None:
                verdict = known
                break
            path.append(parent.mem_id)
            parent = parent.parent
        for key in path:
            self._in_article[key] = verdict
        return verdict


def _page_title(tree: Any) -> Any:
    """The page's ``<title>``: not one of an inline SVG's (a logo's name) or MathML's."""
    for node in tree.css("title"):
        parent = node.parent
        while parent is not None and parent.tag not in ("svg", "math"):
            parent = parent.parent
        if parent is None:
            return node
    return None


_HTML_PRESCAN_SKIP = re.compile(rb"<!--.*?(?:-->|$)|<script\b.*?(?:</script\s*>|$)", re.I | re.S)
_HTML_META = re.compile(rb"<meta\s([^>]*)>?", re.I)
_HTML_ATTRIBUTE = re.compile(rb"""([a-z][a-z0-9_:-]*)\s*=\s*("[^"]*"|'[^']*'|[^\s"'>]+)""", re.I)
_XML_ENCODING = re.compile(rb"""<\?xml\s[^>]*?encoding\s*=\s*["']([A-Za-z0-9._:-]+)""", re.I)
_CONTENT_CHARSET = re.compile(rb"charset\s*=\s*[\"']?\s*([A-Za-z0-9._:-]+)", re.I)
# What browsers read a label as (the WHATWG Encoding Standard): the supersets real pages
# use under the older names; a UTF-16 label in a byte-per-character page means UTF-8.
_BROWSER_READS = {
    "latin-1": "cp1252",
    "iso8859-1": "cp1252",
    "ascii": "cp1252",
    "iso8859-9": "cp1254",
    "iso8859-11": "cp874",
    "tis-620": "cp874",
    "gb2312": "gb18030",
    "gbk": "gb18030",
    "shift_jis": "cp932",
    "euc_kr": "cp949",
    "big5": "big5hkscs",
    "utf-16": "utf-8",
    "utf-16-le": "utf-8",
    "utf-16-be": "utf-8",
    "utf-32": "utf-8",
}
# Codecs Python knows that no page is written in (escapes, transforms, UTF-7).
_NOT_PAGE_ENCODINGS = frozenset(
    {"utf-7", "unicode-escape", "raw-unicode-escape", "punycode", "idna", "undefined"}
)


def html_declared_charset(data: bytes) -> str | None:
    """The charset an HTML page declares in its first 1024 bytes, as browsers find it
    (``<meta charset>``, ``http-equiv`` Content-Type, an XML declaration; comments and
    scripts skipped), as the Python codec browsers would read it with; None for none,
    or a label Python does not know as a text encoding."""
    head = _HTML_PRESCAN_SKIP.sub(b"", data[:1024])
    label: bytes | None = None
    for meta in _HTML_META.finditer(head):
        attributes = {
            name.lower(): value.strip(b"\"'")
            for name, value in _HTML_ATTRIBUTE.findall(meta.group(1))
        }
        if b"charset" in attributes:
            label = attributes[b"charset"]
        elif attributes.get(b"http-equiv", b"").lower() == b"content-type":
            found = _CONTENT_CHARSET.search(attributes.get(b"content", b""))
            label = found.group(1) if found else None
        if label:
            break
    if not label:
        xml = _XML_ENCODING.search(head)
        label = xml.group(1) if xml else None
    if not label:
        return None
    try:
        info = codecs.lookup(label.decode("ascii", "replace").strip().lower())
    except LookupError:
        return None
    if not getattr(info, "_is_text_encoding", True) or info.name in _NOT_PAGE_ENCODINGS:
        return None
    return _BROWSER_READS.get(info.name, info.name)


_LIST_INDENT_LEVELS = 8


def _shown_h1(tree: Any) -> Any:
    """The page's first ``<h1>`` that is shown and not in navigation, an aside or a
    footer (a site's header holds the page's title often enough); None if none."""
    for h1 in tree.css("h1"):
        node = h1
        while node is not None and node.tag not in ("body", "html"):
            if node.tag in ("aside", "footer") or _dropped(node):  # nav, hidden: dropped
                break
            node = node.parent
        else:
            return h1
    return None


def html_to_text(html: str) -> tuple[str, str]:
    """The title and main text of an HTML page, as markdown-ish text.

    Uses selectolax (lexbor). The main text is the page's shown ``<main>``,
    ``[role=main]`` or single ``<article>`` when it has one, else ``<body>``
    (see :func:`_main_node`). Scripts, styles,
    navigation (``<nav>``, navigation roles, Sphinx sidebars and header
    links, hidden elements, line numbers of highlighted code) are dropped.
    Headings become ``#`` lines, list items ``-`` lines, ``pre`` blocks (and
    line-numbered code tables) fenced code; paragraph lines that would read as
    markdown structure (``# ...``, a fence, an underline) are escaped with ``\\``.
    """
    from selectolax.lexbor import LexborHTMLParser

    # A byte order mark left in (a file read as UTF-8) is text before <html> to the
    # parser, which then moved the head's <title> into the body text.
    tree = LexborHTMLParser(html.removeprefix("\ufeff"))
    title = ""
    title_node = _page_title(tree)
    if title_node is not None:
        title = _SPACE_RUN.sub(" ", title_node.text(deep=True) or "").strip()
    main = _main_node(tree)
    if main is None:
        return title, ""
    out = _HtmlText()
    whole_page = tree.body is not None and main.mem_id == tree.body.mem_id
    _render(main, out, page_furniture=whole_page)
    text = out.text()
    if not text and tree.body is not None:
        out = _HtmlText()  # the chosen element held nothing to read: take the whole page
        _render(tree.body, out)
        text = out.text()
    if not title:
        # The main text's first <h1>, else the page's (one in a <header> above <main>).
        h1 = main.css_first("h1") or _shown_h1(tree)
        if h1 is not None:
            title = _SPACE_RUN.sub(" ", h1.text(deep=True) or "").replace("¶", "").strip()
    return title, text
