"""Benchmark: each shipped CPU recipe as a user runs it, its peak memory and how its RL steps split into
micro-batches, with the default ``trainer.micro_batch_tokens=auto`` (whole groups per micro-batch) and, for the
stage-2 recipes, with ``trainer.micro_batch_tokens=null`` (``trainer.micro_batch_size`` rollouts each) beside it.

Every recipe runs as ``rcgrpo train --config-name NAME`` in its own process, in one work folder, so that a stage-2
recipe starts from the export of the stage-1 recipe run before it (``model.path`` / ``rl.stage1_recipe``, as a user
gets them). Shortened to ``trainer.max_steps`` (``--stage1-steps`` for stage-1 recipes, ``--rl-steps`` for stage-2):
a step holds the memory of any other step of the same recipe, so the peak is the recipe's; the data is prepared by
the first recipe that needs it (``data.dir``'s default). Peak memory is the largest resident set of the command or any
process it waited for (``os.wait4``'s ``ru_maxrss``), against this machine's total memory.

Usage: python -m scripts.bench.recipe_steps [--recipes smoke_rl ...] [--rl-steps 1] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench._common import REPO, cpu_name, dist_version, emit

START, END = "<!-- bench:recipe_steps:start -->", "<!-- bench:recipe_steps:end -->"
# the shipped CPU recipes, each stage-1 recipe before the stage-2 recipes that start from its export
STAGE1 = ("smoke_stage1", "sft_smollm_cpu", "rctp_smollm_cpu", "micro_sft", "micro_rctp")
STAGE2 = ("smoke_rl", "rcgrpo_smollm_cpu", "micro_grpo", "micro_rcgrpo")
BUDGET = re.compile(r"micro-batches (?:filled to (\d+) forward positions|of (\d+) rollouts?)")


def total_memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run_recipe(name: str, work: Path, overrides: list[str], suffix: str = "") -> dict:
    """``rcgrpo train --config-name NAME`` in ``work`` (into runs/NAME, with ``suffix`` for a side's own folder):
    exit code, wall seconds, peak RSS (GiB), the micro-batching the banner states and the metrics of its steps."""
    run_dir = f"runs/{name}{suffix}"
    cmd = [sys.executable, "-m", "nemo_rcgrpo.cli", "train", "--config-name", name, f"run_dir={run_dir}"]
    cmd += ["logging.progress=false", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = work / f"{run_dir.replace('/', '_')}.log"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    text = log.read_text()
    found = BUDGET.search(text)
    metrics_file = work / run_dir / "metrics.jsonl"
    metrics = [json.loads(l) for l in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return {
        "rc": os.waitstatus_to_exitcode(status),
        "wall": wall,
        "peak_gib": usage.ru_maxrss / 2**20,  # KiB on Linux
        "load": load,
        "micro": (f"filled to {found[1]} positions" if found[1] else f"{found[2]} rollouts each") if found else "",
        "micro_batches": [m.get("micro_batches") for m in metrics if "micro_batches" in m],
        "metrics": [m for m in metrics if "train_seconds" in m and "logprob_seconds" in m],
        "log": log,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", nargs="*", default=[*STAGE1, *STAGE2], help="in this order (stage 1 first)")
    p.add_argument("--stage1-steps", type=int, default=2)
    p.add_argument("--rl-steps", type=int, default=1)
    p.add_argument("--no-baseline", action="store_true", help="skip the trainer.micro_batch_tokens=null rows")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="recipe_steps_"))
    work.mkdir(parents=True, exist_ok=True)
    mem = total_memory_gib()
    rows, failed = [], []
    for name in args.recipes:
        rl = name in STAGE2
        steps = [f"trainer.max_steps={args.rl_steps if rl else args.stage1_steps}"]
        sides = [("auto (default)", [], "")]
        if rl and not args.no_baseline:
            sides.append(("null", ["trainer.micro_batch_tokens=null"], "_null"))
        for label, extra, suffix in sides:
            r = run_recipe(name, work, steps + extra, suffix)
            print(f"{name} [{label}]: rc {r['rc']}, {r['wall']:.0f} s, peak {r['peak_gib']:.2f} GiB", file=sys.stderr)
            if r["rc"] != 0:
                failed.append(f"{name} [{label}] (exit {r['rc']}, log {r['log']})")
            batches = ", ".join(f"{b:g}" for b in r["micro_batches"]) or "-"
            steps_done = r["metrics"] if rl else []
            training = ", ".join(f"{m['logprob_seconds'] + m['train_seconds']:.1f}" for m in steps_done) or "-"
            saved = ", ".join(f"{m['forward_positions_saved']:.2f}" for m in steps_done) or "-"
            rows.append(
                f"| {name} | {'2' if rl else '1'} | {label if rl else 'stage 1'} | {r['micro'] or '-'} | {batches} "
                f"| {saved} | {training} | {r['peak_gib']:.2f} | {100 * r['peak_gib'] / mem:.0f}% | {r['wall']:.0f} "
                f"| {r['load']:.1f} | {'ok' if r['rc'] == 0 else 'FAILED'} |"
            )
    import torch

    head = [
        START,
        "## Shipped CPU recipes: peak memory and micro-batches (`scripts/bench/recipe_steps.py`)",
        "",
        f"{dt.date.today().isoformat()}, {cpu_name()}, {os.cpu_count()} cores, {mem:.1f} GiB; torch {torch.__version__},"
        f" transformers {dist_version('transformers')}. Each recipe as a user runs it (`rcgrpo train --config-name "
        f"NAME`, its own process, one work folder: a stage-2 recipe starts from the export of the stage-1 recipe "
        f"above it), shortened to {args.stage1_steps} stage-1 steps / {args.rl_steps} RL step(s). Peak: the largest "
        "resident set of the command (`ru_maxrss`), against the machine's memory. Micro-batches: per RL step, as "
        "the step logged them; positions saved: the share of the padded micro-batches' positions not run (a group's "
        "prompt computed once); training part: the step's reference (and old) logprob pass and update, seconds. "
        "Wall seconds include start-up, data preparation and a stage-2 recipe's closing evaluation. Times are of "
        "one step under the load shown (1-minute average at start): read them as rough; the memory and the counts "
        "do not depend on the load.",
        "",
        "| recipe | stage | trainer.micro_batch_tokens | micro-batching (banner) | micro-batches per step "
        "| positions saved | training part (s) | peak RSS (GiB) | of memory | wall (s) | load | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tail = ["", f"Failed: {'; '.join(failed)}" if failed else "Every recipe ran to its end.", END]
    emit(head + rows + tail, args.out, START, END)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
