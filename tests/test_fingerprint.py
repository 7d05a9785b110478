"""The model key is a stored contract: indexes built by earlier versions carry it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from quarry.errors import FingerprintMismatch
from quarry.fingerprint import (
    Fingerprint,
    ModelIdentity,
    ServingIdentity,
    check_compatible,
    query_task_changed,
)


def test_the_model_key_is_the_hash_earlier_versions_stored() -> None:
    identity = ModelIdentity(
        "sentence-transformers/all-MiniLM-L6-v2", "abc123", "mean", 384, True, "none"
    )
    # What every index written so far holds for this identity: a changed derivation
    # would make quarry refuse (or re-embed) every existing collection.
    fields = {
        "model_id": "sentence-transformers/all-MiniLM-L6-v2",
        "model_sha": "abc123",
        "pooling": "mean",
        "dimensions": 384,
        "normalized": True,
        "profile": "none",
    }
    expected = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    assert identity.key == expected
    assert identity.key == identity.key  # cached: the same answer every time


def test_identities_that_differ_in_any_field_get_different_keys() -> None:
    base = ModelIdentity("m", None, "mean", 384, True, "none")
    variants = [
        ModelIdentity("m2", None, "mean", 384, True, "none"),
        ModelIdentity("m", "sha", "mean", 384, True, "none"),
        ModelIdentity("m", None, "cls", 384, True, "none"),
        ModelIdentity("m", None, "mean", 768, True, "none"),
        ModelIdentity("m", None, "mean", 384, False, "none"),
        ModelIdentity("m", None, "mean", 384, True, "qwen3"),
    ]
    keys = {base.key, *(v.key for v in variants)}
    assert len(keys) == len(variants) + 1


def _fingerprint(model: ModelIdentity) -> Fingerprint:
    serving = ServingIdentity("tei", "1.9.3", "float32", 512)
    return Fingerprint(model=model, serving=serving, canary=[1.0, 0.0], query_task="t")


def test_a_prompt_profile_changed_here_is_named_not_blamed_on_the_service() -> None:
    # Review trial: QUARRY_PROMPT_PROFILE=qwen3 against an index built with "none" said
    # the service now serves another model and to reindex, which would rebuild the
    # index for a setting made by mistake.
    built = _fingerprint(ModelIdentity("m", None, "mean", 384, True, "none"))
    now = _fingerprint(ModelIdentity("m", None, "mean", 384, True, "qwen3"))
    with pytest.raises(FingerprintMismatch) as refused:
        check_compatible(built, now, collection="kb")
    message = str(refused.value)
    assert "built with prompt profile 'none', but 'qwen3' is in force now" in message
    assert "Set QUARRY_PROMPT_PROFILE=none" in message
    other = _fingerprint(ModelIdentity("m2", None, "mean", 384, True, "qwen3"))
    with pytest.raises(FingerprintMismatch, match="the embedding service now serves m2"):
        check_compatible(built, other, collection="kb")


def test_an_index_that_recorded_no_task_is_queried_with_the_live_one() -> None:
    # Review trial: it warned that queries used the recorded task (''), while they use
    # the live one (search passes ``query_task or None``).
    model = ModelIdentity("m", None, "mean", 384, True, "qwen3")
    recorded, live = _fingerprint(model), _fingerprint(model)
    assert not query_task_changed(replace(recorded, query_task=""), live)
    assert query_task_changed(replace(recorded, query_task="other"), live)
    plain = ModelIdentity("m", None, "mean", 384, True, "none")  # its queries take no task
    assert not query_task_changed(
        replace(_fingerprint(plain), query_task="other"), _fingerprint(plain)
    )
