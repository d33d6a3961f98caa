"""Benchmark: stage-1 step time of the Megatron-Core backend vs the torch backend on the same run (CPU).

Runs the stage-1 recipe ``rctp_smollm_cpu`` (SmolLM2-135M, fp32, same data
order and seed) four times, one after another: ``policy.backend=torch`` (the
baseline), ``policy.backend=megatron`` at TP=1, at TP=3 under torchrun
(3 processes, gloo) and at PP=2 (2 processes, 1F1B schedule). Reports the mean step seconds after the first step, the
ratio to the torch run, and the loss difference at every step.

Usage: python -m scripts.bench.megatron_cpu [--steps 3] [--data data/bfcl_v4] [--note "..."] [--out docs/benchmarks.md]
(--note: a remark about the conditions of the run, written into the section so that nothing is added by hand)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from nemo_rcgrpo.utils.logging import read_metrics
from scripts.bench._common import cpu_name, dist_version, emit

START, END = "<!-- bench:megatron_cpu:start -->", "<!-- bench:megatron_cpu:end -->"
REPO = Path(__file__).resolve().parents[2]


def train(run_dir: Path, common: list[str], extra: list[str], nproc: int) -> list[dict]:
    launch = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port=29741"]
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [*launch, str(REPO / "nemo_rcgrpo" / "train.py"), *common, f"run_dir={run_dir}", *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    if proc.returncode != 0:
        sys.exit(
            f"run {run_dir.name} failed (exit status {proc.returncode}; -9 is usually out of memory):\n"
            f"{proc.stderr[-3000:]}"
        )
    return read_metrics(run_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--data", type=Path, default=Path("data/bfcl_v4"))
    p.add_argument("--note", default="", help="a remark on this run's conditions, written into the section")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is not counted)")
    common = [
        "--config-name=rctp_smollm_cpu",
        f"data.dir={args.data.resolve()}",
        f"trainer.max_steps={args.steps}",
        "trainer.micro_batch_size=1",
        "trainer.save_every=1000",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    runs = {
        "torch": ([], 1),
        "megatron TP=1": (["policy.backend=megatron"], 1),
        "megatron TP=3 (3 processes)": (
            ["policy.backend=megatron", "policy.megatron.tp=3", "layout.gpus_per_node=3"],
            3,
        ),
        "megatron PP=2 (2 processes)": (
            ["policy.backend=megatron", "policy.megatron.pp=2", "layout.gpus_per_node=2"],
            2,
        ),
    }
    metrics = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (extra, nproc)) in enumerate(runs.items()):
            metrics[name] = train(Path(tmp) / f"run{i}", common, extra, nproc)
            print(f"{name}: {[round(m['step_seconds'], 1) for m in metrics[name]]} s", file=sys.stderr)
    base = metrics["torch"]
    base_s = statistics.fmean(m["step_seconds"] for m in base[1:])
    rows = [
        START,
        "## Megatron-Core backend vs torch backend, stage 1 on CPU (`scripts/bench/megatron_cpu.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {os.cpu_count()} cores; "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"megatron-core {dist_version('megatron-core')} (local spec, "
        "CPU compatibility layer, gloo).",
        f"- Run: `rctp_smollm_cpu` (SmolLM2-135M fp32, 4 sequences of <= 1536 tokens per step, micro-batches of 1), "
        f"{args.steps} steps per backend, same data order and seed; the runs one after another; mean over "
        f"the steps after the first. TP=3 runs 3 processes and PP=2 two (1 thread each) on the {os.cpu_count()} "
        f"cores. 1-min load average {os.getloadavg()[0]:.1f} at the end." + (f" {args.note}" if args.note else ""),
        "",
        "| backend | step seconds | ratio to torch | max loss diff to torch | every step (s) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, ms in metrics.items():
        sec = statistics.fmean(m["step_seconds"] for m in ms[1:])
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(base, ms))
        steps = ", ".join(f"{m['step_seconds']:.1f}" for m in ms)
        rows.append(f"| {name} | {sec:.1f} | {sec / base_s:.2f} | {diff:.1e} | {steps} |")
    rows += [
        "",
        "On CPU the Megatron path pays for the compatibility layer (a TorchFunctionMode on every torch call) "
        "and the local spec's unfused attention (scores and probabilities of every layer kept for the backward: "
        "about 14 GB peak at TP=1 with 2 x 1536-token micro-batches, against 6 GB for the torch backend's SDPA, "
        "an earlier observation, not measured by this script); "
        "it exists for tests. Its speed matters on GPU (`scripts/bench/megatron_gpu.py`, Transformer Engine "
        "spec). PP=2 adds the 1F1B bubble (4 micro-batches over 2 stages: each stage idles for 1 of 5 slots) "
        f"and the point-to-point exchange of activations, on top of two processes sharing {os.cpu_count()} cores.",
        END,
    ]
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
