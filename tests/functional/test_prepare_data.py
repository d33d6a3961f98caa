"""`rcgrpo prepare-data` end to end: counts, replay of every line, determinism, bad input."""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import pytest

from nemo_rcgrpo.envs.bfcl.trajectories import replay_messages
from nemo_rcgrpo.prepare_data import PrepareDataConfig, run

FILES = ("sft.jsonl", "failures.jsonl", "rctp.jsonl", "rl_train.jsonl", "rl_test.jsonl", "split.json", "stats.json")


def _lines(path):
    return [json.loads(l) for l in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "data"
    stats = run(PrepareDataConfig(out_dir=str(out), seed=11, progress=False))
    return out, stats


def test_files_and_counts(prepared):
    out, stats = prepared
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES + ("config.yaml",))
    split = json.loads((out / "split.json").read_text())
    assert split["counts"]["train"] == {
        "total": 720,
        "base": 180,
        "long_context": 180,
        "miss_func": 180,
        "miss_param": 180,
    }
    assert split["counts"]["test"]["total"] == 80
    train_scen = {int(i.rsplit("_", 1)[1]) for i in split["train"]}
    test_scen = {int(i.rsplit("_", 1)[1]) for i in split["test"]}
    assert not train_scen & test_scen and len(test_scen) == 20
    sft, failures, rctp = (_lines(out / n) for n in ("sft.jsonl", "failures.jsonl", "rctp.jsonl"))
    assert (len(sft), len(failures), len(rctp)) == (800, 800, 1600)
    assert Counter(r["reward"] for r in rctp) == {1: 800, 0: 800}
    assert {r["split"] for r in sft if r["task_id"] in split["test"]} == {"test"}
    rl_train, rl_test = _lines(out / "rl_train.jsonl"), _lines(out / "rl_test.jsonl")
    assert (len(rl_train), len(rl_test)) == (720, 80)
    assert rl_test[0].keys() == {"task_id", "category", "env", "task_source", "mode"} and {
        r["task_id"] for r in rl_test
    } == set(split["test"])
    for record in sft:
        assert record.keys() >= {"task_id", "category", "split", "mode", "messages", "tools"}
    calls = [c for r in sft for m in r["messages"] for c in m.get("tool_calls") or []]
    assert all(c["type"] == "function" and isinstance(c["function"]["arguments"], str) for c in calls)
    tool_msgs = [m for r in sft for m in r["messages"] if m["role"] == "tool"]
    assert all(m["tool_call_id"].startswith("call_") for m in tool_msgs)
    assert stats["files"]["sft.jsonl"]["success_rate"] == 1.0 and stats["files"]["rctp.jsonl"]["success_rate"] == 0.5
    assert sum(stats["failure_types"].values()) == 800 and set(stats["failure_types"]) <= {
        "wrong_tool",
        "wrong_param",
        "premature_termination",
    }
    assert min(stats["failure_types"].values()) > 200  # a real mix
    tokens = stats["files"]["sft.jsonl"]["tokens"]
    assert 1000 < tokens["p50"] <= tokens["p90"] <= tokens["max"] and stats["tokenizer"] == "smollm2"


def test_every_line_replays_to_its_reward(prepared, suite):
    out, _ = prepared
    for name, expected in (("sft.jsonl", 1.0), ("failures.jsonl", 0.0)):
        for record in _lines(out / name):
            task = suite[record["task_id"]]
            reward, results = replay_messages(task, record["messages"], record["mode"], gold=suite.gold(task))
            assert reward.value == expected, (name, record["task_id"])
            if name == "sft.jsonl":
                assert results == [m["content"] for m in record["messages"] if m["role"] == "tool"]


def test_reward_token_only_in_first_user_message_of_rctp(prepared):
    out, _ = prepared
    for name in ("sft.jsonl", "failures.jsonl"):
        assert "Reward Goal" not in (out / name).read_text()
    for record in _lines(out / "rctp.jsonl"):
        users = [m for m in record["messages"] if m["role"] == "user"]
        goal = "<|high_reward|>" if record["reward"] == 1 else "<|low_reward|>"
        assert users[0]["content"].endswith(f" [Reward Goal: {goal}]") and record["reward_goal"] == goal
        rest = json.dumps([m for m in record["messages"] if m is not users[0]])
        assert "<|high_reward|>" not in rest and "<|low_reward|>" not in rest


def test_loads_with_hf_datasets(prepared):
    out, _ = prepared
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("json", data_files=str(out / "rctp.jsonl"), split="train")
    assert len(ds) == 1600 and ds[0]["messages"][1]["role"] == "user"
    assert ds[0]["tools"][0]["function"]["parameters"]["type"] == "object"


def _cli(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "nemo_rcgrpo.cli", "prepare-data", *args], capture_output=True, text=True, env=env
    )


