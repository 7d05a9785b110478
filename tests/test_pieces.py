"""Counting by pre-tokenizer pieces agrees with tiktoken, character by character."""

from __future__ import annotations

import regex  # tiktoken's own dependency: it runs cl100k_base's pattern as written
from hypothesis import given, settings
from hypothesis import strategies as st

from quarry._pieces import PieceCounts, countable_characters, pretokenize
from quarry.chunking import _CL100K_PATTERN, count_tokens, get_encoding

CL100K = regex.compile(_CL100K_PATTERN)


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
    split_differently = [
        hex(ord(c)) for c in chars if pretokenize(probes(c)) != CL100K.findall(probes(c))
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
    pieces = pretokenize(text)
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
            assert pretokenize(text) == CL100K.findall(text), text
            assert count_tokens(text) == tiktoken_count(text), text


def test_characters_outside_the_checked_set_are_not_split() -> None:
    # CJK and emoji are outside the blocks; U+017F matches tiktoken's (?i)'s.
    for text in ("日本語", "a 😀 b", "it'\u017f", "\U0001d2c0"):
        assert pretokenize(text) is None
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
