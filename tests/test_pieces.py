"""Counting by pre-tokenizer pieces agrees with tiktoken, character by character.

Both splitters are checked: quarry._cpieces (C, what runs where it is built) and
the regex (what runs where it is not).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import regex  # tiktoken's own dependency: it runs cl100k_base's pattern as written
from hypothesis import given, settings
from hypothesis import strategies as st

from quarry import _pieces, chunking
from quarry._pieces import PieceCounts, countable_characters, pretokenize, regex_pretokenize
from quarry.chunking import _CL100K_PATTERN, count_tokens, get_encoding

CL100K = regex.compile(_CL100K_PATTERN)
SPLITTERS: dict[str, Callable[[str], list[str] | None]] = {
    "compiled": pretokenize,
    "regex": regex_pretokenize,
}


def tiktoken_count(text: str) -> int:
    return len(get_encoding().encode_ordinary(text))


def probes(char: str) -> str:
    """``char`` in the places where the pattern's classes decide a split."""
    return (
        f"a{char}b {char}1{char}{char} '{char}s {char}\n{char}  {char}\t{char}{char}a1 "
        f"{char}.\n\n{char}\r\n {char}x{char}99999{char} \u00a0{char}"
    )


def test_every_countable_character_splits_as_tiktoken_splits() -> None:
    chars = list(countable_characters())
    assert len(chars) > 4000  # the blocks named in quarry._pieces, less unassigned points
    wrong = [hex(ord(c)) for c in chars if count_tokens(probes(c)) != tiktoken_count(probes(c))]
    assert wrong == []
    for split in SPLITTERS.values():
        split_differently = [
            hex(ord(c)) for c in chars if split(probes(c)) != CL100K.findall(probes(c))
        ]
        assert split_differently == []


def test_every_ascii_character_splits_as_tiktoken_splits() -> None:
    chars = [chr(cp) for cp in range(128)]
    wrong = [hex(ord(c)) for c in chars if count_tokens(probes(c)) != tiktoken_count(probes(c))]
    assert wrong == []


countable = st.one_of(
    st.characters(max_codepoint=0x7F),
    st.sampled_from(sorted(countable_characters())),
    st.sampled_from([" ", "  ", "\n", "\r\n", "\t", "123456", "\u00a0", "x", "'"]),
    st.sampled_from(
        [f"'{c}x" for c in ("s", "t", "d", "m", "re", "ll", "ve", "S", "T", "RE", "lL")]
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(countable, max_size=200).map("".join))
def test_counts_match_tiktoken_on_countable_text(text: str) -> None:
    for split in SPLITTERS.values():
        pieces = split(text)
        assert pieces is not None
        assert pieces == CL100K.findall(text)
    assert count_tokens(text) == tiktoken_count(text)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300))
def test_counts_match_tiktoken_on_any_text(text: str) -> None:
    assert count_tokens(text) == tiktoken_count(text)


def test_contractions_split_as_tiktoken_splits() -> None:
    for suffix in ("s", "t", "d", "m", "re", "ll", "ve"):
        for cased in (suffix, suffix.upper(), suffix.capitalize()):
            text = f"it'{cased} it'{cased}x '{cased}99 ''{cased}'"
            for split in SPLITTERS.values():
                assert split(text) == CL100K.findall(text), text
            assert count_tokens(text) == tiktoken_count(text), text


def test_characters_outside_the_checked_set_are_not_split() -> None:
    # CJK and emoji are outside the blocks; U+017F matches tiktoken's (?i)'s.
    for text in ("日本語", "a 😀 b", "it'\u017f", "\U0001d2c0", "x\ud800"):
        assert pretokenize(text) is None
        assert regex_pretokenize(text) is None
        assert count_tokens(text) == tiktoken_count(text)


