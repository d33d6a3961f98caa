"""Benchmark: the RC-GRPO step with rollouts generated ahead (``rl.max_staleness=1``) against the synchronous step
(``rl.max_staleness=0``), the vLLM server and the trainer each on a core of their own, in the same run.

Both sides are whole runs of ``rcgrpo train`` with ``generation=vllm`` (a server the run starts, weights moved by
the collective transfer after every step) on the bfcl_micro tasks:

- the trainer process is pinned to one core (``taskset -c 1``, one torch thread); its rollout thread (env steps,
  rewards, HTTP) shares that core with the update;
- the server is pinned to the other (``generation.vllm.python`` is a wrapper that runs the interpreter under
  ``taskset -c 0``, and ``VLLM_CPU_OMP_THREADS_BIND=0`` binds vLLM's OpenMP thread there).

The work is sized so that the two sides take about the same time per step (``--ppo-epochs`` sets the trainer's
side, ``--tasks`` x ``--group-size`` x ``--max-new-tokens`` the server's; the table shows both). Sides alternate
(sync, async, async, sync, ...) so that machine load affects both alike; step 1 (compilation, first requests) is
left out of the medians.

Per step, from each run's metrics.jsonl:

- trainer work: logprob passes + update + weight sync (``logprob_seconds + train_seconds + weight_sync_seconds``,
  less ``update_waited_seconds``: at k >= 1 the sync first waits for the generator call in flight); trainer idle:
  the rest of the step (waiting for rollouts, dumps, checkpoint);
- generation: the seconds rollouts spent in generation calls (``generation_seconds``), less the seconds calls
  waited for a weight update (``generation_blocked_seconds``);
- busy: a side's seconds summed over the measured steps, over the steps' wall time summed (see ``busy``);
- staleness: the mean over rollouts of (the step's weights' version - the version of the rollout's first turn).

Usage: python -m scripts.bench.async_rl [--repeats 2] [--steps 6] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench._common import REPO, cpu_name, dist_version, emit

START, END = "<!-- bench:async_rl:start -->", "<!-- bench:async_rl:end -->"
TARGET = 0.65  # the asynchronous step at most this fraction of the synchronous one


def _metric_values(record: dict) -> dict:
    """A metrics.jsonl record with its non-finite values ("nan", "inf", "-inf") as floats again."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}


def prepare(data: Path) -> Path:
    if not data.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "nemo_rcgrpo.cli",
                "prepare-data",
                "task_source=bfcl_micro",
                "tokenizer=null",
                "progress=false",
                f"out_dir={data}",
            ],
            check=True,
            cwd=REPO,
        )
    return data


