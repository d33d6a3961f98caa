"""A key-value store environment for RC-GRPO, outside the package: its tasks, its environment and its reward.

Registered by name when imported (``plugins=[kv_store]`` with this folder on PYTHONPATH):

    task_source  kv_store   360 generated tasks of one or two calls (put / get / delete) on a small store
    env          kv_store   one store per rollout; the reward is the final store against the task's target
    env_settings kv_store   its settings, env.settings of a run (max_steps)

Nothing here imports BFCL: the rollout engine meets this environment only through the Protocols of
`nemo_rcgrpo/envs/interfaces.py` (an opener's ``open(task)`` -> (Env, opening messages); ``Env.step(calls)``).
Model output is untrusted: an unknown tool, a missing or non-string argument, a call that could not be parsed,
each becomes an error observation the model reads, never an exception.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from nemo_rcgrpo import register
from nemo_rcgrpo.types import Observation, RewardInfo, ToolCall

SYSTEM = "You manage a key-value store through the provided tools. Do what the user asks, then call done()."
KEYS = ("colour", "shape", "city", "fruit", "animal", "size", "metal", "planet")
VALUES = (
    "red",
    "blue",
    "green",
    "round",
    "square",
    "paris",
    "lima",
    "apple",
    "plum",
    "fox",
    "owl",
    "small",
    "large",
    "iron",
    "gold",
    "mars",
    "venus",
)


def _tool(name: str, description: str, params: Sequence[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string"} for p in params},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool("put", "Store value under key (replaces an old value).", ("key", "value")),
    _tool("get", "Return the value stored under key.", ("key",)),
    _tool("delete", "Remove key and its value.", ("key",)),
    _tool("done", "Call when the request is complete.", ()),
]


@dataclass(frozen=True)
class KVTask:
    id: str
    category: str  # the per-category metrics' key
    request: str  # the user message
    initial: tuple[tuple[str, str], ...]  # the store at the start
    target: tuple[tuple[str, str], ...]  # the store the request asks for
    gold: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # the calls that do it: (name, ((arg, value), ...))


def make_tasks(seed: int = 0, per_kind: int = 120) -> dict[str, KVTask]:
    """Three kinds of request, ``per_kind`` each, from a seeded generator: store a value, copy a value from one key
    to another (a get, then a put of what it returned), delete a key."""
    rng = random.Random(seed)
    tasks: dict[str, KVTask] = {}
    for kind in ("put", "copy", "delete"):
        for _ in range(per_kind):
            a, b = rng.sample(KEYS, 2)
            x, y, z = rng.sample(VALUES, 3)
            if kind == "put":
                initial = {b: y}
                request, gold = f"Store {x} under {a}.", [("put", (("key", a), ("value", x)))]
                target = {**initial, a: x}
            elif kind == "copy":
                initial = {a: x, b: y}
                request = f"Copy the value stored under {a} to {b}."
                gold, target = [("get", (("key", a),)), ("put", (("key", b), ("value", x)))], {a: x, b: x}
            else:
                initial = {a: x, b: z}
                request, gold, target = f"Delete {a}.", [("delete", (("key", a),))], {b: z}
            tid = f"kv_{len(tasks)}"
            tasks[tid] = KVTask(
                tid, kind, request, tuple(sorted(initial.items())), tuple(sorted(target.items())), tuple(gold)
            )
    return tasks


class KVSuite:
    """The task source's suite: ``.tasks`` by id (what the RL loop and `rcgrpo eval` read)."""

    def __init__(self, categories: Sequence[str] = ()):
        self.tasks = make_tasks()

    def __getitem__(self, task_id: str) -> KVTask:
        return self.tasks[task_id]

    def oracle_calls(self, task: KVTask) -> list[list[ToolCall]]:
        """The ground truth, one user turn of calls (``rcgrpo eval policy=oracle``; the Suite's capability)."""
        return [[ToolCall(name, dict(args)) for name, args in task.gold]]


@dataclass
class Result:  # envs/interfaces.py: StepResult
    observations: list[Observation]
    messages: list[dict[str, Any]]
    tools_changed: bool = False


