"""Stage-1 training end to end on a tiny model: metrics, checkpoints, export, exact resume, errors, DDP."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_rcgrpo.utils.logging import read_metrics

REPO = Path(__file__).resolve().parents[2]


def _args(data_dir, run_dir, *extra, stage="sft"):
    return [
        f"--config-name={stage}_smollm_cpu",
        "model.path=tiny-qwen2",
        f"run_dir={run_dir}",
        f"data.dir={data_dir}",
        "chat.max_length=900",
        "data.max_examples=16",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=1",
        "trainer.save_every=2",
        "logging.progress=false",
        "logging.tensorboard=true",
        *extra,
    ]


def _train(args, env=None):
    return subprocess.run(
        [sys.executable, str(REPO / "nemo_rcgrpo" / "train.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def test_three_steps_metrics_checkpoint_export(data_dir, tmp_path):
    from nemo_rcgrpo.train import main

    assert main(_args(data_dir, tmp_path / "r", "trainer.max_steps=3", stage="rctp")) == 0
    metrics = read_metrics(tmp_path / "r")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["loss"] > 0 and m["tokens"] > 0 and m["tokens_per_s"] > 0
        assert {"lr", "grad_norm", "tokens_total", "step_seconds"} <= m.keys()
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert list((tmp_path / "r" / "tensorboard").iterdir())
    hf = tmp_path / "r" / "hf"
    tok, model = AutoTokenizer.from_pretrained(hf), AutoModelForCausalLM.from_pretrained(hf)
    high = tok.encode("<|high_reward|>", add_special_tokens=False)
    assert len(high) == 1 and model.get_input_embeddings().weight.shape[0] == len(tok)
    # the training record (what reward_token=auto reads) in the export and beside the checkpoint's tokenizer
    from nemo_rcgrpo.utils.provenance import read_record

    for folder in (hf, tmp_path / "r" / "checkpoints" / "step_3" / "tokenizer"):
        record = read_record(folder)
        assert (record["stage"], record["reward_conditioned"], record["init"]) == ("rctp", True, "tiny-qwen2")


def test_a_token_budget_trains_the_same_steps_as_single_example_micro_batches(data_dir, tmp_path):
    """trainer.micro_batch_tokens: the global batch of 4 runs in micro-batches filled to 3600 positions (its rows
    packed or their shared system prompt run once) and each step's loss and gradient norm equal those of four
    single-example micro-batches (the loss is normalised over the whole batch)."""
    from nemo_rcgrpo.train import main

    common = ("trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.export_hf=false")
    assert main(_args(data_dir, tmp_path / "one", *common)) == 0
    assert main(_args(data_dir, tmp_path / "budget", *common, "trainer.micro_batch_tokens=3600")) == 0
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "budget"), strict=True):
        assert a["micro_batches"] == 4.0 and b["micro_batches"] < 4.0
        assert a["tokens"] == b["tokens"] and b["tokens_total"] == a["tokens_total"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-4
        )


def test_resume_reproduces_the_uninterrupted_run(data_dir, tmp_path):
    from nemo_rcgrpo.train import main

    assert main(_args(data_dir, tmp_path / "a", "trainer.max_steps=4", "trainer.export_hf=false")) == 0
    assert (
        main(_args(data_dir, tmp_path / "b", "trainer.max_steps=4", "trainer.stop_after=2", "trainer.export_hf=false"))
        == 0
    )
    assert [m["step"] for m in read_metrics(tmp_path / "b")] == [1, 2]
    # as a run killed after logging step 3 and while writing its next line, before step 3's checkpoint: the resume
    # drops both (the torn line with a note) and goes on from step 2's checkpoint
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 9.0}\n{"step": 4, "lo')
    assert main(_args(data_dir, tmp_path / "b", "trainer.max_steps=4", "trainer.export_hf=false")) == 0
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    from nemo_rcgrpo.utils.provenance import read_record

    record = read_record(tmp_path / "b" / "checkpoints" / "step_4" / "tokenizer")
    assert (record["stage"], record["reward_conditioned"]) == ("sft", False)  # SFT: reward tokens, no conditioning
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6) and x["lr"] == pytest.approx(y["lr"])
    sa = torch.load(tmp_path / "a" / "checkpoints" / "step_4" / "model.pt", weights_only=True)
    sb = torch.load(tmp_path / "b" / "checkpoints" / "step_4" / "model.pt", weights_only=True)
    assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)


def test_bad_inputs_are_one_line_errors(data_dir, tmp_path, capsys):
    """One line on stderr, exit status 2: the first case and the other model's checkpoint through the real entry
    point (a process of their own), the others through the same main() in this process."""
    from nemo_rcgrpo.train import main

    def in_process(args):
        capsys.readouterr()
        code = main(args)
        return code, capsys.readouterr().err

    cases = [
        (_args(data_dir, tmp_path / "x", f"model.path={tmp_path / 'no_model'}"), "not a local HF folder"),
        (
            _args(data_dir, tmp_path / "y", "model.reward_tokens=none", stage="rctp"),
            "stage=rctp conditions on reward tokens",
        ),
        (
            _args(data_dir, tmp_path / "z", "trainer.global_batch_size=3", "trainer.micro_batch_size=2"),
            "must be a multiple",
        ),
        (
            _args(data_dir, tmp_path / "w", "+trainer.epochz=3"),
            "unknown setting trainer.epochz; did you mean trainer.epochs?",
        ),
    ]
    for i, (args, message) in enumerate(cases):
        if i == 0:
            proc = _train(args)
            code, stderr = proc.returncode, proc.stderr
        else:
            code, stderr = in_process(args)
        err = stderr.strip().splitlines()
        assert code == 2 and err and err[-1].startswith("error: ") and message in err[-1], stderr[-800:]
    # a checkpoint of another model in run_dir
    assert main(_args(data_dir, tmp_path / "other", "trainer.max_steps=1", "trainer.export_hf=false")) == 0
    proc = _train(_args(data_dir, tmp_path / "other", "model.path=tiny-llama", "trainer.max_steps=2"))
    assert (
        proc.returncode == 2
        and "model.path is 'tiny-qwen2' there and 'tiny-llama' now" in proc.stderr.strip().splitlines()[-1]
    )
    # the checkpoint itself is checked too, whatever the folder's config says
    (tmp_path / "other" / "config.yaml").unlink()
    code, stderr = in_process(_args(data_dir, tmp_path / "other", "model.path=tiny-llama", "trainer.max_steps=2"))
    assert code == 2 and "was written for another model" in stderr.strip().splitlines()[-1]


def test_run_folders_refuse_another_run(data_dir, tmp_path, capsys):
    """Resume only the same run; changes only where allowed; resume=false only with overwrite=true; every
    invocation's config kept; an extended max_steps continues on the new schedule (not at the old final lr 0)."""
    import yaml

    from nemo_rcgrpo.models.torch_policy import lr_lambda
    from nemo_rcgrpo.train import main

    run = tmp_path / "r"
    common = (
        "trainer.export_hf=false",
        "logging.tensorboard=false",
        "trainer.schedule=cosine",
        "trainer.lr=1e-4",
        "trainer.warmup_steps=0",
    )
    assert main(_args(data_dir, run, "trainer.max_steps=2", *common)) == 0
    original = (run / "config.yaml").read_text()
    assert "run     " + str(run) + ": fresh start" in capsys.readouterr().err  # the banner of the first run

    def refused(*extra, stage="sft"):
        assert main(_args(data_dir, run, *common, *extra, stage=stage)) == 2
        return capsys.readouterr().err.strip()

    err = refused("trainer.max_steps=2", stage="rctp")
    assert "cannot resume run_dir" in err and "stage is 'sft' there and 'rctp' now" in err and "\n" not in err
    err = refused("trainer.max_steps=4")
    assert "trainer.max_steps is 2 there and 4 now" in err and "trainer.resume_may_change=[trainer.max_steps]" in err
    err = refused("trainer.max_steps=2", "trainer.lr=2e-4")  # (appended after common: the later value wins)
    assert "trainer.lr is 0.0001 there and 0.0002 now" in err
    err = refused("trainer.max_steps=2", "trainer.resume=false")
    assert "holds a run" in err and "overwrite=true" in err
    assert (run / "config.yaml").read_text() == original and sorted(p.name for p in run.glob("config*")) == [
        "config.yaml"
    ]

    # allowed: extend the run; config.1.yaml records this invocation, config.yaml stays the original
    assert (
        main(_args(data_dir, run, *common, "trainer.max_steps=4", "trainer.resume_may_change=[trainer.max_steps]")) == 0
    )
    assert (run / "config.yaml").read_text() == original
    assert yaml.safe_load((run / "config.1.yaml").read_text())["trainer"]["max_steps"] == 4
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    new = lr_lambda("cosine", 0, 4, 0.0)
    assert metrics[2]["lr"] == pytest.approx(1e-4 * new(2)) and metrics[2]["lr"] > 0  # was 0: the old schedule's end
    assert metrics[3]["lr"] == pytest.approx(1e-4 * new(3))

    # start over explicitly: the old run's checkpoints and metrics go, the configs stay
    assert main(_args(data_dir, run, *common, "trainer.max_steps=1", "trainer.resume=false", "overwrite=true")) == 0
    assert [m["step"] for m in read_metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    assert sorted(p.name for p in run.glob("config*")) == ["config.1.yaml", "config.2.yaml", "config.yaml"]


def test_torchrun_ddp_matches_single_process(data_dir, tmp_path):
    """Two DDP ranks, each with a micro-batch of 2 of the global 4: the same losses and gradient norms as one
    process, and each rank runs its rows as one process does (packed or their shared prefix once, inside DDP's
    forward, so the gradients still synchronise)."""
    common = [
        "trainer.max_steps=2",
        "trainer.export_hf=false",
        "logging.tensorboard=false",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
    ]
    single = _train(_args(data_dir, tmp_path / "one", *common))
    assert single.returncode == 0, single.stderr[-2000:]
    env = {"OMP_NUM_THREADS": "1"}
    ddp = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-port=29517",
            str(REPO / "nemo_rcgrpo" / "train.py"),
            *_args(data_dir, tmp_path / "two", *common),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert len(one) == len(two) == 2
    for x, y in zip(one, two):  # same global batch, split over two ranks
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["tokens"] == y["tokens"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
        assert x["micro_batches"] == y["micro_batches"] == 2.0
        assert x["forward_positions_saved"] > 0 and y["forward_positions_saved"] == x["forward_positions_saved"]
