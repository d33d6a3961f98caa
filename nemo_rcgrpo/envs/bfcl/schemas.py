"""BFCL tool documentation -> OpenAI function schemas (valid JSON Schema).

BFCL's docs use Gorilla type names ("dict", "float", "tuple", "any"), carry a
non-standard top-level ``response`` key, and write ``default: "None"`` for
optional strings. The conversion maps the types to JSON Schema, folds the
response description into the function description (so a model still learns
what a tool returns) and drops the fake "None" defaults.
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any, Literal, Mapping

# Gorilla type name -> JSON Schema type; None means "any value" (no type key).
GORILLA_TO_JSON_SCHEMA: Mapping[str, str | None] = MappingProxyType(
    {
        "dict": "object",
        "object": "object",
        "float": "number",
        "number": "number",
        "integer": "integer",
        "int": "integer",
        "string": "string",
        "str": "string",
        "boolean": "boolean",
        "bool": "boolean",
        "array": "array",
        "list": "array",
        "tuple": "array",
        "any": None,
    }
)

ResponseMode = Literal["description", "drop"]


def _convert_property(prop: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in prop.items():
        if key == "type":
            if value not in GORILLA_TO_JSON_SCHEMA:
                raise ValueError(f"unknown BFCL parameter type {value!r}")
            mapped = GORILLA_TO_JSON_SCHEMA[value]
            if mapped is not None:
                out["type"] = mapped
        elif key == "properties":
            out["properties"] = {k: _convert_property(v) for k, v in value.items()}
        elif key == "items":
            out["items"] = _convert_property(value)
        elif key == "default" and value == "None":
            continue  # BFCL's spelling of "optional, defaults to None"
        else:
            out[key] = copy.deepcopy(value)
    return out


def _describe_response(response: dict[str, Any]) -> str:
    fields = []
    for name, spec in (response.get("properties") or {}).items():
        typ = GORILLA_TO_JSON_SCHEMA.get(spec.get("type", "any")) or "any"
        desc = (spec.get("description") or "").strip()
        fields.append(f"{name} ({typ}){': ' + desc if desc else ''}")
    return "Returns: " + "; ".join(fields) if fields else ""


def to_openai_tool(doc: dict[str, Any], response: ResponseMode = "description") -> dict[str, Any]:
    """One BFCL function doc -> ``{"type": "function", "function": {...}}``."""
    params = doc.get("parameters") or {}
    properties = {k: _convert_property(v) for k, v in (params.get("properties") or {}).items()}
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    required = [r for r in params.get("required", []) if r in properties]
    if required:
        parameters["required"] = required
    description = (doc.get("description") or "").strip()
    if response == "description" and doc.get("response"):
        returns = _describe_response(doc["response"])
        if returns:
            description = f"{description} {returns}".strip()
    return {
        "type": "function",
        "function": {"name": doc["name"], "description": description, "parameters": parameters},
    }


def done_tool() -> dict[str, Any]:
    """The ``done()`` tool of merged episodes (a new dict each call: callers may edit it)."""
    return {
        "type": "function",
        "function": {
            "name": "done",
            "description": "Call this once every step of the request has been completed. It ends the episode.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
