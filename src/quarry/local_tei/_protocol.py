"""TEI's wire protocol: request bodies, error bodies and JSON encoding.

TEI (axum + serde) rejects a body it cannot deserialise with a *plain-text* answer
such as ``Failed to deserialize the JSON body into the target type: missing field
`texts` at line 1 column 31``, and answers its own errors with JSON
``{"error", "error_type"}``. Clients key off both, so this module reproduces
serde's messages for the request types the service accepts, instead of letting
FastAPI/pydantic answer in their own words.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

try:  # orjson is optional: it is only faster.
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised only without orjson
    _orjson = None  # type: ignore[assignment]

import numpy as np

__all__ = [
    "BodyRejected",
    "ErrorType",
    "TEIError",
    "dumps",
    "parse_body",
]

ErrorType = Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]

STATUS_OF: Final[Mapping[str, int]] = {
    "Unhealthy": 503,
    "Backend": 424,
    "Overloaded": 429,
    "Validation": 422,
    "Tokenizer": 422,
    "Empty": 400,
}

U32_MAX: Final = 2**32 - 1
USIZE_MAX: Final = 2**64 - 1
MAX_CHAR_MULTIPLIER: Final = 250  # TEI refuses inputs over max_input_length * 250 characters


class TEIError(Exception):
    """An error TEI answers with ``{"error": message, "error_type": error_type}``."""

    def __init__(self, error_type: ErrorType, message: str) -> None:
        super().__init__(message)
        self.error_type: ErrorType = error_type
        self.message = message

    @property
    def status(self) -> int:
        """The HTTP status TEI maps this error type to."""
        return STATUS_OF[self.error_type]

    def body(self) -> dict[str, Any]:
        """TEI's ``ErrorResponse``."""
        return {"error": self.message, "error_type": self.error_type}

    def openai_body(self) -> dict[str, Any]:
        """TEI's ``OpenAICompatErrorResponse``.

        TEI's code serialises the type as ``type`` while its OpenAPI document names it
        ``error_type``; both keys are sent so that clients of either reading work.
        """
        return {
            "message": self.message,
            "code": self.status,
            "type": self.error_type,
            "error_type": self.error_type,
        }


def validation(message: str) -> TEIError:
    """``TextEmbeddingsError::Validation`` as the router words it."""
    return TEIError("Validation", f"Input validation error: {message}")


def empty_input() -> TEIError:
    """An empty string (or id list) reached the tokenizer."""
    return TEIError("Empty", "Input validation error: `inputs` cannot be empty")


def overloaded() -> TEIError:
    """No concurrency permit was free."""
    return TEIError("Overloaded", "Model is overloaded")


class BodyRejected(Exception):
    """axum refused the body before the handler ran: a plain-text answer."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


PAYLOAD_TOO_LARGE_TEXT: Final = "Failed to buffer the request body: length limit exceeded"
WRONG_CONTENT_TYPE_TEXT: Final = "Expected request with `Content-Type: application/json`"


def is_json_content_type(content_type: str | None) -> bool:
    """axum's test: ``application/json`` or ``application/*+json``, parameters allowed."""
    if not content_type:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime == "application/json":
        return True
    kind, _, sub = mime.partition("/")
    return kind == "application" and sub.endswith("+json")


# --------------------------------------------------------------------------- serde emulation


