"""Multi-turn rollouts: the only place a generator meets an environment.

Token-in, token-out. For every rollout the engine renders the opening messages
(with the rollout's reward-goal token, for RC-GRPO) into token ids; the
generator continues all live rollouts at once; generated tokens are kept as
they are (loss mask 1, with their sampling logprobs); the text is parsed into
tool calls, the rollout's own environment answers, and the answer is appended
as tokens rendered by the chat format (loss mask 0). A trajectory is never
re-tokenised from text, so training sees exactly what was sampled.

A rollout ends when its environment is done (a message without tool calls in
merged mode, the last user turn in per_turn mode), at a ``done()`` call of an
environment that offers the ``done`` tool, after ``max_turns`` assistant
messages, or when the next prompt would not fit the context budget or a message
hits ``max_new_tokens`` without a stop token. The engine owns these rules for
every environment: a truncated rollout pays 0 with the reason recorded, whatever
the environment's ``reward()`` says, and a ``done()`` ends the episode after the
calls before it whether or not the environment ends it (calls after it are not
run).

Environments come through the seam of `envs/interfaces.py`: ``envs.open(task)`` gives each rollout a fresh
``Env`` reset on its task (the registered ``env.name``: `envs/sources.py: make_opener`), so nothing here names an
environment's types.

Every value an environment hands over is checked at the seam (`envs/contract.py`: its tools, step() results
and reward()). One rollout never takes down its batch: an exception while advancing or scoring a rollout (a
tokenizer that cannot read an id, an environment bug, a value that breaks the contract) ends that rollout alone,
with reward 0 and the error recorded (``error``, and ``truncated="rollout error"``); the others go on. An
environment that cannot open a task stops the run with one line naming the env and the task.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.tokenize import ChatRenderer, Tokenized
from nemo_rcgrpo.data.tool_parsers import REJECTED_MESSAGE
from nemo_rcgrpo.envs.contract import PluginContractError, check_messages, check_reward, check_step, check_tools, where
from nemo_rcgrpo.envs.interfaces import Env, EnvOpener, Task
from nemo_rcgrpo.generation.base import Generator, SamplingParams, places_groups
from nemo_rcgrpo.registry import error_line
from nemo_rcgrpo.rollout.record import EpisodeRecord
from nemo_rcgrpo.types import Message, RewardInfo, ToolCall, ToolCallError

log = logging.getLogger(__name__)

_CALLS = itertools.count()  # rollout calls in this process (rollouts generated ahead overlap a step's)


@dataclass(frozen=True)
class RolloutSpec:
    task: Task
    group: int  # index of the rollout's group in the step
    reward_token: bool | None = None  # True high, False low, None: no token (GRPO, or literal eval prompts)


@dataclass
class Trajectory:
    task_id: str
    category: str
    group: int
    reward_token: str | None
    token_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    prompt_length: int
    reward: float = 0.0
    state_ok: bool = False
    actions_ok: bool = False
    official_valid: bool | None = None
    official_error: str | None = None  # per_turn episodes: BFCL's error type and message when not valid
    reward_details: dict[str, Any] = field(default_factory=dict)  # state differences, missing actions
    truncated: str | None = None
    num_turns: int = 0  # assistant messages
    tool_errors: int = 0
    rejected_messages: int = 0  # assistant messages the chat format's parser rejected whole (chat.rejected_message)
    calls: list[list[Any]] = field(default_factory=list)  # per assistant message: {"name", "arguments"} or {"error"}
    observations: list[list[str]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # decoded assistant messages
    followups: list[list[dict[str, str]]] = field(default_factory=list)  # per assistant message: later user turns
    error: str | None = None  # an exception that ended this rollout alone (reward 0)
    # the generator's version (RL steps applied to its weights) of the rollout's first turn (at its start where it
    # took no turn), and of each of its turns: with rollouts generated ahead an episode can span a weight update
    weight_version: int | None = None
    turn_versions: list[int] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    def episode(self, **where: Any) -> EpisodeRecord:
        """This rollout as the one episode record every dump writes (`rollout/record.py`): ``turns`` the calls read
        from each assistant message (what the reward replays), ``messages`` the conversation after the prompt
        (texts, calls, tool results and later user turns); ``where``: the writer's fields (step, group, ...)."""
        return EpisodeRecord(
            task_id=self.task_id,
            category=self.category,
            reward=self.reward,
            reward_token=self.reward_token,
            turns=self.calls,
            messages=self.messages(),
            state_ok=self.state_ok,
            actions_ok=self.actions_ok,
            official_valid=self.official_valid,
            truncated=self.truncated,
            error=self.error,
            num_turns=self.num_turns,
            tool_errors=self.tool_errors,
            rejected_messages=self.rejected_messages,
            generated_tokens=self.generated_tokens,
            reward_details=self.reward_details,
            weight_version=self.weight_version,
            turn_versions=self.turn_versions,
            group=self.group,
            **where,
        )

    def record(self, **where: Any) -> dict[str, Any]:
        """`episode` as a dump line's object (JSON-serialisable)."""
        return self.episode(**where).to_json()

    def messages(self) -> list[dict[str, Any]]:
        """The conversation after the prompt as a person reads it: each assistant message (decoded text and the calls
        read from it), the tool results it got, and the user turns that came next (per-turn episodes)."""
        out: list[dict[str, Any]] = []
        for i, text in enumerate(self.texts):
            out.append(
                {"role": "assistant", "content": text, "tool_calls": self.calls[i] if i < len(self.calls) else []}
            )
            for result in self.observations[i] if i < len(self.observations) else []:
                out.append({"role": "tool", "content": result})
            out += self.followups[i] if i < len(self.followups) else []
        return out


