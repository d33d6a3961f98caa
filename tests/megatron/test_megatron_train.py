"""Megatron-Core backend in the trainers: stage-1 losses equal the torch backend's (TP=1, TP=3), resume, export,
RC-GRPO at TP=2 with weight sync to the generator, and start-up errors. CPU, torchrun with gloo."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.prepare_data import PrepareDataConfig, run
from nemo_rcgrpo.utils.logging import read_metrics

pytestmark = pytest.mark.megatron
REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("d") / "data"
    run(PrepareDataConfig(out_dir=str(out), categories=("base",), tokenizer=None, progress=False))
    return out


def _stage1_args(data_dir, run_dir, *extra):
    """rctp_smollm_cpu with its data order and seed, cut to 3 short steps of 2 sequences (CPU test budget)."""
    return ["--config-name=rctp_smollm_cpu", f"run_dir={run_dir}", f"data.dir={data_dir}", "chat.max_length=600",
            "data.max_examples=16", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
            "trainer.max_steps=3", "trainer.lr=1e-4", "logging.progress=false", "logging.tensorboard=false", *extra]


def _train(args, nproc=1, port=29650):
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   f"--nproc-per-node={nproc}", f"--master-port={port}"]
    return subprocess.run([*launch, str(REPO / "nemo_rcgrpo" / "train.py"), *args], capture_output=True, text=True,
                          env={**os.environ, **ENV}, cwd=REPO, timeout=900)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_stage1_smollm2_same_losses_torch_and_megatron_tp1_tp3(data_dir, tmp_path):
    common = ["trainer.save_every=100", "trainer.export_hf=false"]
    _ok(_train(_stage1_args(data_dir, tmp_path / "torch", *common)))
    _ok(_train(_stage1_args(data_dir, tmp_path / "tp1", *common, "policy.backend=megatron")))
    _ok(_train(_stage1_args(data_dir, tmp_path / "tp3", *common, "policy.backend=megatron", "policy.megatron.tp=3",
                      "layout.gpus_per_node=3"),
               nproc=3, port=29653))
    runs = {name: read_metrics(tmp_path / name) for name in ("torch", "tp1", "tp3")}
    assert [m["step"] for m in runs["torch"]] == [1, 2, 3]
    for name in ("tp1", "tp3"):
        assert len(runs[name]) == 3
        for a, b in zip(runs["torch"], runs[name]):
            assert a["tokens"] == b["tokens"] and a["tokens_total"] == b["tokens_total"]  # same data, split by DP only
            assert abs(a["loss"] - b["loss"]) <= 1e-3, (name, a["loss"], b["loss"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3) and a["lr"] == pytest.approx(b["lr"])
    # the losses move (the run trains), so equality is not that of three untouched models
    assert runs["torch"][0]["loss"] != runs["torch"][2]["loss"]
