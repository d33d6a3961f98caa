"""Model text -> tool calls, for both chat formats.

Tolerant of what small models emit (surrounding whitespace, several calls,
text before or after the calls, a last ``<tool_call>`` left unclosed), strict
about what is accepted: every call must be a JSON object with a string
``name`` and an object of arguments (``arguments`` or ``parameters``);
anything else, and a name that is not an offered tool, becomes a
``ToolCallError``, which the environment answers with an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Collection

from nemo_rcgrpo.envs.bfcl.executor import parse_json_call, CallRejected
from nemo_rcgrpo.types import ToolCall, ToolCallError

MAX_CALLS = 128  # more calls than this in one message are reported as one error


@dataclass
class ParsedMessage:
    content: str  # the text outside the calls
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)


def _to_call(raw: str, known: Collection[str] | None) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return ToolCallError(raw=raw[:200], message=f"tool call is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return ToolCallError(raw=raw[:200], message="a tool call must be a JSON object with 'name' and 'arguments'")
    try:
        call = parse_json_call(obj)
    except CallRejected as e:
        return ToolCallError(raw=raw[:200], message=str(e))
    if known is not None and call.name not in known:
        return ToolCallError(raw=raw[:200], message=f"unknown tool {call.name!r}")
    return call


_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str, known_tools: Collection[str] | None = None) -> ParsedMessage:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (a bare JSON call also counts)."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        stripped = text.strip()
        if stripped.startswith("{") and stripped.endswith("}") and '"name"' in stripped:
            return ParsedMessage("", [_to_call(stripped, known_tools)])
        return ParsedMessage(text.strip(), [])
    content = _TOOL_CALL.sub("", text).strip()
    calls = [_to_call(b.strip(), known_tools) for b in blocks[:MAX_CALLS]]
    if len(blocks) > MAX_CALLS:
        calls.append(ToolCallError(raw="", message=f"more than {MAX_CALLS} tool calls in one message"))
    return ParsedMessage(content, calls)


_DECODER = json.JSONDecoder()


def parse_llama3_json(text: str, known_tools: Collection[str] | None = None) -> ParsedMessage:
    """One or more JSON calls ``{"name": ..., "parameters": {...}}`` separated by ``;`` or newlines."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith("{"):
        return ParsedMessage(text.strip(), [])
    calls: list[ToolCall | ToolCallError] = []
    pos = 0
    while pos < len(body) and len(calls) < MAX_CALLS:
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(body):
            break
        if body[pos] != "{":
            return ParsedMessage(body[pos:].strip(), calls)  # trailing text after the calls
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError) as e:
            calls.append(ToolCallError(raw=body[pos:pos + 200], message=f"tool call is not valid JSON: {e}"))
            break
        calls.append(_to_call(json.dumps(obj), known_tools))
        pos = end
    return ParsedMessage("", calls)


PARSERS: dict[str, Callable[[str, Collection[str] | None], ParsedMessage]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}
