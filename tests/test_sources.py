"""Loaders: every file kind, broken files, symlinks, globs, metadata."""

from __future__ import annotations

import fnmatch
import io
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pypdf import PdfWriter
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject, StreamObject

from quarry.chunking import Chunker
from quarry.documents import Document, doc_id_for
from quarry.errors import ConfigError, SourceNotFound, UnreadableDocument
from quarry.sources import (
    DEFAULT_EXCLUDE,
    DEFAULT_INCLUDE,
    LoadFailure,
    SourceSpec,
    _markup_title,
    discover,
    html_to_text,
    iter_documents,
    join_hyphenated_lines,
    list_source,
    load_document,
    load_path,
    open_source,
    refuse_overlapping_sources,
    uri_for,
)
from tests.conftest import write_corpus

# ---------------------------------------------------------------------------
# Fixtures


def make_pdf(
    pages: list[str], title: str | None = None, corrupt: int | None = None, hex_page: int = 0
) -> bytes:
    """A small PDF with one Helvetica text line per input line, made with pypdf; page
    number ``corrupt`` (from 1) has a Flate stream that will not decompress, page
    ``hex_page`` an ASCIIHex one without its end marker (pypdf warns, loses nothing)."""
    writer = PdfWriter()
    font = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
        }
    )
    font_ref = writer._add_object(font)
    for text in pages:
        page = writer.add_blank_page(612, 792)
        ops = ["BT", "/F1 12 Tf", "72 720 Td", "14 TL"]
        for line in text.split("\n"):
            escaped = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(f"({escaped}) Tj T*")
        ops.append("ET")
        stream = DecodedStreamObject()
        stream.set_data("\n".join(ops).encode("latin-1"))
        if corrupt == len(writer.pages):
            stream = StreamObject()
            stream.set_data(b"x\x9cBROKENBROKENBROK")
            stream[NameObject("/Filter")] = NameObject("/FlateDecode")
        elif hex_page == len(writer.pages):
            stream = StreamObject()
            stream.set_data("\n".join(ops).encode("latin-1").hex().encode())
            stream[NameObject("/Filter")] = NameObject("/ASCIIHexDecode")
        page[NameObject("/Contents")] = writer._add_object(stream)
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font_ref})}
        )
    if title:
        writer.add_metadata({"/Title": title})
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


