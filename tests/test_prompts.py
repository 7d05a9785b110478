"""Prompt profiles: every template pinned to the exact string the model was trained with."""

from __future__ import annotations

import pytest

from quarry.prompts import PROFILES, profile_for_model

TASK = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.mark.parametrize(
    ("profile", "query", "passage"),
    [
        ("qwen3", f"Instruct: {TASK}\nQuery:what is tei", "doc text"),
        ("e5-instruct", f"Instruct: {TASK}\nQuery: what is tei", "doc text"),
        ("e5", "query: what is tei", "passage: doc text"),
        (
            "bge-en",
            "Represent this sentence for searching relevant passages: what is tei",
            "doc text",
        ),
        ("none", "what is tei", "doc text"),
    ],
)
def test_templates_are_exact(profile: str, query: str, passage: str) -> None:
    chosen = PROFILES[profile]  # type: ignore[index]
    assert chosen.format_query("what is tei", TASK) == query
    assert chosen.format_passage("doc text") == passage


def test_qwen3_and_e5_instruct_differ_by_one_space() -> None:
    qwen = PROFILES["qwen3"].format_query("q", TASK)
    e5 = PROFILES["e5-instruct"].format_query("q", TASK)
    assert e5 == qwen.replace("Query:q", "Query: q")
    assert qwen != e5


@pytest.mark.parametrize(
    ("model_id", "expected"),
    [
        ("Qwen/Qwen3-Embedding-0.6B", "qwen3"),
        ("Qwen/Qwen3-Embedding-8B", "qwen3"),
        ("intfloat/multilingual-e5-large-instruct", "e5-instruct"),
        ("intfloat/multilingual-e5-small", "e5"),
        ("intfloat/e5-base-v2", "e5"),
        ("BAAI/bge-base-en-v1.5", "bge-en"),
        ("BAAI/bge-small-en-v1.5", "bge-en"),
        ("sentence-transformers/all-MiniLM-L6-v2", "none"),
        ("BAAI/bge-m3", "none"),
        ("something/unknown", "none"),
    ],
)
def test_profile_chosen_from_model_id(model_id: str, expected: str) -> None:
    assert profile_for_model(model_id).name == expected


def test_explicit_profile_wins() -> None:
    assert profile_for_model("Qwen/Qwen3-Embedding-0.6B", "none").name == "none"
    assert profile_for_model(None).name == "none"
