"""What identifies the model behind a vector, and when two services are interchangeable.

A fingerprint has three parts:

* **model identity** (``model_key``): model id, revision, pooling, dimensions,
  normalisation and passage formatting. Vectors with different keys are not
  comparable, so ingest and query refuse.
* **serving identity**: engine, engine version, dtype, max input length. A change
  here with the same model is allowed only once a parity measurement has been
  accepted (or ``QUARRY_ALLOW_SERVING_CHANGE=1``).
* **canary**: a fixed text's vector, re-embedded at startup and compared by
  cosine; it catches a silent model swap behind a gateway without ``/info``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from quarry.embeddings import EmbeddingClient, ServiceInfo
from quarry.errors import CanaryMismatch, FingerprintMismatch, ServingChanged
from quarry.prompts import PROFILES

CANARY_TEXT = (
    "quarry canary v1: Granite quarries were cut in terraces; the water that filled "
    "them after 1920 is forty metres deep."
)


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Everything that decides which vector a passage gets."""

    model_id: str
    model_sha: str | None
    pooling: str | None
    dimensions: int
    normalized: bool
    profile: str

    @property
    def key(self) -> str:
        """A short stable hash of the identity: ``model_key`` in payloads and names."""
        return _identity_key(self)

    def describe(self) -> str:
        """One line naming the model for error messages."""
        revision = f"@{self.model_sha[:10]}" if self.model_sha else ""
        # Every part of the key is named, so two models that differ only in pooling or
        # normalisation do not read the same in a refusal.
        pooling = f"{self.pooling} pooling, " if self.pooling else ""
        scale = "normalized" if self.normalized else "not normalized"
        return (
            f"{self.model_id}{revision} ({self.dimensions}d, {pooling}{scale}, "
            f"profile {self.profile}, key {self.key})"
        )


