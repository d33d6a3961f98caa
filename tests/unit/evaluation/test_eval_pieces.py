"""Evaluation pieces with hand-computed values: pass@k, summaries, failure reasons, endpoint parsing, config."""

import math

import pytest

from nemo_rcgrpo.evaluation.config import EvalConfig
from nemo_rcgrpo.evaluation.endpoint import parse_tool_calls
from nemo_rcgrpo.evaluation.policies import failure_reason
from nemo_rcgrpo.evaluation.run import pass_at_k, select_tasks, summarize
from nemo_rcgrpo.types import ToolCall, ToolCallError
from nemo_rcgrpo.utils.config import ConfigError, compose


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0  # n - c < k


def _rec(task, cat, success, sample=0):
    return {"task_id": task, "category": cat, "success": success, "sample": sample}


def test_summarize_accuracies_and_pass_at_k():
    records = [
        _rec("a", "base", True, 0),
        _rec("a", "base", False, 1),
        _rec("b", "base", False, 0),
        _rec("b", "base", False, 1),
        _rec("c", "miss_func", True, 0),
        _rec("c", "miss_func", True, 1),
    ]
    s = summarize(records, samples=2)
    # per task mean accuracy: a 0.5, b 0, c 1 -> overall over tasks 50%
    assert s["overall"] == pytest.approx(50.0)
    assert s["categories"]["base"] == {"accuracy": pytest.approx(25.0), "tasks": 2}
    assert s["categories"]["miss_func"]["accuracy"] == pytest.approx(100.0)
    assert s["category_mean"] == pytest.approx(62.5)
    # pass@1 = mean over tasks of c/n = (0.5 + 0 + 1) / 3; pass@2 = (1 + 0 + 1) / 3
    assert s["pass_at_k"]["1"] == pytest.approx(50.0)
    assert s["pass_at_k"]["2"] == pytest.approx(200 / 3)
    assert list(s["categories"]) == ["base", "miss_func"]  # BFCL's category order


def test_failure_reasons():
    assert failure_reason("paper", success=True, truncated=None, official_error=None, details={}) is None
    assert (
        failure_reason("paper", success=False, truncated="context budget", official_error=None, details={})
        == "truncated: context budget"
    )
    r = failure_reason(
        "paper",
        success=False,
        truncated=None,
        official_error=None,
        details={"state_differences": {"TwitterAPI": {}}, "missing_actions": ["post_tweet(x=1)"]},
    )
    assert "TwitterAPI" in r and "1 gold action(s) missing" in r and "post_tweet" in r
    assert (
        failure_reason(
            "bfcl", success=False, truncated="x", official_error="multi_turn:force_terminated: y", details={}
        )
        == "multi_turn:force_terminated: y"
    )


def test_endpoint_tool_calls_parsing_never_raises():
    calls = parse_tool_calls(
        [
            {"id": "1", "type": "function", "function": {"name": "ls", "arguments": '{"a": true}'}},
            {"id": "2", "function": {"name": "cd", "arguments": "{not json"}},
            {"id": "3", "function": {"name": "cd", "arguments": "[1, 2]"}},
            {"id": "4", "function": {"arguments": "{}"}},
            "garbage",
            {"id": "6", "function": {"name": "pwd", "arguments": ""}},
            {"id": "7", "function": {"name": "mv", "arguments": {"source": "a"}}},
        ]
    )
    assert calls[0] == ToolCall("ls", {"a": True}, id="1")
    assert [type(c) for c in calls] == [
        ToolCall,
        ToolCallError,
        ToolCallError,
        ToolCallError,
        ToolCallError,
        ToolCall,
        ToolCall,
    ]
    assert "not JSON" in calls[1].message and "not a JSON object" in calls[2].message
    assert calls[5].kwargs == {} and calls[6].kwargs == {"source": "a"}
    assert parse_tool_calls(None) == [] and isinstance(parse_tool_calls("x")[0], ToolCallError)


def test_config_from_hydra_and_validation(tmp_path):
    cfg = EvalConfig.from_dict(compose("eval", ["policy=null", f"out_dir={tmp_path}"]))
    assert cfg.policy == "null" and cfg.mode == "merged"  # `policy=null` arrives as YAML null
    assert EvalConfig.from_dict(compose("eval", ["protocol=bfcl", f"out_dir={tmp_path}"])).mode == "per_turn"
    bad = {
        "out_dir is required": [],
        "temperature > 0": ["samples=4", f"out_dir={tmp_path}"],
        "policy='random': no eval_policy of that name": ["policy=random", f"out_dir={tmp_path}"],
        "checkpoint.path": ["policy=checkpoint", f"out_dir={tmp_path}"],
        "endpoint.model": ["policy=endpoint", f"out_dir={tmp_path}"],
        "categories": ["categories=[base,simple]", f"out_dir={tmp_path}"],
        "unknown setting": ["+endpoint.api_key=abc", f"out_dir={tmp_path}"],
    }
    for message, overrides in bad.items():
        with pytest.raises(ConfigError, match=message):
            EvalConfig.from_dict(compose("eval", overrides))
    cfg = EvalConfig.from_dict(compose("eval_smollm_cpu", [f"out_dir={tmp_path}"]))
    assert cfg.policy == "checkpoint" and cfg.limit == 2


