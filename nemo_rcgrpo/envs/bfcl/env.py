"""One BFCL multi-turn episode: per-rollout API state, safe tool calls, reward.

Two episode shapes:
- ``per_turn`` (official BFCL protocol): user turns arrive one at a time; an
  assistant message without tool calls ends the turn and the next user turn
  follows; a miss_func holdout turn offers the held-out tools with BFCL's
  "I have updated some more functions" message. Ends after the last turn or
  when a turn exceeds ``max_steps`` tool-calling steps (force quit, as BFCL).
  With ``on_parse_failure="end_turn"`` a message none of whose calls parse
  ends the turn, as BFCL's inference loop does.
- ``merged`` (the paper's RL episode): all user turns in one prompt
  ("Step 1: ... Step 2: ..."), every tool offered from the start plus a
  ``done()`` tool; ends on ``done()``, on a message without tool calls, or
  after ``max_steps`` steps.

Usage::

    env = BFCLEnv(mode="merged")
    messages = env.reset(task, gold=suite.gold(task))
    result = env.step(["cd(folder='document')", {"name": "ls", "arguments": {}}])
    ...
    env.reward()            # RewardInfo(value, state_ok, actions_ok, details)
    env.official_verdict()  # per_turn only
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping, Sequence, get_args

from nemo_rcgrpo.envs.bfcl.apis import build_instances
from nemo_rcgrpo.envs.bfcl.executor import ArgTypes, ExecutedCall, Toolbox
from nemo_rcgrpo.envs.bfcl.reward import GoldReplay, OfficialChecker, compute_reward, replay_gold
from nemo_rcgrpo.envs.bfcl.schemas import ResponseMode, done_tool
from nemo_rcgrpo.envs.bfcl.tasks import HOLDOUT_TURN_PROMPT, BFCLTask
from nemo_rcgrpo.envs.calls import CallRejected, to_tool_call
from nemo_rcgrpo.envs.interfaces import EPISODE_MODES, EpisodeMode
from nemo_rcgrpo.types import Message, Observation, OfficialVerdict, RewardInfo, ToolCall, ToolCallError, valid_text

# What an assistant message whose calls all fail to parse does: "observe" returns
# error observations (useful feedback in RL); "end_turn" ends the turn, which is
# what BFCL's inference loop does when decoding fails.
ParseFailure = Literal["observe", "end_turn"]
PARSE_FAILURE_MODES: tuple[str, ...] = get_args(ParseFailure)

SYSTEM_PROMPTS: Mapping[str, str] = MappingProxyType(
    {
        "per_turn": (
            "You are an assistant that completes the user's requests by calling the provided tools. "
            "Call tools as needed; their results are returned to you. When the request is complete, "
            "reply without a tool call."
        ),
        "merged": (
            "You are an assistant that completes the user's requests by calling the provided tools. "
            "Work through every step in order, calling tools as needed; their results are returned to you. "
            "When all steps are complete, call done()."
        ),
    }
)


@dataclass
class StepResult:
    observations: list[Observation]
    messages: list[Message]  # tool messages, then the next user turn if one started
    done: bool
    tools_changed: bool = False  # a miss_func turn offered new tools


@dataclass
class _TurnLog:
    steps: list[list[Observation]] = field(default_factory=list)
    decoded_steps: int = 0  # steps with at least one parseable call (BFCL's "decoded")
    results: list[str] = field(default_factory=list)


def merged_prompt(task: BFCLTask) -> str:
    """All user turns as one request: "Step 1: ...\\nStep 2: ..." (holdout turns skipped)."""
    steps = ["\n".join(m["content"] for m in turn) for turn in task.turns if turn]
    return "\n".join(f"Step {i}: {text}" for i, text in enumerate(steps, 1))


class BFCLEnv:
    """A single rollout's environment. Not shared: build one per rollout."""

    def __init__(
        self,
        mode: EpisodeMode = "merged",
        *,
        max_steps: int = 20,
        max_calls_per_step: int = 128,
        system_prompt: str | None = None,
        tool_response: ResponseMode = "description",
        arg_types: ArgTypes = "bfcl",
        on_parse_failure: ParseFailure = "observe",
        holdout_tools_in_message: bool = True,
        max_observation_chars: int = 65_536,
        reward: str = "state_x_action",
    ):
        if mode not in EPISODE_MODES:
            raise ValueError(f"unknown episode mode {mode!r}; choose one of {EPISODE_MODES}")
        if on_parse_failure not in PARSE_FAILURE_MODES:
            raise ValueError(f"unknown on_parse_failure {on_parse_failure!r}; choose one of {PARSE_FAILURE_MODES}")
        if max_steps < 1 or max_calls_per_step < 1 or max_observation_chars < 64:
            raise ValueError("max_steps, max_calls_per_step must be >= 1 and max_observation_chars >= 64")
        self.mode = mode
        self.reward_name = reward  # a registered reward (kind reward): what reward() pays
        self.max_steps = max_steps
        self.max_calls_per_step = max_calls_per_step
        self.system_prompt = SYSTEM_PROMPTS[mode] if system_prompt is None else system_prompt
        self.tool_response = tool_response
        self.arg_types = arg_types
        self.on_parse_failure = on_parse_failure
        self.holdout_tools_in_message = holdout_tools_in_message
        self.max_observation_chars = max_observation_chars
        self.task: BFCLTask | None = None

    # ------------------------------------------------------------------ episode
    def reset(self, task: BFCLTask, gold: GoldReplay | None = None) -> list[Message]:
        """Fresh API instances for ``task``; returns the opening messages."""
        self.task = task
        self.gold = gold if gold is not None else replay_gold(task)
        self.instances = build_instances(task)
        self.toolbox = Toolbox(self.instances, task.tools, self.arg_types)
        self.turn = 0
        self.turns: list[_TurnLog] = [_TurnLog()]
        self.executed: list[ExecutedCall] = []
        self.done = False
        self.truncated: str | None = None
        self.force_quit: str | None = None
        self.checker = OfficialChecker(self.gold)
        messages: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if self.mode == "merged":
            return messages + [{"role": "user", "content": merged_prompt(task)}]
        return messages + self._user_turn_messages(0)

    def _user_turn_messages(self, turn: int) -> list[Message]:
        msgs = [dict(m) for m in self.task.turns[turn]]
        if msgs:
            return msgs
        # A miss_func holdout turn. As in BFCL's prompting handlers, the new tools are
        # listed in the message itself, so the conversation so far stays a prefix
        # (FC endpoints also get them through `tools`).
        content = HOLDOUT_TURN_PROMPT
        new = [
            t
            for t in self.task.openai_tools(turn, self.tool_response)
            if t["function"]["name"] in self.task.missed_functions.get(turn, ())
        ]
        if new and self.holdout_tools_in_message:
            content = json.dumps(new) + "\n" + HOLDOUT_TURN_PROMPT
        return [{"role": "user", "content": content}]

    @property
    def offered(self) -> frozenset[str]:
        return self.task.offered_tool_names(None if self.mode == "merged" else self.turn)

    @property
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas offered right now."""
        turn = None if self.mode == "merged" else self.turn
        tools = self.task.openai_tools(turn, self.tool_response)
        return tools + [done_tool()] if self.mode == "merged" else tools

    # ------------------------------------------------------------------ step
    def step(self, calls: Sequence[Any]) -> StepResult:
        """Run one assistant message's tool calls (call strings, OpenAI dicts or ToolCall).

        An empty ``calls`` means the assistant answered without calling a tool.
        """
        if self.task is None:
            raise RuntimeError("call reset(task) before step()")
        if self.done:
            raise RuntimeError("episode is over; call reset(task) to start another")
        if not calls:
            return self._end_turn()
        if self.on_parse_failure == "end_turn":
            parsed = [to_tool_call(c) for c in calls]
            if not any(isinstance(c, ToolCall) for c in parsed):
                return self._end_turn()
            calls = parsed
        log = self.turns[self.turn]
        observations: list[Observation] = []
        step_log: list[Observation] = []
        decoded = False
        finished = False
        for i, raw in enumerate(calls):
            call = to_tool_call(raw)
            call_id = call.id or f"call_{self.turn}_{len(log.steps)}_{i}"
            if isinstance(call, ToolCall):
                decoded = True
                if self.mode == "merged" and call.name == "done":
                    finished = True
                    break
            obs = self._execute(call, call_id, too_many=len(calls) if i >= self.max_calls_per_step else 0)
            observations.append(obs)
            step_log.append(obs)
            log.results.append(obs.content)
        log.steps.append(step_log)
        log.decoded_steps += decoded
        messages: list[Message] = [
            {"role": "tool", "tool_call_id": o.tool_call_id, "name": o.name or "", "content": o.content}
            for o in observations
        ]
        if finished:
            self._finish()
            return StepResult(observations, messages, done=True)
        if len(log.steps) > self.max_steps:  # BFCL: force quit when count > MAXIMUM_STEP_LIMIT
            self.force_quit = f"more than {self.max_steps} tool-calling steps in turn {self.turn}"
            if self.mode == "per_turn":
                self._close_turn()
            self._finish()
            return StepResult(observations, messages, done=True)
        return StepResult(observations, messages, done=False)

    def _execute(self, call: ToolCall | ToolCallError, call_id: str, too_many: int) -> Observation:
        obs = self._observe(call, call_id, too_many)
        return Observation(valid_text(obs.content), obs.ok, obs.name, obs.tool_call_id)  # always encodable text

    def _observe(self, call: ToolCall | ToolCallError, call_id: str, too_many: int) -> Observation:
        if isinstance(call, ToolCallError):
            return Observation(f"Error: could not parse tool call: {call.message}", False, None, call_id)
        if too_many:
            return Observation(
                f"Error: this message has {too_many} tool calls; at most {self.max_calls_per_step} are "
                "run per message, so this one was not run",
                False,
                call.name,
                call_id,
            )
        try:
            executed = self.toolbox.execute(call, self.offered)
        except CallRejected as e:
            return Observation(f"Error: {e}", False, call.name, call_id)
        self.executed.append(executed)
        return Observation(self._clip(executed.result), executed.ok, executed.name, call_id)

    def _clip(self, text: str) -> str:
        """Bound what one call can add to the context (the longest gold result is ~32k characters)."""
        if len(text) <= self.max_observation_chars:
            return text
        return (
            text[: self.max_observation_chars] + f"... [truncated {len(text) - self.max_observation_chars} characters]"
        )

    def _close_turn(self) -> None:
        log = self.turns[self.turn]
        self.checker.end_turn(self.turn, self.instances, log.results, log.decoded_steps)

    def _end_turn(self) -> StepResult:
        if self.mode == "merged":
            self._finish()
            return StepResult([], [], done=True)
        self._close_turn()
        self.turn += 1
        if self.turn >= self.task.num_turns:
            self._finish()
            return StepResult([], [], done=True)
        self.turns.append(_TurnLog())
        changed = self.turn in self.task.missed_functions
        return StepResult([], self._user_turn_messages(self.turn), done=False, tools_changed=changed)

    def _finish(self) -> None:
        self.done = True

    def truncate(self, reason: str) -> None:
        """End the episode early (context budget, generation failure): reward 0, recorded."""
        self.truncated = reason
        self.done = True

    # ------------------------------------------------------------------ scoring
    def reward(self) -> RewardInfo:
        if self.task is None:
            raise RuntimeError("call reset(task) first")
        return compute_reward(
            self.instances, self.executed, self.gold, truncated=self.truncated, reward=self.reward_name
        )

    def official_verdict(self) -> OfficialVerdict | None:
        """BFCL's verdict; None for merged episodes (no turn structure to check)."""
        if self.mode != "per_turn":
            return None
        return self.checker.verdict(self.truncated or self.force_quit)

    @property
    def num_errors(self) -> int:
        return sum(1 for t in self.turns for s in t.steps for o in s if not o.ok)

    def observations_by_turn(self) -> list[list[str]]:
        return [list(t.results) for t in self.turns]
