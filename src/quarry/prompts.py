"""Per-model-family formatting of queries and passages.

Passages are embedded raw (the e5 family alone wants ``passage: ``); queries
get the instruction format their model was trained with. Only the embedding
client calls these, so no caller can format inconsistently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ProfileName = Literal["qwen3", "e5-instruct", "e5", "bge-en", "none"]


@dataclass(frozen=True, slots=True)
class PromptProfile:
    """How one model family wants its queries and passages written."""

    name: ProfileName
    query_template: str
    passage_template: str

    @property
    def takes_task(self) -> bool:
        """Whether its queries carry a task instruction (QUARRY_QUERY_TASK)."""
        return "{task}" in self.query_template

    def format_query(self, query: str, task: str) -> str:
        """The text to embed for a search query."""
        return self.query_template.format(task=task, query=query)

    def format_passage(self, text: str) -> str:
        """The text to embed for a stored passage."""
        return self.passage_template.format(text=text)


PROFILES: dict[ProfileName, PromptProfile] = {
    # Qwen3-Embedding: no space after "Query:" (as in the model card's get_detailed_instruct).
    "qwen3": PromptProfile("qwen3", "Instruct: {task}\nQuery:{query}", "{text}"),
    "e5-instruct": PromptProfile("e5-instruct", "Instruct: {task}\nQuery: {query}", "{text}"),
    "e5": PromptProfile("e5", "query: {query}", "passage: {text}"),
    "bge-en": PromptProfile(
        "bge-en", "Represent this sentence for searching relevant passages: {query}", "{text}"
    ),
    "none": PromptProfile("none", "{query}", "{text}"),
}

# Order matters: the instruct variants must match before their plain families.
_FAMILY_PATTERNS: tuple[tuple[re.Pattern[str], ProfileName], ...] = (
    (re.compile(r"qwen3-embedding", re.IGNORECASE), "qwen3"),
    (re.compile(r"e5-[a-z0-9-]*instruct", re.IGNORECASE), "e5-instruct"),
    (re.compile(r"(^|/)(multilingual-)?e5-", re.IGNORECASE), "e5"),
    (re.compile(r"bge-[a-z0-9-]*-en(-v1\.5)?$", re.IGNORECASE), "bge-en"),
)


def profile_for_model(model_id: str | None, override: ProfileName | None = None) -> PromptProfile:
    """The profile for a model id (from ``/info``), unless ``override`` names one."""
    if override is not None:
        return PROFILES[override]
    if model_id:
        for pattern, name in _FAMILY_PATTERNS:
            if pattern.search(model_id):
                return PROFILES[name]
    return PROFILES["none"]