def test_task_selection(suite, tmp_path):
    from nemo_rcgrpo.envs.splits import split_by_scenario

    paper = select_tasks(EvalConfig(out_dir=str(tmp_path)), suite)
    assert paper == split_by_scenario(suite, 1234, 0.1).to_json(suite)["test"] and len(paper) == 80
    assert len(select_tasks(EvalConfig(out_dir=str(tmp_path), protocol="bfcl"), suite)) == 800
    few = select_tasks(
        EvalConfig(out_dir=str(tmp_path), protocol="bfcl", limit=2, categories=("base", "miss_func")), suite
    )
    assert [suite[t].category for t in few] == ["base", "base", "miss_func", "miss_func"]
    (tmp_path / "split.json").write_text('{"test": ["multi_turn_base_3", "multi_turn_miss_param_7"]}')
    assert select_tasks(EvalConfig(out_dir=str(tmp_path), data_dir=str(tmp_path)), suite) == [
        "multi_turn_base_3",
        "multi_turn_miss_param_7",
    ]
    with pytest.raises(ConfigError, match="not in task_source=bfcl"):
        select_tasks(EvalConfig(out_dir=str(tmp_path), tasks=("multi_turn_base_9999",)), suite)
    assert math.isclose(len(paper) / 800, 0.1)


def test_held_out_tasks_of_a_data_builder_without_split_json(suite, tmp_path):
    """A plugin's data (no split.json) gives its held-out RL pointers, in their order, and its tasks of categories
    that are not BFCL's are not filtered; BFCL's tasks still need the split prepare-data wrote."""
    import types

    class Suite(dict):  # a plugin's task source: .tasks and [id], no BFCL split
        tasks = property(lambda self: self)

    kv = Suite(
        kv_1=types.SimpleNamespace(id="kv_1", category="put"), kv_2=types.SimpleNamespace(id="kv_2", category="copy")
    )
    (tmp_path / "rl_test.jsonl").write_text('{"task_id": "kv_2"}\n{"task_id": "kv_1"}\n')
    cfg = EvalConfig(out_dir=str(tmp_path), data_dir=str(tmp_path), categories=("base",))
    assert select_tasks(cfg, kv) == ["kv_2", "kv_1"]
    with pytest.raises(FileNotFoundError, match="split.json not found"):
        select_tasks(cfg, suite)
    (tmp_path / "split.json").write_text('{"test": ["kv_1"]}')
    assert select_tasks(cfg, kv) == ["kv_1"]  # a split.json wins


def test_which_of_bfcls_handlers_plays_a_policy(tmp_path):
    from nemo_rcgrpo.envs.bfcl.leaderboard import local_handler

    def cfg(*overrides):
        return EvalConfig.from_dict(compose("eval", [f"out_dir={tmp_path}", "protocol=bfcl", *overrides]))

    ckpt = ("policy=checkpoint", "checkpoint.path=tiny-llama")
    assert local_handler(cfg(*ckpt)) == "qwen_fc"  # hermes, the default chat format
    assert local_handler(cfg(*ckpt, "chat.format=llama3_json")) == "llama3_1"
    assert local_handler(cfg(*ckpt, "bfcl_handler=project")) is None
    endpoint = ("policy=endpoint", "endpoint.model=m")
    assert local_handler(cfg(*endpoint)) is None  # BFCL's OpenAI-compatible FC handler
    assert local_handler(cfg(*endpoint, "bfcl_handler=llama3_1")) == "llama3_1"
    assert local_handler(cfg("policy=oracle", "bfcl_handler=qwen_fc")) is None  # whole messages: FC
    for overrides, message in (
        (("bfcl_handler=gpt",), "bfcl_handler='gpt': choose one of"),
        ((*endpoint, "bfcl_handler=project"), "bfcl_handler=project is a checkpoint's"),
        ((*ckpt, "bfcl_handler=openai_fc"), "needs a chat server"),
    ):
        with pytest.raises(ConfigError, match=message):
            cfg(*overrides)


def test_trajectories_jsonl_lines_are_bounded_and_the_results_are_whole(suite, tmp_path, monkeypatch):
    """An episode whose tool results total 8 MB is one line of trajectories.jsonl within its cap (the longest
    results clipped with the marker, the record flagged); results.json counts it as the policy scored it; a normal
    episode beside it is written as json.dumps writes it."""
    import json

    import nemo_rcgrpo.evaluation.run as run
    from nemo_rcgrpo.utils.bounded import MAX_DUMP_RECORD_CHARS

    def record(task_id, results):
        return {
            "task_id": task_id,
            "category": "base",
            "sample": 0,
            "seed": 0,
            "reward_token": None,
            "success": True,
            "reward": 1.0,
            "official_valid": True,
            "failure_reason": None,
            "truncated": None,
            "num_turns": 1,
            "tool_errors": 0,
            "generated_tokens": 4,
            "calls": [[{"name": "cat", "arguments": {}}]],
            "observations": [results],
            "messages": [{"role": "assistant", "content": "cat()", "tool_calls": []}]
            + [{"role": "tool", "content": r} for r in results],
        }

    huge, normal = record("multi_turn_base_0", ["x" * 65_536] * 128), record("multi_turn_base_1", ["a.txt"])

    class Policy:
        description = {"policy": "fake"}

        def run(self, suite, task_ids, sample, seed, on_done, only=None):
            for r in (huge, normal):
                on_done(r)
            return [huge, normal]

        def close(self):
            pass

    monkeypatch.setattr(run, "make_policy", lambda cfg, suite: Policy())
    cfg = EvalConfig(
        out_dir=str(tmp_path), protocol="bfcl", tasks=("multi_turn_base_0", "multi_turn_base_1"), progress=False
    )
    result = run.evaluate(cfg, suite)
    first, second = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(first) <= MAX_DUMP_RECORD_CHARS  # 16.8 MB before (each result twice)
    clipped = json.loads(first)
    assert clipped["observations_clipped"] is True and clipped["success"] is True
    assert clipped["observations"][0][0].endswith(" characters]") and "... [clipped " in clipped["observations"][0][0]
    assert second == json.dumps(normal, default=str)
    assert result["overall"] == 100.0 and len(huge["observations"][0][0]) == 65_536
