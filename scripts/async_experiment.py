"""`make experiment-async`: RC-GRPO with rollouts generated ahead (rl.max_staleness=1) against the synchronous loop
(rl.max_staleness=0), over seeds, on the bfcl_micro tasks (docs/experiments.md, "Rollouts generated ahead").

The same commands as `make experiment` (`scripts/experiment.py`), which this script shares its stage 1 with:

  data    rcgrpo prepare-data task_source=bfcl_micro
  stage 1 micro_rctp (tiny-llama trained from scratch, RCTP-FT)
  runs    micro_rcgrpo from the RCTP-FT export with generation=vllm (a server each run starts, weights moved by
          the collective transfer after every step), rl.max_staleness=0 and =1 (with token-level truncated IS,
          rl.loss.correction=token_tis, as docs/stage2.md advises there), seeds 1..N, the same steps and held-out
          evaluation as E3

The question asked: does k = 1 stay within the synchronous runs' seed band, in training reward (the mean over
steps of the training rollouts' reward) and in held-out success at the last evaluation (greedy, high token; the
earlier evaluations are tabulated beside it)? The band is [min, max] over the synchronous seeds; k = 1 is
within it when its mean over seeds is. Every number is recomputed from the runs' metrics.jsonl and eval dumps by
`report()` (tests/unit/scripts/test_async_experiment.py runs it on hand-made outputs).

Usage: python -m scripts.async_experiment [--out outputs/experiment] [--doc docs/experiments.md] [--seeds 5]
                                          [--steps 30] [--eval-every 10] [--jobs 2] [--report-only]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from scripts.experiment import ROOT, Job, Runner, cores, cpu_name, experiment_jobs, metrics_of, write_section

START, END = "<!-- async-experiment:start -->", "<!-- async-experiment:end -->"
STALENESS = (0, 1)
# k = 1 runs as stage2.md advises for rollouts generated ahead: truncated importance weights on the sampler's gap
AHEAD = ["rl.loss.correction=token_tis"]
VLLM = ["generation=vllm", "generation.vllm.enforce_eager=true", "generation.vllm.kv_cache_gib=1"]


def run_dir(out: Path, k: int, seed: int) -> Path:
    return out / "async" / f"k{k}_s{seed}"


def jobs(args: argparse.Namespace) -> list[Job]:
    """Data and stage 1 as `make experiment` runs them (skipped where its outputs exist), then the runs."""
    shared = [
        j
        for j in experiment_jobs(
            argparse.Namespace(
                out=args.out, seeds=0, steps=args.steps, eval_every=args.eval_every, e1_samples=1, e2_groups=1
            )
        )
        if j.name in ("data", "stage1_rctp")
    ]
    out = list(shared)
    for seed in range(1, args.seeds + 1):
        for k in STALENESS:
            rd = run_dir(args.out, k, seed)
            out.append(
                Job(
                    f"async_k{k}_s{seed}",
                    [
                        "train",
                        "--config-name",
                        "micro_rcgrpo",
                        f"model.path={args.out / 'rctp' / 'hf'}",
                        f"run_dir={rd}",
                        f"data.dir={args.out / 'data'}",
                        f"seed={seed}",
                        f"trainer.max_steps={args.steps}",
                        f"rl.eval_every={args.eval_every}",
                        f"rl.max_staleness={k}",
                        "trainer.export_hf=false",
                        "logging.progress=false",
                        "logging.tensorboard=false",
                        *VLLM,
                        *(AHEAD if k else []),
                    ],
                    rd / "eval" / f"step_{args.steps}.jsonl",
                    ("stage1_rctp",),
                )
            )
    return out


def band(values: Sequence[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def report(out: Path, seeds: int, steps: int) -> dict[str, Any]:
    """Per k: each seed's training reward (mean over steps), held-out success per evaluation step (eval dumps:
    the share of episodes with reward 1), mean staleness; then the synchronous band and whether k = 1 is in it."""
    res: dict[str, Any] = {}
    for k in STALENESS:
        runs = []
        for seed in range(1, seeds + 1):
            rd = run_dir(out, k, seed)
            m = [x for x in metrics_of(rd) if "reward_mean" in x]
            if len(m) < steps:
                continue
            evals = {}
            for path in sorted((rd / "eval").glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1])):
                rewards = [json.loads(line)["reward"] for line in path.read_text().splitlines() if line.strip()]
                evals[int(path.stem.split("_")[1])] = statistics.fmean(float(r == 1.0) for r in rewards)
            runs.append(
                {
                    "seed": seed,
                    "reward": statistics.fmean(x["reward_mean"] for x in m),
                    "evals": evals,
                    "staleness": statistics.fmean(x.get("staleness_mean", 0.0) for x in m),
                    "spanning": sum(x.get("spanning_rollouts", 0.0) for x in m),
                    "seconds": sum(x.get("step_seconds", 0.0) for x in m),
                }
            )
        res[k] = runs
    sync, ahead = res[0], res[1]
    out_: dict[str, Any] = {"runs": res}
    if sync and ahead:
        last = max(sync[0]["evals"]) if sync[0]["evals"] else None
        checks = {"training reward": ([r["reward"] for r in sync], [r["reward"] for r in ahead])}
        if last is not None:
            checks[f"held-out success, step {last}"] = (
                [r["evals"].get(last, float("nan")) for r in sync],
                [r["evals"].get(last, float("nan")) for r in ahead],
            )
        out_["checks"] = {
            name: {
                "band": band(s),
                "ahead": statistics.fmean(a),
                "within": band(s)[0] <= statistics.fmean(a) <= band(s)[1],
            }
            for name, (s, a) in checks.items()
        }
    return out_


def render(res: dict[str, Any], steps: int) -> list[str]:
    rows = [
        "| run | seed | training reward (mean over steps) | held-out success per evaluation | staleness (mean) | "
        "rollouts spanning an update | step seconds (sum) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for k, runs in res["runs"].items():
        for r in runs:
            evals = ", ".join(f"{s}: {v:.3f}" for s, v in sorted(r["evals"].items()))
            rows.append(
                f"| rl.max_staleness={k} | {r['seed']} | {r['reward']:.3f} | {evals} | {r['staleness']:.2f} | "
                f"{r['spanning']:.0f} | {r['seconds']:.0f} |"
            )
    rows.append("")
    for name, c in res.get("checks", {}).items():
        rows.append(
            f"- {name}: synchronous seeds [{c['band'][0]:.3f}, {c['band'][1]:.3f}]; rl.max_staleness=1, "
            f"mean over seeds {c['ahead']:.3f}: {'within the band' if c['within'] else 'OUTSIDE the band'}."
        )
    if not res.get("checks"):
        rows.append("- Not every run has finished: no comparison.")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "experiment")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "experiments.md")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--jobs", type=int, default=2, help="commands run at once (each run also starts a vLLM server)")
    p.add_argument("--report-only", action="store_true", help="recompute the section from --out, run nothing")
    args = p.parse_args(argv)
    if args.eval_every <= 0 or args.steps % args.eval_every:
        p.error(f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every}")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        Runner(args.out, jobs=args.jobs).run(jobs(args))
    seconds = json.loads((args.out / "seconds.json").read_text()) if (args.out / "seconds.json").is_file() else {}
    ran = {k: v for k, v in seconds.items() if k.startswith("async_")}
    res = report(args.out, args.seeds, args.steps)
    header = (
        f"Measured {dt.date.today():%Y-%m-%d} on {cpu_name()}, {cores()} cores, vLLM (CPU) started by each run. "
        f"Command: `python -m scripts.async_experiment --seeds {args.seeds} --steps {args.steps} --eval-every "
        f"{args.eval_every} --jobs {args.jobs}`; outputs in {args.out.name}/async/. The runs' commands took "
        f"{sum(ran.values()):.0f} s added up."
    )
    section = "\n".join([START, header, "", *render(res, args.steps), END])
    write_section(args.doc, section, START, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
