"""Failure trajectories (paper, Appendix B): wrong tool, parameter errors, premature termination.

Each failure type is a registered perturbation operator ``(task, plan, rng) ->
(plan, description) | None`` applied to an expert plan. A perturbed plan is
played through the environment (so observations are real, including the
errors the mistake causes downstream) and kept only if the environment gives
it reward 0; one that still scores 1 is discarded and another perturbation is
tried. Failures can also come from recorded rollouts (`load_rollout_failures`),
re-verified the same way.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask, ToolDoc
from nemo_rcgrpo.envs.bfcl.trajectories import Plan, PlayedTrajectory, play, replay_messages
from nemo_rcgrpo.envs.interfaces import Suite
from nemo_rcgrpo.registry import lookup, names, register
from nemo_rcgrpo.types import ToolCall

Perturbation = Callable[[BFCLTask, Plan, random.Random], "tuple[Plan, str] | None"]


def register_failure(name: str) -> Callable[[Perturbation], Perturbation]:
    """``@register("failure", name)``."""
    return register("failure", name)


def _positions(plan: Plan) -> list[tuple[int, int]]:
    return [(t, i) for t, calls in enumerate(plan) for i in range(len(calls))]


def _replace(plan: Plan, turn: int, index: int, call: ToolCall | None) -> Plan:
    new = [list(calls) for calls in plan]
    if call is None:
        del new[turn][index]
    else:
        new[turn][index] = call
    return new


def _param_names(tool: ToolDoc) -> set[str]:
    return set(tool.parameters)


def _compatible_tools(task: BFCLTask, call: ToolCall, turn: int) -> list[tuple[int, ToolDoc]]:
    """Other offered tools that accept a subset of the call's arguments, ranked by overlap."""
    own = task.tool(call.name)
    offered = task.offered_tool_names(turn)
    given = set(call.kwargs)
    out = []
    for tool in task.tools:
        if tool.name == call.name or tool.name not in offered:
            continue
        shared = _param_names(tool) & given
        if not set(tool.required) <= given or (given and not shared):
            continue
        same_class = own is not None and tool.class_name == own.class_name
        out.append((len(shared) * 2 + same_class, tool))
    return sorted(out, key=lambda x: (-x[0], x[1].name))


@register_failure("wrong_tool")
def wrong_tool(task: BFCLTask, plan: Plan, rng: random.Random):
    """Replace one call by another tool that accepts its arguments (e.g. cp for mv)."""
    candidates = []
    for turn, index in _positions(plan):
        ranked = _compatible_tools(task, plan[turn][index], turn)
        if ranked:
            best = ranked[0][0]
            candidates.append((turn, index, [tool for score, tool in ranked if score == best]))
    if not candidates:
        return None
    turn, index, tools = rng.choice(candidates)
    tool = rng.choice(tools)
    old = plan[turn][index]
    kwargs = {k: v for k, v in old.kwargs.items() if k in tool.parameters}
    return _replace(plan, turn, index, ToolCall(tool.name, kwargs)), f"turn {turn}: {old.name} -> {tool.name}"


def _string_pool(plan: Plan) -> list[str]:
    return sorted({v for calls in plan for c in calls for v in c.kwargs.values() if isinstance(v, str)})


def _perturb_value(value: Any, pool: list[str], rng: random.Random) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([-1, 1, 10])
    if isinstance(value, float):
        return round(value * rng.choice([0.5, 1.1, 2.0]) + rng.choice([0.0, 1.0]), 2)
    if isinstance(value, str):
        others = [s for s in pool if s != value]
        options = [f"{value}_1", value[:-1] if len(value) > 1 else value + value]
        if others:
            options.append(rng.choice(others))
        return rng.choice(options)
    if isinstance(value, list) and value:
        mutated = list(value)
        if rng.random() < 0.5 and len(mutated) > 1:
            mutated.pop(rng.randrange(len(mutated)))
        else:
            i = rng.randrange(len(mutated))
            mutated[i] = _perturb_value(mutated[i], pool, rng)
        return mutated
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        return {**value, key: _perturb_value(value[key], pool, rng)}
    return None  # nothing sensible to change


