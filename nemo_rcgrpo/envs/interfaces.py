"""The seam between the rollout engine and an environment, as Protocols (shapes in the docstrings).

The engine (`rollout/multi_turn.py`) names none of BFCL's types. It gets an ``EnvOpener``, whose ``open(task)``
returns a fresh environment already reset on the task, and the opening messages. Whatever the environment needs
for that, such as BFCL's memoised gold replays, stays on its side of the seam. Openers are registered by name
(kind ``env``, setting ``env.name``; `envs/sources.py: make_opener`); BFCL's is `envs/bfcl/config.py: BFCLOpener`,
and `examples/plugins/kv_store` has one outside the package.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from nemo_rcgrpo.types import Message, Observation, OfficialVerdict, RewardInfo, ToolCall, ToolCallError


class Task(Protocol):
    id: str  # unique within its task source
    category: str  # what the per-category metrics are keyed on


class StepResult(Protocol):
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
    def open(self, task: Any) -> tuple[Env, list[Message]]: ...  # a fresh env reset on task; its opening messages
