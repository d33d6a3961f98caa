"""BFCL v4 multi-turn tasks, ground truth and tool docs, read from `bfcl-eval`.

Four categories x 200 entries (base, miss_func, miss_param, long_context).
Entries with the same number across the four files are the same scenario.
Everything is loaded into immutable task objects, owned by a `BFCLSuite`
(`suite.py`, which also memoises each task's ground-truth replay,
`suite.gold(task)`, so a group of G rollouts replays the ground truth once).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from nemo_rcgrpo.envs.bfcl.schemas import ResponseMode, to_openai_tool
from nemo_rcgrpo.envs.interfaces import DataError
from nemo_rcgrpo.types import Message

CATEGORIES: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")


def category_order(category: str) -> tuple[int, str]:
    """Sort key: BFCL's categories in BFCL's order, then another task source's categories by name."""
    return (CATEGORIES.index(category), "") if category in CATEGORIES else (len(CATEGORIES), category)


# The eight executable APIs of the multi-turn categories: class -> (module, doc file).
_FUNC_SOURCE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
API_CLASSES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "GorillaFileSystem": (f"{_FUNC_SOURCE}.gorilla_file_system", "gorilla_file_system.json"),
        "MathAPI": (f"{_FUNC_SOURCE}.math_api", "math_api.json"),
        "MessageAPI": (f"{_FUNC_SOURCE}.message_api", "message_api.json"),
        "TwitterAPI": (f"{_FUNC_SOURCE}.posting_api", "posting_api.json"),
        "TicketAPI": (f"{_FUNC_SOURCE}.ticket_api", "ticket_api.json"),
        "TradingBot": (f"{_FUNC_SOURCE}.trading_bot", "trading_bot.json"),
        "TravelAPI": (f"{_FUNC_SOURCE}.travel_booking", "travel_booking.json"),
        "VehicleControlAPI": (f"{_FUNC_SOURCE}.vehicle_control", "vehicle_control.json"),
    }
)
STATELESS_CLASSES = frozenset({"MathAPI"})  # built without _load_scenario, as in BFCL

# BFCL's user message for a miss_func turn that only announces the held-out tools.
HOLDOUT_TURN_PROMPT = "I have updated some more functions you can choose from. What about now?"


class BFCLDataError(DataError):
    """The bfcl-eval package or its data files are missing or inconsistent."""


def bfcl_data_dir() -> Path:
    """Where the installed bfcl-eval keeps its data, without importing the package.

    Importing some bfcl_eval modules creates folders inside site-packages, so the
    path is found through the import system's metadata only.
    """
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BFCLDataError(
            "bfcl-eval is not installed. Run `make install` (it installs "
            "bfcl-eval==2026.3.23 with --no-deps) or `pip install --no-deps bfcl-eval==2026.3.23 mpmath`."
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise BFCLDataError(f"missing BFCL data file {path}; reinstall bfcl-eval==2026.3.23 (make install)")
    rows = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise BFCLDataError(
                    f"corrupt BFCL data file {path} (line {number}: {e}); reinstall bfcl-eval==2026.3.23 (make install)"
                ) from None
    return rows


@dataclass(frozen=True)
class ToolDoc:
    """One documented API method: the BFCL doc, the class that owns it, its signature."""

    name: str
    class_name: str
    doc: Mapping[str, Any]
    signature: inspect.Signature  # of the unbound method (first parameter: self)

    @property
    def parameters(self) -> Mapping[str, Any]:
        return (self.doc.get("parameters") or {}).get("properties") or {}

    @property
    def required(self) -> tuple[str, ...]:
        return tuple((self.doc.get("parameters") or {}).get("required") or ())


@dataclass(frozen=True, eq=False)
class BFCLTask:
    """One BFCL multi-turn entry. Treat as read-only; envs deep-copy what they mutate."""

    id: str
    category: str
    turns: tuple[tuple[Message, ...], ...]  # user messages per turn; () = miss_func holdout turn
    ground_truth: tuple[tuple[str, ...], ...]  # call strings per turn
    initial_config: Mapping[str, Any]
    involved_classes: tuple[str, ...]
    tools: tuple[ToolDoc, ...]  # every documented method of the involved classes
    missed_functions: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    excluded_functions: tuple[str, ...] = ()

    @property
    def long_context(self) -> bool:
        return self.category == "long_context"

    @property
    def scenario(self) -> int:
        """The number shared by the same scenario across the four categories."""
        return int(self.id.rsplit("_", 1)[1])

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def tool(self, name: str) -> ToolDoc | None:
        for t in self.tools:
            if t.name == name:
                return t
        return None

    def offered_tool_names(self, turn: int | None) -> frozenset[str]:
        """Tools the model may call at ``turn`` (None: all of them, e.g. merged episodes)."""
        names = {t.name for t in self.tools}
        if turn is None:
            return frozenset(names)
        for t, missed in self.missed_functions.items():
            if t > turn:
                names.difference_update(missed)
        return frozenset(names)

    def openai_tools(self, turn: int | None = None, response: ResponseMode = "description") -> list[dict]:
        """OpenAI function schemas of the tools offered at ``turn``, in doc order."""
        offered = self.offered_tool_names(turn)
        return [to_openai_tool(dict(t.doc), response) for t in self.tools if t.name in offered]


def _public_method_signature(cls: type, name: str) -> inspect.Signature:
    fn = inspect.getattr_static(cls, name, None)
    if name.startswith("_") or not inspect.isfunction(fn):
        raise BFCLDataError(f"documented tool {name} is not a public method of {cls.__name__}")
    return inspect.signature(fn)


def _called_name(call: str) -> str:
    return call.split("(", 1)[0].strip()


def _holdout_schedule(entry: dict[str, Any], ground_truth: list[list[str]]) -> dict[int, tuple[str, ...]]:
    """miss_func: turn -> tools first offered at that turn.

    One BFCL entry (multi_turn_miss_func_49) has its ground truth call ``tail``
    at turn 1 although ``tail`` is held out until turn 3; BFCL's executor does
    not gate tools, so its checker never notices. Here tools are gated, so a
    held-out tool that the ground truth itself uses earlier is offered from
    that earlier turn on (the data is made consistent, not the check relaxed).
    """
    schedule = {}
    for turn_key, names in (entry.get("missed_function") or {}).items():
        turn = int(turn_key)
        used_before = {_called_name(c) for calls in ground_truth[:turn] for c in calls}
        schedule[turn] = tuple(n for n in names if n not in used_before)
    return schedule