@register_failure("wrong_param")
def wrong_param(task: BFCLTask, plan: Plan, rng: random.Random):
    """Change one argument value of one call (a wrong file name, amount, flag, ...)."""
    positions = [(t, i) for t, i in _positions(plan) if plan[t][i].kwargs]
    if not positions:
        return None
    turn, index = rng.choice(positions)
    old = plan[turn][index]
    key = rng.choice(sorted(old.kwargs))
    value = _perturb_value(old.kwargs[key], _string_pool(plan), rng)
    if value is None or value == old.kwargs[key]:
        return None
    call = ToolCall(old.name, {**old.kwargs, key: value})
    return _replace(plan, turn, index, call), f"turn {turn}: {old.name}.{key} {old.kwargs[key]!r} -> {value!r}"


@register_failure("premature_termination")
def premature_termination(task: BFCLTask, plan: Plan, rng: random.Random):
    """Stop after k of the N planned calls (the agent believes it is done)."""
    positions = _positions(plan)
    if not positions:
        return None
    k = rng.randrange(len(positions))
    kept = set(positions[:k])
    new = [[c for i, c in enumerate(calls) if (t, i) in kept] for t, calls in enumerate(plan)]
    return new, f"stopped after {k} of {len(positions)} calls"


@dataclass
class Failure:
    played: PlayedTrajectory
    failure_type: str
    detail: str
    source: str  # perturbation | rollout


SHIPPED_FAILURES = names("failure")  # the types above, in order (fallbacks; a plugin registers later)


def make_failure(
    task: BFCLTask,
    plan: Plan,
    preferred: str,
    rng: random.Random,
    play_kwargs: Mapping[str, Any],
    max_tries: int = 20,
) -> Failure | None:
    """A verified (reward 0) failure of ``task``: the preferred type first, then the shipped ones (not a plugin's:
    the same seed gives the same data whatever is installed)."""
    order = [preferred] + [name for name in SHIPPED_FAILURES if name != preferred]
    for name in order:
        operator = lookup("failure", name)
        for _ in range(max_tries):
            perturbed = operator(task, plan, rng)
            if perturbed is None:
                continue
            new_plan, detail = perturbed
            played = play(task, new_plan, **play_kwargs)
            if played.reward.value == 0.0:
                return Failure(played, name, detail, "perturbation")
    return None


def assign_types(n: int, weights: Mapping[str, float], rng: random.Random) -> list[str]:
    """``n`` failure types in proportion to ``weights`` (largest remainder), shuffled."""
    for name in weights:  # an unknown type: the one-line error of every registered kind
        lookup("failure", name)
    total = sum(weights.values())
    if total <= 0 or any(w < 0 for w in weights.values()):
        raise ValueError(f"failure type weights must be >= 0 with a positive sum, got {dict(weights)}")
    exact = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[: n - sum(counts.values())]:
        counts[k] += 1
    types = [k for k in sorted(counts) for _ in range(counts[k])]
    rng.shuffle(types)
    return types


def load_rollout_failures(
    paths: Iterable[str | Path], suite: Suite, mode: str
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """Reward-0 trajectories recorded by a training/eval run, re-verified by replay.

    Lines: ``{"task_id", "messages", "reward", "mode"?, "failure_type"?}``.
    Returns (task id -> verified records, counts of what was read/kept/rejected).
    """
    by_task: dict[str, list[dict[str, Any]]] = {}
    counts = {"read": 0, "kept": 0, "not_failures": 0, "other_mode": 0, "unknown_task": 0, "rejected_on_replay": 0}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"rollout file {path} does not exist (failures.rollout_files)")
        with path.open() as f:
            for line in f:
                if not line.strip():
                    continue
                counts["read"] += 1
                record = json.loads(line)
                if record.get("reward") != 0:
                    counts["not_failures"] += 1
                elif record.get("mode", mode) != mode:
                    counts["other_mode"] += 1
                elif record.get("task_id") not in suite.tasks:
                    counts["unknown_task"] += 1
                else:
                    task = suite[record["task_id"]]
                    reward, _ = replay_messages(task, record["messages"], mode, gold=suite.gold(task))
                    if reward.value != 0.0:
                        counts["rejected_on_replay"] += 1
                        continue
                    counts["kept"] += 1
                    by_task.setdefault(task.id, []).append(record)
    return by_task, counts
