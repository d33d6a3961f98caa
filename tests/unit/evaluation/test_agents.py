"""evaluation/agents.py: the oracle's moves, turn by turn, and how it ends a merged episode."""

import types

from nemo_rcgrpo.evaluation.agents import OracleAgent
from nemo_rcgrpo.types import ToolCall

TOOL = {"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {}}}}
DONE = {"type": "function", "function": {"name": "done", "parameters": {"type": "object", "properties": {}}}}


def _oracle(plan):
    agent = OracleAgent(lambda task: plan)
    agent.start(types.SimpleNamespace(id="t", category="c"), "merged", seed=0)
    return agent


def test_a_merged_episode_plays_each_turn_with_calls_then_ends_it_the_envs_way():
    plan = [[ToolCall("put", {"k": "a"})], [], [ToolCall("put", {"k": "b"}), ToolCall("put", {"k": "c"})]]
    agent = _oracle(plan)
    moves = [agent.act([], [TOOL, DONE], turn=0) for _ in range(3)]
    assert [m.calls for m in moves] == [plan[0], plan[2], [ToolCall("done")]]  # the empty turn skipped
    # an env without a done tool: a message without a call ends the episode (envs/interfaces.py)
    agent = _oracle(plan)
    last = [agent.act([], [TOOL], turn=0) for _ in range(3)][-1]
    assert last.calls == [] and last.content == agent.closing.completed
