"""Typed containers shared across the pipeline.

Messages stay plain OpenAI chat dicts (``{"role": ..., "content": ...}``,
assistant ``tool_calls``, tool ``tool_call_id``) because that is what chat
templates, datasets and servers all speak; everything the project itself
reasons about (tool calls, observations, rewards) is a frozen dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for, after parsing (not yet validated).

    ``args`` holds positional arguments exactly as written in a BFCL-style call
    string (``sort('a.txt')``); they are bound to parameter names against the
    method signature at dispatch time. OpenAI-style calls only use ``kwargs``.
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: tuple[Any, ...] = ()
    id: str | None = None


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be parsed. The env turns it into an error observation."""

    raw: str
    message: str
    id: str | None = None


@dataclass(frozen=True)
class Observation:
    """The result string of one call, as the model will see it."""

    content: str
    ok: bool
    name: str | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True)
class RewardInfo:
    """R = R_state x R_action (the RC-GRPO paper, Appendix D), with both components kept."""

    value: float
    state_ok: bool
    actions_ok: bool
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OfficialVerdict:
    """The BFCL multi-turn checker's decision for a per-turn episode."""

    valid: bool
    error_type: str | None = None
    error_message: str | None = None
    turn: int | None = None


def valid_text(text: str) -> str:
    """``text`` as valid Unicode: lone surrogates (``"\\ud800"`` from a JSON escape) become their escape text.

    Observations are tokenised; a string that cannot be encoded as UTF-8 would make the tokenizer raise."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
