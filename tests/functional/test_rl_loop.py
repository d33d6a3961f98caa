"""Two RC-GRPO steps on a tiny model end to end; dumps re-score; resume continues exactly."""

import json
import math
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.envs.bfcl import BFCLEnv
from nemo_rcgrpo.train import main
from nemo_rcgrpo.utils.logging import read_metrics


def _args(data_dir, run_dir, *extra):
    return ["--config-name=rcgrpo_smollm_cpu", "model.path=tiny-llama", "rl.stage1_recipe=null", f"data.dir={data_dir}",
            f"run_dir={run_dir}", "rl.group_size=4", "rl.tasks_per_step=2", "rl.max_turns=2",
            "rl.sampling.max_new_tokens=16", "rl.max_total_tokens=1536", "trainer.lr=1e-3", "trainer.max_steps=2",
            "logging.progress=false", "logging.tensorboard=false", *extra]


def _rescore(suite, record):
    env = BFCLEnv(mode="merged")
    env.reset(suite[record["task_id"]])
    for calls in record["turns"]:
        if env.done:
            break
        env.step([{"name": c["name"], "arguments": c["arguments"]} if "name" in c else "<unparsable>" for c in calls])
    if record["truncated"]:
        env.truncate(record["truncated"])
    return env.reward()


def test_two_rcgrpo_steps(data_dir, tmp_path, suite):
    from nemo_rcgrpo.models.hf import load_model

    initial = load_model("tiny-llama").state_dict()
    assert main(_args(data_dir, tmp_path / "r")) == 0
    metrics = read_metrics(tmp_path / "r")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["rollouts"] == 8 and 0.0 <= m["zero_variance_fraction"] <= 1.0
        assert {"entropy", "kl", "clip_fraction", "advantage_abs_mean", "generation_seconds", "reward_mean_high",
                "reward_mean_low", "tool_error_rate", "success_base"} <= m.keys()
    after = torch.load(tmp_path / "r" / "checkpoints" / "step_2" / "model.pt", weights_only=True)
    assert any(not torch.equal(initial[k], after[k]) for k in initial if k in after)
    for step in (0, 1):
        records = [json.loads(l) for l in (tmp_path / "r" / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(records) == 8
        for g in (0, 1):
            tokens = [r["reward_token"] for r in records if r["group"] == g]
            assert sorted(tokens) == ["high", "high", "low", "low"]  # stratified, p = 0.5, G = 4
        for r in records:
            rescored = _rescore(suite, r)
            assert (rescored.value, rescored.state_ok, rescored.actions_ok) == (r["reward"], r["state_ok"], r["actions_ok"])
            assert {"task_id", "group", "reward_token", "turns", "observations", "reward", "advantage", "num_turns",
                    "text"} <= r.keys()


def test_resume_after_interruption_continues_at_the_right_step(data_dir, tmp_path):
    assert main(_args(data_dir, tmp_path / "a", "trainer.export_hf=false")) == 0
    assert main(_args(data_dir, tmp_path / "b", "trainer.stop_after=1", "trainer.export_hf=false")) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "b")] == [1]
    assert main(_args(data_dir, tmp_path / "b", "trainer.export_hf=false")) == 0
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    dump_a = (tmp_path / "a" / "rollouts" / "step_1.jsonl").read_text()
    assert dump_a == (tmp_path / "b" / "rollouts" / "step_1.jsonl").read_text()


def test_kill_mid_run_then_resume(data_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[2]
    args = _args(data_dir, tmp_path / "k", "trainer.max_steps=3", "trainer.save_every=1", "trainer.export_hf=false")
    proc = subprocess.Popen([sys.executable, str(repo / "nemo_rcgrpo" / "train.py"), *args], cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    first = tmp_path / "k" / "checkpoints" / "step_1" / "trainer_state.json"
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # somewhere inside step 2
    proc.wait()
    assert first.exists()
    assert main(args) == 0
    steps = [m["step"] for m in read_metrics(tmp_path / "k")]
    assert steps == [1, 2, 3]  # each step once, none lost
    assert sorted(p.name for p in (tmp_path / "k" / "rollouts").iterdir()) == ["step_0.jsonl", "step_1.jsonl", "step_2.jsonl"]


def test_pipeline_runs_stage1_first_and_evaluates(data_dir, tmp_path):
    stage1 = tmp_path / "s1"
    args = _args(data_dir, tmp_path / "rl", "trainer.max_steps=1", f"model.path={stage1}/hf",
                 "rl.stage1_recipe=rctp_smollm_cpu", "trainer.export_hf=false",
                 "rl.stage1_overrides=['model.path=tiny-llama','trainer.max_steps=1','data.max_examples=4',"
                 "'chat.max_length=900','trainer.global_batch_size=2','logging.progress=false']",
                 "rl.eval_every=1", "rl.eval_tasks=2")
    args = [a for a in args if a != "rl.stage1_recipe=null"]
    assert main(args) == 0
    assert (stage1 / "hf" / "config.json").is_file() and len(read_metrics(stage1)) == 1
    m = read_metrics(tmp_path / "rl")[0]
    assert m["eval_reward"] == 0.0 and "eval_seconds" in m and m["reward_seconds"] >= 0
    assert m["eval_accuracy"] == 0.0 and m["eval_accuracy_base"] == 0.0
    assert len((tmp_path / "rl" / "eval" / "step_1.jsonl").read_text().splitlines()) == 2


def test_dapo_filter_replaces_zero_variance_groups(data_dir, tmp_path):
    # a random model scores 0 everywhere: every group has zero variance, is dropped and replaced once
    assert main(_args(data_dir, tmp_path / "d", "stage=dapo_filter", "rl.dapo_max_rounds=1", "trainer.max_steps=1",
                      "trainer.export_hf=false")) == 0
    m = read_metrics(tmp_path / "d")[0]
    assert (m["dropped_zero_variance_groups"], m["groups"], m["rollouts"]) == (2.0, 2.0, 8.0)
    records = [json.loads(l) for l in (tmp_path / "d" / "rollouts" / "step_0.jsonl").read_text().splitlines()]
    assert all(r["reward_token"] is None for r in records)  # no tokens outside rcgrpo