def pinned_python(folder: Path, core: int) -> Path:
    """An interpreter path for ``generation.vllm.python`` that runs this interpreter on one core."""
    wrapper = folder / f"python_on_core{core}"
    wrapper.write_text(f'#!/bin/sh\nexec taskset -c {core} {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def run(side: str, k: int, args, data: Path, work: Path, rep: int) -> list[dict]:
    run_dir = work / f"{side}_{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND=str(args.server_core),
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [
        "taskset",
        "-c",
        str(args.trainer_core),
        sys.executable,
        "-m",
        "nemo_rcgrpo.cli",
        "train",
        "--config-name=rcgrpo_smollm_cpu",
        f"model.path={args.model}",
        "rl.stage1_recipe=null",
        "env.task_source=bfcl_micro",
        f"data.dir={data}",
        f"run_dir={run_dir}",
        f"rl.tasks_per_step={args.tasks}",
        f"rl.group_size={args.group_size}",
        f"rl.max_turns={args.max_turns}",
        f"rl.sampling.max_new_tokens={args.max_new_tokens}",
        f"rl.ppo_epochs={args.ppo_epochs}",
        "rl.old_logprobs=recompute" if args.ppo_epochs > 1 else "rl.old_logprobs=auto",
        f"trainer.max_steps={args.steps}",
        "trainer.save_every=1000",
        "trainer.export_hf=false",
        "trainer.lr=1e-4",
        "logging.progress=false",
        "logging.tensorboard=false",
        "generation=vllm",
        "generation.vllm.enforce_eager=true",
        "generation.vllm.kv_cache_gib=1",
        f"generation.vllm.python={pinned_python(work, args.server_core)}",
        f"rl.max_staleness={k}",
        "rl.eval_every=0",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{side} run {rep} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    print(f"{side} run {rep}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return [
        _metric_values(json.loads(line))
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def per_step(m: dict) -> dict[str, float]:
    waited = m.get("update_waited_seconds", 0.0)  # inside the sync's time: the update waiting for a call in flight
    sync = m["weight_sync_seconds"] - waited
    return {
        "step": m["step_seconds"],
        "train": m["logprob_seconds"] + m["train_seconds"] + sync,
        "sync": sync,
        "generation": m["generation_seconds"] - m.get("generation_blocked_seconds", 0.0),
        "wait": m.get("rollout_wait_seconds", m["generation_seconds"] + m["env_seconds"] + m["reward_seconds"]),
        "staleness": m.get("staleness_mean", 0.0),
        "reward": m["reward_mean"],
        "spanning": m.get("spanning_rollouts", 0.0),
    }


def busy(rows: list[dict[str, float]], key: str) -> float:
    """A side's seconds over the steps' wall time, both summed over the measured steps (a step's generation ran
    during the step before it at k >= 1, and its logged blocked seconds are those of the next calls: the sums
    over steps 2..N cancel the shift but at the edges)."""
    return min(1.0, sum(r[key] for r in rows) / sum(r["step"] for r in rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--data", type=Path, default=Path("outputs/bench/micro_data"))
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is left out)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--trainer-core", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None:
        raise SystemExit("needs two cores and taskset: the server and the trainer each get one")
    data = prepare((REPO / args.data).resolve() if not args.data.is_absolute() else args.data)
    work = Path(tempfile.mkdtemp(prefix="async_rl_"))
    steps: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for rep in range(args.repeats):
        for side in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
            metrics = run(side, 0 if side == "sync" else 1, args, data, work, rep)
            steps[side] += [per_step(m) for m in metrics[1:]]
    med = {side: {k: statistics.median(s[k] for s in rows) for k in rows[0]} for side, rows in steps.items()}
    for side, rows in steps.items():
        med[side]["trainer_busy"], med[side]["server_busy"] = busy(rows, "train"), busy(rows, "generation")
    ratio = med["async"]["step"] / med["sync"]["step"]
    rows = [
        START,
        "## Rollouts generated ahead: asynchronous vs synchronous RC-GRPO step (`scripts/bench/async_rl.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {os.cpu_count()} cores; Python "
        f"{platform.python_version()}, vllm-cpu {dist_version('vllm-cpu') if dist_version('vllm-cpu') != 'not installed' else dist_version('vllm')}.",
        f"- {args.model} on bfcl_micro, {args.tasks} tasks x G={args.group_size}, up to {args.max_turns} turns x "
        f"{args.max_new_tokens} new tokens, {args.ppo_epochs} update epoch(s) per step; generation=vllm (started by "
        f"the run, collective weight transfer after every step); the server on core {args.server_core}, the "
        f"trainer (and its rollout thread) on core {args.trainer_core} with one torch thread. {args.repeats} runs "
        f"per side of {args.steps} steps, alternating; medians over steps 2..{args.steps} of every run.",
        "",
        "| side | step (s) | trainer work (s) | of which weight sync (s) | generation (s) | rollout wait (s) | "
        "trainer busy | server busy | staleness (mean) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, label in (
        ("sync", "synchronous (`rl.max_staleness=0`)"),
        ("async", "generated ahead (`rl.max_staleness=1`)"),
    ):
        m = med[side]
        rows.append(
            f"| {label} | {m['step']:.2f} | {m['train']:.2f} | {m['sync']:.2f} | {m['generation']:.2f} | "
            f"{m['wait']:.2f} | "
            f"{m['trainer_busy']:.0%} | {m['server_busy']:.0%} | {m['staleness']:.2f} | "
            f"{m['step'] / med['sync']['step']:.2f} |"
        )
    spanning = sum(s["spanning"] for s in steps["async"])
    rows += [
        "",
        "Trainer work: logprob passes + update + weight sync (less its wait for a call in flight). "
        "Generation: seconds in generation calls, less those held back by a weight update. Busy: a side's "
        "seconds over the steps' wall time, summed over the measured steps. Rollout wait: on the synchronous side the whole collection "
        "(generation, env, reward); on the other, the seconds the trainer waited for the step's rollouts. "
        f"Rollouts whose turns spanned a weight update: "
        f"{spanning:.0f} of {len(steps['async']) * args.tasks * args.group_size}.",
        "",
        f"Target: the asynchronous step at most {TARGET}x the synchronous one: "
        f"{'met' if ratio <= TARGET else 'NOT met'} ({ratio:.2f}x, medians).",
        END,
    ]
    shutil.rmtree(work, ignore_errors=True)
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
