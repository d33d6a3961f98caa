"""Parsing model-written tool calls: text or JSON in, a `ToolCall` (or a `ToolCallError` saying why not) out.

Model output is data, never code. A call string is parsed with ``ast`` (``mv(source='a', destination='b')``,
positional arguments allowed), an OpenAI-style ``{"name", "arguments"}`` call is taken as JSON; every argument
must be a literal (``ast.literal_eval`` or JSON), so nested calls, names, lambdas and attribute chains are
refused, and sizes (text, nesting, integer digits, names, call ids) are bounded before anything is built.
Nothing here knows the tools: dispatching a call to a rollout's API objects is `executor.py: Toolbox`.
"""

from __future__ import annotations

import ast
import json
import tokenize
import unicodedata
from io import StringIO
from typing import Any, Mapping

from nemo_rcgrpo.types import ToolCall, ToolCallError, valid_text

MAX_CALL_CHARS = 16_384  # longest call string accepted (ground truth: < 400)
MAX_NESTING = 16  # deepest list/dict nesting accepted in an argument
MAX_INT_DIGITS = 30  # integers beyond this are not plausible API arguments
MAX_NAME_CHARS = 128
MAX_CALL_ID_CHARS = 64  # a tool-call id is a short string (OpenAI's are about 30 characters)


class CallRejected(ValueError):
    """A call that must not run; the message becomes the error observation."""


# --------------------------------------------------------------------------- parsing


def _spend(budget: list[int], amount: int) -> None:
    budget[0] -= amount
    if budget[0] < 0:
        raise CallRejected(
            f"arguments hold more than {MAX_CALL_CHARS} characters of text (an element of a list "
            "or a nested mapping counts as one)"
        )


def _check_nesting(value: Any, depth: int = 0, budget: list[int] | None = None) -> None:
    """Refuse deep nesting, huge integers and, in total, more than MAX_CALL_CHARS of size: characters of text plus
    one per element of every container below the top level, checked before a container is walked."""
    budget = [MAX_CALL_CHARS] if budget is None else budget
    if depth > MAX_NESTING:
        raise CallRejected(f"argument nested deeper than {MAX_NESTING} levels")
    if isinstance(value, (str, bytes)):
        _spend(budget, len(value))
    elif isinstance(value, dict):
        if depth:  # the top-level mapping is the argument list itself
            _spend(budget, len(value))
        for k, v in value.items():
            _check_nesting(k, depth + 1, budget)
            _check_nesting(v, depth + 1, budget)
    elif isinstance(value, (list, tuple, set, frozenset)):
        _spend(budget, len(value))
        for v in value:
            _check_nesting(v, depth + 1, budget)
    elif isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 10**MAX_INT_DIGITS:
            raise CallRejected(f"integer argument with more than {MAX_INT_DIGITS} digits")
    elif isinstance(value, complex):
        raise CallRejected("complex numbers are not valid arguments")


def _literal(node: ast.AST, what: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise CallRejected(
            f"{what} is not a literal value (only strings, numbers, booleans, None, lists, dicts and "
            f"tuples are allowed; no expressions, names or nested calls)"
        ) from None
    _check_nesting(value)
    return value


def _check_plain_names(text: str) -> None:
    """Names are matched exactly as written: Python's parser NFKC-normalises identifiers (``ｃｄ`` -> ``cd``,
    ``𝐥𝐬`` -> ``ls``), which the JSON forms never do, so any name that normalisation would change is refused."""
    try:
        tokens = list(tokenize.generate_tokens(StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return  # ast.parse accepted it; nothing to compare
    for t in tokens:
        if t.type == tokenize.NAME and unicodedata.normalize("NFKC", t.string) != t.string:
            raise CallRejected(
                f"name {t.string!r} is not written in plain characters (it would be read as "
                f"{unicodedata.normalize('NFKC', t.string)!r}); names are matched exactly as written"
            )


def _check_call_id(call_id: Any) -> str | None:
    if call_id is None:
        return None
    if not isinstance(call_id, str) or not call_id or len(call_id) > MAX_CALL_ID_CHARS:
        raise CallRejected(f"a tool-call id must be a string of 1 to {MAX_CALL_ID_CHARS} characters")
    return call_id


def parse_call_string(text: str, call_id: str | None = None) -> ToolCall:
    """``"mv(source='a', destination='b')"`` -> ToolCall. Raises CallRejected."""
    if not isinstance(text, str):
        raise CallRejected(f"a call must be a string, got {type(text).__name__}")
    if len(text) > MAX_CALL_CHARS:
        raise CallRejected(f"call is {len(text)} characters long; the limit is {MAX_CALL_CHARS}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise CallRejected(f"not a valid function call: {type(e).__name__}: {e}") from None
    _check_plain_names(text.strip())
    call = tree.body
    if not isinstance(call, ast.Call):
        raise CallRejected("expected a single function call like name(arg=value)")
    if not isinstance(call.func, ast.Name):
        raise CallRejected("the called function must be a plain tool name (no attributes, subscripts or calls)")
    args = []
    for i, a in enumerate(call.args):
        if isinstance(a, ast.Starred):
            raise CallRejected("*args unpacking is not allowed")
        args.append(_literal(a, f"positional argument {i}"))
    kwargs: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise CallRejected("**kwargs unpacking is not allowed")
        if kw.arg in kwargs:
            raise CallRejected(f"argument {kw.arg!r} given twice")
        kwargs[kw.arg] = _literal(kw.value, f"argument {kw.arg!r}")
    return ToolCall(name=call.func.id, kwargs=kwargs, args=tuple(args), id=call_id)


def parse_json_call(obj: Mapping[str, Any], call_id: str | None = None) -> ToolCall:
    """OpenAI-style ``{"name": ..., "arguments": {...} | "json"}`` -> ToolCall."""
    if "function" in obj and isinstance(obj["function"], Mapping):  # full OpenAI tool_call dict
        call_id = _check_call_id(obj.get("id", call_id))
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise CallRejected("a tool call needs a non-empty string 'name'")
    if len(name) > MAX_NAME_CHARS:
        raise CallRejected(f"tool name longer than {MAX_NAME_CHARS} characters")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        if len(arguments) > MAX_CALL_CHARS:
            raise CallRejected(f"arguments are {len(arguments)} characters long; the limit is {MAX_CALL_CHARS}")
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:
            raise CallRejected(f"arguments of {name!r} are not valid JSON: {e}") from None
    if not isinstance(arguments, Mapping):
        raise CallRejected(f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    if not all(isinstance(k, str) for k in arguments):
        raise CallRejected(f"argument names of {name!r} must be strings")
    _check_nesting(dict(arguments))
    return ToolCall(name=name, kwargs=dict(arguments), id=call_id)


def to_tool_call(raw: Any, call_id: str | None = None) -> ToolCall | ToolCallError:
    """Any accepted call form -> ToolCall, or ToolCallError saying why not."""
    if isinstance(raw, (ToolCall, ToolCallError)):
        return raw
    try:
        if isinstance(raw, str):
            return parse_call_string(raw, call_id)
        if isinstance(raw, Mapping):
            return parse_json_call(raw, call_id)
        raise CallRejected(
            f"a call must be a string or an object with 'name' and 'arguments', got {type(raw).__name__}"
        )
    except CallRejected as e:
        text = raw[:200] if isinstance(raw, str) else repr(raw)[:200]
        return ToolCallError(
            raw=valid_text(text),
            message=valid_text(str(e)),
            id=call_id if isinstance(call_id, str) and len(call_id) <= MAX_CALL_ID_CHARS else None,
        )