# Every point an ingest writes carries the key: hash the (frozen) identity once.
@functools.lru_cache(maxsize=64)
def _identity_key(identity: ModelIdentity) -> str:
    blob = json.dumps(asdict(identity), sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class ServingIdentity:
    """How the model is served; may change without changing the vectors much."""

    engine: str
    engine_version: str | None
    dtype: str | None
    max_input_length: int | None

    def describe(self) -> str:
        """One line naming the serving stack."""
        return (
            f"{self.engine} {self.engine_version or '?'} dtype={self.dtype or '?'} "
            f"max_input_length={self.max_input_length or '?'}"
        )


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The full record stored with a collection."""

    model: ModelIdentity
    serving: ServingIdentity
    canary: list[float]
    query_task: str
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def model_key(self) -> str:
        """Shortcut for ``model.key``."""
        return self.model.key

    def to_metadata(self) -> dict[str, Any]:
        """A JSON-ready dict for Qdrant collection metadata."""
        return {
            "model": asdict(self.model),
            "model_key": self.model.key,
            "serving": asdict(self.serving),
            "canary": [round(x, 7) for x in self.canary],
            "query_task": self.query_task,
            "created_at": self.created_at,
        }

    @classmethod
    def from_metadata(cls, data: Mapping[str, Any]) -> Fingerprint:
        """Rebuild from :meth:`to_metadata` output."""
        return cls(
            model=ModelIdentity(**data["model"]),
            serving=ServingIdentity(**data["serving"]),
            canary=[float(x) for x in data["canary"]],
            query_task=str(data.get("query_task", "")),
            created_at=str(data.get("created_at", "")),
        )


def read_fingerprint(client: EmbeddingClient) -> Fingerprint:
    """The live service's fingerprint: ``/info`` (where it has one) plus the canary vector."""
    canary = client.embed_raw([client.profile.format_passage(CANARY_TEXT)])[0]
    return build_fingerprint(client.info, canary, client.profile.name, client.query_task)


def build_fingerprint(
    info: ServiceInfo, canary: list[float], profile: str, query_task: str
) -> Fingerprint:
    """A fingerprint from what a service said about itself and its canary vector.

    ``canary`` is the vector of ``CANARY_TEXT`` formatted as a passage by ``profile``.
    Shared by the sync client (:func:`read_fingerprint`) and the API's async one.
    """
    norm = math.sqrt(sum(x * x for x in canary))
    model = ModelIdentity(
        model_id=info.model_id,
        model_sha=info.model_sha,
        pooling=info.pooling,
        dimensions=len(canary),
        normalized=abs(norm - 1.0) < 1e-3,
        profile=profile,
    )
    serving = ServingIdentity(
        engine=info.engine,
        engine_version=info.engine_version,
        dtype=info.dtype,
        max_input_length=info.max_input_length,
    )
    return Fingerprint(model=model, serving=serving, canary=canary, query_task=query_task)


def query_task_changed(recorded: Fingerprint, live: Fingerprint) -> bool:
    """Whether ``live`` carries another query task than ``recorded``, for a model whose
    queries take one (queries keep the recorded task; a reindex records the new one)."""
    profile = PROFILES.get(recorded.model.profile)  # type: ignore[call-overload]
    takes_task = profile.takes_task if profile is not None else True
    # An index that recorded none is queried with the live task (the client's own).
    return takes_task and (recorded.query_task or live.query_task) != live.query_task


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 when either is zero or they differ in size)."""
    if len(a) != len(b):
        return 0.0
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0


def check_compatible(
    stored: Fingerprint,
    live: Fingerprint,
    *,
    collection: str,
    accepted_serving: Sequence[Mapping[str, Any]] = (),
    allow_serving_change: bool = False,
    min_canary_cosine: float = 0.999,
) -> None:
    """Refuse when the live service cannot produce vectors comparable with the stored ones.

    Raises FingerprintMismatch (other model), ServingChanged (same model, other
    engine, no accepted parity) or CanaryMismatch (the canary moved).
    """
    if stored.model_key != live.model_key:
        if replace(stored.model, profile=live.model.profile) == live.model:
            # The same model: a setting changed here, not the service.
            raise FingerprintMismatch(
                f"collection {collection!r} was built with prompt profile "
                f"{stored.model.profile!r}, but {live.model.profile!r} is in force now for "
                f"the same model, {live.model.model_id} (QUARRY_PROMPT_PROFILE, or the "
                f"model's own when unset). Set QUARRY_PROMPT_PROFILE={stored.model.profile} "
                "to query and ingest it as built; to move it to the new profile, run "
                f"`quarry reindex --collection {collection}`."
            )
        raise FingerprintMismatch(
            f"collection {collection!r} was built with {stored.model.describe()}, "
            f"but the embedding service now serves {live.model.describe()}. "
            f"Vectors from different models are not comparable. Run `quarry reindex "
            f"--collection {collection}` to rebuild it with the live model, or point "
            f"QUARRY_EMBED_URL back at the original model."
        )
    if stored.serving != live.serving and not allow_serving_change:
        accepted = {json.dumps(dict(entry), sort_keys=True) for entry in accepted_serving}
        if json.dumps(asdict(live.serving), sort_keys=True) not in accepted:
            raise ServingChanged(
                f"collection {collection!r}: same model, but the serving stack changed from "
                f"{stored.serving.describe()} to {live.serving.describe()}. Measure it with "
                f"`quarry parity --candidate-embed-url <url> --accept`, or set "
                f"QUARRY_ALLOW_SERVING_CHANGE=1 to proceed anyway."
            )
    similarity = cosine(stored.canary, live.canary)
    if similarity < min_canary_cosine:
        raise CanaryMismatch(
            f"collection {collection!r}: the canary text embeds differently now "
            f"(cosine {similarity:.5f} < {min_canary_cosine}); the service behind "
            f"{live.model.model_id} is not the model that built the index. Run "
            f"`quarry reindex --collection {collection}` if the change is intended."
        )
