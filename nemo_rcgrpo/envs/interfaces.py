"""The seam between the rollout engine and an environment, as Protocols (shapes in the docstrings).

The engine (`rollout/multi_turn.py`) names none of BFCL's types. It gets an ``EnvOpener``, whose ``open(task)``
returns a fresh environment already reset on the task, and the opening messages. Whatever the environment needs
for that, such as BFCL's memoised gold replays, stays on its side of the seam. Openers are registered by name
(kind ``env``, setting ``env.name``; `envs/sources.py: make_opener`); BFCL's is `envs/bfcl/config.py: BFCLOpener`,
and `examples/plugins/kv_store` has one outside the package.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Protocol, Sequence, get_args, runtime_checkable

from nemo_rcgrpo.types import Message, Observation, OfficialVerdict, RewardInfo, ToolCall, ToolCallError


class Task(Protocol):
    """One task of a suite: any object with these two attributes (a frozen dataclass is usual); what else it holds
    (its question, its initial state, its gold answer) is the env's business, read in ``EnvOpener.open``."""

    id: str  # unique within its task source: its key in Suite.tasks and in the data's rl_*.jsonl pointers
    category: str  # what the per-category metrics are keyed on (eval_accuracy_<category>)


class Suite(Protocol):
    """What a task source returns, checked once when it is built, before anything trains (`envs/contract.py:
    check_suite`). The generic commands ask a suite for more only where they need it; each capability is optional
    and named in the error of a command that needs one a suite lacks:

    - ``gold(task)``: the task's ground-truth replay. ``prepare-data``'s BFCL data builder and ``rcgrpo eval
      policy=oracle`` need it.
    - ``split(seed, test_fraction)``: the train / held-out ids (`envs/splits.py`). ``prepare-data`` and the paper
      protocol of ``rcgrpo eval`` need it (or the data's ``rl_test.jsonl``).
    - ``category_order(category)``: a sort key, the order of the per-category tables (default: by name).
    - ``oracle_calls(task)``: the calls an oracle makes, per user turn (``rcgrpo eval policy=oracle``; the scripted
      generator, ``generation.backend=scripted``, plays them and verified reward-0 plans with fewer calls).
    - ``scripted_messages(task, success, variant, settings, failure_type)``: the conversation a scripted rollout
      plays instead (opening, assistant messages, tool results): the ground truth (``success``) or a verified
      reward-0 failure (``variant``: which of a few, 0-3; ``failure_type``: the preferred registered ``failure``),
      for the env's ``settings``; None where no failure can be built (`generation/scripted.py`).
    - ``title``: what the evaluation results say they were run on (default: the task source's name).
    - ``data_builder``: the registered data builder of ``prepare-data`` where none has the task source's name
      (a suite built on `BFCLSuite` gets BFCL's).

    The task source itself may declare ``categories`` (a tuple attribute of the registered function): the names
    ``env.categories`` and ``categories`` are checked against, and their default. A source that declares none
    is given what the setting lists (by default nothing: all its tasks). Data a source cannot read is a `DataError` (one line, what to install or rebuild).
    `envs/bfcl/suite.py: BFCLSuite` has all of these; `examples/plugins/kv_store` shows a suite with the few it
    needs."""

    tasks: Mapping[str, Task]  # {task.id: task}; tools a task carries as dicts must be OpenAI function schemas

    def __getitem__(self, task_id: str) -> Task: ...  # tasks[task_id]


class DataError(RuntimeError):
    """A task source's data is missing or inconsistent: the message is one line naming what to install or rebuild
    (every command prints it and exits 2)."""


# The episode shapes an environment may offer (``data.mode``, BFCL's ``env.settings.mode``): merged (the paper's RL
# episode: every user turn in the first prompt, the model ends it with done()) | per_turn (user turns one at a time)
EpisodeMode = Literal["per_turn", "merged"]
EPISODE_MODES: tuple[str, ...] = get_args(EpisodeMode)


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