HTML = """<!doctype html>
<html><head><title>Page  Title</title>
<style>body { color: red }</style><script>var secret = "script text";</script></head>
<body>
<nav><a href="/">Home</a> | <a href="/docs">Docs navigation</a></nav>
<div class="sphinxsidebar">Sidebar links</div>
<main>
<h1>Main heading<a class="headerlink" href="#x">¶</a></h1>
<p>First   paragraph with <code>inline code</code> and
<b>bold</b> words.</p>
<ul><li>apple</li><li>pear</li></ul>
<ol><li>one</li><li>two</li></ol>
<pre>def f():
    return 1</pre>
<table><tr><th>Name</th><th>Value</th></tr><tr><td>a</td><td>1</td></tr></table>
<h2>Second</h2>
<p>Last paragraph.<br>New line.</p>
<script>more_script()</script>
</main>
<footer role="contentinfo">Footer text</footer>
</body></html>
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "docs"
    (root / "guide").mkdir(parents=True)
    (root / "guide" / "intro.md").write_text("# Intro\n\nHello from markdown.\n")
    (root / "notes.txt").write_text("Plain text notes.\r\nSecond line.\r\n")
    (root / "manual.rst").write_text("Manual\n======\n\nSome rst text.\n")
    (root / "page.html").write_text(HTML)
    (root / "report.pdf").write_bytes(make_pdf(["Page one text", "Page two text"], "Report"))
    (root / "script.py").write_text("# a comment\nprint('code')\n")
    (root / "node_modules" / "pkg").mkdir(parents=True)
    (root / "node_modules" / "pkg" / "README.md").write_text("# vendored\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD.md").write_text("ref\n")
    return root


def documents(spec: SourceSpec, **kwargs: int) -> tuple[list[Document], list[LoadFailure]]:
    docs: list[Document] = []
    failures: list[LoadFailure] = []
    for item in iter_documents(spec, **kwargs):
        (failures if isinstance(item, LoadFailure) else docs).append(item)
    return docs, failures


# ---------------------------------------------------------------------------
# Sources, globs, discovery


def test_open_source_defaults(tree: Path) -> None:
    spec = open_source(tree)
    assert spec.root == tree.resolve()
    assert spec.name == "docs"
    assert spec.uri_prefix == "docs/"
    assert spec.include == DEFAULT_INCLUDE
    assert spec.exclude == DEFAULT_EXCLUDE


def test_open_source_names_a_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SourceNotFound) as info:
        open_source(missing)
    assert str(missing) in str(info.value)
    assert info.value.uri == str(missing)


def test_open_source_on_a_single_file(tree: Path) -> None:
    spec = open_source(tree / "manual.rst")
    assert [p.name for p in discover(spec)] == ["manual.rst"]
    assert uri_for(tree / "manual.rst", spec) == "docs/manual.rst"


def test_discover_is_sorted_and_skips_excluded_directories(tree: Path) -> None:
    spec = open_source(tree)
    rels = [p.relative_to(tree).as_posix() for p in discover(spec)]
    assert rels == ["guide/intro.md", "manual.rst", "notes.txt", "page.html", "report.pdf"]
    assert rels == sorted(rels)


def test_excluded_directories_are_not_descended(tree: Path) -> None:
    locked = tree / "node_modules" / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        docs, failures = documents(open_source(tree))
    finally:
        locked.chmod(0o755)
    assert failures == []  # an unreadable folder under an excluded one is never listed
    assert not any("node_modules" in d.uri for d in docs)


def test_virtualenvs_and_quarry_data_are_skipped_at_any_depth(tree: Path) -> None:
    for folder in (".venv/lib", "sub/.venv/lib", ".quarry", "sub/deeper/.quarry"):
        (tree / folder).mkdir(parents=True)
        (tree / folder / "README.md").write_text("# not documentation\n")
    rels = [p.relative_to(tree).as_posix() for p in discover(open_source(tree))]
    assert not any(".venv" in rel or ".quarry" in rel for rel in rels), rels
    assert "guide/intro.md" in rels


def test_include_globs_pick_source_code(tree: Path) -> None:
    spec = open_source(tree, include=("**/*.py",))
    docs, failures = documents(spec)
    assert failures == []
    assert [d.uri for d in docs] == ["docs/script.py"]
    assert docs[0].metadata["content_type"] == "text/x-python"
    assert docs[0].text == "# a comment\nprint('code')\n"


def test_globs_match_case_insensitively_and_at_any_depth(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "DEEP.MD").write_text("deep\n")
    (tmp_path / "top.md").write_text("top\n")
    (tmp_path / "skip.md").write_text("skip\n")
    spec = SourceSpec(tmp_path, include=("**/*.md",), exclude=("skip.md",), name="n")
    assert [uri_for(p, spec) for p in discover(spec)] == ["n/a/b/DEEP.MD", "n/top.md"]


# ---------------------------------------------------------------------------
# Each kind of file


def test_every_kind_loads_with_its_metadata(tree: Path) -> None:
    docs, failures = documents(open_source(tree))
    assert failures == []
    by_uri = {d.uri: d for d in docs}
    assert sorted(by_uri) == [
        "docs/guide/intro.md",
        "docs/manual.rst",
        "docs/notes.txt",
        "docs/page.html",
        "docs/report.pdf#page=1",
        "docs/report.pdf#page=2",
    ]
    for doc in docs:
        for key in ("uri", "title", "content_type", "mtime", "size"):
            assert key in doc.metadata, (doc.uri, key)
        assert doc.metadata["uri"] == doc.uri
        assert doc.metadata["title"] == doc.title
        assert doc.doc_id == doc_id_for(doc.uri)
    assert by_uri["docs/guide/intro.md"].title == "Intro"
    assert by_uri["docs/guide/intro.md"].metadata["content_type"] == "text/markdown"
    assert by_uri["docs/manual.rst"].title == "Manual"
    assert by_uri["docs/manual.rst"].metadata["content_type"] == "text/x-rst"
    assert by_uri["docs/notes.txt"].title == "notes"
    assert by_uri["docs/notes.txt"].metadata["size"] == len(
        b"Plain text notes.\r\nSecond line.\r\n"
    )
    assert by_uri["docs/page.html"].title == "Page Title"


def test_text_is_normalised_but_otherwise_exact(tmp_path: Path) -> None:
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfline one\r\nline two\rline three\n")
    [doc] = load_document(tmp_path / "bom.txt", open_source(tmp_path))
    assert doc.text == "line one\nline two\nline three\n"
    assert "encoding" not in doc.metadata


def test_pdf_keeps_page_numbers(tree: Path) -> None:
    spec = open_source(tree)
    pages = load_document(tree / "report.pdf", spec)
    assert [d.metadata["page"] for d in pages] == [1, 2]
    assert [d.metadata["page_count"] for d in pages] == [2, 2]
    assert [d.uri for d in pages] == ["docs/report.pdf#page=1", "docs/report.pdf#page=2"]
    assert "Page one text" in pages[0].text
    assert "Page two text" in pages[1].text
    assert {d.title for d in pages} == {"Report"}
    assert pages[0].metadata["content_type"] == "application/pdf"


@pytest.mark.parametrize("repeat", [1, 20], ids=["short", "long"])
def test_html_is_read_in_the_charset_it_declares(tmp_path: Path, repeat: int) -> None:
    # Review: a Latin-2 page that said so in <meta charset> was detected as Latin-6
    # ("Ģódž to miasto") or cp1250; browsers read what the page declares.
    body = "Zażółć gęślą jaźń. Łódź to miasto w Polsce. " * repeat
    for head in (
        '<meta charset="iso-8859-2">',
        '<meta http-equiv="Content-Type" content="text/html; charset=ISO-8859-2">',
    ):
        page = f"<html><head>{head}<title>Łódź</title></head><body><p>{body}</p></body></html>"
        (tmp_path / "pl.html").write_bytes(page.encode("iso8859_2"))
        [doc] = load_document(tmp_path / "pl.html", open_source(tmp_path))
        assert (doc.title, doc.metadata["encoding"]) == ("Łódź", "iso8859-2"), head
        assert "Łódź to miasto w Polsce" in doc.text
    # Review: only the page's own charset declaration counts (not a description that
    # mentions one, nor one commented out), and it is read as browsers read it.
    for head in (
        '<meta name="description" content="set charset=iso-8859-1">',
        '<!-- <meta charset="iso-8859-1"> -->',
    ):
        page = f"<html><head>{head}<meta charset=windows-1251><title>Тест</title></head>"
        (tmp_path / "ru.html").write_bytes(page.encode("cp1251") + "<p>Текст.</p>".encode("cp1251"))
        [doc] = load_document(tmp_path / "ru.html", open_source(tmp_path))
        assert doc.title == "Тест", head
    page = "<html><head><meta charset=gb2312><title>中文</title></head><p>测试 镕。</p>"
    (tmp_path / "zh.html").write_bytes(page.encode("gbk"))  # 镕 is GBK's, not GB2312's
    [doc] = load_document(tmp_path / "zh.html", open_source(tmp_path))
    assert "测试 镕" in doc.text
    # A page mislabelled (a template's utf-8, its text in cp1252) is read as detected.
    page = (
        f'<html><head><meta charset="utf-8"><title>Café</title></head><p>{"Déjà vu à côté. " * 9}'
    )
    (tmp_path / "fr.html").write_bytes(page.encode("cp1252"))
    [doc] = load_document(tmp_path / "fr.html", open_source(tmp_path))
    assert doc.title == "Café" and "Déjà vu" in doc.text
    # A page in UTF-8 that declares another charset is read as the UTF-8 it is.
    page = f'<html><head><meta charset="iso-8859-2"></head><body><p>{body}</p></body></html>'
    (tmp_path / "pl.html").write_bytes(page.encode("utf-8"))
    [doc] = load_document(tmp_path / "pl.html", open_source(tmp_path))
    assert "Łódź" in doc.text and "encoding" not in doc.metadata


def test_a_byte_order_mark_keeps_the_html_title_out_of_the_text(tmp_path: Path) -> None:
    # Review: the mark, left in, was text before <html> to the parser, which then put
    # the head's <title> in the body.
    page = "<!doctype html><html><head><title>My Page</title></head><body><p>Body text</p>"
    (tmp_path / "p.html").write_bytes(b"\xef\xbb\xbf" + page.encode())
    [doc] = load_document(tmp_path / "p.html", open_source(tmp_path))
    assert (doc.title, doc.text) == ("My Page", "Body text\n")


def test_an_html_title_falls_back_to_the_pages_first_h1_outside_main_too() -> None:
    html = "<body><header><h1>Real Page Title</h1></header><main><p>Words.</p></main></body>"
    assert html_to_text(html) == ("Real Page Title", "Words.\n")
    # Not one the text drops (review: "Menu", "Cookie settings", "Related posts").
    for dropped in (
        "<nav><h1>Menu</h1></nav>",
        "<div hidden><h1>Cookies</h1></div>",
        "<aside><h1>Related</h1></aside>",
        '<h1 style="display:none">S</h1>',
    ):
        html = f"<body>{dropped}<main><p>Words.</p></main></body>"
        assert html_to_text(html) == ("", "Words.\n"), dropped


def test_deeply_nested_html_lists_are_indented_only_so_far() -> None:
    # Review: two spaces per level without end made 76 KB of nested lists 16 MB of
    # text, nearly all spaces, which an ingest would have embedded.
    _, text = html_to_text("<ul><li>x" * 3000 + "</li></ul>" * 3000)
    lines = text.splitlines()
    assert len(lines) == 3000 and {line.strip() for line in lines} == {"- x"}
    assert max(len(line) for line in lines) == len("  " * 8 + "- x")


def test_html_keeps_title_and_main_text_only() -> None:
    title, text = html_to_text(HTML)
    assert title == "Page Title"
    assert "# Main heading\n" in text
    assert "First paragraph with inline code and bold words." in text
    assert "- apple\n- pear\n\n1. one\n2. two\n\n" in text  # two lists, a blank line apart
    assert "```\ndef f():\n    return 1\n```" in text
    assert "Name | Value" in text
    assert "a | 1" in text
    assert "## Second" in text
    assert "Last paragraph.\nNew line." in text
    for dropped in ("script text", "more_script", "color: red", "navigation", "Sidebar", "¶"):
        assert dropped not in text
    assert "Footer" not in text  # outside <main>


def test_html_without_main_uses_the_body() -> None:
    title, text = html_to_text(
        "<html><body><nav>menu</nav><h1>Only</h1><p>Body text.</p>"
        "<div role='navigation'>more menu</div></body></html>"
    )
    assert title == "Only"
    assert text == "# Only\n\nBody text.\n"


@pytest.mark.parametrize(
    ("html", "expected"),
    [
        (  # an article in a sidebar is not the page
            "<aside><article>Related: see also</article></aside>"
            "<div><h1>Install</h1><p>Run pip install it.</p></div>",
            "Run pip install it.",
        ),
        (  # two articles: both kept
            "<article><p>First post.</p></article><article><p>Second post.</p></article>",
            "Second post.",
        ),
        ("<main hidden>old text</main><div>Visible text.</div>", "Visible text."),
        ("<main></main><p>Text outside an empty main.</p>", "Text outside an empty main."),
    ],
)
def test_html_main_text_is_the_shown_main_content(html: str, expected: str) -> None:
    _title, text = html_to_text(f"<html><body>{html}</body></html>")
    assert expected in text
    assert "old text" not in text


def test_a_page_of_many_articles_keeps_them_all() -> None:
    articles = "".join(
        f"<article><p>Post {n}.</p><article><p>Reply {n}.</p></article></article>"
        for n in range(300)
    )
    _title, text = html_to_text(f"<html><body>{articles}</body></html>")
    assert "Post 0." in text and "Reply 299." in text


def test_an_empty_html_heading_or_item_does_not_mark_the_next_block() -> None:
    _title, text = html_to_text(
        '<html><body><h2><a id="install"></a></h2><p>Run the installer.</p>'
        "<ul><li><button>x</button></li></ul><p>An ordinary paragraph.</p></body></html>"
    )
    assert text == "Run the installer.\n\nAn ordinary paragraph.\n"


_PYGMENTS_LINENOS_TABLE = (
    '<div class="highlight"><table class="highlighttable"><tr><td class="linenos">'
    '<div class="linenodiv"><pre><span class="normal">1</span>\n'
    '<span class="normal">2</span></pre></div></td><td class="code"><div><pre><span></span>'
    '<span class="k">def</span><span class="w"> </span><span class="nf">main</span>'
    '<span class="p">():</span>\n    <span class="k">return</span> <span class="mi">1</span>\n'
    "</pre></div></td></tr></table></div>"
)


@pytest.mark.parametrize(
    ("html", "expected"),
    [
        # Code keeps its lines, however the page breaks them; line numbers are dropped.
        ("<pre>make build<br>make test</pre>", "```\nmake build\nmake test\n```\n"),
        ("<pre><div>SELECT *</div><div>FROM users</div></pre>", "```\nSELECT *\nFROM users\n```\n"),
        (_PYGMENTS_LINENOS_TABLE, "```\ndef main():\n    return 1\n```\n"),
        (
            '<pre><span class="linenos">1</span>x = 1\n<span class="linenos">2</span>y = 2</pre>',
            "```\nx = 1\ny = 2\n```\n",
        ),
        # Inline elements in a table cell are part of its words, blocks separate them.
        (
            '<table><tr><td><code>len</code>()</td><td>the <em>len</em>gth of <a href="#">x</a>s'
            "</td></tr><tr><td><p>a</p><p>b</p></td><td>c</td></tr></table>",
            "len() | the length of xs\n\na b | c\n",
        ),
        # Paragraph text that reads as markdown structure stays text.
        (
            "<h2>Growth</h2><p># of users grew.</p><p><code>```</code> opens a fence.</p>"
            "<p>Title<br>=====</p><ul><li># one</li></ul>",
            "## Growth\n\n\\# of users grew.\n\n\\``` opens a fence.\n\nTitle\n\\=====\n\n- # one\n",
        ),
        ('<p style="color: red; display:none">hidden</p><p>shown</p>', "shown\n"),
    ],
)
def test_html_text_keeps_what_the_page_shows(html: str, expected: str) -> None:
    _title, text = html_to_text(f"<html><body><main>{html}</main></body></html>")
    assert text == expected


def test_a_page_without_main_drops_its_banner_footer_and_sidebar() -> None:
    html = (
        "<html><body><header>ACME HEADER <a href='/'>Home</a></header><h1>Post</h1>"
        "<p>Body text.</p><section><header>Section head</header><p>In section.</p>"
        "<footer>Section foot</footer></section><aside>Sidebar</aside>"
        "<footer>FOOTER COPYRIGHT</footer></body></html>"
    )
    assert html_to_text(html)[1] == (
        "# Post\n\nBody text.\n\nSection head\n\nIn section.\n\nSection foot\n"
    )
    # A page header that holds the page's heading is its start, not a banner.
    kept = "<html><body><header><h1>My Post</h1></header><p>Body.</p><footer>(c)</footer></body></html>"
    assert html_to_text(kept)[1] == "# My Post\n\nBody.\n"
    # A page that is nothing but furniture is still read.
    assert (
        html_to_text("<html><body><footer>Only this.</footer></body></html>")[1] == "Only this.\n"
    )


def test_html_lists_are_tight_nested_and_numbered_from_their_start() -> None:
    html = (
        "<p>Intro</p><ul><li>a<ul><li>a1</li><li>a2<ol start='4'><li>x</li><li>y</li></ol>"
        "</li></ul></li><li>b</li></ul><ol start='3'><li>three</li></ol><p>After.</p>"
    )
    _title, text = html_to_text(f"<html><body><main>{html}</main></body></html>")
    assert text == "Intro\n\n- a\n  - a1\n  - a2\n    4. x\n    5. y\n- b\n\n3. three\n\nAfter.\n"
    # A start that is no ASCII number counts from 1 (int() refuses "²", isdigit() not).
    for start in ("²", "x", "-2", "99999999999"):
        odd = f"<html><body><main><ol start='{start}'><li>one</li></ol></main></body></html>"
        assert html_to_text(odd)[1] == "1. one\n"
    # Each item is still a unit the chunker may cut before.
    headings = [c.headings for c in Chunker(4, 0).chunk_text(text)]
    assert headings and all(h == () for h in headings)


def test_an_inline_svg_title_is_not_the_page_title() -> None:
    html = (
        "<html><head></head><body><header><svg><title>Company logo</title></svg></header>"
        "<main><h1>Real title</h1><p>Text.</p></main></body></html>"
    )
    assert html_to_text(html) == ("Real title", "# Real title\n\nText.\n")


@pytest.mark.parametrize(
    ("markdown", "title"),
    [
        ("---\ntitle: Real Title\ndate: 2024-01-01\n---\n\n## Usage\n", "Real Title"),
        ("---\ndate: 2024-01-01\n---\n\n## Usage\n", "Usage"),
        ("- first item\n---\n\n## After\n", "After"),
        ("1. numbered\n=====\n", ""),
        ("````\n```\n# Not a title\n````\n# Title\n", "Title"),
        ("---\ntitle: >-\n  Folded\n---\n\n# Heading\n", "Heading"),
        ('---\ntitle: "Quoted" # a comment\n---\n', "Quoted"),
        ("---\ntitle: Plain # a comment\n---\n", "Plain"),
        # As the chunker reads them: a rule then a blank line is no front matter, and a
        # heading in an HTML comment is none (one never closed hides nothing).
        ("---\n\n# Slide one\n\n---\n\n# Slide two\n", "Slide one"),
        ("<!--\n# Old\n-->\n# New\n", "New"),
        ("<!-- x -->\n## Sub\n", "Sub"),
        ("<!-- never closed\n# Kept\n", "Kept"),
    ],
)
def test_markdown_titles_skip_front_matter_lists_and_fences(markdown: str, title: str) -> None:
    assert _markup_title(markdown, rst=False) == title


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("main.tf", "text/x-hcl"),
        ("analysis.R", "text/x-r"),
        ("app.ini", "text/x-ini"),
        ("nginx.conf", "text/x-config"),
        ("Dockerfile", "text/x-dockerfile"),
        ("Dockerfile.dev", "text/x-dockerfile"),
        ("Makefile", "text/x-makefile"),
        ("CMakeLists.txt", "text/x-cmake"),
        ("Makefile.am", "text/x-makefile"),
        (".env", "text/x-config"),
        (".env.local", "text/x-config"),
        ("prod.env", "text/x-config"),
        ("notes.txt", "text/plain"),
        ("makefile.txt", "text/plain"),
    ],
)
def test_config_and_build_files_are_code_whose_comments_are_no_headings(
    tmp_path: Path, name: str, content_type: str
) -> None:
    # A "# comment" in these is not a heading: each would start a chunk and a breadcrumb.
    path = tmp_path / name
    path.write_text("# Web server\nport = 80\n\n  # Tags for billing\ntags = 1\n")
    [doc] = load_path(path)
    assert doc.metadata["content_type"] == content_type
    headings = {h for chunk in Chunker(8, 0).chunk(doc) for h in chunk.headings}
    assert headings == (
        set() if content_type != "text/plain" else {"Web server", "Tags for billing"}
    )


def test_load_path_reads_any_single_file_as_text(tmp_path: Path) -> None:
    source = tmp_path / "tool.go"
    source.write_text("package main\n\nfunc main() {}\n")
    [doc] = load_path(source)
    assert doc.uri == f"{tmp_path.name}/tool.go"
    assert doc.text == "package main\n\nfunc main() {}\n"
    assert doc.metadata["content_type"] == "text/x-go"
    with pytest.raises(SourceNotFound):
        load_path(tmp_path / "missing.md")
    with pytest.raises(UnreadableDocument):
        load_path(tmp_path)


def test_touching_a_file_keeps_its_hash(tree: Path) -> None:
    spec = open_source(tree)
    path = tree / "notes.txt"
    [before] = load_document(path, spec)
    os.utime(path, (1_000_000_000, 1_000_000_000))
    [after] = load_document(path, spec)
    assert after.metadata["mtime"] != before.metadata["mtime"]
    assert after.doc_hash == before.doc_hash
    path.write_text("Changed.\n")
    [changed] = load_document(path, spec)
    assert changed.doc_hash != before.doc_hash


# ---------------------------------------------------------------------------
# Broken and unwelcome files: reported, never fatal


def test_truncated_pdf_is_reported_and_the_run_goes_on(tree: Path) -> None:
    good = make_pdf(["Some text"])
    (tree / "broken.pdf").write_bytes(good[: len(good) // 2])
    docs, failures = documents(open_source(tree))
    assert [f.uri for f in failures] == ["docs/broken.pdf"]
    assert "broken PDF" in failures[0].error
    assert len(docs) == 6  # every other file still loaded


def test_a_pdf_page_that_will_not_decompress_fails_the_file_naming_the_page(tree: Path) -> None:
    # Review: pypdf logs the zlib error and goes on, so the page read as empty; a sync
    # then deleted what the index held of it, reporting nothing.
    (tree / "torn.pdf").write_bytes(make_pdf(["Page one text", "Page two", "Three"], corrupt=2))
    docs, failures = documents(open_source(tree))
    assert [f.uri for f in failures] == ["docs/torn.pdf"]
    assert "broken PDF (page 2: Error -3 while decompressing" in failures[0].error
    assert len(docs) == 6
    # Said however quiet the logging is made (Prefect's PREFECT_LOGGING_ROOT_LEVEL).
    root, filters = logging.getLogger(), logging.getLogger("pypdf.filters")
    levels = root.level, filters.level
    try:
        root.setLevel(logging.ERROR)
        filters.setLevel(logging.NOTSET)
        assert [f.uri for f in documents(open_source(tree))[1]] == ["docs/torn.pdf"]
    finally:
        root.setLevel(levels[0])
        filters.setLevel(levels[1])
    # The handler is the load's alone: a good PDF afterwards reads as ever, and so does
    # one pypdf warns about without losing anything (review: it failed as broken).
    (tree / "torn.pdf").write_bytes(make_pdf(["Page one text", "Page two", "Three"], hex_page=2))
    docs, failures = documents(open_source(tree))
    assert failures == [] and len(docs) == 9
    assert "Page two" in {d.text.strip() for d in docs}


def test_pdf_cut_anywhere_never_raises_anything_else(tmp_path: Path) -> None:
    good = make_pdf(["Some text", "More text"])
    spec = open_source(tmp_path)
    for cut in range(0, len(good), max(1, len(good) // 25)):
        (tmp_path / "cut.pdf").write_bytes(good[:cut])
        items = list(iter_documents(spec))
        assert all(isinstance(i, Document | LoadFailure) for i in items)


def test_invalid_utf8_is_decoded_by_detection_and_says_so(tmp_path: Path) -> None:
    text = "Le café est très chaud, à côté de la fenêtre. " * 4
    (tmp_path / "latin.txt").write_bytes(text.encode("cp1252"))
    [doc] = load_document(tmp_path / "latin.txt", open_source(tmp_path))
    assert doc.text == text
    assert doc.metadata["encoding"] in {"cp1252", "latin_1", "iso8859_15", "cp1250"}


@pytest.mark.parametrize("text", ["Ångström", "São Paulo ação", "Zürich, Ørsted & Ærø\n"])
def test_short_latin1_text_is_not_read_as_a_cjk_encoding(tmp_path: Path, text: str) -> None:
    # Detection alone calls these Big5 or UTF-16: two accented letters look like one CJK character.
    (tmp_path / "short.txt").write_bytes(text.encode("latin-1"))
    [doc] = load_document(tmp_path / "short.txt", open_source(tmp_path))
    assert doc.text == text
    assert doc.metadata["encoding"] == "cp1252"


@pytest.mark.parametrize(
    "text",
    [
        "Price list:\n- Coffee €2.50\n- Tea €2.00\n",  # detection alone: cp437, "Ç2.50"
        # Detection alone: cp775, "¢ Q3 budget is Ć12,000".
        "Meeting notes – Q3 budget is €12,000; travel €3,500.\nNext review in October.\n",
        # Detection alone: latin_1, with U+0097 (a C1 control) where browsers show a dash.
        '<html><head><meta charset="iso-8859-1"><title>Café menu</title></head><body><main>'
        "<p>Crème brûlée — naïve</p></main></body></html>",
    ],
)
def test_cp1252_symbols_are_not_read_as_a_dos_code_page_or_latin1_controls(
    tmp_path: Path, text: str
) -> None:
    (tmp_path / "prices.txt").write_bytes(text.encode("cp1252"))
    [doc] = load_document(tmp_path / "prices.txt", open_source(tmp_path))
    assert doc.text == text
    assert doc.metadata["encoding"] == "cp1252"


@pytest.mark.parametrize(
    ("text", "encoding"),
    [
        ("Résumé: naïve façade, élève très sûr.\n", "cp437"),
        ("Crème brûlée and café au lait, très bien.", "cp850"),
        ("Ça marche, déjà vu à côté.", "cp437"),
    ],
)
def test_dos_code_page_text_with_accented_letters_is_not_taken_for_cp1252(
    tmp_path: Path, text: str, encoding: str
) -> None:
    # Review: read as cp1252, these are "R‚sum‚" and "CrŠme br–l‚e"; a byte of 0x80-0x9F
    # inside a word is a DOS letter, not cp1252's punctuation.
    (tmp_path / "dos.txt").write_bytes(text.encode(encoding))
    [doc] = load_document(tmp_path / "dos.txt", open_source(tmp_path))
    assert doc.text == text


@pytest.mark.parametrize(
    ("text", "encoding"),
    [
        ("日本は東アジアに位置する島国で、首都は東京である。\n", "iso2022_jp"),
        ("Mail from 2003: 会議は明日の午後です。\n", "iso2022_jp"),
        ("한국어 텍스트입니다. 서울은 수도입니다.\n", "iso2022_kr"),
    ],
)
def test_iso2022_text_is_read_by_its_escape_sequences(
    tmp_path: Path, text: str, encoding: str
) -> None:
    # 7-bit, so it decoded as UTF-8: escape sequences and ASCII letters were indexed.
    (tmp_path / "mail.txt").write_bytes(text.encode(encoding))
    [doc] = load_document(tmp_path / "mail.txt", open_source(tmp_path))
    assert doc.text == text
    assert doc.metadata["encoding"] == encoding


def test_greek_iso_8859_7_keeps_its_accented_capitals(tmp_path: Path) -> None:
    # Detected as cp1253, which has the pilcrow where ISO-8859-7 has Ά: "¶λλες".
    text = (
        "Η Θεσσαλονίκη είναι η δεύτερη. Άλλες σημαντικές πόλεις είναι η Πάτρα, το "
        "Ηράκλειο και η Λάρισα. Ο Όλυμπος είναι το ψηλότερο βουνό της Ελλάδας.\n"
    )
    for encoding in ("iso8859_7", "cp1253"):
        (tmp_path / "el.txt").write_bytes(text.encode(encoding))
        [doc] = load_document(tmp_path / "el.txt", open_source(tmp_path))
        assert doc.text == text, encoding


def test_html_ruby_readings_are_dropped() -> None:
    _, text = html_to_text(
        "<html><body><h2>日本語<ruby>漢字<rp>(</rp><rt>かんじ</rt><rp>)</rp></ruby>見出し</h2>"
        "<p><ruby>東京<rt>とうきょう</rt></ruby>に住む</p></body></html>"
    )
    assert text == "## 日本語漢字見出し\n\n東京に住む\n"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_text_with_a_wide_byte_order_mark_is_read_by_it(tmp_path: Path, encoding: str) -> None:
    text = "Hello world, a note saved by Notepad.\n"
    data = text.encode(encoding)
    if encoding == "utf-16-be":
        data = b"\xfe\xff" + data
    (tmp_path / "note.txt").write_bytes(data)
    [doc] = load_document(tmp_path / "note.txt", open_source(tmp_path))
    assert doc.text == text


@pytest.mark.parametrize(
    ("text", "encoding"),
    [("Hello 你好 world", "big5"), ("The 中文 annex of the report", "big5")],
)
def test_mostly_ascii_cjk_text_keeps_its_detected_encoding(
    tmp_path: Path, text: str, encoding: str
) -> None:
    (tmp_path / "cjk.txt").write_bytes(text.encode(encoding))
    [doc] = load_document(tmp_path / "cjk.txt", open_source(tmp_path))
    assert doc.text == text


def test_undecodable_text_is_reported_with_what_was_tried(tmp_path: Path) -> None:
    garbage = bytes(range(0x80, 0x100)) * 40 + b"\xc3\x28\xa0\xa1\xe2\x28\xa1\xf0\x28\x8c\xbc"
    (tmp_path / "bad.md").write_bytes(garbage)
    [failure] = list(iter_documents(open_source(tmp_path)))
    assert isinstance(failure, LoadFailure)
    assert failure.uri == f"{tmp_path.name}/bad.md"
    assert "utf-8" in failure.error
    assert "utf-8-sig" in failure.error
    assert "detect" in failure.error


@pytest.mark.parametrize(
    ("head", "stray", "tail"),
    [
        ("The \u201cquarterly\u201d report\u2019s figures. " * 20, b"10\x9620", "\u2013"),
        ("Die Gr\u00f6\u00dfe f\u00fcr M\u00fcnchen ist sch\u00f6n. " * 20, b"Stra\xdfe", "\u00df"),
        ("Le caf\u00e9 \u00e0 c\u00f4t\u00e9 de l\u2019h\u00f4tel. " * 20, b"d\xe9j\xe0", "\u00e9"),
    ],
)
def test_utf8_text_with_a_few_stray_legacy_bytes_stays_utf8(
    tmp_path: Path, head: str, stray: bytes, tail: str
) -> None:
    # One cp1252/latin-1 byte pasted into a UTF-8 file must not turn the whole file into
    # mojibake (detection picked mac_iceland, cp1250) or fail it ("nothing plausible").
    (tmp_path / "mixed.txt").write_bytes(head.encode() + stray)
    [doc] = load_document(tmp_path / "mixed.txt", open_source(tmp_path))
    assert doc.text.startswith(head)
    assert tail in doc.text[len(head) :]
    assert doc.metadata["encoding"] == "utf-8+cp1252"


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
@pytest.mark.parametrize(
    "text",
    [
        "Exported by a tool that writes no byte order mark.\n" * 3,
        "Москва - столица России. Moscow is the capital.\n",  # i18n trial: "binary"
        "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.\n",
    ],
    ids=["ascii", "cyrillic", "greek"],
)
def test_utf16_text_without_a_byte_order_mark_is_not_binary(
    tmp_path: Path, encoding: str, text: str
) -> None:
    (tmp_path / "export.txt").write_bytes(text.encode(encoding))
    [doc] = load_document(tmp_path / "export.txt", open_source(tmp_path))
    assert doc.text == text


def test_bomless_ascii_utf16_with_control_characters_is_still_text(tmp_path: Path) -> None:
    # Review: a colourised log exported as UTF-16 became "binary" with the one-script rule.
    text = "\x1b[31merror\x1b[0m: disk full\n" * 20
    (tmp_path / "log.txt").write_bytes(text.encode("utf-16-le"))
    [doc] = load_document(tmp_path / "log.txt", open_source(tmp_path))
    assert doc.text == text


def test_iso2022_text_with_nul_bytes_is_binary(tmp_path: Path) -> None:
    (tmp_path / "odd.txt").write_bytes(b"\x1b$B\x1b(Bhello\x00\x00world")
    [failure] = list(iter_documents(open_source(tmp_path)))
    assert isinstance(failure, LoadFailure) and "binary" in failure.error


def test_a_declared_utf16_encoding_reads_cjk_text_that_has_nul_bytes(tmp_path: Path) -> None:
    # Review: the NUL sniff ran first, so --encoding utf-16-le could not read it.
    text = "東京は日本の首都です。 大阪は西にあります。\n" * 40
    (tmp_path / "jp.txt").write_bytes(text.encode("utf-16-le"))
    [doc] = load_document(tmp_path / "jp.txt", open_source(tmp_path, encoding="UTF-16-LE"))
    assert (doc.text, doc.metadata["encoding"]) == (text, "utf_16_le")


@pytest.mark.parametrize("encoding", ["UTF-16", "utf-16-le", "UTF-32"])
@pytest.mark.parametrize("text", ["# Title\n\nHello world. This is a doc.\n", "Grüße, ça va?\n"])
def test_a_declared_utf16_encoding_leaves_the_sources_utf8_files_utf8(
    tmp_path: Path, encoding: str, text: str
) -> None:
    # Nightly trial: --encoding utf-16 on a mixed folder read every UTF-8 file of even
    # length as UTF-16 nonsense (and those of odd length failed), replacing good vectors.
    (tmp_path / "a.md").write_text(text, encoding="utf-8")
    (tmp_path / "wide.txt").write_bytes(text.encode(encoding.lower().replace("-", "_")))
    source = open_source(tmp_path, encoding=encoding)
    [doc] = load_document(tmp_path / "a.md", source)
    assert doc.text.strip() == text.strip() and "encoding" not in doc.metadata
    [wide] = load_document(tmp_path / "wide.txt", source)
    assert wide.text.lstrip("\ufeff") == text
    # Review: a legacy file of the folder (even length, no NUL) still read as UTF-16.
    legacy = "Résumé: café, naïve, déjà vu.\n"
    (tmp_path / "legacy.txt").write_bytes(legacy.encode("cp1252"))
    [old] = load_document(tmp_path / "legacy.txt", source)
    assert old.text == legacy


@pytest.mark.parametrize("name", ["undefined", "unicode_escape", "idna", "klingon", "rot13"])
def test_an_encoding_that_is_no_character_set_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"not a text encoding|unknown encoding"):
        open_source(Path("."), encoding=name)


def test_a_declared_encoding_takes_the_name_detection_reports(tmp_path: Path) -> None:
    # Review: ISO-8859-7 declared was "iso8859-7", detected "iso8859_7": the same file's
    # indexed metadata, and so its hash, changed with the way it was read.
    assert open_source(tmp_path, encoding="ISO-8859-7").encoding == "iso8859_7"
    assert open_source(tmp_path, encoding="koi8-r").encoding == "koi8_r"


def test_binary_data_with_nul_bytes_is_not_taken_for_utf16(tmp_path: Path) -> None:
    import random

    rng = random.Random(7)
    for n in range(50):
        data = bytes(rng.randrange(256) for _ in range(2 * rng.randrange(8, 400)))
        (tmp_path / f"blob{n}.txt").write_bytes(data[:3] + b"\x00" + data[4:])
    found = list(iter_documents(open_source(tmp_path)))
    assert len(found) == 50
    assert all(isinstance(f, LoadFailure) and "binary" in f.error for f in found)


def test_nul_bytes_past_the_first_8_kib_are_binary_too(tmp_path: Path) -> None:
    (tmp_path / "log.txt").write_bytes(b"a" * 9000 + b"\x00\x01\x02 tail")
    [failure] = list(iter_documents(open_source(tmp_path)))
    assert isinstance(failure, LoadFailure)
    assert "binary" in failure.error


def test_a_folder_swapped_for_a_symlink_out_after_the_walk_is_not_read(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "a.md").write_text("# inside\n")
    (outside / "a.md").write_text("# outside secret\n")
    spec = open_source(root)
    listing = list_source(spec)
    (root / "sub" / "a.md").unlink()
    (root / "sub").rmdir()
    (root / "sub").symlink_to(outside)
    [failure] = list(iter_documents(spec, listing=listing))
    assert isinstance(failure, LoadFailure)
    assert "symlink" in failure.error


def test_binary_file_is_skipped_and_reported(tmp_path: Path) -> None:
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(200))
    [failure] = list(iter_documents(open_source(tmp_path)))
    assert isinstance(failure, LoadFailure)
    assert "binary" in failure.error


def test_file_over_the_size_limit_is_reported(tmp_path: Path) -> None:
    (tmp_path / "big.md").write_text("x" * 2000)
    (tmp_path / "small.md").write_text("small\n")
    docs, failures = documents(open_source(tmp_path), max_file_bytes=1000)
    assert [d.uri for d in docs] == [f"{tmp_path.name}/small.md"]
    assert [f.uri for f in failures] == [f"{tmp_path.name}/big.md"]
    assert "2000 bytes" in failures[0].error
    assert "QUARRY_MAX_FILE_BYTES" in failures[0].error


def test_empty_files_give_no_document_and_no_failure(tmp_path: Path) -> None:
    for name in ("empty.md", "empty.txt", "empty.html", "empty.pdf", "blank.rst"):
        (tmp_path / name).write_bytes(b"" if name != "blank.rst" else b" \n\n\t\n")
    spec = open_source(tmp_path)
    assert list(iter_documents(spec)) == []
    assert load_document(tmp_path / "empty.md", spec) == []


def test_pdf_without_text_is_reported(tmp_path: Path) -> None:
    writer = PdfWriter()
    writer.add_blank_page(612, 792)
    buffer = io.BytesIO()
    writer.write(buffer)
    (tmp_path / "scan.pdf").write_bytes(buffer.getvalue())
    [failure] = list(iter_documents(open_source(tmp_path)))
    assert isinstance(failure, LoadFailure)
    assert "no extractable text" in failure.error


def _root_with_links(tmp_path: Path) -> Path:
    """``root/``: ``real.md``, and links to it (``inside.md``), to a file outside
    (``leak.md``, "Do not index") and to the folder outside (``leakdir``)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.md").write_text("# Secret\n\nDo not index.\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / "real.md").write_text("# Real\n")
    (root / "leak.md").symlink_to(outside / "secret.md")
    (root / "leakdir").symlink_to(outside, target_is_directory=True)
    (root / "inside.md").symlink_to(root / "real.md")
    return root


