"""Benchmark: where the experiment's stage-1 step goes, and the two changes that cut it, measured in one run.

`make experiment` (docs/experiments.md) is bound by CPU time, most of it stage 1 (tiny-llama: 2 layers, but a
49k-token output layer) and the RL runs. Two changes, each against its baseline in the same process:

- **output layer at the trained positions only.** Before: the logits of every position some row of the batch
  trains (``logits_to_keep``, the union over rows). Now: each row's own trained positions (`position_logits`),
  so the output layer and the cross-entropy run on the assistant tokens only. One optimizer step (forward,
  backward, AdamW) on the same micro_sft batches of the bfcl_micro data, sides alternated per batch.
- **glibc keeps freed memory** (`scripts/experiment.py`'s ALLOCATOR_ENV: `MALLOC_MMAP_MAX_=0`,
  `MALLOC_TRIM_THRESHOLD_` large). Before: glibc's defaults, under which every block over its mmap threshold
  (the logits of the 49k-token output layer, hundreds of MB) is a fresh mmap whose pages fault in again each
  step. Now: those blocks come from the heap and are reused. One-thread `micro_rctp` runs (stage 1) and
  `micro_rcgrpo` runs from a random tiny-llama (stage 2: rollouts, logprob pass, update), one side after the
  other, seconds per step from the runs' own metrics.
- **commands at once.** Before: `rcgrpo train --config-name micro_sft` alone with 2 torch threads. Now: two such
  runs at once with one thread each (`python -m scripts.experiment --jobs 2`). Steps per second of the whole machine,
  from the runs' own step_seconds (after the first 3 steps).

Usage: python -m scripts.bench.experiment_speed [--batches 8] [--steps 20] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scripts.bench._common import cpu_name, emit
from scripts.experiment import ALLOCATOR_ENV  # the settings `make experiment` runs its commands with

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- bench:experiment_speed:start -->", "<!-- bench:experiment_speed:end -->"


def _metric_values(record: dict) -> dict:
    """A metrics.jsonl record with its non-finite values ("nan", "inf", "-inf") as floats again."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}