@dataclass
class KVEnv:
    task: KVTask
    max_steps: int = 8
    store: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    steps: int = 0
    done: bool = False
    truncated: str | None = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def step(self, calls) -> Result:
        if not calls:  # an answer without a tool call ends the episode
            self.done = True
            return Result([], [])
        self.steps += 1
        observations = []
        for i, call in enumerate(calls):
            if isinstance(call, ToolCall) and call.name == "done":
                self.done = True
                break
            observations.append(self._run(call, getattr(call, "id", None) or f"call_{self.steps}_{i}"))
        if not self.done and self.steps > self.max_steps:  # as BFCL's env: cut when the count exceeds the limit
            self.truncate(f"more than {self.max_steps} tool-calling steps")
        messages = [
            {"role": "tool", "tool_call_id": o.tool_call_id, "name": o.name or "", "content": o.content}
            for o in observations
        ]
        return Result(observations, messages)

    def _run(self, call, call_id: str) -> Observation:
        if not isinstance(call, ToolCall):  # a call that could not be parsed
            return Observation(f"Error: {call.message}", False, None, call_id)
        params = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}
        if call.name not in params:
            return Observation(f"Error: no tool named {call.name!r}", False, call.name, call_id)
        kwargs = dict(call.kwargs)
        if (
            call.args
            or sorted(kwargs) != sorted(params[call.name])
            or not all(isinstance(v, str) for v in kwargs.values())
        ):
            return Observation(
                f"Error: {call.name} takes string arguments {params[call.name]}", False, call.name, call_id
            )
        self.calls.append((call.name, kwargs))
        key = kwargs["key"]
        if call.name == "put":
            self.store[key] = kwargs["value"]
            return Observation("ok", True, call.name, call_id)
        if key not in self.store:
            return Observation(f"Error: no key {key!r}", False, call.name, call_id)
        if call.name == "get":
            return Observation(self.store[key], True, call.name, call_id)
        del self.store[key]
        return Observation("ok", True, call.name, call_id)

    def truncate(self, reason: str) -> None:
        self.done, self.truncated = True, reason

    def reward(self) -> RewardInfo:
        """1 when the store is the target and every call the request needs was made (state x actions)."""
        state_ok = self.truncated is None and tuple(sorted(self.store.items())) == self.task.target
        made = [(name, tuple(sorted(kw.items()))) for name, kw in self.calls]
        actions_ok = all((name, tuple(sorted(args))) in made for name, args in self.task.gold)
        ok = state_ok and actions_ok
        return RewardInfo(float(ok), state_ok, actions_ok, {"store": dict(self.store), "truncated": self.truncated})

    def official_verdict(self):
        return None  # no external checker for this environment


class KVOpener:  # envs/interfaces.py: EnvOpener
    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def open(self, task: KVTask):
        env = KVEnv(task, self.max_steps, dict(task.initial))
        return env, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.request}]


@register("task_source", "kv_store")
def kv_tasks(categories, data_dir=None) -> KVSuite:
    return KVSuite(categories)


@register("env_settings", "kv_store")
@dataclass(frozen=True)
class KVSettings:
    """``env.settings`` of a run with ``env.name=kv_store`` (a recipe gives ``env: {settings: {max_steps: 4}}``)."""

    max_steps: int = 8  # tool-calling steps per episode; one more cuts the episode (reward 0)

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"env.settings.max_steps={self.max_steps}: must be >= 1")


@register("env", "kv_store")
def kv_env(settings: KVSettings, suite) -> KVOpener:
    return KVOpener(max_steps=settings.max_steps)


@register("data_builder", "kv_store")
def kv_data(cfg, suite, split, rng):
    """``rcgrpo prepare-data task_source=kv_store plugins=[kv_store]``: an expert and a verified failure per task,
    played through this environment (`make_data.py: records`)."""
    from make_data import records

    if cfg.mode != "merged":
        raise ValueError(f"mode={cfg.mode}: the kv_store environment plays merged episodes only (mode=merged)")
    experts, failures = records(suite, split, rng)
    return experts, failures, {}


kv_data.env = "kv_store"  # the env of its RL pointers