def test_symlink_out_of_the_root_is_not_followed(tmp_path: Path) -> None:
    root = _root_with_links(tmp_path)
    spec = open_source(root)
    # The link inside leads to a file indexed anyway: once, under its own name.
    assert [p.name for p in discover(spec)] == ["real.md"]
    docs, failures = documents(spec)
    assert sorted(d.uri for d in docs) == ["root/real.md"]
    assert sorted(f.uri for f in failures) == ["root/leak.md", "root/leakdir"]
    assert all("outside the source root" in f.error for f in failures)
    assert not any("Do not index" in d.text for d in docs)
    with pytest.raises(UnreadableDocument, match="outside the source root"):
        load_document(root / "leak.md", spec)


def test_a_symlink_out_of_its_folder_given_by_name_is_reported_as_a_walk_reports_it(
    tmp_path: Path,
) -> None:
    # Nightly trial: `quarry ingest root/*.md` indexed the link's target as a source
    # of its own ('outside'), which a walk of root/ refuses to follow.
    root = _root_with_links(tmp_path)
    leak = open_source(root / "leak.md")
    assert leak.name == "root"
    docs, failures = documents(leak)
    assert docs == [] and [f.uri for f in failures] == ["root/leak.md"]
    assert "outside the source root" in failures[0].error
    # A link within its folder is the file it leads to, as before.
    inside = open_source(root / "inside.md")
    assert [d.uri for d in documents(inside)[0]] == ["root/real.md"]


