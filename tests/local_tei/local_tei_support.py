"""Helpers of the local TEI tests: TEI's OpenAPI schemas as validators, shared settings."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import jsonschema

from quarry.local_tei import LocalTEIConfig, LocalTEIServer

#: The ``start_server`` fixture: keyword settings of a hash server -> a started server.
StartServer = Callable[..., LocalTEIServer]

SCHEMAS_FILE = Path(__file__).parent / "data" / "tei_openapi_schemas.json"

# The shared hash server: small limits so that limit tests need small bodies.
HASH_CONFIG = LocalTEIConfig(
    backend="hash", max_input_length=64, max_client_batch_size=8, payload_limit=100_000
)


def _to_json_schema(node: Any) -> Any:
    """OpenAPI 3.0 schema -> JSON Schema: refs to ``$defs``, ``nullable`` to a null type."""
    if isinstance(node, list):
        return [_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref":
            out[key] = value.replace("#/components/schemas/", "#/$defs/")
        elif key == "properties":
            out[key] = {name: _to_json_schema(schema) for name, schema in value.items()}
        elif key != "nullable":
            out[key] = _to_json_schema(value)
    if node.get("nullable") is True:
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


class TEISchemas:
    """Validators for the response bodies TEI's OpenAPI document defines."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self._defs = {name: _to_json_schema(s) for name, s in document["schemas"].items()}
        self._validators: dict[str, jsonschema.Draft202012Validator] = {}

    def validator(self, name: str) -> jsonschema.Draft202012Validator:
        """A validator for ``#/components/schemas/<name>``."""
        if name not in self._validators:
            schema = {"$ref": f"#/$defs/{name}", "$defs": self._defs}
            jsonschema.Draft202012Validator.check_schema(schema)
            self._validators[name] = jsonschema.Draft202012Validator(schema)
        return self._validators[name]

    def validate(self, name: str, body: Any) -> None:
        """Raise ``jsonschema.ValidationError`` unless ``body`` matches schema ``name``."""
        self.validator(name).validate(body)

    def check_response(self, path: str, method: str, response: httpx2.Response) -> Any:
        """Validate a response against the schema the OpenAPI document gives its status.

        A status the document does not list for the route fails; a 429 or 503 answer
        (overload, injected fault) must be TEI's error shape for the route.
        """
        responses = self.document["responses"][path][method.lower()]["responses"]
        status = str(response.status_code)
        if status in responses:
            name = responses[status]
        elif status in ("429", "503"):
            name = "OpenAICompatErrorResponse" if path == "/v1/embeddings" else "ErrorResponse"
        else:
            raise AssertionError(f"{method} {path}: status {status} is not in TEI's OpenAPI")
        if name is None:
            assert response.content == b""
            return None
        assert response.headers["content-type"].startswith("application/json")
        body = response.json()
        self.validate(name, body)
        return body


def load_schemas() -> TEISchemas:
    """TEI 1.9.3's response schemas, vendored under ``data/``."""
    document = json.loads(SCHEMAS_FILE.read_text())
    assert "huggingface/text-embeddings-inference" in document["_source"]
    return TEISchemas(document)


def http_client(base_url: str, **kwargs: Any) -> httpx2.Client:
    """A client for a local plain-HTTP server (no TLS context: cheap to build)."""
    return httpx2.Client(base_url=base_url, timeout=30, verify=False, **kwargs)
