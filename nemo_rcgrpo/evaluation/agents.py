"""Message-level agents for evaluation and the loop that plays them through an environment (`envs/interfaces.py`).

Checkpoints are evaluated token-in/token-out through the rollout engine (the
same code as RL rollouts). Everything that speaks whole messages — the two
reference policies and OpenAI-compatible endpoints — goes through
`play_episode` here: the agent gets the conversation and the tools offered
right now, answers with text and/or tool calls, the env executes the calls and
appends its messages. Both paths end in the same env scoring.

Reference policies (they make the harness itself testable):
- ``oracle`` plays the suite's ``oracle_calls(task)`` (BFCL's: the ground truth): per turn, the turn's calls in one
  message, then (per-turn episodes) a closing text; in merged episodes every
  non-empty gold turn in order, then ``done()`` where the env offers it (else a closing text). It must score 100%.
- ``null`` never calls a tool. It must score 0%.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from nemo_rcgrpo.data.closing import ClosingTexts
from nemo_rcgrpo.envs.interfaces import Env, Task
from nemo_rcgrpo.types import Message, ToolCall, ToolCallError


class EpisodeRefused(RuntimeError):
    """The policy cannot continue this episode (e.g. the endpoint rejected the request); scored as it stands."""


@dataclass
class AgentReply:
    content: str = ""
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)
    truncated: str | None = None  # the message was cut (length limit): the episode ends with reward 0
    tokens: int = 0
    message: Message | None = None  # the assistant message as the policy wrote it (endpoints); else built here


class Agent(Protocol):
    def start(self, task: Task, mode: str, seed: int) -> None: ...

    def act(self, messages: list[Message], tools: list[dict], turn: int) -> AgentReply: ...


class OracleAgent:
    """``plan_of(task)``: the calls per user turn (the suite's ``oracle_calls``)."""

    def __init__(self, plan_of: Callable[[Task], list[list[ToolCall]]], closing: ClosingTexts = ClosingTexts()):
        self.plan_of, self.closing = plan_of, closing

    def start(self, task: Task, mode: str, seed: int) -> None:
        self.task, self.mode = task, mode
        self.plan = self.plan_of(task)
        self.next_turn = 0  # merged: next gold turn to emit
        self.emitted: set[int] = set()  # per_turn: turns whose calls were sent

    def act(self, messages: list[Message], tools: list[dict], turn: int) -> AgentReply:
        if self.mode == "merged":
            while self.next_turn < len(self.plan) and not self.plan[self.next_turn]:
                self.next_turn += 1
            if self.next_turn < len(self.plan):
                self.next_turn += 1
                return AgentReply(calls=list(self.plan[self.next_turn - 1]))
            if any(
                t["function"]["name"] == "done" for t in tools
            ):  # the env's way to end an episode (envs/interfaces.py)
                return AgentReply(calls=[ToolCall("done")])
            return AgentReply(content=self.closing.completed)  # a message without a call ends it
        if self.plan[turn] and turn not in self.emitted:
            self.emitted.add(turn)
            return AgentReply(calls=list(self.plan[turn]))
        return AgentReply(content=self.closing.for_turn(self.task, turn, len(self.plan[turn])))


class NullAgent:
    def start(self, task: Task, mode: str, seed: int) -> None:
        pass

    def act(self, messages: list[Message], tools: list[dict], turn: int) -> AgentReply:
        return AgentReply(content="I will not use any tools.")


@dataclass
class MessageEpisode:
    messages: list[Message]
    num_turns: int = 0
    tool_errors: int = 0
    generated_tokens: int = 0
    calls: list[list[dict[str, Any]]] = field(default_factory=list)
    observations: list[list[str]] = field(default_factory=list)


def _call_record(call: ToolCall | ToolCallError) -> dict[str, Any]:
    if isinstance(call, ToolCallError):
        return {"error": call.message, "raw": call.raw}
    return {"name": call.name, "arguments": call.kwargs}


def play_episode(agent: Agent, env: Env, opening: list[Message], *, max_turns: int) -> MessageEpisode:
    """Alternate agent and env until the env is done, ``max_turns`` messages were written, or the agent stops."""
    ep = MessageEpisode(messages=list(opening))
    while not env.done:
        if ep.num_turns >= max_turns:
            env.truncate(f"more than {max_turns} assistant messages")
            break
        try:
            reply = agent.act(ep.messages, env.tools, getattr(env, "turn", 0))  # a per-turn env's user turn
        except EpisodeRefused as e:
            env.truncate(str(e))
            break
        ep.num_turns += 1
        ep.generated_tokens += reply.tokens
        ids = [c.id or f"call_{len(ep.messages)}_{i}" for i, c in enumerate(reply.calls)]
        ep.messages.append(
            reply.message
            or {
                "role": "assistant",
                "content": reply.content,
                "tool_calls": [
                    {"id": ids[i], "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.kwargs)}}
                    for i, c in enumerate(reply.calls)
                    if isinstance(c, ToolCall)
                ],
            }
        )
        if reply.truncated:
            env.truncate(reply.truncated)
            break
        calls = [c if c.id else _with_id(c, ids[i]) for i, c in enumerate(reply.calls)]
        ep.calls.append([_call_record(c) for c in calls])
        result = env.step(calls)
        ep.observations.append([o.content for o in result.observations])
        ep.tool_errors += sum(not o.ok for o in result.observations)
        ep.messages += result.messages
    return ep


def _with_id(call: ToolCall | ToolCallError, call_id: str) -> ToolCall | ToolCallError:
    if isinstance(call, ToolCall):
        return ToolCall(call.name, call.kwargs, call.args, call_id)
    return ToolCallError(call.raw, call.message, call_id)