def test_broken_symlink_is_reported(tmp_path: Path) -> None:
    (tmp_path / "gone.md").symlink_to(tmp_path / "missing.md")
    [failure] = list(iter_documents(open_source(tmp_path)))
    assert isinstance(failure, LoadFailure)
    assert "broken symlink" in failure.error


def test_symlink_loop_inside_the_root_terminates(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "doc.md").write_text("# Doc\n")
    (tmp_path / "a" / "loop").symlink_to(tmp_path / "a", target_is_directory=True)
    paths = [p.relative_to(tmp_path).as_posix() for p in discover(open_source(tmp_path))]
    assert paths == ["a/doc.md"]
    # ... and is not a failure (a `latest -> .` link is common and harmless): its
    # files are indexed once, a link to the root itself too.
    (tmp_path / "a" / "up").symlink_to("..", target_is_directory=True)
    docs, failures = documents(open_source(tmp_path))
    assert [d.uri for d in docs] == [f"{tmp_path.name}/a/doc.md"] and failures == []


def test_a_file_symlink_loop_is_reported_and_the_rest_loaded(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\nText.\n")
    (tmp_path / "self.md").symlink_to("self.md")
    (tmp_path / "b.md").symlink_to("c.md")
    (tmp_path / "c.md").symlink_to("b.md")
    docs, failures = documents(open_source(tmp_path))
    name = tmp_path.name
    assert [d.uri for d in docs] == [f"{name}/a.md"]
    assert sorted(f.uri for f in failures) == [f"{name}/{n}" for n in ("b.md", "c.md", "self.md")]
    assert all("symlink loop" in f.error for f in failures)


def test_a_link_to_an_excluded_file_is_excluded_one_to_an_unpicked_file_is_followed(
    tmp_path: Path,
) -> None:
    root = write_corpus(
        tmp_path / "root",
        {"private/secret.md": "# Secret", "notes/plan.txt.bak": "The plan.", "a.md": "# A"},
    )
    (root / "readme.md").symlink_to(root / "private" / "secret.md")
    (root / "plan.md").symlink_to(root / "notes" / "plan.txt.bak")
    spec = open_source(root, exclude=(*DEFAULT_EXCLUDE, "private/**"))
    docs, failures = documents(spec)
    assert sorted(d.uri for d in docs) == ["root/a.md", "root/plan.md"]
    assert failures == []


def test_fifos_are_reported_not_read_even_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\nText.\n")
    os.mkfifo(tmp_path / "pipe.md")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link.md").symlink_to("pipe")
    # Opening a FIFO blocks until a writer comes: the walk must not hand one to the loader.
    docs, failures = documents(open_source(tmp_path))
    assert [d.uri for d in docs] == [f"{tmp_path.name}/a.md"]
    assert sorted(f.uri.rsplit("/", 1)[1] for f in failures) == ["link.md", "pipe.md"]
    assert all("not a regular file" in f.error for f in failures)


@pytest.mark.parametrize(
    ("glob", "name", "matches"),
    [("[]]", "]", True), ("[!]]", "a", True), ("[!]]", "]", False), ("[[]x.md", "[x.md", True)],
)
def test_globs_read_brackets_as_fnmatch_does(glob: str, name: str, matches: bool) -> None:
    assert SourceSpec(Path("/"), (glob,), ()).includes(name) is matches
    assert fnmatch.fnmatchcase(name, glob) is matches


def test_an_unusable_glob_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[z-a\]"):
        open_source(tmp_path, include=("[z-a].md",))


def test_a_pdf_padded_after_its_end_marker_loads(tmp_path: Path) -> None:
    (tmp_path / "padded.pdf").write_bytes(make_pdf(["Padded text"]) + b" " * 70_000 + b"\n")
    docs, failures = documents(open_source(tmp_path))
    assert failures == []
    assert "Padded text" in docs[0].text


def test_a_pdf_word_broken_at_a_line_end_is_joined(tmp_path: Path) -> None:
    lines = [
        "The quarry was an exam-",
        "ple of stone work, a well-",
        "known site near Jean-",
        "Pierre Roux's farm: a well-known place.",
        "Costs rose 10-",
        "20 percent in the cen-",
        "tury's first year.",
    ]
    (tmp_path / "broken.pdf").write_bytes(make_pdf(["\n".join(lines)]))
    [doc], failures = documents(open_source(tmp_path))
    assert failures == []
    text = doc.text
    assert "an example of stone work" in text
    assert "a well-known site" in text  # written with its hyphen elsewhere in the page
    assert "Jean-\nPierre" in text  # a capital starts the next line: a name, kept
    assert "10-\n20" in text  # a range of numbers, kept
    assert "in the century’s first year" in text


@pytest.mark.parametrize(
    ("text", "joined"),
    [
        ("exam-\nple", "example"),
        ("exam- \n  ple", "example"),
        ("soft\u00ad\nhyphen", "softhyphen"),
        ("exam\u2010\nple", "example"),
        ("a co-\nop and a co-op", "a co-op and a co-op"),
        ("Jean-\nPierre", "Jean-\nPierre"),
        ("10-\n20", "10-\n20"),
        ("ends with-\n", "ends with-\n"),
        ("a -\nb", "a -\nb"),
        ("no break-here", "no break-here"),
    ],
)
def test_join_hyphenated_lines(text: str, joined: str) -> None:
    assert join_hyphenated_lines(text) == joined


def _swap_after_the_walk(
    monkeypatch: pytest.MonkeyPatch, root: Path, swap: Callable[[Path], None]
) -> Path:
    """``root`` with a.md and b.md, b.md swapped by ``swap`` once the walk has listed it."""
    import quarry.sources as sources

    root.mkdir(exist_ok=True)
    (root / "a.md").write_text("# A\n\nfine\n")
    victim = root / "b.md"
    victim.write_text("# B\n\nfine\n")
    walk = sources._walk

    def walk_then_swap(spec: SourceSpec) -> Iterator[object]:
        listed = list(walk(spec))
        victim.unlink()
        swap(victim)
        yield from listed

    monkeypatch.setattr(sources, "_walk", walk_then_swap)
    return victim


def test_file_swapped_for_a_symlink_after_the_walk_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside.md"
    outside.write_text("# Secret\n\nDo not index.\n")
    root = tmp_path / "root"
    _swap_after_the_walk(monkeypatch, root, lambda victim: victim.symlink_to(outside))
    items = list(iter_documents(open_source(root)))
    assert [d.uri for d in items if not isinstance(d, LoadFailure)] == ["root/a.md"]
    [failure] = [f for f in items if isinstance(f, LoadFailure)]
    assert failure.uri == "root/b.md" and "symlink" in failure.error


def test_file_swapped_for_a_fifo_after_the_walk_is_reported_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    victim = _swap_after_the_walk(monkeypatch, tmp_path, os.mkfifo)
    items: list[object] = []
    # A blocking open would wait for a writer forever: run it where the test can give up.
    reader = threading.Thread(target=lambda: items.extend(iter_documents(open_source(tmp_path))))
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        with open(victim, "wb"):  # release the reader so the test process can exit
            pass
        pytest.fail("the loader waited for a writer on a FIFO")
    assert [d.uri for d in items if isinstance(d, Document)] == [f"{tmp_path.name}/a.md"]
    [failure] = [f for f in items if isinstance(f, LoadFailure)]
    assert failure.uri == f"{tmp_path.name}/b.md" and "not a regular file" in failure.error


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_file_longer_than_its_stat_size_is_read_whole() -> None:
    # /proc files stat as 0 bytes; the loader reads what fstat reports, then on to the end.
    from quarry.sources import _load_file

    documents = _load_file(
        Path("/proc/self/status"),
        "proc/status.txt",
        name=Path("status.txt"),
        max_file_bytes=1_000_000,
    )
    assert len(documents) == 1
    assert "Pid:" in documents[0].text
    assert len(documents[0].text) > 100


def test_names_that_are_not_utf8_are_reported_and_the_rest_is_loaded(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    (root / "ok.md").write_text("# ok\n\nfine\n")
    raw = os.fsencode(root)
    with open(raw + b"/b\xe9d.md", "wb") as handle:
        handle.write(b"# bad name\n")
    os.mkdir(raw + b"/d\xe9r")
    with open(raw + b"/d\xe9r/in.md", "wb") as handle:
        handle.write(b"# inside\n")
    spec = open_source(root)
    items = list(iter_documents(spec))
    failures = {i.uri: i.error for i in items if isinstance(i, LoadFailure)}
    assert [d.uri for d in items if isinstance(d, Document)] == ["src/ok.md"]
    assert set(failures) == {"src/b\ufffdd.md", "src/d\ufffdr/"}
    assert "not valid UTF-8" in failures["src/b\ufffdd.md"]
    assert "rename" in failures["src/d\ufffdr/"]
    for uri in failures:  # every uri can be logged, stored and sent as JSON
        uri.encode("utf-8")
    # A folder it could not name counts as unlisted: nothing under it is deleted.
    _, unlisted = list_source(spec).still_there()
    assert unlisted == ("src/d\ufffdr/",)


def test_a_source_path_whose_name_is_not_utf8_is_refused_by_name(tmp_path: Path) -> None:
    raw = os.fsencode(tmp_path)
    with open(raw + b"/caf\xe9.md", "wb") as handle:
        handle.write(b"# menu\n")
    with pytest.raises(SourceNotFound, match="not valid UTF-8") as caught:
        open_source(os.fsdecode(raw + b"/caf\xe9.md"))
    str(caught.value).encode("utf-8")
    with pytest.raises(SourceNotFound, match="not valid UTF-8"):
        load_path(os.fsdecode(raw + b"/caf\xe9.md"))


def test_a_source_inside_another_is_refused_siblings_and_own_files_are_not(
    tmp_path: Path,
) -> None:
    from quarry.errors import ConfigError

    docs = write_corpus(tmp_path / "proj" / "docs", {"a.md": "a", "sub/b.md": "b"})
    other = write_corpus(tmp_path / "proj" / "other", {"c.md": "c"})
    refuse_overlapping_sources([open_source(docs), open_source(other)])
    refuse_overlapping_sources([open_source(docs), open_source(docs / "a.md")])
    with pytest.raises(ConfigError, match=r"inside the source .*docs: its files would be"):
        refuse_overlapping_sources([open_source(docs), open_source(docs / "sub")])
    with pytest.raises(ConfigError, match=r"b\.md is inside the source .*proj"):
        refuse_overlapping_sources([open_source(docs / "sub" / "b.md"), open_source(docs.parent)])
    # Inside the folder but never walked into by it: no overlap.
    deps = write_corpus(docs / "node_modules" / "pkg", {"r.md": "r"})
    refuse_overlapping_sources([open_source(docs), open_source(deps)])
    excluded = open_source(docs, exclude=(*DEFAULT_EXCLUDE, "sub/**"))
    refuse_overlapping_sources([excluded, open_source(docs / "sub")])
    refuse_overlapping_sources([excluded, open_source(docs / "sub" / "b.md")])
    top_level_only = open_source(docs, include=("*.md",))
    refuse_overlapping_sources([top_level_only, open_source(docs / "sub")])


def test_a_folder_link_to_an_excluded_folder_is_excluded_too(tmp_path: Path) -> None:
    root = write_corpus(
        tmp_path / "root",
        {"private/secret.md": "# Secret", "pub/private/x.md": "# X", "a.md": "# A"},
    )
    (root / "shared").symlink_to(root / "private", target_is_directory=True)
    (root / "mirror").symlink_to(root / "pub", target_is_directory=True)
    spec = open_source(root, exclude=(*DEFAULT_EXCLUDE, "private/**", "pub/private/**"))
    docs, failures = documents(spec)
    assert sorted(d.uri for d in docs) == ["root/a.md"]
    assert failures == []


def test_a_large_legacy_file_is_not_counted_byte_by_byte_in_memory() -> None:
    import tracemalloc

    from quarry.sources import _mostly_utf8

    data = ("Привет, это текст на русском языке. " * 60_000).encode("cp1251")  # ~2 MB
    tracemalloc.start()
    try:
        assert _mostly_utf8(data) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(data)  # a str per bad byte was ~70 bytes each


@pytest.mark.timeout(60)
def test_deeply_nested_articles_are_judged_once_each() -> None:
    # Walking up from every candidate was quadratic: 4,000 nested <article>s took 5 s,
    # 16,000 would take over a minute. The outermost article is the main text.
    depth = 16_000
    html = (
        "<html><head><title>Deep</title></head><body><nav>menu</nav>"
        + "<article>x" * depth
        + "</article>" * depth
        + "<aside>"
        + "<main>hidden</main>" * depth
        + "</aside></body></html>"
    )
    title, text = html_to_text(html)
    assert title == "Deep"
    assert text.count("x") == depth
    assert "menu" not in text and "hidden" not in text


def test_a_pdf_whose_pages_decompress_past_a_hundred_times_its_size_is_refused(
    tmp_path: Path,
) -> None:
    # 40 pages share one Flate stream of 0.5 MB of text operators: an 8 KB file that
    # pypdf would spend about 20 s extracting 5 million characters from.
    writer = PdfWriter()
    ops = "BT /F1 12 Tf 72 720 Td " + "(bomb text bomb text) Tj T* " * 18_000 + "ET"
    stream = DecodedStreamObject()
    stream.set_data(ops.encode("latin-1"))
    shared = writer._add_object(stream.flate_encode())
    for _ in range(40):
        page = writer.add_blank_page(612, 792)
        page[NameObject("/Contents")] = shared
    buffer = io.BytesIO()
    writer.write(buffer)
    assert len(buffer.getvalue()) < 20_000
    (tmp_path / "bomb.pdf").write_bytes(buffer.getvalue())
    with pytest.raises(UnreadableDocument, match="decompression bomb") as refused:
        load_document(tmp_path / "bomb.pdf", open_source(tmp_path))
    assert "bomb.pdf" in str(refused.value)


def test_a_pdf_page_that_draws_one_form_thousands_of_times_is_refused(tmp_path: Path) -> None:
    # A 1 KB page whose content is "/X0 Do" 2,000 times over a form of 2,000 text lines:
    # its own content stream is tiny, its text 76 million characters.
    from pypdf.generic import ArrayObject, NumberObject

    writer = PdfWriter()
    form = DecodedStreamObject()
    form.set_data(("BT /F1 12 Tf 72 720 Td " + "(bomb text) Tj T* " * 2000 + "ET").encode())
    form = form.flate_encode()
    form[NameObject("/Type")] = NameObject("/XObject")
    form[NameObject("/Subtype")] = NameObject("/Form")
    form[NameObject("/BBox")] = ArrayObject([NumberObject(n) for n in (0, 0, 612, 792)])
    font = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
        }
    )
    form[NameObject("/Resources")] = DictionaryObject(
        {NameObject("/Font"): DictionaryObject({NameObject("/F1"): writer._add_object(font)})}
    )
    page = writer.add_blank_page(612, 792)
    page[NameObject("/Resources")] = DictionaryObject(
        {NameObject("/XObject"): DictionaryObject({NameObject("/X0"): writer._add_object(form)})}
    )
    draws = DecodedStreamObject()
    draws.set_data(b"/X0 Do\n" * 2000)
    page[NameObject("/Contents")] = writer._add_object(draws.flate_encode())
    buffer = io.BytesIO()
    writer.write(buffer)
    assert len(buffer.getvalue()) < 4_000
    (tmp_path / "forms.pdf").write_bytes(buffer.getvalue())
    with pytest.raises(UnreadableDocument, match=r"text runs past .* decompression bomb"):
        load_document(tmp_path / "forms.pdf", open_source(tmp_path))
