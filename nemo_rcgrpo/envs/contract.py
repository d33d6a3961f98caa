"""The plugin author's contract, checked at the seam: what a task source or an environment hands the engine.

Each check is a pure function that returns the value (normalised where that is harmless) or raises one
``PluginContractError`` line naming the plugin, the object and the field, and what to return instead:

- a task source's suite, once at load (`envs/sources.py: make_suite`): ``.tasks`` a mapping ``{id: task}``; each
  task has a non-empty string ``id`` (its key) and a non-empty string ``category``; tools a task carries as dicts
  are OpenAI function schemas;
- an environment's tools (at each opening, and again when a step says ``tools_changed``): a list of OpenAI function
  schemas ``{"type": "function", "function": {"name": str, "description": str, "parameters": {JSON Schema}}}``
  (``description`` and ``parameters`` optional), names unique;
- its opening messages and each ``step()`` result: ``observations`` a sequence of ``Observation`` (``content`` a
  string, ``ok`` a bool), ``messages`` a list of chat dicts (``role`` a string, ``content`` a string or None),
  ``tools_changed`` a bool;
- each ``reward()``: a ``RewardInfo``-like object whose ``value`` is a finite number in [0, 1] (a bool, None, a
  string or NaN is refused), ``state_ok`` / ``actions_ok`` bools and ``details`` a dict.

The rollout engine runs the per-rollout checks inside its guard, so a bad value ends that rollout alone, reward 0
and the line in its record's ``error`` (`rollout/multi_turn.py`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rcgrpo.types import Observation, RewardInfo

REWARD_RANGE = (0.0, 1.0)  # what a reward pays: 0 (failure) .. 1 (success), RC-GRPO's high token is "1"
TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


class PluginContractError(ValueError):
    """A value a plugin handed over breaks the documented contract; the message names plugin, object and field."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def where(fn: Any) -> str:
    """``Class.method (file.py:line)`` of a plugin's function, for the error lines ('' when it has no code)."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    return f"{getattr(fn, '__qualname__', fn.__name__)} ({Path(code.co_filename).name}:{code.co_firstlineno})"


def check_tools(owner: str, tools: Any) -> list[dict[str, Any]]:
    """``tools`` as a list of OpenAI function schemas with unique names."""
    if not isinstance(tools, (list, tuple)):
        raise PluginContractError(
            f"{owner}: tools is {_short(tools)}: give a list of OpenAI function schemas {TOOL_SHAPE}"
        )
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        field = f"{owner}: tools[{i}]"
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), Mapping)
        ):
            raise PluginContractError(
                f"{field} is {_short(tool)}: a tool is an OpenAI function schema {TOOL_SHAPE} "
                '(the "function" wrapper included)'
            )
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise PluginContractError(f"{field}.function.name is {_short(name)}: give the tool's name as a string")
        if name in seen:
            raise PluginContractError(f"{field}: a second tool named {name!r}; tool names must be unique")
        seen.add(name)
        if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
            raise PluginContractError(
                f"{field}.function.parameters is {_short(fn['parameters'])}: give a JSON "
                'Schema object, e.g. {"type": "object", "properties": {...}}'
            )
        if "description" in fn and not isinstance(fn["description"], str):
            raise PluginContractError(f"{field}.function.description is {_short(fn['description'])}: give a string")
    return list(tools)


def check_messages(owner: str, messages: Any) -> list[dict[str, Any]]:
    """``messages`` as a list of chat dicts with a string role and string-or-None content."""
    if not isinstance(messages, list):
        raise PluginContractError(
            f'{owner} is {_short(messages)}: give a list of chat messages {{"role": ..., "content": ...}}'
        )
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"]:
            raise PluginContractError(
                f'{owner}[{i}] is {_short(m)}: a message is a dict with a string "role" (tool, user, ...) and "content"'
            )
        if not isinstance(m.get("content"), (str, type(None))):
            raise PluginContractError(f"{owner}[{i}].content is {_short(m.get('content'))}: give a string (or None)")
    return messages


def check_step(owner: str, result: Any) -> Any:
    """A ``step()`` result (envs/interfaces.py: StepResult): observations, messages, tools_changed."""
    if result is None or not all(hasattr(result, f) for f in ("observations", "messages", "tools_changed")):
        missing = [f for f in ("observations", "messages", "tools_changed") if not hasattr(result, f)]
        raise PluginContractError(
            f"{owner}: step() returned {_short(result)}, which has no {', '.join(missing)}: "
            "return an object with observations, messages and tools_changed (StepResult)"
        )
    observations = result.observations
    if isinstance(observations, (str, bytes)) or not isinstance(observations, Sequence):
        raise PluginContractError(
            f"{owner}: step().observations is {_short(observations)}: give a list of "
            "Observation(content, ok, name, tool_call_id)"
        )
    for i, o in enumerate(observations):
        if not isinstance(o, Observation):
            raise PluginContractError(
                f"{owner}: step().observations[{i}] is {_short(o)}, not an Observation: "
                "return nemo_rcgrpo.types.Observation(content, ok, name, tool_call_id)"
            )
        if not isinstance(o.content, str) or not isinstance(o.ok, bool):
            raise PluginContractError(
                f"{owner}: step().observations[{i}] has content {_short(o.content)} and ok "
                f"{_short(o.ok)}: content is a string, ok a bool"
            )
    check_messages(f"{owner}: step().messages", result.messages)
    if not isinstance(result.tools_changed, bool):
        raise PluginContractError(
            f"{owner}: step().tools_changed is {_short(result.tools_changed)}: give True (Env.tools changed) or False"
        )
    return result


def check_reward(owner: str, info: Any) -> RewardInfo:
    """A ``reward()`` result as a RewardInfo with a finite float value in REWARD_RANGE."""
    lo, hi = REWARD_RANGE
    if not all(hasattr(info, f) for f in ("value", "state_ok", "actions_ok", "details")):
        raise PluginContractError(
            f"{owner}: reward() returned {_short(info)}: return "
            "nemo_rcgrpo.types.RewardInfo(value, state_ok, actions_ok, details)"
        )
    value = info.value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PluginContractError(
            f"{owner}: reward().value is {_short(value)} ({type(value).__name__}): give a "
            f"float in [{lo:g}, {hi:g}], e.g. float(success)"
        )
    if not math.isfinite(float(value)) or not lo <= float(value) <= hi:
        raise PluginContractError(
            f"{owner}: reward().value is {float(value)!r}: give a finite float in [{lo:g}, {hi:g}]"
        )
    for name in ("state_ok", "actions_ok"):
        if not isinstance(getattr(info, name), bool):
            raise PluginContractError(f"{owner}: reward().{name} is {_short(getattr(info, name))}: give a bool")
    if not isinstance(info.details, Mapping):
        raise PluginContractError(
            f"{owner}: reward().details is {_short(info.details)}: give a dict (it goes into the rollout dump)"
        )
    return RewardInfo(float(value), info.state_ok, info.actions_ok, dict(info.details))


def check_suite(source: str, suite: Any) -> Any:
    """A task source's suite: ``.tasks`` ``{id: task}``, every task with its id and a category (and any tools it
    carries as dicts OpenAI function schemas). Read once at load, before anything trains."""
    owner = f"task source {source}"
    tasks = getattr(suite, "tasks", None)
    if not isinstance(tasks, Mapping):
        raise PluginContractError(f"{owner}: the suite's .tasks is {_short(tasks)}: give a dict {{task id: task}}")
    for key, task in tasks.items():
        tid = getattr(task, "id", None)
        if not isinstance(tid, str) or not tid:
            raise PluginContractError(
                f"{owner}: task {_short(key)} has id {_short(tid)}: a task is an object with "
                "a non-empty string .id (its key in .tasks) and .category"
            )
        if tid != key:
            raise PluginContractError(f"{owner}: the task filed under {key!r} has id {tid!r}: key .tasks by task id")
        category = getattr(task, "category", None)
        if not isinstance(category, str) or not category:
            raise PluginContractError(
                f"{owner}: task {tid} has category {_short(category)}: give every task a "
                "non-empty string .category (what the per-category metrics are keyed on)"
            )
        tools = getattr(task, "tools", None)
        if isinstance(tools, (list, tuple)) and any(isinstance(t, Mapping) for t in tools):
            check_tools(f"{owner}: task {tid}", tools)
    if not hasattr(suite, "__getitem__"):
        raise PluginContractError(
            f"{owner}: the suite has no suite[task_id]: add __getitem__ returning .tasks[task_id]"
        )
    return suite