def test_the_piece_cache_is_bounded_and_skips_long_pieces() -> None:
    encode = get_encoding().encode_ordinary
    counts = PieceCounts(lambda piece: len(encode(piece)), max_entries=3)
    words = [" alpha", " beta", " gamma", " delta", " epsilon"]
    assert [counts[w] for w in words] == [len(encode(w)) for w in words]
    assert len(counts) <= 3
    long_piece = "x" * 200
    assert counts[long_piece] == len(encode(long_piece))
    assert long_piece not in counts
    assert counts.total(pretokenize("the alpha and the omega") or []) == tiktoken_count(
        "the alpha and the omega"
    )


# ---------------------------------------------------------------------------
# quarry._cpieces itself


def test_the_extension_is_built_by_the_install() -> None:
    # `make install-dev` compiles it (hatch_build.py); a silent failure would make
    # chunking slower with every other test still passing.
    if os.environ.get("QUARRY_BUILD_EXTENSION") == "0":
        pytest.skip("built without the extension on purpose")
    assert _pieces._cpieces is not None


@pytest.fixture
def compiled() -> Iterator[object]:
    """quarry._cpieces; chunking's own table is set up afresh after the test."""
    if _pieces._cpieces is None:
        pytest.skip("quarry._cpieces is not built")
    assert _pieces._configured()
    yield _pieces._cpieces
    chunking._compiled_counts.cache_clear()
    chunking._piece_counts.cache_clear()


def bpe_count(piece: str) -> int:
    return len(get_encoding().encode_ordinary(piece))


@settings(max_examples=200, deadline=None)
@given(st.lists(countable, max_size=120).map("".join), st.data())
def test_a_range_counts_as_its_slice_does(text: str, data: st.DataObject) -> None:
    counts = _pieces.compiled_counter(chunking._piece_counter())
    if counts is None:
        pytest.skip("quarry._cpieces is not built")
    try:
        start = data.draw(st.integers(0, len(text)))
        end = data.draw(st.integers(start, len(text)))
        assert counts.range(text, start, end) == tiktoken_count(text[start:end])
        assert _pieces._cpieces.split(text, start, end) == CL100K.findall(text[start:end])
    finally:
        chunking._compiled_counts.cache_clear()
        chunking._piece_counts.cache_clear()


def test_the_table_is_bounded_and_skips_long_pieces(compiled: object) -> None:
    seen: list[str] = []

    def count(piece: str) -> int:
        seen.append(piece)
        return bpe_count(piece)

    counts = _pieces.compiled_counter(count, max_entries=3)
    assert counts is not None
    text = " alpha beta gamma delta epsilon"
    assert counts.range(text, 0, 11) == tiktoken_count(text[:11])  # " alpha beta"
    assert seen == [" alpha", " beta"]
    seen.clear()
    assert counts.range(text, 0, 11) == tiktoken_count(text[:11])
    assert seen == []  # held
    assert counts.range(text, 0, len(text)) == tiktoken_count(text)
    assert seen == [" gamma", " delta", " epsilon"]
    assert _pieces._cpieces.size() <= 3  # emptied when full: " delta" and " epsilon" now
    seen.clear()
    assert counts.range(text, 0, 11) == tiktoken_count(text[:11])
    assert seen == [" alpha", " beta"]
    seen.clear()
    long_piece = " " + "x" * 200
    assert counts.piece(long_piece) == bpe_count(long_piece)
    assert counts.piece(long_piece) == bpe_count(long_piece)
    assert seen == [long_piece, long_piece]  # never stored


def test_a_failing_count_is_raised_not_swallowed(compiled: object) -> None:
    def count(piece: str) -> int:
        raise RuntimeError(f"no count for {piece!r}")

    counts = _pieces.compiled_counter(count)
    assert counts is not None
    with pytest.raises(RuntimeError, match="no count for ' alpha'"):
        counts.range(" alpha", 0, 6)
    with pytest.raises(ValueError, match="range"):
        counts.range("abc", 2, 1)
    with pytest.raises(ValueError, match="range"):
        counts.range("abc", 0, 4)
    with pytest.raises(TypeError):
        counts.range(b"abc", 0, 1)  # type: ignore[arg-type]


