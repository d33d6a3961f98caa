"""A newcomer's first commands: self-describing `--help`, `--cfg job`, a refused recipe-less `train`, and the
README's one-minute smoke run from the command line in an empty folder (banner, per-step lines, outputs numbered
from 1, a resume that says so)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_rcgrpo.cli import main
from nemo_rcgrpo.utils.cli_help import documented_settings
from nemo_rcgrpo.utils.config import conf_dir

RCGRPO = [sys.executable, "-m", "nemo_rcgrpo.cli"]


@pytest.mark.parametrize(
    "command,expected",
    [
        (
            "train",
            [
                "smoke_rl",
                "rcgrpo_smollm_cpu",
                "rl.group_size=5",
                "trainer.lr=1.0e-05",
                "model.path=smollm2",
                "env.settings.mode=merged",
                "trainer.lr=1.0e-6",
            ],
        ),
        ("eval", ["eval_smollm_cpu", "protocol=paper", "max_turns=20"]),
        ("prepare-data", ["seed=1234", "test_fraction=0.1"]),
        ("layout", ["rcgrpo_llama8b", "layout.nodes=1", "policy.megatron.tp=1"]),
    ],
)
def test_help_lists_recipes_and_settings_with_defaults(command, expected, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    for text in expected:
        assert text in out, text
    if command == "train":  # one line per recipe with its description; bases are not recipes
        lines = {l.split()[0]: l for l in out.splitlines() if l.startswith("  ") and l.split()}
        assert "Smoke run" in lines["smoke_rl"] and "stage1_defaults" not in lines
        not_recipes = {
            "stage1_defaults",
            "rl_defaults",
            "rl_gpu_defaults",
            "paper_rl_defaults",
            "paper_stage1_defaults",
            "eval",
            "eval_smollm_cpu",
            "prepare_data",
        }
        assert {p.stem for p in conf_dir().glob("*.yaml")} - not_recipes <= set(lines)  # every train recipe listed
        # the meaning is the comment of the schema's field, the one place it is written; a base file's change is
        # listed with its own comment
        assert re.search(r"^  rl\.group_size=5 +G rollouts per task$", out, re.M)
        assert re.search(r"^  trainer\.max_steps=400 +RL steps$", out, re.M)
        changes = {k: (v, c) for k, v, c in documented_settings(conf_dir() / "rl_defaults.yaml")}
        assert changes["trainer.max_steps"] == ("400", "RL steps") and "rl.group_size" not in changes


def test_train_without_a_recipe_refuses_and_lists_them(capsys):
    for command in ("train", "layout"):
        assert main([command, "trainer.max_steps=1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--config-name" in err and "smoke_rl" in err and "rcgrpo_llama8b" in err


def test_cfg_job_prints_the_resolved_config_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config-name", "smoke_rl", "--cfg", "job", "rl.group_size=3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rl"]["group_size"] == 3 and cfg["run_dir"] == "runs/smoke_rl" and cfg["stage"] == "rcgrpo"
    assert cfg["trainer"]["lr"] == 1e-4 and cfg["generation"]["backend"] == "hf"  # recipe over rl_defaults
    assert list(tmp_path.iterdir()) == []  # no data, no run folder
    assert main(["eval", "--cfg=job", "policy=oracle", "protocol=bfcl", "out_dir=x"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["protocol"] == "bfcl"
    assert main(["train", "--config-name=smoke_rl", "--cfg", "all"]) == 2  # only `job`
    assert main(["train", "--config-name=smoke_rl", "--cfg=job", "rl.group_sizes=3"]) == 2  # validated first
    assert "did you mean rl.group_size" in capsys.readouterr().err


def test_smoke_run_from_an_empty_folder(data_dir, tmp_path):
    """`rcgrpo train --config-name smoke_rl` as the README's first screen runs it (the shared prepared data
    stands in for the step that prepares data/bfcl_v4, 6 s): the stage-1 recipe first, then 2 RC-GRPO steps."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [*RCGRPO, "train", "--config-name", "smoke_rl", f"data.dir={data_dir}", "logging.progress=false"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    # the banner of each stage, then one line per step
    assert "training rl.stage1_recipe=smoke_stage1 first" in err
    assert "recipe  smoke_stage1: stage rctp" in err and "recipe  smoke_rl: stage rcgrpo" in err
    assert "model   tiny-llama: 6.6M parameters" in err and "16 examples of " in err
    assert err.count("fresh start") == 2 and "a log line per step" in err
    assert [l.split(":")[0] for l in err.splitlines() if " step " in l and l.startswith(("rctp", "rcgrpo"))] == [
        "rctp step 1/4",
        "rctp step 2/4",
        "rctp step 3/4",
        "rctp step 4/4",
        "rcgrpo step 1/2",
        "rcgrpo step 2/2",
    ]
    run = tmp_path / "runs" / "smoke_rl"
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "eval_accuracy" in metrics[1]
    # the fast path by default: micro-batches filled to a whole group of max-length rollouts (4 x 1536 on CPU), so
    # the 2 groups take at most 2 passes instead of the 4 of trainer.micro_batch_size=2
    assert "micro-batches filled to 6144 forward positions (whole groups first)" in err
    assert all(1.0 <= m["micro_batches"] <= 2.0 for m in metrics), [m["micro_batches"] for m in metrics]
    # one step number everywhere: metrics, rollouts/, eval/, checkpoints/
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["step_2.jsonl"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_2"]
    records = [json.loads(l) for l in (run / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["step"] == 2 for r in records)
    for r in records:  # prompt once per group and token, or the line that has it; every message; the reward parts
        holder = r if r["prompt"] is not None else records[r["prompt_line"] - 1]
        assert (holder["group"], holder["reward_token"]) == (r["group"], r["reward_token"])
        assert f"[Reward Goal: <|{r['reward_token']}_reward|>]" in holder["prompt"]
        assert [m["role"] for m in r["messages"]].count("assistant") == r["num_turns"]
        assert {"reward", "state_ok", "actions_ok", "advantage", "reward_details"} <= set(r)
    assert (run / "hf" / "config.json").is_file() and (tmp_path / "runs" / "smoke_stage1" / "hf").is_dir()
    # the same command again: the banner says it resumes; nothing is left to train
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumes from runs/smoke_rl/checkpoints/step_2 (step 2)" in again.stderr
    assert "training rl.stage1_recipe" not in again.stderr


def test_a_users_recipe_folder_builds_on_the_shipped_recipes(tmp_path, capsys, monkeypatch):
    import nemo_rcgrpo.utils.config as config

    monkeypatch.setattr(config, "_USER_DIRS", [])  # --config-dir is remembered for the process
    mine = tmp_path / "my_conf"
    mine.mkdir()
    (mine / "my_smoke.yaml").write_text(
        "# My smoke run: three rollouts a group.\ndefaults:\n  - smoke_rl\n  - _self_\nrl:\n  group_size: 3\n"
    )
    (mine / "my_vllm.yaml").write_text("defaults:\n  - my_smoke\n  - override generation: vllm\n  - _self_\n")
    assert main(["train", "--config-dir", str(mine), "--help"]) == 0
    assert re.search(r"^  my_smoke +My smoke run: three rollouts a group\.$", capsys.readouterr().out, re.M)
    assert main(["train", "--config-dir", str(mine), "--config-name", "my_smoke", "--cfg", "job"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rl"]["group_size"] == 3 and cfg["rl"]["tasks_per_step"] == 2 and cfg["run_dir"] == "runs/smoke_rl"
    assert main(["train", f"--config-dir={mine}", "--config-name", "my_vllm", "--cfg", "job"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)  # a shipped group chosen from the user's recipe
    assert cfg["generation"]["backend"] == "vllm" and cfg["rl"]["group_size"] == 3
    assert main(["train", "--config-name", "smoke_stage1", "--cfg", "job"]) == 0  # shipped recipes still found
    assert yaml.safe_load(capsys.readouterr().out)["stage"] == "rctp"
    (mine / "smoke_stage1.yaml").write_text("defaults:\n  - stage1_defaults\n  - _self_\nstage: sft\n")
    assert main(["train", "--config-name", "smoke_stage1", "--cfg", "job"]) == 0  # a user's recipe of that name wins
    assert yaml.safe_load(capsys.readouterr().out)["stage"] == "sft"
    assert main(["train", "--config-name", "smoke_rl", "hydra.searchpath=[x]"]) == 2
    assert "set by --config-dir" in capsys.readouterr().err
    assert main(["train", "--config-dir", str(tmp_path / "absent"), "--config-name", "my_smoke"]) == 2
    assert "not a folder" in capsys.readouterr().err
