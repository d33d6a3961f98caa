"""Sharded Megatron checkpoints (megatron-core dist_checkpointing): exact resume at TP=2, with and without the
distributed optimizer, and resharding of weights and optimizer state to TP=1 x DP=2 (and back) and to PP=2.
CPU, torchrun with gloo."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.megatron.helpers import free_port

pytestmark = pytest.mark.megatron
REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    out = tmp / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            str(REPO / "tests" / "megatron" / "ckpt_worker.py"),
            str(out),
            str(tmp),
            "tiny-llama",
            "tiny-qwen2",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ckpt in (p for p in tmp.iterdir() if p.is_dir()):  # about 1 GB of checkpoints
        shutil.rmtree(ckpt)
    return json.loads(out.read_text())


def test_every_model_and_optimizer_kind_ran(results):
    assert [(r["model"], r["distributed_optimizer"]) for r in results] == [
        ("tiny-llama", True),
        ("tiny-llama", False),
        ("tiny-qwen2", False),
        ("tiny-qwen2", True),
    ]


def test_resume_at_the_same_layout_is_exact(results):
    """A fresh policy (initial weights, no optimizer state) loaded from the checkpoint is the saved one: same
    logprobs, and the next step (which needs the Adam moments and step) gives the same loss and weights."""
    for r in results:
        assert r["tp"] == 2 and r["fresh_logprob_diff"] > 0.1, r  # the fresh policy starts elsewhere
        assert r["reloaded_logprob_diff"] == 0, r
        assert r["resumed_step_loss_diff"] == 0 and r["resumed_grad_norm_diff"] == 0, r
        assert r["resumed_logprob_diff"] <= 1e-6, r


def test_tp2_checkpoint_resumes_at_tp1_dp2(results):
    """Weights and optimizer state reshard: the TP=1 x DP=2 policy continues like the TP=2 original (the sums
    only change order)."""
    for r in results:
        assert r["tp1_dp"] == 2, r
        assert r["tp1_logprob_diff"] <= 1e-5, r
        assert r["tp1_step_loss_diff"] <= 1e-6 and r["tp1_grad_norm_diff"] <= 1e-5, r
        assert r["tp1_resumed_logprob_diff"] <= 1e-5, r


def test_dp_sharded_distributed_optimizer_state_goes_back_to_tp2(results):
    for r in (r for r in results if r["distributed_optimizer"]):
        assert r["back_logprob_diff"] <= 1e-5, r
        assert r["back_step_loss_diff"] <= 1e-6 and r["back_resumed_logprob_diff"] <= 1e-5, r


def test_tp2_checkpoint_resumes_at_pp2(results):
    """The layers (global indices in the checkpoint) split between two pipeline stages, optimizer state included."""
    for r in results:
        assert r["pp2_logprob_diff"] <= 1e-5, r
        assert r["pp2_step_loss_diff"] <= 1e-6 and r["pp2_resumed_logprob_diff"] <= 1e-5, r


def test_the_other_optimizer_kind_is_refused_with_the_saved_layout(results):
    errors = {r["model"]: r["other_kind_error"] for r in results if "other_kind_error" in r}
    assert "dp=1, distributed_optimizer=True;" in errors["tiny-llama"]  # a distributed optimizer's checkpoint
    assert "dp=1, distributed_optimizer=False;" in errors["tiny-qwen2"]  # and the other way round
    for e in errors.values():
        assert "was saved at tp=2, pp=1, dp=1, distributed_optimizer=" in e and "(now tp=1, pp=1, dp=2" in e, e


def test_checkpoint_sizes(results):
    """fp32 weights + Adam moments (+ the fp32 main weights with the distributed optimizer), each stored once."""
    for r in results:
        ratio = (
            r["checkpoint_bytes"]
            / next(x for x in results if x["model"] == r["model"] and not x["distributed_optimizer"])[
                "checkpoint_bytes"
            ]
        )
        assert ratio == pytest.approx(4 / 3 if r["distributed_optimizer"] else 1, rel=0.02), r


def _stage1(data_dir, run_dir, nproc, *extra):
    """rctp_smollm_cpu on the tiny Llama: 4 steps of 4 sequences, a checkpoint every 2 steps."""
    args = [
        "--config-name=rctp_smollm_cpu",
        "model.path=tiny-llama",
        f"run_dir={run_dir}",
        f"data.dir={data_dir}",
        "chat.max_length=900",
        "data.max_examples=16",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=1",
        "trainer.max_steps=4",
        "trainer.save_every=2",
        "trainer.lr=1e-3",
        "trainer.warmup_steps=0",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        "policy.backend=megatron",
        f"layout.gpus_per_node={nproc}",
        *extra,
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            str(REPO / "nemo_rcgrpo" / "train.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_stage1_resumes_from_the_sharded_checkpoint_at_the_same_and_another_layout(data_dir, tmp_path):
    """Data parallel (TP=1 x DP=2) stage 1: stopped after 2 steps and resumed, it logs the losses of the run that
    never stopped; the same checkpoint resumed at TP=2 x DP=1 continues with them too (sums in another order)."""
    from nemo_rcgrpo.utils.logging import read_metrics

    _stage1(data_dir, tmp_path / "straight", 2)
    _stage1(data_dir, tmp_path / "stopped", 2, "trainer.stop_after=2")
    step2 = tmp_path / "stopped" / "checkpoints" / "step_2"
    assert sorted(p.name for p in step2.iterdir()) == [
        "extra.pt",
        "manifest.json",
        "megatron",
        "model.pt",
        "optimizer.pt",
        "tokenizer",
        "trainer_state.json",
    ]
    from nemo_rcgrpo.utils.checkpoint import verify_checkpoint

    manifest = json.loads((step2 / "manifest.json").read_text())
    shards = [name for name in manifest["files"] if name.startswith("megatron/")]
    assert shards and verify_checkpoint(step2) is None  # every rank's shards are in the manifest, and verify
    shutil.copytree(tmp_path / "stopped", tmp_path / "tp2")
    _stage1(data_dir, tmp_path / "stopped", 2)
    _stage1(data_dir, tmp_path / "tp2", 2, "policy.megatron.tp=2")
    straight = read_metrics(tmp_path / "straight")
    assert [m["step"] for m in straight] == [1, 2, 3, 4] and straight[2]["loss"] != straight[3]["loss"]
    for name, tol in (("stopped", 1e-6), ("tp2", 1e-4)):
        resumed = read_metrics(tmp_path / name)
        assert [m["step"] for m in resumed] == [1, 2, 3, 4], name  # each step logged once
        for a, b in zip(straight[2:], resumed[2:]):
            assert abs(a["loss"] - b["loss"]) <= tol and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=tol), (
                name,
                a,
                b,
            )
            assert a["tokens"] == b["tokens"]