class _DataError(Exception):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def _describe(value: Any) -> str:
    """serde's ``Unexpected`` wording for a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        text = repr(value)
        return f"floating point `{text}`"
    if isinstance(value, str):
        return f"string {json.dumps(value, ensure_ascii=False)}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def _invalid_type(path: str, value: Any, expected: str) -> _DataError:
    return _DataError(path, f"invalid type: {_describe(value)}, expected {expected}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


Converter = Callable[[Any, str], Any]


def as_bool(value: Any, path: str) -> bool:
    """serde ``bool``."""
    if isinstance(value, bool):
        return value
    raise _invalid_type(path, value, "a boolean")


def as_str(value: Any, path: str) -> str:
    """serde ``String``."""
    if isinstance(value, str):
        return value
    raise _invalid_type(path, value, "a string")


def _unsigned(kind: str, maximum: int) -> Converter:
    def convert(value: Any, path: str) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            if 0 <= value <= maximum:
                return value
            raise _DataError(path, f"invalid value: integer `{value}`, expected {kind}")
        raise _invalid_type(path, value, kind)

    return convert


as_usize = _unsigned("usize", USIZE_MAX)
as_u32 = _unsigned("u32", U32_MAX)


def optional(convert: Converter) -> Converter:
    """serde ``Option<T>``: null is ``None``."""

    def wrapped(value: Any, path: str) -> Any:
        return None if value is None else convert(value, path)

    return wrapped


def seq_of(convert: Converter) -> Converter:
    """serde ``Vec<T>``."""

    def wrapped(value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise _invalid_type(path, value, "a sequence")
        return [convert(item, f"{path}[{i}]") for i, item in enumerate(value)]

    return wrapped


def unit_enum(variants: Mapping[str, str], listed: Sequence[str], name: str) -> Converter:
    """A serde enum of unit variants; ``variants`` maps accepted spellings to values."""
    expected = (
        f"`{listed[0]}`"
        if len(listed) == 1
        else ", ".join(f"`{v}`" for v in listed[:-1]) + f" or `{listed[-1]}`"
    )

    def convert(value: Any, path: str) -> str:
        if isinstance(value, str):
            if value in variants:
                return variants[value]
            raise _DataError(path, f"unknown variant `{value}`, expected {expected}")
        raise _invalid_type(path, value, f"enum {name}")

    return convert


def _is_u32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U32_MAX


def _input_type(value: Any) -> str | list[int] | None:
    """TEI's untagged ``InputType``: a string or a list of u32 token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(_is_u32(v) for v in value):
        return list(value)
    return None


@dataclass(frozen=True)
class Inputs:
    """A deserialised ``Input``: one input, or a batch of them."""

    items: list[str | list[int]]
    batch: bool


def as_input(value: Any, path: str) -> Inputs:
    """TEI's untagged ``Input``: ``InputType`` or ``Vec<InputType>``, tried in that order."""
    single = _input_type(value)
    if single is not None:
        return Inputs([single], batch=False)
    if isinstance(value, list):
        items = [_input_type(v) for v in value]
        if all(item is not None for item in items):
            return Inputs([item for item in items if item is not None], batch=True)
    raise _DataError(path, "data did not match any variant of untagged enum Input")


def as_tokenize_input(value: Any, path: str) -> Inputs:
    """TEI's untagged ``TokenizeInput``: a string or a list of strings."""
    if isinstance(value, str):
        return Inputs([value], batch=False)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return Inputs(list(value), batch=True)
    raise _DataError(path, "data did not match any variant of untagged enum TokenizeInput")


as_direction = unit_enum(
    {"Left": "left", "left": "left", "Right": "right", "right": "right"},
    ["Left", "Right"],
    "TruncationDirection",
)
as_encoding_format = unit_enum(
    {"float": "float", "base64": "base64"}, ["float", "base64"], "EncodingFormat"
)


@dataclass(frozen=True)
class Field:
    """One field of a request struct: converter, and whether it may be absent."""

    convert: Converter
    required: bool = False
    default: Any = None


@dataclass(frozen=True)
class Struct:
    """A serde struct: its Rust name and fields in declaration order."""

    name: str
    fields: dict[str, Field] = field(default_factory=dict)


def _position(body: bytes, index: int) -> tuple[int, int]:
    """serde_json's (line, column) of a byte index: column counts bytes since the newline."""
    start_of_line = body.rfind(b"\n", 0, index) + 1
    return body.count(b"\n", 0, start_of_line) + 1, index - start_of_line


def _deserialize_error(body: bytes, path: str, message: str) -> BodyRejected:
    # serde_json reports a struct-level error after consuming the closing brace: the end of
    # the document. Errors inside a value are reported at the same place here, which is
    # only approximately where serde_json would put them.
    line, column = _position(body, len(body.rstrip()))
    text = f"{path}: {message}" if path else message
    return BodyRejected(
        422,
        "Failed to deserialize the JSON body into the target type: "
        f"{text} at line {line} column {column}",
    )


def _syntax_error(body: bytes, exc: ValueError) -> BodyRejected:
    if not body.strip():
        line, column = _position(body, len(body))
        detail = f"EOF while parsing a value at line {line} column {column}"
    else:
        lineno = getattr(exc, "lineno", 1)
        colno = getattr(exc, "colno", 1)
        msg = getattr(exc, "msg", str(exc))
        if msg in ("unexpected content after document", "Extra data"):
            msg = "trailing characters"  # serde_json's words for it
        detail = f"{msg} at line {lineno} column {colno}"
    return BodyRejected(400, f"Failed to parse the request body as JSON: {detail}")