def test_same_seed_byte_identical_across_processes_other_seed_differs(tmp_path):
    small = ["categories=[miss_param]", "tokenizer=null", "progress=false"]
    a = _cli(f"out_dir={tmp_path / 'a'}", "seed=5", *small, env_extra={"PYTHONHASHSEED": "1"})
    b = _cli(f"out_dir={tmp_path / 'b'}", "seed=5", *small, env_extra={"PYTHONHASHSEED": "2"})
    c = _cli(f"out_dir={tmp_path / 'c'}", "seed=6", *small)
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    split_a = json.loads((tmp_path / "a" / "split.json").read_text())
    split_c = json.loads((tmp_path / "c" / "split.json").read_text())
    assert split_a["test"] != split_c["test"] and split_a["counts"]["test"]["total"] == 20


def _bfcl_copy(tmp_path):
    from nemo_rcgrpo.envs.bfcl.tasks import bfcl_data_dir

    dst = tmp_path / "bfcl_data"
    src = bfcl_data_dir()
    (dst / "possible_answer").mkdir(parents=True)
    shutil.copytree(src / "multi_turn_func_doc", dst / "multi_turn_func_doc")
    for cat in ("base", "miss_func", "miss_param", "long_context"):
        name = f"BFCL_v4_multi_turn_{cat}.json"
        shutil.copy(src / name, dst / name)
        shutil.copy(src / "possible_answer" / name, dst / "possible_answer" / name)
    return dst


def test_bad_input_gives_one_line_errors(tmp_path, capfd, monkeypatch):
    """The first case as a user's own process (exit status and stderr); the others through the CLI's entry point in
    this process (PYTHONHASHSEED=0 set, as the command sets it for itself before it runs), with what reaches file
    descriptor 2."""
    from nemo_rcgrpo.cli import main

    monkeypatch.setenv("PYTHONHASHSEED", "0")

    data = _bfcl_copy(tmp_path)
    (data / "possible_answer" / "BFCL_v4_multi_turn_base.json").unlink()
    corrupt = _bfcl_copy(tmp_path / "c")
    with (corrupt / "BFCL_v4_multi_turn_miss_func.json").open("a") as f:
        f.write("{this is not json\n")
    existing = tmp_path / "exists"
    existing.mkdir()
    cases = [
        ([f"bfcl_data_dir={data}"], "missing BFCL data file", "reinstall bfcl-eval"),
        ([f"bfcl_data_dir={corrupt}"], "corrupt BFCL data file", "reinstall bfcl-eval"),
        (["categories=[base,web_search]"], "categories=", "use a non-empty subset of"),
        ([f"out_dir={existing}"], "already exists", "overwrite=true"),
        (["mode=turnwise"], "mode='turnwise'", "choose one of"),
        (["+epochs=3"], "unknown setting epochs", "known: ["),
    ]
    for i, (args, what, how) in enumerate(cases):
        if not any(a.startswith("out_dir=") for a in args):
            args = [*args, f"out_dir={tmp_path / 'never'}"]
        args = [*args, "tokenizer=null", "progress=false"]
        if i == 0:
            proc = _cli(*args, env_extra={"PYTHONHASHSEED": ""})
            code, err = proc.returncode, proc.stderr.strip()
        else:
            code = main(["prepare-data", *args])
            err = capfd.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, (args, err)
        assert err.startswith("error: ") and what in err and how in err, err
    assert not (tmp_path / "never").exists() and list(existing.iterdir()) == []


def test_failures_from_recorded_rollouts(tmp_path, suite):
    base = PrepareDataConfig(out_dir=str(tmp_path / "p"), categories=("base",), tokenizer=None, progress=False)
    run(base)
    failures = _lines(tmp_path / "p" / "failures.jsonl")
    experts = _lines(tmp_path / "p" / "sft.jsonl")
    rollouts = tmp_path / "rollouts.jsonl"
    with rollouts.open("w") as f:
        for r in failures[:5]:  # genuine failures recorded by a "run"
            f.write(
                json.dumps({"task_id": r["task_id"], "messages": r["messages"], "reward": 0, "mode": "merged"}) + "\n"
            )
        f.write(json.dumps({"task_id": experts[9]["task_id"], "messages": experts[9]["messages"], "reward": 0}) + "\n")
        f.write(json.dumps({"task_id": experts[8]["task_id"], "messages": experts[8]["messages"], "reward": 1}) + "\n")
    cfg = PrepareDataConfig(
        out_dir=str(tmp_path / "q"),
        categories=("base",),
        tokenizer=None,
        progress=False,
        failures=PrepareDataConfig().failures.__class__(rollout_files=(str(rollouts),), rollout_fraction=1.0),
    )
    stats = run(cfg)
    assert stats["rollout_files"] == {
        "read": 7,
        "kept": 5,
        "not_failures": 1,
        "other_mode": 0,
        "unknown_task": 0,
        "rejected_on_replay": 1,
    }
    assert stats["failure_sources"] == {"perturbation": 195, "rollout": 5}
    mixed = _lines(tmp_path / "q" / "failures.jsonl")
    from_rollouts = [r for r in mixed if r["source"] == "rollout"]
    assert {r["task_id"] for r in from_rollouts} == {r["task_id"] for r in failures[:5]}
    assert all(r["failure_type"] == "exploration" for r in from_rollouts)
