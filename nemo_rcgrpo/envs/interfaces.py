"""The seam between the rollout engine and an environment, as Protocols (shapes in the docstrings).

The engine (`rollout/multi_turn.py`) names none of BFCL's types. It gets an ``EnvOpener``, whose ``open(task)``
returns a fresh environment already reset on the task, and the opening messages. Whatever the environment needs
for that, such as BFCL's memoised gold replays, stays on its side of the seam. Openers are registered by name
(kind ``env``, setting ``env.name``; `envs/sources.py: make_opener`); BFCL's is `envs/bfcl/config.py: BFCLOpener`,
and `examples/plugins/kv_store` has one outside the package.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from nemo_rcgrpo.types import Message, Observation, OfficialVerdict, RewardInfo, ToolCall, ToolCallError


class Task(Protocol):
    """One task of a suite: any object with these two attributes (a frozen dataclass is usual); what else it holds
    (its question, its initial state, its gold answer) is the env's business, read in ``EnvOpener.open``."""

    id: str  # unique within its task source: its key in Suite.tasks and in the data's rl_*.jsonl pointers
    category: str  # what the per-category metrics are keyed on (eval_accuracy_<category>)


class Suite(Protocol):
    """What a task source returns, checked once when it is built, before anything trains (`envs/contract.py:
    check_suite`). ``prepare-data``, ``rcgrpo eval policy=oracle`` and BFCL's env also need ``gold(task)`` (the
    ground-truth replay) and ``split(seed, test_fraction)`` (train / held-out ids): subclass `envs/bfcl/suite.py:
    BFCLSuite` for them, or bring your own data builder (`examples/plugins/kv_store/make_data.py`)."""

    tasks: Mapping[str, Task]  # {task.id: task}; tools a task carries as dicts must be OpenAI function schemas

    def __getitem__(self, task_id: str) -> Task: ...  # tasks[task_id]


class StepResult(Protocol):
    """What ``Env.step`` returns (any object with these attributes; a dataclass is usual)."""

    observations: Sequence[Observation]  # one per call of the step but ``done``, in order (ok False: an error)
    messages: list[Message]  # what the conversation gets next: tool results, then the next user turn if any
    tools_changed: bool  # True when ``Env.tools`` changed (a held-out function revealed): the engine re-reads it


@runtime_checkable
class Env(Protocol):
    """One rollout's environment. Model output is untrusted: ``step`` turns a malformed or forbidden call into an
    error observation and never raises for one. Besides ``tools`` the engine's parser knows one call more,
    ``done`` (no arguments): the model says it has finished. Where ``tools`` offers ``done``, the engine ends the
    episode at that call (``step`` gets the calls up to it, never those after it), whether or not ``step`` sets
    ``done``. A truncated episode (the engine's limits, or ``truncated`` set by the env) pays 0 whatever ``reward``
    says. What every method returns is checked by the engine (`envs/contract.py`)."""

    done: bool  # the episode is over (``reward`` may be read)
    truncated: str | None  # why it was cut short (reward 0), or None

    @property
    def tools(self) -> list[dict[str, Any]]: ...  # the OpenAI tool schemas offered now

    def step(self, calls: Sequence[ToolCall | ToolCallError]) -> StepResult: ...  # one assistant message's calls

    def truncate(self, reason: str) -> None: ...  # end the episode now, reward 0

    def reward(self) -> RewardInfo: ...  # value a finite float in [0, 1], state_ok and actions_ok bools, details dict

    def official_verdict(self) -> OfficialVerdict | None: ...  # an external checker's verdict, where there is one


class EnvOpener(Protocol):
    """What an ``env`` factory returns. ``open`` is called once per rollout (and once before training, on the first
    training task, to check it): return a new Env each time, never one shared by two rollouts. One opener serves a
    run's training rollouts and its held-out evaluation episodes alike: keep per-episode state in the Env. With
    rollouts generated ahead (``rl.max_staleness`` >= 1) and an in-training evaluation, ``open`` and the Envs it
    returned are called from two threads (the rollout thread and the trainer's): state shared between Envs (a
    cache, a counter) must be safe for that."""

    def open(self, task: Any) -> tuple[Env, list[Message]]: ...  # a fresh env reset on task; its opening messages
