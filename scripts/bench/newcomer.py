"""Benchmark: a newcomer's first run, timed, following only the README's first screen.

A clean `git clone` of this repository at --ref (default HEAD: committed work only) into a new temporary
folder, an empty model cache and no pip cache, this checkout's venv off PATH (as `fresh_machine.py`); then the
README's commands, exactly, one after another in one shell each, every one timed:

  make install
  source .venv/bin/activate && rcgrpo --help
  rcgrpo train --config-name smoke_rl
  rcgrpo plot runs/smoke_rl --out runs/smoke_rl/dynamics.png
  rcgrpo report runs/smoke_rl -o runs/smoke_rl/report.html

Goal: a finished smoke run (metrics of 2 steps, rollout dumps, HF export, plot, report) in under 5 minutes from
the clone. Logs go to the work folder (kept with --keep, and always when a command fails). About 3 minutes on
2 cores.

Usage: python -m scripts.bench.newcomer [--ref HEAD] [--keep] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench._common import REPO, cpu_name, emit
from scripts.bench.fresh_machine import clean_env, memory_gib

START, END = "<!-- bench:newcomer:start -->", "<!-- bench:newcomer:end -->"
STEPS = (
    "make install",
    "source .venv/bin/activate && rcgrpo --help",
    "source .venv/bin/activate && rcgrpo train --config-name smoke_rl",
    "source .venv/bin/activate && rcgrpo plot runs/smoke_rl --out runs/smoke_rl/dynamics.png",
    "source .venv/bin/activate && rcgrpo report runs/smoke_rl -o runs/smoke_rl/report.html",
)
GOAL_S = 300.0


def _metric_values(record: dict) -> dict:
    """A metrics.jsonl record with its non-finite values ("nan", "inf", "-inf") as floats again."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", default="HEAD")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rcgrpo_newcomer_"))
    clone, logs = work / "clone", work / "logs"
    logs.mkdir()
    env = clean_env(work / "model_cache")
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", args.ref], cwd=clone, check=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True
    ).stdout.strip()
    rows_out, failed = [], False
    for i, command in enumerate(STEPS, start=1):
        log = logs / f"{i}.log"
        t0 = time.perf_counter()
        with log.open("w") as f:
            rc = subprocess.run(
                ["bash", "-c", command], cwd=clone, env=env, stdout=f, stderr=subprocess.STDOUT
            ).returncode
        seconds = time.perf_counter() - t0
        print(f"{command}: exit {rc}, {seconds:.0f} s", file=sys.stderr)
        rows_out.append((command.replace("source .venv/bin/activate && ", ""), rc, seconds))
        if rc != 0:
            failed = True
            print(f"failed; log {log}:\n" + log.read_text()[-3000:], file=sys.stderr)
            break
    run = clone / "runs" / "smoke_rl"
    metrics = (
        [_metric_values(json.loads(l)) for l in (run / "metrics.jsonl").read_text().splitlines()]
        if (run / "metrics.jsonl").is_file()
        else []
    )
    produced = {
        "metrics steps": [m["step"] for m in metrics],
        "rollouts": sorted(q.name for q in (run / "rollouts").glob("*.jsonl")) if run.is_dir() else [],
        "hf export": (run / "hf" / "config.json").is_file(),
        "plot": (run / "dynamics.png").is_file(),
        "report": (run / "report.html").is_file(),
    }
    total = sum(s for _, _, s in rows_out)
    finished = not failed and produced["metrics steps"] == [1, 2] and produced["plot"] and produced["report"]
    rows = [
        START,
        "## A newcomer's first run, timed (the README's first screen; `scripts/bench/newcomer.py`)",
        "",
        f"- Date: {dt.date.today()}; machine: {cpu_name()}, {os.cpu_count()} cores, {memory_gib()}, Python {platform.python_version()}; "
        f"commit {commit}, a clean clone, an empty model cache, no pip cache (packages from a PyPI mirror), "
        "commands exactly as the README gives them, one after another.",
        "",
        "| command | exit | wall seconds |",
        "|---|---:|---:|",
    ]
    rows += [f"| `{c}` | {rc} | {s:.1f} |" for c, rc, s in rows_out]
    rows += [
        f"| **total** | | **{total:.1f}** |",
        "",
        f"Outputs: {json.dumps(produced)}.",
        "",
        f"A finished smoke run {total / 60:.1f} minutes after the clone: "
        + (
            f"{'within' if total <= GOAL_S else 'over'} the 5-minute goal." if finished else "NOT finished (see above)."
        ),
        END,
    ]
    emit(rows, args.out, START, END)
    if args.keep or failed:
        print(f"work folder kept: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
