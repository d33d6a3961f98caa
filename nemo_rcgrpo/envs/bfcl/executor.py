"""Safe execution of model-written tool calls against per-rollout BFCL API objects.

Model output is data, never code. BFCL's own executor ``eval()``s the call
text (arbitrary code execution) and caches API objects in module globals; this
one instead:

1. takes calls parsed by `calls.py` (a call string through ``ast``, or an
   OpenAI-style ``{"name", "arguments"}`` call; every argument a literal, so
   nested calls, names, lambdas and attribute chains are refused there);
2. dispatches only to documented public methods of the rollout's own
   instances that are offered at this point of the episode;
3. binds arguments to the method signature before anything runs; with
   ``arg_types="strict"`` it also checks them against the documented types
   (the default ``"bfcl"`` lets the API method judge them, as BFCL does: one
   ground-truth call, ``close_ticket(ticket_id='ticket_001')``, relies on it);
4. formats the result exactly like BFCL's executor (str as is, dict as
   ``json.dumps`` falling back to ``str``, anything else ``str``, exceptions as
   ``"Error during execution: ..."``), so observations match the leaderboard's;
5. runs each call under `isolation.isolated`: alone in the process, on the rollout's private copies of BFCL's
   module-level objects, with the numeric state MathAPI changes restored.

Every rejection comes back as an error observation, never as an exception.
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Literal, Mapping, get_args

from nemo_rcgrpo.envs.bfcl.isolation import isolated
from nemo_rcgrpo.envs.bfcl.tasks import ToolDoc
from nemo_rcgrpo.envs.calls import CallRejected
from nemo_rcgrpo.types import ToolCall, valid_text

MAX_PRECISION = 1_000  # MathAPI precision / decimal_places arguments (digits)
MAX_TREE_ENTRIES = 100_000  # paths that GorillaFileSystem.find / du may walk
MAX_INT_EXPONENT = 4_096  # MathAPI power() with integer base and exponent
MAX_POWER_BITS = 1_000_000  # and the size of its result: bits of the base x the exponent
MAX_WALK_CHARS = 4_000_000  # total path characters a find / du walk may produce (its output is built from them)

# --------------------------------------------------------------------------- validation

_JSON_TYPES: Mapping[str, tuple[type, ...]] = MappingProxyType(
    {
        "string": (str,),
        "integer": (int,),
        "float": (int, float),
        "number": (int, float),
        "boolean": (bool,),
        "array": (list, tuple),
        "list": (list, tuple),
        "tuple": (list, tuple),
        "dict": (dict,),
        "object": (dict,),
    }
)


def _check_type(value: Any, spec: Mapping[str, Any], where: str) -> None:
    typ = spec.get("type", "any")
    if typ == "any" or value is None and "default" in spec:
        return
    allowed = _JSON_TYPES.get(typ)
    if allowed is None:
        return
    if isinstance(value, bool) and bool not in allowed:
        raise CallRejected(f"{where} must be of type {typ}, got a boolean")
    if not isinstance(value, allowed):
        raise CallRejected(f"{where} must be of type {typ}, got {type(value).__name__} {value!r:.60}")
    if "items" in spec and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_type(item, spec["items"], f"{where}[{i}]")


def _as_number(value: Any) -> float | None:
    """What mpmath/decimal/round would make of an argument (they accept numeric strings too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _walk_fits(directory: Any, max_entries: int, max_chars: int) -> bool:
    """Whether a find / du walk below ``directory`` stays within ``max_entries`` paths and ``max_chars`` characters
    of paths in total (what find's output is built from), counted before anything is built. Shared subtrees
    (cp copies directories shallowly) are counted each time they are reached, as the walk reaches them; the
    count stops at the first bound, so a tree with 2^40 paths or a cycle costs at most ``max_entries`` steps."""
    entries, chars = 0, 0
    stack = [(directory, len(getattr(directory, "name", "") or ""))]
    while stack:
        node, length = stack.pop()
        entries += 1
        chars += length
        if entries > max_entries or chars > max_chars:
            return False
        for name, child in (getattr(node, "contents", None) or {}).items():
            path = length + 1 + len(str(name))
            if hasattr(child, "contents"):
                stack.append((child, path))
            else:
                entries += 1
                chars += path
                if entries > max_entries or chars > max_chars:
                    return False
    return True


def _resource_guard(name: str, arguments: Mapping[str, Any], instance: object) -> None:
    """Refuse arguments that would make a documented method run for minutes or exhaust memory."""
    for key in ("precision", "decimal_places"):
        if arguments.get(key) is None:
            continue
        number = _as_number(arguments[key])
        # a type the guard cannot read (bytes, containers, non-numeric text) is refused: mpmath and decimal
        # convert more than this guard would check (bytes precision ran for minutes under the global lock)
        if number is None or number != number or abs(number) > MAX_PRECISION:
            raise CallRejected(f"{key} must be a number of at most {MAX_PRECISION} digits, got {arguments[key]!r:.60}")
    if name == "power":
        base, exponent = arguments.get("base"), arguments.get("exponent")
        if isinstance(base, int) and isinstance(exponent, int) and abs(exponent) > MAX_INT_EXPONENT:
            raise CallRejected(f"integer exponent {exponent} exceeds the limit of {MAX_INT_EXPONENT}")
        if isinstance(base, int) and isinstance(exponent, int) and base.bit_length() * exponent > MAX_POWER_BITS:
            # a 4,300-digit base to the 4096th took 28 s under the numeric-state lock
            raise CallRejected(f"the result of power would hold more than {MAX_POWER_BITS} bits")
    if name in ("find", "du") and hasattr(instance, "root"):
        # cp copies directories shallowly, so copies share subtrees and a few dozen calls
        # build a tree whose walk is exponential (2^40 paths from 160 calls)
        if not _walk_fits(instance.root, MAX_TREE_ENTRIES, MAX_WALK_CHARS):
            raise CallRejected(
                f"the directory tree has more than {MAX_TREE_ENTRIES} entries or "
                f"{MAX_WALK_CHARS} characters of paths to walk"
            )


# --------------------------------------------------------------------------- dispatch


@dataclass(frozen=True)
class ExecutedCall:
    """A call that passed validation and ran. ``arguments`` are bound by name."""

    name: str
    arguments: Mapping[str, Any]  # explicit arguments only (positional bound to names)
    full_arguments: Mapping[str, Any]  # with the signature's defaults applied
    result: str
    ok: bool  # False when the API method itself raised


def format_result(result: Any) -> str:
    """BFCL's result formatting (multi_turn_utils.execute_multi_turn_func_call)."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:  # noqa: BLE001 - a result JSON cannot hold is shown as text
            return str(result)
    return str(result)


def _bind(tool: ToolDoc, call: ToolCall) -> inspect.BoundArguments:
    try:
        return tool.signature.bind(None, *call.args, **call.kwargs)  # None stands in for self
    except TypeError as e:
        raise CallRejected(f"invalid arguments for {call.name}: {e}") from None


def named_arguments(tool: ToolDoc, call: ToolCall) -> dict[str, Any]:
    """The call's explicit arguments with positional ones bound to parameter names."""
    return {k: v for k, v in _bind(tool, call).arguments.items() if k != "self"}


ArgTypes = Literal["bfcl", "strict"]
ARG_TYPE_MODES: tuple[str, ...] = get_args(ArgTypes)


class Toolbox:
    """The callable surface of one rollout: its own API instances, documented tools only."""

    def __init__(self, instances: Mapping[str, object], tools: Iterable[ToolDoc], arg_types: ArgTypes = "bfcl"):
        if arg_types not in ARG_TYPE_MODES:
            raise ValueError(f"unknown arg_types {arg_types!r}; choose one of {ARG_TYPE_MODES}")
        self.arg_types = arg_types
        self.instances = dict(instances)
        # Only documented tools of involved classes; ToolDoc carries the method's signature,
        # checked at load time to be a public function of the class.
        self._tools: dict[str, ToolDoc] = {t.name: t for t in tools if t.class_name in self.instances}

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._tools)

    def bind(self, call: ToolCall, offered: frozenset[str] | None = None) -> tuple[ToolDoc, inspect.BoundArguments]:
        """Resolve and validate a call without running it. Raises CallRejected."""
        if call.name not in self._tools:
            raise CallRejected(
                f"unknown tool {call.name!r}; available tools: {', '.join(sorted(offered or self._tools))}"
            )
        if offered is not None and call.name not in offered:
            raise CallRejected(f"tool {call.name!r} is not available at this point of the conversation")
        tool = self._tools[call.name]
        bound = _bind(tool, call)
        explicit = {k: v for k, v in bound.arguments.items() if k != "self"}
        params = tool.parameters
        for key, value in explicit.items():
            if key not in params:
                raise CallRejected(f"{call.name} has no documented parameter {key!r}")
            if self.arg_types == "strict":
                _check_type(value, params[key], f"{call.name}.{key}")
        _resource_guard(call.name, explicit, self.instances[tool.class_name])
        return tool, bound

    def execute(self, call: ToolCall, offered: frozenset[str] | None = None) -> ExecutedCall:
        """Run one validated call. Raises CallRejected when it must not run."""
        tool, bound = self.bind(call, offered)
        explicit = {k: v for k, v in bound.arguments.items() if k != "self"}
        # The method gets private copies: APIs store argument lists in their state
        # (and extend them later), which must not reach this record or another rollout.
        # Mutable defaults are passed as fresh copies too: TwitterAPI.post_tweet's
        # ``mentions=[]`` is one list shared by every instance in the process.
        call_args = copy.deepcopy(explicit)
        for param in tool.signature.parameters.values():
            if param.name not in call_args and param.name != "self" and isinstance(param.default, (list, dict, set)):
                call_args[param.name] = copy.deepcopy(param.default)
        method = getattr(self.instances[tool.class_name], tool.name)
        with isolated(self.instances[tool.class_name], tool.name):  # BFCL's module-level objects: the rollout's own
            try:
                result, ok = format_result(method(**call_args)), True
            except Exception as e:  # noqa: BLE001 - the API's own errors are observations, as in BFCL
                result, ok = f"Error during execution: {e}", False
        result = valid_text(result)
        bound.apply_defaults()
        full = {k: v for k, v in bound.arguments.items() if k != "self"}
        return ExecutedCall(tool.name, explicit, full, result, ok)
