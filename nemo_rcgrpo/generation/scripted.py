"""A scripted generator (``generation.backend=scripted``): plays chosen completions instead of sampling a model, on
any environment.

For RL tests and for checking a pipeline end to end: groups get known, mixed rewards, so the path from rewards
to advantages, loss, gradient and weights is exercised even with a random tiny policy (which scores 0 on every
rollout, leaving every group at zero variance).

Each rollout is, at its first turn, either a *success* (it plays the task's ground truth) or a *failure* (a plan
verified to score 0). The choice is a seeded coin per rollout, with

    P(success) = success_high  when the prompt carries the high reward token,
                 success_low   when it carries the low one,
                 success_rate  otherwise (GRPO, evaluation without a token),

so a scripted "RCTP-FT model" follows its reward token as strongly as one chooses. The coin depends on the
sampling seed the engine passes (step and round), the rollout's position in the first generator call and its
prompt ids, so a resumed run plays the same rollouts as an uninterrupted one.

What it asks of the run's suite are optional capabilities of the `Suite` Protocol (`envs/interfaces.py`):

- ``scripted_messages(task, success, variant, settings, failure_type)``, where the suite has it, gives the
  conversation to play (BFCL's: its ground truth played, or a verified failure of `envs/bfcl/failures.py` of the
  preferred ``generation.scripted.failure_type``).
- Otherwise ``oracle_calls(task)`` (the calls per user turn, as ``rcgrpo eval policy=oracle`` plays them). The
  success plan is one assistant message per user turn with that turn's calls (one message per call where the chat
  format renders one call per message), closed by a ``done()`` call where the env offers a ``done`` tool, else by
  a closing text; where that does not score 1 and the task has several user turns, a closing text also ends
  each turn (an env that hands out its user turns one at a time). The failure plan is the success plan with one
  call dropped (the calls tried in an order seeded per rollout), else with no call at all. Every plan is played
  through a fresh env of the run (its registered opener) before it is used: the success must score 1, the failure
  0, each an error in one line where none does. ``failure_type`` is not read.

A suite with neither is refused when the generator is built, in one line.

Token-in, token-out like every generator: the task is recognised in the decoded prompt by its first user message,
as the env opens it (each task of the suite is opened once, at the first call, to read it; the longest match wins,
one text may contain another). Tasks that open alike are played alike as long as their plans are the same messages
(as bfcl_micro's twins that differ only in files the request does not touch); where their plans part, the rollout
keeps the tasks whose env answered as the prompt shows (kv_store's copy tasks: the same request on other stores,
told apart by what ``get`` returned), and a prompt that still cannot tell them apart is an error in one line (as
BFCL's base and long_context with both categories in the run, whose first messages differ). Later turns of a rollout are recognised because their prompt
extends an earlier prompt plus completion, and a completion is the token ids of the planned assistant message as
the chat format renders it (the trained tokens: content and end-of-turn). Sampler logprobs are 0.0 (the completion
is a choice, not a sample). Weights sent to it are consumed and ignored; ``version`` records the last update.

The live rollouts are kept per calling thread: with rollouts generated ahead (``rl.max_staleness`` >= 1) the
rollout thread and the trainer's in-training evaluation call one generator in turns, and each caller's next call
continues its own rollouts.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from nemo_rcgrpo.data.chat_format import one_call_per_message
from nemo_rcgrpo.generation.base import Completion, SamplingParams
from nemo_rcgrpo.types import Message, ToolCall

if TYPE_CHECKING:
    from nemo_rcgrpo.config import PolicySetup
    from nemo_rcgrpo.data.tokenize import ChatRenderer
    from nemo_rcgrpo.envs.interfaces import EnvOpener, Suite, Task

FINAL_TEXT = "I have completed the request."
_CLOSE = object()  # a plan's last move: a done() call where the env offers the tool, else FINAL_TEXT


@dataclass
class _Script:
    """A live rollout: the conversations it may be playing (one per task that opens alike and still fits what the
    env answered), and the index of the next assistant message to play."""

    candidates: list[list[dict[str, Any]]]  # each a whole conversation played through the env, in the same order
    turn: int
    success: bool
    task_ids: list[str]  # the tasks that open alike (named in the error where the prompt cannot tell them apart)

    def next_message(self) -> dict[str, Any] | None:
        """The next planned assistant message (the same in every candidate), or None once the plan is played out."""
        plans = [[m for m in c if m["role"] == "assistant"] for c in self.candidates]
        nexts = [plan[self.turn] if self.turn < len(plan) else None for plan in plans]
        if any(n != nexts[0] for n in nexts[1:]):
            raise ValueError(
                f"scripted generator: tasks {self.task_ids} open with the same user message but are played "
                "differently, and what the env answered so far does not tell them apart; restrict env.categories "
                "for scripted runs"
            )
        return nexts[0]

    def narrow(self, answered: str) -> None:
        """Keep the candidates whose env answered the last message as the prompt shows (``answered``: the prompt's
        text after the last completion); where none fits exactly (a renderer that reshapes the answer), all stay."""
        fitting = [c for c in self.candidates if all(text in answered for text in _answers(c, self.turn))]
        if fitting:
            self.candidates = fitting


def _answers(conversation: list[dict[str, Any]], turn: int) -> list[str]:
    """The texts the env answered assistant message ``turn - 1`` of ``conversation`` with (stripped, non-empty)."""
    seen, out = 0, []
    for m in conversation:
        if m["role"] == "assistant":
            seen += 1
        elif seen == turn and isinstance(m.get("content"), str) and m["content"].strip():
            out.append(m["content"].strip())
    return out


class ScriptedGenerator:
    shares_policy_weights = False  # weights are streamed to it (consumed and ignored), as to a server

    def __init__(
        self,
        renderer: ChatRenderer,
        suite: Suite,
        envs: EnvOpener,
        *,
        settings: Any = None,
        success_rate: float = 0.5,
        success_high: float = 1.0,
        success_low: float = 0.0,
        high_token: str = "<|high_reward|>",
        low_token: str = "<|low_reward|>",
        failure_type: str = "wrong_param",
        seed: int = 0,
        task_source: str = "the task source",
        env_name: str = "of the run",
    ):
        from nemo_rcgrpo.utils.config import ConfigError

        for key, p in {"success_rate": success_rate, "success_high": success_high, "success_low": success_low}.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"generation.scripted.{key}={p}: must be in [0, 1]")
        self._suite_script = getattr(suite, "scripted_messages", None)  # the suite's own plans (BFCL's)
        self._oracle_calls = getattr(suite, "oracle_calls", None)
        if not callable(self._suite_script) and not callable(self._oracle_calls):
            raise ConfigError(
                f"generation.backend=scripted plays a suite's oracle_calls(task); task_source={task_source}'s "
                f"suite ({type(suite).__name__}) has none (envs/interfaces.py: Suite)"
            )
        self.renderer, self.tokenizer, self.suite, self.envs = renderer, renderer.tokenizer, suite, envs
        self.settings, self.env_name = settings, env_name
        self.success_rate, self.success_high, self.success_low = success_rate, success_high, success_low
        self.high_token, self.low_token = high_token, low_token
        self.failure_type, self.seed = failure_type, seed
        self.version = 0
        self._opening: dict[str, list[Task]] | None = None  # first user message -> the tasks that open with it
        self._opening_lock = threading.Lock()
        self._plans: dict[tuple[str, bool, int | None], list[dict[str, Any]]] = {}
        self._conversations: dict[tuple[str, bool, int | None], list[dict[str, Any]]] = {}  # the plans, played
        self._twins: dict[tuple[tuple[str, ...], bool, int | None], list[list[dict[str, Any]]]] = {}
        self._per_turn: dict[str, bool] = {}  # task id -> its oracle plan closes every user turn with a text
        # prompt + completion so far -> the scripts of the live rollouts with exactly these ids (rollouts of one
        # group can share them), handed out in order: the engine passes live rollouts in a fixed order
        # (per calling thread: `_live`)
        self._local = threading.local()
        self.played = {"success": 0, "failure": 0}  # rollouts started, by kind (for tests and logs)

    # ------------------------------------------------------------------ recognising a task
    def _first_user_message(self, task: Task) -> str:
        from nemo_rcgrpo.registry import error_line

        try:
            _, messages = self.envs.open(task)
        except Exception as e:  # noqa: BLE001 - the env's error, one line with where it was raised
            raise ValueError(
                f"scripted generator: env {self.env_name} cannot open task {task.id}: {error_line(e)}"
            ) from e
        text = next((m.get("content") for m in messages if m.get("role") == "user"), None)
        if not text:
            raise ValueError(
                f"scripted generator: env {self.env_name} opens task {task.id} without a user message; "
                "a scripted rollout's task is recognised by its first user message"
            )
        return text.strip()  # a chat format may strip a message's edges (llama3_json)

    def _openings(self) -> dict[str, list[Task]]:
        with self._opening_lock:
            if self._opening is None:
                opening: dict[str, list[Task]] = {}
                for task in self.suite.tasks.values():
                    opening.setdefault(self._first_user_message(task), []).append(task)
                self._opening = opening
        return self._opening

    def _tasks(self, text: str) -> list[Task]:
        """The tasks whose first user message ``text`` holds (the longest match: one text may contain another)."""
        openings = self._openings()
        found = [opening for opening in openings if opening in text]
        if not found:
            raise ValueError(
                "scripted generator: the prompt holds no known task's first user message "
                "(are env.task_source, env.categories and env.settings those of the run?)"
            )
        return openings[max(found, key=len)]

    def _conversations_for(self, tasks: list[Task], success: bool, variant: int) -> list[list[dict[str, Any]]]:
        """The conversations a rollout that opens like ``tasks`` may be playing, one per distinct plan: tasks that
        open with the same request (a base task and its long_context twin, generated tasks that differ only in what
        the request does not show) are told apart later by what the env answers, where their plans differ."""
        out: list[list[dict[str, Any]]] = []
        for t in tasks:
            self._plan(t, success, variant)
            conversation = self._conversations[(t.id, success, None if success else variant)]
            if conversation not in out:
                out.append(conversation)
        firsts = [next((m for m in c if m["role"] == "assistant"), None) for c in out]
        if any(f != firsts[0] for f in firsts[1:]) and not callable(self._suite_script):
            key = (tuple(t.id for t in tasks), success, None if success else variant)
            if key not in self._twins:
                twins = self._twin_conversations(tasks, success, variant)
                self._twins[key] = [c for i, c in enumerate(twins) if c not in twins[:i]]
            return self._twins[key]
        return out

    # ------------------------------------------------------------------ plans
    def _plan(self, task: Task, success: bool, variant: int) -> list[dict[str, Any]]:
        """The assistant messages a rollout of ``task`` plays (``variant``: which of a few failures, 0-3); the
        whole conversation is kept in ``_conversations``."""
        key = (task.id, success, None if success else variant)
        if key not in self._plans:
            if callable(self._suite_script):
                messages = self._suite_script(task, success, variant, self.settings, self.failure_type)
                if messages is None:
                    raise ValueError(f"scripted generator: no reward-0 perturbation of {task.id} could be built")
            else:
                messages = self._oracle_plan(task) if success else self._failure_plan(task, variant)
            if self.renderer.spec.one_call_per_message:  # one call per message, as the format allows
                messages = one_call_per_message(messages)
            self._conversations[key] = list(messages)
            self._plans[key] = [m for m in messages if m["role"] == "assistant"]
        return self._plans[key]

    def _turns(self, task: Task) -> list[list[ToolCall]]:
        """The suite's ``oracle_calls(task)``, checked: a list of user turns, each a list of ``ToolCall``s."""
        from nemo_rcgrpo.registry import error_line

        try:
            turns = [list(calls) for calls in self._oracle_calls(task)]
        except Exception as e:  # noqa: BLE001 - the plugin's error, one line with where it was raised
            raise ValueError(f"scripted generator: oracle_calls({task.id}) failed: {error_line(e)}") from e
        if not all(isinstance(c, ToolCall) for calls in turns for c in calls):
            raise ValueError(
                f"scripted generator: oracle_calls({task.id}) must give a list of user turns, each a list of ToolCall"
            )
        return turns

    def _moves(self, turns: Sequence[Sequence[ToolCall]], per_turn: bool, split: bool = False) -> list[Any]:
        """What the assistant says, message by message: each user turn's calls (one message, or one per call where
        the chat format renders no more, or ``split``), a closing text after each turn (``per_turn``) or a close at
        the end."""
        moves: list[Any] = []
        for calls in turns:
            if calls:
                alone = split or self.renderer.spec.one_call_per_message
                moves += [[c] for c in calls] if alone else [list(calls)]
            if per_turn:
                moves.append(FINAL_TEXT)
        return moves if per_turn else [*moves, _CLOSE]

    def _oracle_plan(self, task: Task) -> list[Message]:
        """The oracle's conversation: as one request, or with a closing text after each user turn; the first
        that scores 1 through the env."""
        turns = self._turns(task)
        tried = []
        for per_turn in (False, True) if len(turns) > 1 else (False,):
            messages, reward = self._play(task, self._moves(turns, per_turn))
            if reward == 1.0:
                self._per_turn[task.id] = per_turn
                return messages
            tried.append(reward)
        how = "as one request" + (" and with a closing text after each user turn" if len(tried) > 1 else "")
        raise ValueError(
            f"scripted generator: the oracle calls of {task.id} score {max(tried)} through env {self.env_name} "
            f"({how}), not 1: a scripted success plays the suite's oracle_calls, which must solve the task"
        )

    def _failure_candidates(self, task: Task, variant: int) -> list[list[list[ToolCall]]]:
        """The plans a failure tries, in order: the oracle's with one call dropped (the calls in an order seeded by
        ``variant``), then no call at all."""
        turns = self._turns(task)
        positions = [(t, i) for t, calls in enumerate(turns) for i in range(len(calls))]
        random.Random(variant).shuffle(positions)
        candidates = [
            [[c for i, c in enumerate(calls) if (t, i) != p] for t, calls in enumerate(turns)] for p in positions
        ]
        return [*candidates, [[] for _ in turns]]

    def _failure_plan(self, task: Task, variant: int) -> list[Message]:
        """A reward-0 plan: the first of ``_failure_candidates`` that scores 0 through the env."""
        if task.id not in self._per_turn:
            self._oracle_plan(task)
        per_turn = self._per_turn[task.id]
        for plan in self._failure_candidates(task, variant):
            messages, reward = self._play(task, self._moves(plan, per_turn))
            if reward == 0.0:
                return messages
        raise ValueError(
            f"scripted generator: no reward-0 plan of {task.id}: its oracle calls with one dropped, and no call at "
            f"all, score > 0 through env {self.env_name}"
        )

    def _twin_conversations(self, tasks: list[Task], success: bool, variant: int) -> list[list[Message]]:
        """Conversations for tasks that open alike but whose plans differ from their first message: each call in a
        message of its own, so that what the env answers tells the tasks apart before they part (a get before the
        put of what it returned); a failure plays the first candidate plan that is the same for all of them and
        scores 0 for each. Refused in one line where there is none (the error names the tasks)."""
        for t in tasks:
            if t.id not in self._per_turn:
                self._oracle_plan(t)
        shapes = {self._per_turn[t.id] for t in tasks}  # closing texts after each user turn, or one close
        if len(shapes) == 1:
            per_turn = shapes.pop()
            if success:
                played = [self._play(t, self._moves(self._turns(t), per_turn, split=True)) for t in tasks]
                if all(reward == 1.0 for _, reward in played):
                    return [messages for messages, _ in played]
            else:
                options = [self._failure_candidates(t, variant) for t in tasks]
                for plans in zip(*options):
                    if any(repr(plan) != repr(plans[0]) for plan in plans[1:]):
                        continue  # another plan for each task: the prompt could not follow it
                    played = [self._play(t, self._moves(plans[0], per_turn, split=True)) for t in tasks]
                    if all(reward == 0.0 for _, reward in played):
                        return [messages for messages, _ in played]
        raise ValueError(
            f"scripted generator: tasks {[t.id for t in tasks]} open with the same user message but are played "
            "differently, and no plan lets what the env answers tell them apart; restrict env.categories for "
            "scripted runs"
        )

    def _play(self, task: Task, moves: Sequence[Any]) -> tuple[list[Message], float]:
        """The conversation of ``moves`` through a fresh env of ``task``, and the reward the run would pay, by the
        engine's rules: where the env offers ``done``, a done() call ends the episode after the calls before it;
        an episode still open after the last move (the run would truncate it) or truncated pays 0."""
        from nemo_rcgrpo.registry import error_line

        try:
            env, opening = self.envs.open(task)
            messages, tools, ended = list(opening), env.tools, False
            for move in moves:
                if ended or env.done:
                    break
                offers_done = any(t["function"]["name"] == "done" for t in tools)
                if move is _CLOSE:
                    move = [ToolCall("done")] if offers_done else FINAL_TEXT
                calls = [] if isinstance(move, str) else move
                ids = [f"call_{len(messages)}_{i}" for i in range(len(calls))]
                if isinstance(move, str):  # a text: no call
                    messages.append({"role": "assistant", "content": move})
                else:
                    messages.append(
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [
                                {
                                    "id": i,
                                    "type": "function",
                                    "function": {"name": c.name, "arguments": json.dumps(c.kwargs)},
                                }
                                for i, c in zip(ids, calls)
                            ],
                        }
                    )
                stepped = [ToolCall(c.name, dict(c.kwargs), id=ids[i]) for i, c in enumerate(calls)]
                at = next((i for i, c in enumerate(stepped) if c.name == "done"), None) if offers_done else None
                if at is not None:
                    stepped, ended = stepped[: at + 1], True
                result = env.step(stepped)
                messages += list(result.messages)
                if result.tools_changed:
                    tools = env.tools
            over = ended or bool(env.done)
            reward = env.reward().value if over and not env.truncated else 0.0
        except Exception as e:  # noqa: BLE001 - the env's error, one line with where it was raised
            raise ValueError(
                f"scripted generator: playing a plan of {task.id} through env {self.env_name} failed: {error_line(e)}"
            ) from e
        return messages, reward

    # ------------------------------------------------------------------ live rollouts
    @property
    def _live(self) -> dict[tuple[int, ...], list[_Script]]:
        return getattr(self._local, "live", {})

    @_live.setter
    def _live(self, live: dict[tuple[int, ...], list[_Script]]) -> None:
        self._local.live = live

    def _completion_ids(self, message: dict[str, Any]) -> list[int]:
        """The trained tokens (content and end-of-turn) of ``message`` as the chat format renders it."""
        return self.renderer.completion_ids(message)

    def _start(self, prompt: list[int], seed: int | None, position: int) -> _Script:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        tasks = self._tasks(text)
        if self.high_token in text:
            p = self.success_high
        elif self.low_token in text:
            p = self.success_low
        else:
            p = self.success_rate
        digest = hashlib.sha256(repr((self.seed, seed, position, prompt)).encode()).hexdigest()
        rng = random.Random(int(digest[:16], 16))
        success = rng.random() < p
        variant = rng.randrange(4)  # a few different failures per task
        script = _Script(self._conversations_for(tasks, success, variant), 0, success, [t.id for t in tasks])
        self.played["success" if success else "failure"] += 1
        return script

    # ------------------------------------------------------------------ generator interface
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        live: dict[tuple[int, ...], list[_Script]] = {}
        out = []
        for position, prompt in enumerate(prompts):
            script = self._continue(prompt) or self._start(prompt, params.seed, position)
            message = script.next_message()
            if message is None:  # the plan is played out: a message without tool calls ends the episode
                message = {"role": "assistant", "content": FINAL_TEXT}
            script.turn += 1
            ids = self._completion_ids(message)
            reason = "stop"
            if len(ids) > params.max_new_tokens:
                ids, reason = ids[: params.max_new_tokens], "length"
            live.setdefault(tuple(prompt) + tuple(ids), []).append(script)
            out.append(
                Completion(ids, [0.0] * len(ids), reason, {"scripted": "success" if script.success else "failure"})
            )
        self._live = live  # every live rollout comes back in the next call; the rest have ended
        return out

    def _continue(self, prompt: list[int]) -> _Script | None:
        """The live rollout whose prompt and completion ``prompt`` extends, narrowed by what the env answered."""
        for key, scripts in self._live.items():
            if scripts and len(prompt) > len(key) and tuple(prompt[: len(key)]) == key:
                script = scripts.pop(0)
                if len(script.candidates) > 1:
                    script.narrow(self.tokenizer.decode(prompt[len(key) :], skip_special_tokens=False))
                return script
        return None

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        if not isinstance(weights, (str, Path)):
            for _ in weights:  # consume (an export may be a collective's iterator)
                pass
        self.version = version

    def close(self) -> None:
        """Nothing to release."""


def make_scripted_generator(setup: PolicySetup, model: Any, tokenizer: Any) -> ScriptedGenerator:
    """The generator of ``generation.backend=scripted``: the tasks of ``env.task_source`` (its ``env.categories``),
    played through the env ``env.name`` with ``env.settings``, as the run plays them."""
    from nemo_rcgrpo.envs.sources import make_opener, make_suite
    from nemo_rcgrpo.models.setup import make_renderer

    s, env = setup.generation.scripted, setup.env
    suite = make_suite(env.task_source, env.categories)
    return ScriptedGenerator(
        make_renderer(setup, tokenizer),
        suite,
        make_opener(env, suite),
        settings=env.settings,
        success_rate=s.success_rate,
        success_high=s.success_high,
        success_low=s.success_low,
        high_token=setup.reward_tokens.high,
        low_token=setup.reward_tokens.low,
        failure_type=s.failure_type,
        seed=s.seed,
        task_source=env.task_source,
        env_name=env.name,
    )