def head_comparison(data: Path, batches: int) -> dict[str, list[float]]:
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.data.sft_data import build_examples, collate, epoch_batches, load_records
    from nemo_rcgrpo.models import torch_policy
    from nemo_rcgrpo.models.setup import load_tokenizer_and_model, make_renderer
    from nemo_rcgrpo.utils.config import compose

    cfg = TrainConfig.from_dict(compose("micro_sft", [f"data.dir={data}"]))
    setup = cfg.policy_setup()
    tokenizer, model = load_tokenizer_and_model(setup)
    records = load_records(data / "sft.jsonl", "train", progress=False)
    examples, _ = build_examples(records, make_renderer(setup, tokenizer), cfg.chat.max_length, cfg.seed, None)
    order = epoch_batches([len(e) for e in examples], cfg.trainer.global_batch_size, cfg.seed, 0, True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    gathered = torch_policy.GATHERED_MODEL_TYPES
    out: dict[str, list[float]] = {"union": [], "rows": [], "tokens": [], "trained": [], "union_positions": []}
    for i, idx in enumerate(order[: batches + 1]):
        b = collate([examples[j] for j in idx], tokenizer.pad_token_id)
        sides = ("union", "rows") if i % 2 else ("rows", "union")
        for side in sides:
            torch_policy.GATHERED_MODEL_TYPES = gathered if side == "rows" else frozenset()
            t0 = time.perf_counter()
            lp = torch_policy.token_logprobs(model, b.input_ids, b.attention_mask, b.loss_mask)
            loss = -(lp * b.loss_mask).sum() / b.loss_mask.sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:  # the first batch warms up
                out[side].append(time.perf_counter() - t0)
        if i:
            out["tokens"].append(float(b.input_ids.numel()))
            out["trained"].append(float(b.loss_mask[:, 1:].sum()))
            out["union_positions"].append(float(b.loss_mask[:, 1:].any(0).sum() * len(idx)))
    torch_policy.GATHERED_MODEL_TYPES = gathered
    return out


def step_records(
    data: Path, recipe: str, steps: int, tmp: Path, tag: str, allocator: bool, extra: tuple[str, ...] = ()
) -> list[dict]:
    """metrics.jsonl of one one-thread ``recipe`` run, with or without ALLOCATOR_ENV (glibc's defaults)."""
    run_dir = tmp / f"alloc_{recipe}_{tag}"
    cmd = [
        str(Path(sys.executable).parent / "rcgrpo"),
        "train",
        "--config-name",
        recipe,
        f"run_dir={run_dir}",
        f"data.dir={data}",
        f"trainer.max_steps={steps}",
        "trainer.save_every=100000",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(ALLOCATOR_ENV if allocator else {})})
    if subprocess.call(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) != 0:
        raise SystemExit(f"{recipe} run in {run_dir} failed")
    return [_metric_values(json.loads(l)) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def allocator_comparison(data: Path, steps: int, rl_steps: int, tmp: Path) -> list[tuple[str, str, float, float]]:
    """(what, seconds key, before, after): mean seconds per step (stage 1 after its first 3 steps; stage 2 over
    all its steps) under glibc's defaults and under ALLOCATOR_ENV, the two sides run one after the other."""
    out = []
    for recipe, first, extra, n in (
        ("micro_rctp", 3, (), steps),
        ("micro_rcgrpo", 0, ("model.path=tiny-llama", "rl.eval_every=0"), rl_steps),
    ):
        if not n:
            continue
        runs = {side: step_records(data, recipe, n, tmp, side, side == "after", extra) for side in ("before", "after")}
        keys = ["step_seconds"] + (
            ["generation_seconds", "logprob_seconds", "train_seconds"] if recipe == "micro_rcgrpo" else []
        )
        for key in keys:
            out.append(
                (
                    recipe,
                    key,
                    *(statistics.fmean(r[key] for r in runs[side][first:] if key in r) for side in ("before", "after")),
                )
            )
    return out


def steps_per_second(data: Path, steps: int, runs: int, threads: int, tmp: Path) -> tuple[float, list[float]]:
    """Steps per second of the machine with ``runs`` micro_sft runs at once, ``threads`` torch threads each."""
    rcgrpo = str(Path(sys.executable).parent / "rcgrpo")
    procs = []
    for r in range(runs):
        run_dir = tmp / f"jobs{runs}_{r}"
        cmd = [
            rcgrpo,
            "train",
            "--config-name",
            "micro_sft",
            f"run_dir={run_dir}",
            f"data.dir={data}",
            f"trainer.max_steps={steps}",
            "trainer.save_every=100000",
            "trainer.export_hf=false",
            "logging.progress=false",
            "logging.tensorboard=false",
        ]
        env = {**ALLOCATOR_ENV, **os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env), run_dir))
    per_run = []
    for proc, run_dir in procs:
        if proc.wait() != 0:
            raise SystemExit(f"micro_sft run in {run_dir} failed")
        metrics = [
            _metric_values(json.loads(l)) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()
        ]
        per_run.append(statistics.fmean(m["step_seconds"] for m in metrics[3:]))
    return sum(1.0 / s for s in per_run), per_run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8, help="stage-1 batches per side (after one warm-up batch)")
    p.add_argument("--steps", type=int, default=20, help="micro_sft steps per run in the jobs comparison (0: skip)")
    p.add_argument(
        "--alloc-steps", type=int, default=30, help="micro_rctp steps per side in the allocator comparison (0: skip)"
    )
    p.add_argument("--rl-steps", type=int, default=3, help="micro_rcgrpo steps per side there (0: skip)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rcgrpo-speed-") as tmp:
        tmp = Path(tmp)
        data = tmp / "data"
        subprocess.run(
            [
                str(Path(sys.executable).parent / "rcgrpo"),
                "prepare-data",
                "task_source=bfcl_micro",
                f"out_dir={data}",
                "tokenizer=null",
                "progress=false",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        torch.set_num_threads(os.cpu_count() or 1)
        h = head_comparison(data, args.batches)
        alloc = allocator_comparison(data, args.alloc_steps, args.rl_steps, tmp)
        jobs = None
        if args.steps:
            jobs = (
                steps_per_second(data, args.steps, 1, os.cpu_count() or 1, tmp),
                steps_per_second(data, args.steps, 2, max(1, (os.cpu_count() or 1) // 2), tmp),
            )
    union, rows = statistics.fmean(h["union"]), statistics.fmean(h["rows"])
    rows_out = [
        START,
        "## The experiment's stage-1 step and its commands (`scripts/bench/experiment_speed.py`)",
        "",
        f"Measured {dt.date.today():%Y-%m-%d} on {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"CPU, load average {load:.1f} at start. tiny-llama on the bfcl_micro SFT data (`micro_sft`: 16 sequences a step).",
        "",
        "| stage-1 step (forward, backward, AdamW) | seconds per step | positions through the output layer |",
        "|---|---:|---:|",
        f"| before: the union of the batch's trained positions (`logits_to_keep`) | {union:.3f} | "
        f"{statistics.fmean(h['union_positions']):.0f} |",
        f"| now: each row's trained positions (`position_logits`) | {rows:.3f} | {statistics.fmean(h['trained']):.0f} |",
        "",
        f"Ratio now / before: **{rows / union:.2f}** over {len(h['rows'])} batches per side, alternated "
        f"(batch: {statistics.fmean(h['tokens']):.0f} token positions on average).",
    ]
    if alloc:
        rows_out += [
            "",
            "| glibc allocator, one thread | seconds | before: defaults | now: ALLOCATOR_ENV | now / before |",
            "|---|---|---:|---:|---:|",
        ]
        rows_out += [f"| {recipe} | {key} | {b:.3f} | {a:.3f} | **{a / b:.2f}** |" for recipe, key, b, a in alloc]
        rows_out += [
            "",
            f"micro_rctp: {args.alloc_steps} steps a side, the first 3 left out; micro_rcgrpo from a random "
            f"tiny-llama (every rollout runs to its token limit): {args.rl_steps} steps a side, 8 groups of 5.",
        ]
    if jobs:
        (one, one_runs), (two, two_runs) = jobs
        rows_out += [
            "",
            "| commands at once | torch threads each | seconds per step, each run | steps per second, machine |",
            "|---:|---:|---|---:|",
            f"| 1 | {os.cpu_count()} | {one_runs[0]:.2f} | {one:.3f} |",
            f"| 2 | {max(1, (os.cpu_count() or 1) // 2)} | {', '.join(f'{s:.2f}' for s in two_runs)} | {two:.3f} |",
            "",
            f"Throughput two at once / one: **{two / one:.2f}x** ({args.steps} steps a run, the first 3 left out).",
        ]
    rows_out.append(END)
    return emit(rows_out, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
