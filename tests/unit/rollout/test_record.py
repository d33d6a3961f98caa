"""One episode record (rollout/record.py): the three dumps write it, the report reads it, old dumps still load."""

import json
from dataclasses import fields
from types import SimpleNamespace

import torch

from nemo_rcgrpo.rollout.multi_turn import Trajectory
from nemo_rcgrpo.rollout.record import EpisodeRecord

FIELDS = {f.name for f in fields(EpisodeRecord)} - {"extra"}


def _trajectory() -> Trajectory:
    t = Trajectory("kv_1", "put", 0, "high", [1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.1, -0.2], 2, reward=1.0)
    t.calls, t.observations, t.texts = [[{"name": "put", "arguments": {"key": "a"}}]], [["ok"]], ["<tool_call>"]
    t.num_turns, t.reward_details = 1, {"store": {"a": "b"}}
    return t


def test_every_writer_writes_every_field_and_the_line_reads_back():
    from nemo_rcgrpo.evaluation.records import episode_record

    t = _trajectory()
    assert set(t.record()) == FIELDS and t.record()["turns"] == t.calls and t.record()["messages"][1]["content"] == "ok"
    cfg = SimpleNamespace(protocol="paper")
    task = SimpleNamespace(id="kv_1", category="put")
    line = episode_record(
        cfg,
        task,
        0,
        7,
        None,
        reward=0.0,
        official_valid=None,
        official_error=None,
        truncated=None,
        details={"missing_actions": ["put(a)"]},
        num_turns=1,
        tool_errors=0,
        generated_tokens=2,
        calls=[[]],
        observations=[[]],
        extra={"messages": [], "bfcl_result": {"id": "x"}},
    )
    assert set(line) == FIELDS | {"bfcl_result"} and line["turns"] == [[]] and line["sample"] == 0
    assert line["success"] is False and line["failure_reason"] == "1 gold action(s) missing, first: put(a)"
    assert line["reward_details"] == {"missing_actions": ["put(a)"]}
    back = EpisodeRecord.from_json(json.loads(json.dumps(line)))
    assert back.to_json() == line and back.extra == {"bfcl_result": {"id": "x"}}


def test_the_training_dump_is_the_same_record(tmp_path):
    from nemo_rcgrpo.algorithms.rl_batch import write_rollouts

    write_rollouts(
        tmp_path / "step_1.jsonl",
        1,
        [[_trajectory(), _trajectory()]],
        torch.tensor([[0.5, -0.5]]),
        lambda ids: f"prompt {ids}",
    )
    first, second = [json.loads(l) for l in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    assert set(first) == set(second) == FIELDS
    assert (first["step"], first["group"], first["advantage"], first["success"]) == (1, 0, 0.5, True)
    assert first["prompt"] == "prompt [1, 2]" and second["prompt"] is None and second["prompt_line"] == 1


def test_an_evaluation_line_written_before_the_record_still_loads():
    old = {
        "task_id": "multi_turn_base_0",
        "category": "base",
        "sample": 0,
        "seed": 3,
        "reward_token": None,
        "success": False,
        "reward": 0.0,
        "official_valid": False,
        "failure_reason": "reward 0",
        "truncated": None,
        "num_turns": 1,
        "tool_errors": 1,
        "generated_tokens": 9,
        "calls": [[{"name": "ls", "arguments": {}}]],
        "observations": [["Error: no"]],
        "text": ["ls()"],
        "details": {"state_differences": {}},
    }
    r = EpisodeRecord.from_json(old)
    assert r.turns == old["calls"] and r.reward_details == old["details"] and r.extra == {"text": ["ls()"]}
    assert r.messages == [
        {"role": "assistant", "content": "ls()", "tool_calls": old["calls"][0]},
        {"role": "tool", "content": "Error: no"},
    ]
    from nemo_rcgrpo.utils.report import _episode

    page = _episode(old, "eval", None)
    assert page["messages"] == r.messages and page["error"] == "reward 0" and page["task"] == "multi_turn_base_0"
