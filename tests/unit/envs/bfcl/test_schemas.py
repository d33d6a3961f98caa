import json

import jsonschema
import pytest

from nemo_rcgrpo.envs.bfcl.schemas import done_tool, to_openai_tool


def _all_types(schema):
    if isinstance(schema, dict):
        if isinstance(schema.get("type"), str):
            yield schema["type"]
        for v in schema.values():
            yield from _all_types(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _all_types(v)


def test_every_tool_doc_becomes_a_valid_json_schema(suite):
    docs = {d.name: d for docs in suite.docs.values() for d in docs}
    assert len(docs) == 128  # the eight multi-turn APIs
    for doc in docs.values():
        tool = to_openai_tool(dict(doc.doc))
        fn = tool["function"]
        assert tool["type"] == "function" and fn["name"] == doc.name
        jsonschema.Draft202012Validator.check_schema(fn["parameters"])
        assert fn["parameters"]["type"] == "object"
        assert set(_all_types(fn["parameters"])) <= {"object", "string", "number", "integer", "boolean", "array"}
        assert "response" not in fn and "response" not in tool
        json.dumps(tool)  # serialisable


def test_conversion_by_hand():
    doc = {
        "name": "f",
        "description": "Does f.",
        "parameters": {
            "type": "dict",
            "properties": {
                "x": {"type": "float", "description": "x."},
                "pairs": {"type": "array", "items": {"type": "tuple"}, "description": "p."},
                "who": {"type": "string", "description": "w.", "default": "None"},
                "n": {"type": "integer", "description": "n.", "default": 10},
                "blob": {"type": "any", "description": "anything."},
            },
            "required": ["x"],
        },
        "response": {"type": "dict", "properties": {"result": {"type": "float", "description": "The result."}}},
    }
    fn = to_openai_tool(doc)["function"]
    assert fn["description"] == "Does f. Returns: result (number): The result."
    assert fn["parameters"] == {
        "type": "object",
        "properties": {
            "x": {"type": "number", "description": "x."},
            "pairs": {"type": "array", "items": {"type": "array"}, "description": "p."},
            "who": {"type": "string", "description": "w."},  # BFCL's "None" default dropped
            "n": {"type": "integer", "description": "n.", "default": 10},
            "blob": {"description": "anything."},  # "any": no type constraint
        },
        "required": ["x"],
    }
    assert to_openai_tool(doc, response="drop")["function"]["description"] == "Does f."


def test_unknown_type_is_refused():
    with pytest.raises(ValueError, match="unknown BFCL parameter type"):
        to_openai_tool({"name": "g", "parameters": {"type": "dict", "properties": {"a": {"type": "pointer"}}}})


def test_done_tool_is_valid():
    tool = done_tool()
    jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    tool["function"]["name"] = "edited"
    assert done_tool()["function"]["name"] == "done"
