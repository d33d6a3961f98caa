"""Model text -> tool calls, for both chat formats, as vLLM's own tool parsers read them at serving time.

A model trained here is served with ``vllm serve --tool-call-parser hermes`` (or ``llama3_json``), so training
must reward only calls that parser hands a client the same way. Each parser below follows the algorithm of its
vLLM counterpart (``vllm/tool_parsers/hermes_tool_parser.py``, ``llama_tool_parser.py``; vLLM is never imported
here) and is stricter where vLLM hands a client something other than the call the text seems to make:

- hermes: calls only inside ``<tool_call>`` blocks (a last one may be left unclosed), each exactly a JSON
  object with a string ``name`` and an object ``arguments`` (vLLM requires the ``arguments`` key and passes a
  string or null through as the JSON text of a string or null);
- llama3_json: every JSON object that starts at a ``{`` outside an earlier one, anywhere in the text (vLLM's
  rule: separators and surrounding text do not matter), each with a string ``name`` and an object ``arguments``
  or ``parameters``.

vLLM returns no call at all for a message one of whose calls it cannot parse; here such a message is rejected
whole (``ParsedMessage.rejected`` says why): every call in it becomes a ``ToolCallError``, never a partly executed
message. What the rollout engine does with it is ``chat.rejected_message``'s (by default what a served model's
client gets: the text as content, no call).
A message without a call attempt (no ``<tool_call>``; no ``{`` in llama3_json) is plain content. Unknown tools
are errors of their own call only (vLLM hands the call to the client, which refuses it). Duplicate keys and
NaN / Infinity are rejected. `tests/unit/data/test_parser_agreement.py` checks the rules against vLLM's parser
classes on a corpus of model outputs: no accepted call differs from vLLM's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Literal, get_args

from nemo_rcgrpo.envs.calls import CallRejected, parse_json_call
from nemo_rcgrpo.types import ToolCall, ToolCallError

MAX_CALLS = 128  # more calls than this in one message: none runs, and one error observation names the cap
# what the rollout engine makes of a message rejected whole (chat.rejected_message):
#   content: what a served model's client gets, the text as content and no call: the assistant's turn ends
#            (the env's step gets no call) and the reward follows from what the env saw
#   error:   every call attempt an error observation, and the episode goes on (the model may retry: training
#            then teaches what serving will not do)
RejectedMessage = Literal["content", "error"]
REJECTED_MESSAGE: tuple[str, ...] = get_args(RejectedMessage)


@dataclass
class ParsedMessage:
    content: str  # the text outside the calls
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)
    rejected: str | None = None  # why the whole message was rejected (vLLM's parser returns no call for it)


class _Reject(ValueError):
    """The message cannot be served as it reads: every call in it is rejected."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Reject(f"duplicate key {key!r} in a tool call (JSON parsers disagree on which value wins)")
        out[key] = value
    return out


def _no_constant(name: str):
    raise _Reject(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constant)


def _call(obj: Any, args_keys: tuple[str, ...], known: Collection[str] | None) -> ToolCall | ToolCallError:
    """One decoded call object -> ToolCall; raises _Reject where vLLM would hand over something else or nothing."""
    if not isinstance(obj, dict):
        raise _Reject("a tool call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _Reject("a tool call needs a non-empty string 'name'")
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        raise _Reject(f"tool call {name!r} has no {' or '.join(repr(k) for k in args_keys)} object")
    if not isinstance(obj[key], dict):
        raise _Reject(f"'{key}' of {name!r} must be a JSON object, got {type(obj[key]).__name__}")
    try:
        call = parse_json_call({"name": name, "arguments": obj[key]})
    except CallRejected as e:
        raise _Reject(str(e)) from None
    if known is not None and call.name not in known:
        return ToolCallError(raw=json.dumps(obj)[:200], message=f"unknown tool {call.name!r}")
    return call


def _rejected(raws: list[str], reason: str) -> list[ToolCall | ToolCallError]:
    """Every call attempt of a rejected message, as errors (at least one)."""
    message = f"{reason}; the whole message is rejected (vLLM's parser would return no tool call for it)"
    return [ToolCallError(raw=r[:200], message=message) for r in (raws or [""])[:MAX_CALLS]]


def _too_many(content: str, count: str, raw: str) -> ParsedMessage:
    """A message past the cap on calls: one error naming the cap (an observation the model and the dump see). Not
    a rejection: vLLM would hand every call over, so it is an error whatever ``chat.rejected_message`` says."""
    message = (
        f"this message has {count} tool calls; at most {MAX_CALLS} are read per message, so none of them "
        "was run (call fewer tools per message)"
    )
    return ParsedMessage(content, [ToolCallError(raw=raw[:200], message=message)])


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's Hermes2ProToolParser


def parse_hermes(text: str, known_tools: Collection[str] | None = None) -> ParsedMessage:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""
    if "<tool_call>" not in text:
        return ParsedMessage(text.strip(), [])
    raws = [a or b for a, b in _TOOL_CALL.findall(text)]
    content = _TOOL_CALL.sub("", text).strip()
    if len(raws) > MAX_CALLS:
        return _too_many(content, str(len(raws)), raws[MAX_CALLS])
    calls = []
    for raw in raws:
        try:
            try:
                obj = _DECODER.decode(raw.strip())
            except (ValueError, RecursionError) as e:
                if isinstance(e, _Reject):
                    raise
                raise _Reject(f"tool call is not valid JSON: {e}") from None
            calls.append(_call(obj, ("arguments",), known_tools))
        except _Reject as e:
            return ParsedMessage(content, _rejected(raws, str(e)), str(e))
    return ParsedMessage(content, calls)


def parse_llama3_json(text: str, known_tools: Collection[str] | None = None) -> ParsedMessage:
    """JSON calls ``{"name": ..., "parameters": {...}}`` anywhere in the text (separated by ``; `` when this
    project renders them), as vLLM's Llama3JsonToolParser finds them."""
    if "{" not in text:
        return ParsedMessage(text.strip(), [])
    calls: list[ToolCall | ToolCallError] = []
    raws: list[str] = []
    pieces: list[str] = []  # text outside the calls
    end = 0
    for match in re.finditer(r"\{", text):
        start = match.start()
        if start < end:  # inside an object already decoded
            continue
        pieces.append(text[end:start])
        try:
            if raws and start == end:  # vLLM skips an object that directly follows another (no separator)
                raws.append(text[start : start + 200])
                raise _Reject(
                    "tool calls must be separated (e.g. by '; '): vLLM skips a call that directly follows another"
                )
            try:
                obj, end = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError) as e:
                if isinstance(e, _Reject):
                    raise
                raws.append(text[start : start + 200])
                raise _Reject(f"tool call is not valid JSON: {e}") from None
            raws.append(text[start:end])
            if len(raws) > MAX_CALLS:
                return _too_many(text.strip(), f"more than {MAX_CALLS}", raws[-1])
            calls.append(_call(obj, ("arguments", "parameters"), known_tools))
        except _Reject as e:
            return ParsedMessage(text.strip(), _rejected(raws, str(e)), str(e))
    pieces.append(text[end:])
    content = "".join(pieces).replace("<|python_tag|>", "").strip(" \t\r\n;,")
    return ParsedMessage(content, calls)
