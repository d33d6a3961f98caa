"""Trajectories in OpenAI chat format, built by playing a plan of tool calls through the env.

A *plan* is what an agent decides: per BFCL turn, the tool calls it makes
(arguments by name). Playing a plan through a fresh `BFCLEnv` produces the
conversation the model would see and write, with the environment's real
observations in the tool messages, and the reward the env gives it. Expert
trajectories play the ground truth; failures play perturbed plans
(`failures.py`); `replay_messages` plays the stored assistant messages of any
trajectory again (the check that a dataset line earns the reward it claims).

Episode shapes (`mode`):
- ``merged``: system, one "Step 1..N" user message, one assistant message per
  BFCL turn with that turn's tool calls (each followed by its tool messages),
  and a final assistant ``done()`` call.
- ``per_turn``: the BFCL turns one by one; after its tool calls the assistant
  closes each turn with a short text (``ClosingTexts``), which is also how it
  answers a turn it cannot serve (miss_param: asks for the missing value;
  miss_func: says no tool can do it; the next user turn supplies it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from nemo_rcgrpo.data.closing import ClosingTexts
from nemo_rcgrpo.envs.bfcl.env import BFCLEnv
from nemo_rcgrpo.envs.bfcl.executor import named_arguments
from nemo_rcgrpo.envs.bfcl.reward import GoldReplay
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask
from nemo_rcgrpo.envs.calls import parse_call_string
from nemo_rcgrpo.types import Message, RewardInfo, ToolCall

Plan = list[list[ToolCall]]  # per BFCL turn, the calls (kwargs only) in order


@dataclass
class PlayedTrajectory:
    messages: list[Message]
    tools: list[dict[str, Any]]  # tools offered at the start (miss_func additions arrive in a user message)
    reward: RewardInfo
    observations_ok: bool  # no tool call of the plan came back as an error


def gold_plan(task: BFCLTask) -> Plan:
    """The ground truth as a plan, positional arguments bound to names."""
    plan = []
    for calls in task.ground_truth:
        turn = []
        for text in calls:
            call = parse_call_string(text)
            tool = task.tool(call.name)
            turn.append(ToolCall(call.name, named_arguments(tool, call)))
        plan.append(turn)
    return plan


def _assistant_call_message(calls: Sequence[ToolCall], next_id: int) -> Message:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{next_id + i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.kwargs)},
            }
            for i, c in enumerate(calls)
        ],
    }


def play(
    task: BFCLTask,
    plan: Plan,
    mode: str,
    *,
    gold: GoldReplay | None = None,
    closing: ClosingTexts = ClosingTexts(),
    calls_per_message: str = "turn",
    env: BFCLEnv | None = None,
) -> PlayedTrajectory:
    """Play ``plan`` through a fresh episode; returns the conversation and its reward.

    ``calls_per_message``: ``turn`` puts a turn's calls in one assistant message
    (parallel calls), ``one`` gives every call its own assistant message.
    """
    if calls_per_message not in ("turn", "one"):
        raise ValueError(f"calls_per_message={calls_per_message!r}: choose 'turn' or 'one'")
    env = env or BFCLEnv(mode=mode)
    if env.mode != mode:
        raise ValueError(f"env mode {env.mode!r} differs from requested mode {mode!r}")
    messages = env.reset(task, gold=gold)
    tools = env.tools
    n_calls, all_ok = 0, True

    def run(calls: Sequence[ToolCall]) -> None:
        nonlocal n_calls, all_ok
        groups = [list(calls)] if calls_per_message == "turn" else [[c] for c in calls]
        for group in groups:
            if not group or env.done:
                continue
            message = _assistant_call_message(group, n_calls)
            n_calls += len(group)
            result = env.step(message["tool_calls"])
            messages.append(message)
            messages.extend(result.messages)
            all_ok &= all(o.ok for o in result.observations)

    for turn in range(task.num_turns):
        calls = plan[turn] if turn < len(plan) else []
        run(calls)
        if mode == "per_turn" and not env.done:
            messages.append({"role": "assistant", "content": closing.for_turn(task, turn, len(calls))})
            messages.extend(env.step([]).messages)
    if mode == "merged" and not env.done:
        message = _assistant_call_message([ToolCall("done")], n_calls)
        env.step(message["tool_calls"])
        messages.append(message)
    return PlayedTrajectory(messages, tools, env.reward(), all_ok)


def replay_messages(task: BFCLTask, messages: Sequence[Message], mode: str, gold: GoldReplay | None = None):
    """Play the stored assistant messages of a trajectory again; returns (RewardInfo, tool results).

    Only assistant messages are taken from the record: user and tool messages
    are produced by the env, so a record with edited observations cannot earn
    a reward it would not get.
    """
    env = BFCLEnv(mode=mode)
    env.reset(task, gold=gold)
    results: list[str] = []
    for m in messages:
        if env.done:
            break
        if m.get("role") != "assistant":
            continue
        step = env.step(list(m.get("tool_calls") or []))
        results.extend(o.content for o in step.observations)
    if not env.done:
        env.truncate("trajectory ended before the episode did")
    return env.reward(), results