def loads(body: bytes) -> Any:
    """Parse JSON bytes (orjson when installed)."""
    if _orjson is not None:
        return _orjson.loads(body)
    return json.loads(body)


def _duplicate_field(body: bytes, struct: Struct) -> str | None:
    """The first field of ``struct`` the top-level object names twice (serde refuses
    that; a JSON parser keeps the last). Parsed again only when a name occurs twice."""
    if not any(body.count(b'"%s"' % name.encode()) > 1 for name in struct.fields):
        return None
    top: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        top.append(pairs)  # the outermost object is the last one completed
        return dict(pairs)

    json.loads(body, object_pairs_hook=keep)
    seen: set[str] = set()
    for key, _ in top[-1] if top else []:
        if key in struct.fields and key in seen:
            return key
        seen.add(key)
    return None


def parse_body(body: bytes, struct: Struct) -> dict[str, Any]:
    """Deserialise ``body`` as ``struct`` the way axum's ``Json`` extractor would.

    Raises :class:`BodyRejected` with axum's status and plain-text message.
    """
    try:
        document = loads(body)
    except ValueError as exc:  # orjson.JSONDecodeError and json.JSONDecodeError
        raise _syntax_error(body, exc) from None
    if not isinstance(document, dict):
        raise _deserialize_error(
            body, "", f"invalid type: {_describe(document)}, expected struct {struct.name}"
        )
    duplicate = _duplicate_field(body, struct)
    if duplicate is not None:
        raise _deserialize_error(body, "", f"duplicate field `{duplicate}`")
    out: dict[str, Any] = {}
    try:
        # serde visits fields in document order, so the first bad value wins...
        for key, value in document.items():
            spec = struct.fields.get(key)
            if spec is not None:
                out[key] = spec.convert(value, key)
        # ...and only then notices missing fields, in declaration order.
        for name, spec in struct.fields.items():
            if name not in out:
                if spec.required:
                    raise _DataError("", f"missing field `{name}`")
                out[name] = spec.default
    except _DataError as exc:
        raise _deserialize_error(body, exc.path, exc.message) from None
    return out


# ------------------------------------------------------------------------------ request types

EMBED_REQUEST = Struct(
    "EmbedRequest",
    {
        "inputs": Field(as_input, required=True),
        "truncate": Field(optional(as_bool)),
        "truncation_direction": Field(as_direction, default="right"),
        "prompt_name": Field(optional(as_str)),
        "normalize": Field(as_bool, default=True),
        "dimensions": Field(optional(as_usize)),
    },
)

OPENAI_REQUEST = Struct(
    "OpenAICompatRequest",
    {
        "input": Field(as_input, required=True),
        "model": Field(optional(as_str)),
        "user": Field(optional(as_str)),
        "encoding_format": Field(as_encoding_format, default="float"),
        "dimensions": Field(optional(as_usize)),
    },
)

RERANK_REQUEST = Struct(
    "RerankRequest",
    {
        "query": Field(as_str, required=True),
        "texts": Field(seq_of(as_str), required=True),
        "truncate": Field(optional(as_bool)),
        "truncation_direction": Field(as_direction, default="right"),
        "raw_scores": Field(as_bool, default=False),
        "return_text": Field(as_bool, default=False),
    },
)

# The Cohere/infinity-style body some gateways and engines take instead of TEI's.
COHERE_RERANK_REQUEST = Struct(
    "RerankRequest",
    {
        "query": Field(as_str, required=True),
        "documents": Field(seq_of(as_str), required=True),
        "top_n": Field(optional(as_usize)),
        "return_documents": Field(as_bool, default=False),
        "raw_scores": Field(as_bool, default=False),
        "truncate": Field(optional(as_bool)),
        "truncation_direction": Field(as_direction, default="right"),
        "model": Field(optional(as_str)),
    },
)

TOKENIZE_REQUEST = Struct(
    "TokenizeRequest",
    {
        "inputs": Field(as_tokenize_input, required=True),
        "add_special_tokens": Field(as_bool, default=True),
        "prompt_name": Field(optional(as_str)),
    },
)


# ---------------------------------------------------------------------------------- encoding


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def dumps(obj: Any) -> bytes:
    """Encode a response body; numpy arrays are written as (nested) lists of floats."""
    if _orjson is not None:
        return _orjson.dumps(obj, option=_orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(obj, default=_default, separators=(",", ":")).encode()