def test_a_count_that_changes_the_table_midway_leaves_it_sound(compiled: object) -> None:
    # The count callable runs Python, which can let another thread in: the table may
    # be emptied or refilled before the count comes back.
    counts: _pieces.CompiledCounts | None = None
    inside: list[str] = []

    def count(piece: str) -> int:
        assert counts is not None
        if not inside:  # one level deep: another caller empties and refills the table
            inside.append(piece)
            _pieces._cpieces.clear()
            assert counts.range(" other words here", 0, 17) == tiktoken_count(" other words here")
            inside.clear()
        return bpe_count(piece)

    counts = _pieces.compiled_counter(count, max_entries=4)
    assert counts is not None
    text = "The quick brown fox jumps over the lazy dog, twice over."
    assert counts.range(text, 0, len(text)) == tiktoken_count(text)
    assert counts.range(text, 0, len(text)) == tiktoken_count(text)


def test_threads_counting_at_once_get_exact_counts(compiled: object) -> None:
    counts = _pieces.compiled_counter(bpe_count, max_entries=64)
    assert counts is not None
    words = [f" w{i}x{i * 7}" for i in range(400)]
    texts = ["".join(words[k::5]) for k in range(5)]
    wrong: list[str] = []

    def work(text: str) -> None:
        for _ in range(20):
            if counts.range(text, 0, len(text)) != tiktoken_count(text):
                wrong.append(text)

    threads = [threading.Thread(target=work, args=(t,)) for t in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_counter_replaced_while_it_runs_is_not_freed_under_it() -> None:
    # A caching wrapper uses its own state after the call it wraps; set_counter from
    # inside that call used to free it while it ran (a crash), so this runs apart.
    script = """
import functools, gc
from quarry import _pieces
from quarry import _cpieces
assert _pieces._configured()
def inner(piece):
    _cpieces.set_counter(len, 10, 48)
    gc.collect()
    return len(piece)
_cpieces.set_counter(functools.lru_cache(maxsize=8)(inner), 10, 48)
print(_cpieces.count(" hello world", 0, 12))
"""
    if _pieces._cpieces is None:
        pytest.skip("quarry._cpieces is not built")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "12"  # len(" hello") + len(" world")


def test_counts_that_overflow_are_an_error(compiled: object) -> None:
    counts = _pieces.compiled_counter(lambda piece: sys.maxsize)
    assert counts is not None
    with pytest.raises(OverflowError):
        counts.range(" a b c", 0, 6)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        _pieces.compiled_counter(bpe_count, max_entries=2**28)


def fnv1a_slot(piece: str, mask: int) -> int:
    """The table slot quarry._cpieces gives a piece (FNV-1a over code points)."""
    value = 1469598103934665603
    for char in piece:
        value = ((value ^ ord(char)) * 1099511628211) % 2**64
    return (value | 1) & mask


def test_pieces_whose_hashes_collide_cost_no_more_than_counting_them(compiled: object) -> None:
    # Text crafted so that every piece lands on one slot would make each lookup walk
    # all of them; a lookup gives up after 64 slots and the piece is counted instead.
    counts = _pieces.compiled_counter(bpe_count, max_entries=200)  # 512 slots
    assert counts is not None
    words = (" " + "".join(letters) for letters in itertools.product("abcdefgh", repeat=6))
    colliding = [word for word in words if fnv1a_slot(word, 511) == 7]  # one piece each
    assert len(colliding) > 100
    text = "".join(colliding[:100])
    assert counts.range(text, 0, len(text)) == tiktoken_count(text)
    assert _pieces._cpieces.size() == 64  # the rest were counted, not stored
    assert counts.range(text, 0, len(text)) == tiktoken_count(text)