@dataclass
class _Live:
    order: int
    spec: RolloutSpec
    env: Env
    messages: list[Message]
    tools: list[dict]
    seq: Tokenized
    logprobs: list[float]
    traj: Trajectory
    truncated: str | None = None  # the engine's record of why the episode was cut short (the env's is merged in)
    finished: bool = False  # ended by a done() call

    @property
    def over(self) -> bool:
        return self.finished or self.truncated is not None or bool(self.env.done)


def _until_done(calls: Sequence[ToolCall | ToolCallError], tools: Sequence[dict]) -> tuple[list, bool]:
    """(the calls ``step`` gets, whether the episode ends): with a ``done`` tool offered, a ``done()`` call ends the
    episode after the calls before it (it is passed on, the calls after it are not)."""
    if not any(t["function"]["name"] == "done" for t in tools):
        return list(calls), False
    at = next((i for i, c in enumerate(calls) if isinstance(c, ToolCall) and c.name == "done"), None)
    return (list(calls), False) if at is None else (list(calls[: at + 1]), True)


def _call_record(call: ToolCall | ToolCallError) -> dict[str, Any]:
    if isinstance(call, ToolCallError):
        return {"error": call.message, "raw": call.raw}
    return {"name": call.name, "arguments": call.kwargs}


class RolloutEngine:
    def __init__(
        self,
        generator: Generator,
        renderer: ChatRenderer,
        envs: EnvOpener,
        sampling: SamplingParams,
        *,
        max_turns: int = 20,
        max_total_tokens: int = 4096,
        reward_goal: RewardGoal | None = None,
        tokenizer=None,
        name: str | None = None,
        rejected_message: str = "content",
    ):
        if rejected_message not in REJECTED_MESSAGE:
            raise ValueError(f"rejected_message={rejected_message!r}: choose one of {list(REJECTED_MESSAGE)}")
        self.rejected_message = rejected_message
        self.generator = generator
        self.name = name or type(envs).__name__  # the env as the user named it (env.name), for the error lines
        self.renderer = renderer
        self.tokenizer = tokenizer or renderer.tokenizer
        self.envs = envs
        self.sampling = SamplingParams(**{**sampling.__dict__, "stop_token_ids": tuple(renderer.stop_ids)})
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.reward_goal = reward_goal or RewardGoal()
        self.parse = renderer.spec.parse

    def with_sampling(self, sampling: SamplingParams) -> "RolloutEngine":
        """This engine (generator, renderer, envs, limits, reward goal) with other sampling settings: the greedy
        engine of in-training evaluation beside the training one."""
        other = copy.copy(self)
        other.sampling = SamplingParams(**{**sampling.__dict__, "stop_token_ids": tuple(self.renderer.stop_ids)})
        return other

    def opening(self, task: Task, reward_token: bool | None):
        """(env, opening messages with the rollout's reward goal, tools offered) of a new rollout of ``task``."""
        owner = f"env {self.name}: open(task {task.id})"
        try:
            env, messages = self.envs.open(task)
        except Exception as e:  # noqa: BLE001 - the plugin's error, one line with where it was raised
            raise PluginContractError(f"{owner} failed: {error_line(e)}") from e
        messages = check_messages(f"{owner} messages", messages)
        tools = check_tools(owner, env.tools)
        if reward_token is not None:
            messages = self.reward_goal.apply(messages, reward_token)
        return env, messages, tools

    def prompt_ids(self, task: Task, reward_token: bool | None) -> list[int]:
        """The token ids a rollout of ``task`` starts generating from (generation prompt included)."""
        _, messages, tools = self.opening(task, reward_token)
        return self.renderer.render(messages, tools, add_generation_prompt=True).ids

    def _start(self, order: int, spec: RolloutSpec) -> _Live:
        env, messages, tools = self.opening(spec.task, spec.reward_token)
        seq = self.renderer.render(messages, tools, add_generation_prompt=True)
        token = None if spec.reward_token is None else ("high" if spec.reward_token else "low")
        traj = Trajectory(
            spec.task.id,
            spec.task.category,
            spec.group,
            token,
            [],
            [],
            [],
            len(seq.ids),
            weight_version=self.generator.version,
        )
        return _Live(order, spec, env, list(messages), tools, seq, [0.0] * len(seq.ids), traj)

    def rollout(self, specs: Sequence[RolloutSpec], seed: int | None = None) -> list[Trajectory]:
        """Run every rollout to its end; all live rollouts advance together, one generator call per round."""
        return self.rollout_timed(specs, seed)[0]

    def rollout_timed(
        self, specs: Sequence[RolloutSpec], seed: int | None = None
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """``rollout``, and the seconds it spent in the generator, the environments and the rewards."""
        timings = {"generation": 0.0, "env": 0.0, "reward": 0.0}
        live = [self._start(i, s) for i, s in enumerate(specs)]
        done: list[_Live] = []
        round_index = 0
        call = next(_CALLS)  # group keys of this call's rollouts: (call, group), apart from another call's groups
        while live:
            budget = [self.max_total_tokens - len(s.seq.ids) for s in live]
            for s, b in zip(live, budget):
                if b <= 0:
                    self._truncate(s, "context budget")
            still = [s for s in live if not s.over]
            done += [s for s in live if s.over]
            live = still
            if not live:
                break
            max_new = min(self.sampling.max_new_tokens, max(self.max_total_tokens - len(s.seq.ids) for s in live))
            params = SamplingParams(
                max_new_tokens=max_new,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                stop_token_ids=self.sampling.stop_token_ids,
                seed=None if seed is None else seed + 7919 * round_index,
            )
            t0 = time.perf_counter()
            version = self.generator.version
            prompts = [s.seq.ids for s in live]
            if places_groups(self.generator):  # many engines: a group's rollouts on one of them
                completions = self.generator.generate(prompts, params, [(call, s.spec.group) for s in live])
            else:
                completions = self.generator.generate(prompts, params)
            timings["generation"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            for s, c in zip(live, completions):
                turn = version if c.version is None else c.version
                if not s.traj.turn_versions:
                    s.traj.weight_version = turn  # staleness counts from the first turn
                s.traj.turn_versions.append(turn)
                try:
                    self._advance(s, c)
                except Exception as e:  # noqa: BLE001 - this rollout's failure, not the batch's
                    self._fail(s, e)
            timings["env"] += time.perf_counter() - t0
            round_index += 1
        t0 = time.perf_counter()
        out = [self._finish(s) for s in sorted(done, key=lambda s: s.order)]
        timings["reward"] = time.perf_counter() - t0
        return out, timings

    def _advance(self, s: _Live, completion) -> None:
        room = self.max_total_tokens - len(s.seq.ids)
        tokens = completion.token_ids[:room]
        s.seq.ids += tokens
        s.seq.mask += [1] * len(tokens)
        s.logprobs += completion.logprobs[: len(tokens)]
        s.traj.num_turns += 1
        stopped = completion.finish_reason == "stop" and len(tokens) == len(completion.token_ids)
        body = tokens[:-1] if stopped else tokens
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        s.traj.texts.append(text)
        if not stopped:
            self._truncate(s, "context budget" if len(tokens) >= room else "max_new_tokens without a stop token")
            return
        parsed = self.parse(text, {t["function"]["name"] for t in s.tools} | {"done"})
        if self.renderer.spec.one_call_per_message and sum(isinstance(c, ToolCall) for c in parsed.calls) > 1:
            # vLLM's llama3_json parser hands a client several calls, but the Llama 3.1 template cannot render
            # that message back: a served conversation could not continue, so it is not rewarded
            parsed = type(parsed)(
                parsed.content,
                [
                    ToolCallError(
                        raw=text[:200],
                        message="llama3_json: one tool call per assistant message (the Llama 3.1 chat "
                        "template renders no more); call one tool, read its result, then call the next",
                    )
                ],
            )
        if parsed.rejected is not None:
            s.traj.rejected_messages += 1
            if self.rejected_message == "content":  # as served: the whole text is content, no call runs
                parsed = type(parsed)(text, [], parsed.rejected)
        s.traj.calls.append([_call_record(c) for c in parsed.calls])
        calls, finished = _until_done(parsed.calls, s.tools)
        result = check_step(self._owner(s, "step"), s.env.step(calls))
        s.finished = finished
        s.traj.observations.append([o.content for o in result.observations])
        s.traj.tool_errors += sum(not o.ok for o in result.observations)
        s.messages.append(
            {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [
                    {
                        "id": f"call_{len(s.messages)}_{i}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.kwargs)},
                    }
                    for i, c in enumerate(parsed.calls)
                    if isinstance(c, ToolCall)
                ],
            }
        )
        if s.over:
            return
        if s.traj.num_turns >= self.max_turns:
            self._truncate(s, f"more than {self.max_turns} assistant messages")
            return
        start = len(s.messages)
        s.messages += result.messages
        s.traj.followups += [[] for _ in range(len(s.traj.texts) - len(s.traj.followups) - 1)]  # align with texts
        s.traj.followups.append(
            [
                {"role": m["role"], "content": m.get("content") or ""}
                for m in result.messages
                if m.get("role") not in ("tool", "assistant")
            ]
        )
        if result.tools_changed:
            s.tools = check_tools(f"env {self.name}: task {s.spec.task.id} after tools_changed", s.env.tools)
        after = Tokenized(self.renderer.after_stop_ids(), [])
        self.renderer.render_into(after, s.messages, start, s.tools)
        after.ids += self.renderer.generation_prompt_ids()
        if len(s.seq.ids) + len(after.ids) >= self.max_total_tokens:
            self._truncate(s, "context budget")
            return
        s.seq.ids += after.ids
        s.seq.mask += [0] * len(after.ids)
        s.logprobs += [0.0] * len(after.ids)

    def _owner(self, s: _Live, method: str) -> str:
        """``env NAME: Class.method (file.py:line), task ID``: who handed over a value, for the contract's lines."""
        return f"env {self.name}: {where(getattr(type(s.env), method, None)) or method}, task {s.spec.task.id}"

    def _truncate(self, s: _Live, reason: str) -> None:
        """End the episode now (the engine's record decides, whatever the env does with the news), reward 0."""
        s.truncated = s.truncated or reason
        try:
            s.env.truncate(reason)  # the env may want to know (BFCL's official verdict: force-terminated)
        except Exception as e:  # noqa: BLE001 - a broken truncate() cannot keep the episode going
            log.warning("env %s: truncate() of %s raised %s", self.name, s.spec.task.id, error_line(e))

    def _fail(self, s: _Live, error: Exception) -> None:
        message = error_line(error)[:500]
        log.warning("rollout of %s (group %d) failed and ends with reward 0: %s", s.spec.task.id, s.spec.group, message)
        log.debug("the traceback of rollout %s (group %d)'s error:", s.spec.task.id, s.spec.group, exc_info=error)
        s.traj.error = s.traj.error or message
        n = min(len(s.seq.ids), len(s.seq.mask), len(s.logprobs))  # the appends of a half-done round stay aligned
        del s.seq.ids[n:], s.seq.mask[n:], s.logprobs[n:]
        self._truncate(s, "rollout error")

    def _finish(self, s: _Live) -> Trajectory:
        t = s.traj
        try:
            reward = check_reward(self._owner(s, "reward"), s.env.reward())
            verdict = s.env.official_verdict()
        except Exception as e:  # noqa: BLE001 - an env's verdict that raises fails its rollout, not the batch
            self._fail(s, e)
            reward, verdict = RewardInfo(0.0, False, False, {"error": t.error}), None
        t.token_ids, t.loss_mask, t.sampler_logprobs = s.seq.ids, s.seq.mask, s.logprobs
        t.truncated = s.truncated or s.env.truncated
        if t.truncated:  # the engine's rule for every env: a truncated episode pays 0, the reason recorded
            reward = RewardInfo(0.0, reward.state_ok, reward.actions_ok, {**reward.details, "truncated": t.truncated})
        t.reward, t.state_ok, t.actions_ok = reward.value, reward.state_ok, reward.actions_ok
        t.official_valid = None if verdict is None else verdict.valid
        if verdict is not None and not verdict.valid:
            t.official_error = f"{verdict.error_type}: {verdict.error_message}"
        t.reward_details = reward.details
        return t
