"""`make experiment`: the RC-GRPO mechanism measured at CPU scale on the bfcl_micro tasks (docs/experiments.md).

Every number comes from the project's own commands (`rcgrpo prepare-data`, `rcgrpo train`, `rcgrpo eval`), run
as a user would run them; this script only runs them, reads their outputs and writes the report:

  data    rcgrpo prepare-data task_source=bfcl_micro (1200 train / 120 held-out tasks, experts + failures)
  stage 1 micro_sft and micro_rctp: tiny-llama (random init, SmolLM2 tokenizer) trained from scratch
  E1      the RCTP-FT model on the held-out tasks under the high and the low token (sampled, temperature 1):
          mu_h, mu_l with 95% bootstrap intervals over tasks; the SFT model without a token beside them
  E2      the rollouts of the first stage-2 step only, >= 50 groups of G=5 on training tasks: SFT init + GRPO,
          RCTP-FT init + RC-GRPO with iid and with stratified tokens; zero-variance-group fraction and mean
          within-group reward variance (1/G), next to Prop. 4.3's bound ((G-1)/G) p(1-p) (mu_h - mu_l)^2 from E1
  E3      the 2x2 ablation (SFT / RCTP-FT init x GRPO / RC-GRPO), the same steps, several seeds: held-out
          success (greedy, high token where the model is reward-conditioned), zero-variance fraction, entropy,
          entropy-reward correlation per step

Each stage is skipped when its output exists (a rerun continues; --fresh starts over). The tables are
recomputed from the outputs (eval trajectories, rollout dumps, metrics.jsonl) by `report()` and `render()`
(tests/unit/scripts/test_experiment_stats.py runs both on outputs of the same formats).

Usage: python -m scripts.experiment [--out outputs/experiment] [--doc docs/experiments.md] [--seeds 3]
                                    [--steps 30] [--e1-samples 4] [--e2-groups 60] [--jobs 2] [--fresh]

--jobs N runs N commands at once (each with cores/N torch threads), each as soon as the outputs it reads exist.

The commands run with glibc's allocator told to keep freed memory (ALLOCATOR_ENV, unless those variables are set
already): the 49k-token output layer allocates and frees logits of hundreds of MB every step, and by default each
such block is a fresh mmap whose pages fault in again. The numbers do not change (allocation only); a stage-1 step
takes about 0.6x as long ([benchmarks](../docs/benchmarks.md), `scripts/bench/experiment_speed.py`).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from scripts.bench._common import cpu_name, write_section

ROOT = Path(__file__).resolve().parent.parent

G = 5
P_HIGH = 0.5
CONDITIONS = (("sft", "grpo"), ("sft", "rcgrpo"), ("rctp", "grpo"), ("rctp", "rcgrpo"))
LABEL = {
    ("sft", "grpo"): "SFT + GRPO",
    ("sft", "rcgrpo"): "SFT + RC-GRPO",
    ("rctp", "grpo"): "RCTP-FT + GRPO",
    ("rctp", "rcgrpo"): "RCTP-FT + RC-GRPO",
}
E2_CONDITIONS = (
    ("sft_grpo", "sft", "grpo", None),
    ("rctp_rcgrpo_iid", "rctp", "rcgrpo", "iid"),
    ("rctp_rcgrpo_stratified", "rctp", "rcgrpo", "stratified"),
)
# E3's step 0: the initial model evaluated as the run's in-training evaluation will be (rl.eval_token=high where the
# run's training record is reward-conditioned: an RCTP-FT init, or any rcgrpo run; no token for SFT + GRPO)
INIT_EVALS = (("e3_init_sft", "sft", "none"), ("e3_init_sft_high", "sft", "high"), ("e3_init_rctp", "rctp", "high"))
INIT_OF = {
    ("sft", "grpo"): "e3_init_sft",
    ("sft", "rcgrpo"): "e3_init_sft_high",
    ("rctp", "grpo"): "e3_init_rctp",
    ("rctp", "rcgrpo"): "e3_init_rctp",
}
EVAL_BUDGET = ["max_new_tokens=96", "max_turns=4", "max_steps=4", "max_total_tokens=1024"]
CONFIDENCE = 0.95
# glibc: serve large blocks from the heap (no mmap per block) and never trim it, so freed logits are reused
ALLOCATOR_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


def _metric_values(record: dict) -> dict:
    """A metrics.jsonl record with its non-finite values ("nan", "inf", "-inf") as floats again."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------ statistics
def bootstrap_ci(values: Sequence[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean (fewer than 2 values: the value itself, twice)."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        v = float(x.mean()) if len(x) else float("nan")
        return (v, v)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - CONFIDENCE) / 2, 1 - (1 - CONFIDENCE) / 2])
    return float(lo), float(hi)


def success_by_task(trajectories: Path) -> dict[str, list[float]]:
    """task id -> the successes (0/1) of its episodes in an `rcgrpo eval` trajectories.jsonl."""
    out: dict[str, list[float]] = {}
    for line in trajectories.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault(r["task_id"], []).append(float(r["success"]))
    return out


def rate(by_task: dict[str, list[float]]) -> dict[str, Any]:
    """Success rate: the mean over tasks of each task's share of successful episodes, with its bootstrap interval
    (tasks resampled)."""
    per_task = [statistics.fmean(v) for v in by_task.values()]
    episodes = [s for v in by_task.values() for s in v]
    return {
        "mean": statistics.fmean(per_task),
        "ci": bootstrap_ci(per_task),
        "tasks": len(per_task),
        "episodes": len(episodes),
    }


def groups_of(dump: Path) -> list[dict[str, Any]]:
    """The groups of a rollout dump (rollouts/step_N.jsonl): [{"rewards": [...], "tokens": [...]}, ...]."""
    groups: dict[int, dict[str, list]] = {}
    for line in dump.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            g = groups.setdefault(r["group"], {"rewards": [], "tokens": []})
            g["rewards"].append(float(r["reward"]))
            g["tokens"].append(r.get("reward_token"))
    return [groups[k] for k in sorted(groups)]


def variance_stats(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Zero-variance fraction and mean within-group reward variance (population, 1/G), with intervals over groups."""
    zero = [float(len(set(g["rewards"])) == 1) for g in groups]
    var = [float(np.var(g["rewards"])) for g in groups]
    rewards = [r for g in groups for r in g["rewards"]]
    out = {
        "groups": len(groups),
        "zero_variance": statistics.fmean(zero),
        "zero_variance_ci": bootstrap_ci(zero),
        "variance": statistics.fmean(var),
        "variance_ci": bootstrap_ci(var),
        "reward_mean": statistics.fmean(rewards),
        "one_token_groups": statistics.fmean(float(len(set(g["tokens"])) == 1) for g in groups),
    }
    for token in ("high", "low"):
        sel = [r for g in groups for r, t in zip(g["rewards"], g["tokens"]) if t == token]
        if sel:
            out[f"reward_{token}"] = statistics.fmean(sel)
    if "reward_high" in out and "reward_low" in out:  # Prop. 4.3 from these rollouts' own mu_h, mu_l (same tasks)
        out["bound"] = prop43_bound(out["reward_high"], out["reward_low"])
    return out


def prop43_bound(mu_h: float, mu_l: float, p: float = P_HIGH, group_size: int = G) -> float:
    """Prop. 4.3: expected within-group reward variance >= ((G-1)/G) p(1-p) (mu_h - mu_l)^2 (iid tokens)."""
    return (group_size - 1) / group_size * p * (1 - p) * (mu_h - mu_l) ** 2


def metrics_of(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [_metric_values(json.loads(l)) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


# ------------------------------------------------------------------ running the commands
class Job(NamedTuple):
    name: str
    args: list[str]
    done: Path  # the output whose presence means the job has run
    deps: tuple[str, ...] = ()  # jobs whose outputs it reads


class Runner:
    def __init__(self, out: Path, jobs: int = 1, quiet: bool = True):
        self.out, self.quiet, self.jobs = out, quiet, max(1, jobs)
        # each job's torch threads: the cores shared out, so concurrent jobs do not oversubscribe them
        self.threads = max(1, cores() // self.jobs)
        self.seconds: dict[str, float] = {}
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        timings = out / "seconds.json"
        if timings.is_file():
            self.seconds = json.loads(timings.read_text())

    def rcgrpo(self, name: str, args: list[str], done: Path) -> None:
        """Run ``rcgrpo ARGS`` unless ``done`` exists; its output goes to logs/NAME.log; seconds kept."""
        if done.exists():
            return
        cmd = [str(Path(sys.executable).parent / "rcgrpo"), *args]
        print(f"[{dt.datetime.now():%H:%M:%S}] {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        # OMP_NUM_THREADS is the runner's: the cores shared out between the commands running at once
        env = {**ALLOCATOR_ENV, **os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": str(self.threads)}
        with (self.logs / f"{name}.log").open("w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        if rc != 0:
            tail = (self.logs / f"{name}.log").read_text().splitlines()[-5:]
            raise SystemExit(f"{name} failed (exit {rc}); {self.logs / (name + '.log')}:\n" + "\n".join(tail))
        with self._lock:
            self.seconds[name] = time.perf_counter() - t0
            (self.out / "seconds.json").write_text(json.dumps(self.seconds, indent=1))

    def run(self, jobs: Sequence[Job]) -> None:
        """Run the jobs, ``self.jobs`` at a time, each once its dependencies have run, in the order given
        among those ready (the longest first, so the cores stay busy to the end). A failure stops new starts."""
        names = {j.name for j in jobs}
        unknown = {d for j in jobs for d in j.deps} - names
        if unknown:
            raise ValueError(f"jobs depend on unknown jobs {sorted(unknown)}")
        pending, finished, running = list(jobs), set(), {}
        with cf.ThreadPoolExecutor(self.jobs) as pool:
            while pending or running:
                for job in [j for j in pending if set(j.deps) <= finished][: self.jobs - len(running)]:
                    pending.remove(job)
                    running[pool.submit(self.rcgrpo, job.name, job.args, job.done)] = job
                if not running:
                    raise ValueError(f"jobs {[j.name for j in pending]} wait on each other")
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for future in done:
                    job = running.pop(future)
                    if future.exception() is not None:
                        pending.clear()  # the running ones finish; nothing new starts; the first failure is raised
                        print(
                            f"{job.name} failed; waiting for {[running[f].name for f in running]} to finish",
                            file=sys.stderr,
                            flush=True,
                        )
                        cf.wait(running)
                        raise future.exception()
                    finished.add(job.name)


def experiment_jobs(args: argparse.Namespace) -> list[Job]:
    """Every command of the experiment, as jobs with their dependencies (data -> stage 1 -> E1, E2, E3)."""
    out: Path = args.out
    data = out / "data"
    jobs = [
        Job(
            "data",
            ["prepare-data", "task_source=bfcl_micro", f"out_dir={data}", "tokenizer=null", "progress=false"],
            data / "stats.json",
        )
    ]
    for stage in ("rctp", "sft"):  # RCTP-FT first: twice SFT's steps
        jobs.append(
            Job(
                f"stage1_{stage}",
                [
                    "train",
                    "--config-name",
                    f"micro_{stage}",
                    f"run_dir={out / stage}",
                    f"data.dir={data}",
                    "logging.progress=false",
                    "logging.tensorboard=false",
                ],
                out / stage / "hf" / "config.json",
                ("data",),
            )
        )
    for seed in range(1, args.seeds + 1):  # the long runs first
        for model, algo in CONDITIONS:
            run_dir = out / "e3" / f"{model}_{algo}_s{seed}"
            jobs.append(
                Job(
                    f"e3_{model}_{algo}_s{seed}",
                    [
                        "train",
                        "--config-name",
                        f"micro_{algo}",
                        f"model.path={out / model / 'hf'}",
                        f"run_dir={run_dir}",
                        f"data.dir={data}",
                        f"seed={seed}",
                        f"trainer.max_steps={args.steps}",
                        f"rl.eval_every={args.eval_every}",
                        "trainer.export_hf=false",
                        "logging.progress=false",
                        "logging.tensorboard=false",
                    ],
                    run_dir / "eval" / f"step_{args.steps}.jsonl",
                    (f"stage1_{model}",),
                )
            )
    for name, model, algo, sampling in E2_CONDITIONS:
        run_dir = out / "e2" / name
        extra = [f"rl.reward_token_sampling={sampling}"] if sampling else []
        jobs.append(
            Job(
                f"e2_{name}",
                [
                    "train",
                    "--config-name",
                    f"micro_{algo}",
                    f"model.path={out / model / 'hf'}",
                    f"run_dir={run_dir}",
                    f"data.dir={data}",
                    "trainer.max_steps=1",
                    f"rl.tasks_per_step={args.e2_groups}",
                    "rl.eval_every=0",
                    "trainer.export_hf=false",
                    "logging.progress=false",
                    "logging.tensorboard=false",
                    *extra,
                ],
                run_dir / "rollouts" / "step_1.jsonl",
                (f"stage1_{model}",),
            )
        )
    common_eval = [
        "eval",
        "policy=checkpoint",
        "task_source=bfcl_micro",
        f"data_dir={data}",
        "limit=null",
        "progress=false",
        "chat.tool_description=compact",
        *EVAL_BUDGET,
    ]
    for name, model, token in (("e1_high", "rctp", "high"), ("e1_low", "rctp", "low"), ("e1_sft", "sft", "none")):
        jobs.append(
            Job(
                name,
                [
                    *common_eval,
                    f"checkpoint.path={out / model / 'hf'}",
                    f"reward_token={token}",
                    f"samples={args.e1_samples}",
                    "temperature=1.0",
                    f"out_dir={out / name}",
                ],
                out / name / "results.json",
                (f"stage1_{model}",),
            )
        )
    for name, model, token in INIT_EVALS:  # step 0 of E3: greedy, the token the in-training evaluation uses
        jobs.append(
            Job(
                name,
                [
                    *common_eval,
                    f"checkpoint.path={out / model / 'hf'}",
                    f"reward_token={token}",
                    f"out_dir={out / name}",
                ],
                out / name / "results.json",
                (f"stage1_{model}",),
            )
        )
    return jobs


def run_all(args: argparse.Namespace) -> None:
    r = Runner(args.out, jobs=args.jobs)
    t0, before = time.perf_counter(), len(r.seconds)
    try:
        r.run(experiment_jobs(args))
    finally:  # a failed or interrupted invocation's time counts too
        if len(r.seconds) > before:  # something ran: its wall-clock time adds to an interrupted run's
            r.seconds["wall"] = r.seconds.get("wall", 0.0) + time.perf_counter() - t0
            (args.out / "seconds.json").write_text(json.dumps(r.seconds, indent=1))
            # how the commands ran, for the report (a later --report-only must not relabel them); each invocation
            # that ran something is kept, the first one's date labels the results
            path = args.out / "run.json"
            run = json.loads(path.read_text()) if path.is_file() else {}
            run.setdefault("date", f"{dt.date.today():%Y-%m-%d}")
            run.update(
                {
                    "jobs": r.jobs,
                    "threads": r.threads,
                    "cores": cores(),
                    "machine": cpu_name(),
                    "allocator": {k: os.environ.get(k, v) for k, v in ALLOCATOR_ENV.items()},
                }
            )
            run["invocations"] = run.get("invocations", []) + [{"jobs": r.jobs, "threads": r.threads}]
            path.write_text(json.dumps(run, indent=1))


# ------------------------------------------------------------------ the report
def _fmt_ci(m: float, ci: tuple[float, float], digits: int = 3) -> str:
    return f"{m:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def e3_table(out: Path, seeds: int, steps: int) -> tuple[list[str], dict]:
    """Per condition: held-out success at step 0 and at the last step (mean and spread over seeds), the mean
    zero-variance fraction, entropy and entropy-reward correlation over the steps."""
    init = {c: rate(success_by_task(out / INIT_OF[c] / "trajectories.jsonl"))["mean"] for c in CONDITIONS}
    rows = [
        "| init + algorithm | held-out success, step 0 | held-out success, step %d (seeds) | mean over seeds | "
        "zero-variance groups (mean over steps) | reward (train rollouts, mean over steps) | entropy, first / last "
        "step | entropy-reward corr. (mean) |" % steps,
        "|---|---:|---|---:|---:|---:|---|---:|",
    ]
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for model, algo in CONDITIONS:
        finals, zv, rew, ent0, ent1, corr = [], [], [], [], [], []
        curve: dict[str, list[list[float]]] = {
            "eval": [],
            "zero_variance_fraction": [],
            "entropy": [],
            "reward_mean": [],
            "entropy_reward_corr": [],
        }
        for seed in range(1, seeds + 1):
            run = out / "e3" / f"{model}_{algo}_s{seed}"
            last = run / "eval" / f"step_{steps}.jsonl"
            if not last.is_file():
                continue
            finals.append(
                statistics.fmean(
                    float(json.loads(l)["reward"] == 1.0) for l in last.read_text().splitlines() if l.strip()
                )
            )
            m = metrics_of(run)
            steps_m = [x for x in m if "zero_variance_fraction" in x]
            zv.append(statistics.fmean(x["zero_variance_fraction"] for x in steps_m))
            rew.append(statistics.fmean(x["reward_mean"] for x in steps_m))
            ent0.append(steps_m[0]["entropy"])
            ent1.append(steps_m[-1]["entropy"])
            corr += [x["entropy_reward_corr"] for x in steps_m if "entropy_reward_corr" in x]
            for key in curve:
                if key == "eval":
                    evals = [(0, init[(model, algo)])] + [
                        (x["step"], x["eval_accuracy"] / 100.0) for x in m if "eval_accuracy" in x
                    ]
                    curve[key].append([v for _, v in sorted(evals)])
                else:
                    curve[key].append([x.get(key, float("nan")) for x in steps_m])
        curves[LABEL[(model, algo)]] = curve
        if not finals:
            continue
        corr_cell = f"{statistics.fmean(corr):+.2f}" if corr else "- (no step with reward variance)"
        rows.append(
            f"| {LABEL[(model, algo)]} | {init[(model, algo)]:.3f} | {', '.join(f'{v:.3f}' for v in finals)} | "
            f"**{statistics.fmean(finals):.3f}** | {statistics.fmean(zv):.2f} | {statistics.fmean(rew):.3f} | "
            f"{statistics.fmean(ent0):.3f} / {statistics.fmean(ent1):.3f} | {corr_cell} |"
        )
    return rows, curves


def plot_curves(curves: dict, eval_every: int, steps: int, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("eval", "held-out success (greedy)"),
        ("zero_variance_fraction", "zero-variance groups"),
        ("reward_mean", "reward, training rollouts"),
        ("entropy", "entropy (nats / token)"),
        ("entropy_reward_corr", "entropy-reward correlation"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, title) in zip(axes, panels):
        for label, curve in curves.items():
            runs = [c for c in curve[key] if c]
            if not runs:
                continue
            n = min(len(c) for c in runs)
            arr = np.array([c[:n] for c in runs], dtype=np.float64)
            if np.isnan(arr).all():  # e.g. no entropy-reward correlation: no step had reward variance
                continue
            xs = np.arange(n) * eval_every if key == "eval" else np.arange(1, n + 1)
            mean = np.nanmean(arr, axis=0)
            ax.plot(xs, mean, label=label)
            ax.fill_between(xs, np.nanmin(arr, axis=0), np.nanmax(arr, axis=0), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)


def report(out: Path, seeds: int, steps: int, eval_every: int, plot: Path | None = None) -> dict[str, Any]:
    """Every table of docs/experiments.md, recomputed from the outputs in ``out``."""
    e1 = {k: rate(success_by_task(out / f"e1_{k}" / "trajectories.jsonl")) for k in ("high", "low", "sft")}
    bound = prop43_bound(e1["high"]["mean"], e1["low"]["mean"])
    e2 = {
        name: variance_stats(groups_of(out / "e2" / name / "rollouts" / "step_1.jsonl"))
        for name, *_ in E2_CONDITIONS
        if (out / "e2" / name / "rollouts" / "step_1.jsonl").is_file()
    }
    e3_rows, curves = e3_table(out, seeds, steps) if (out / "e3").is_dir() else ([], {})
    if plot is not None and curves:
        plot_curves(curves, eval_every, steps, plot)
    return {"e1": e1, "bound": bound, "e2": e2, "e3_rows": e3_rows}


def render(
    res: dict[str, Any], args: argparse.Namespace, seconds: dict[str, float], run: dict[str, Any] | None = None
) -> str:
    """The results section; ``run`` is run.json (how the commands ran: jobs, threads), else ``args``."""
    jobs = int((run or {}).get("jobs", getattr(args, "jobs", 1)))
    if len({(i["jobs"], i["threads"]) for i in (run or {}).get("invocations", [])}) > 1:
        run = None  # invocations ran differently: the wall clock is theirs added up, labelled as such
        jobs = 0
    e1, e2 = res["e1"], res["e2"]
    gap = e1["high"]["mean"] - e1["low"]["mean"]
    lines = [
        "## E1: conditioning (RCTP-FT model, held-out tasks)",
        "",
        f"{e1['high']['tasks']} held-out tasks x {args.e1_samples} sampled episodes (temperature 1, the RL sampling), "
        "success = reward 1; 95% bootstrap intervals over tasks.",
        "",
        "| model, token | success rate |",
        "|---|---|",
        f"| RCTP-FT, high token (mu_h) | {_fmt_ci(e1['high']['mean'], e1['high']['ci'])} |",
        f"| RCTP-FT, low token (mu_l) | {_fmt_ci(e1['low']['mean'], e1['low']['ci'])} |",
        f"| SFT, no token | {_fmt_ci(e1['sft']['mean'], e1['sft']['ci'])} |",
        "",
        f"mu_h - mu_l = {gap:+.3f} (goal: at least 0.3: {'met' if gap >= 0.3 else 'NOT met'}).",
        "",
        "## E2: reward variance at the start of stage 2 (rollouts of the first step, training tasks)",
        "",
        f"G = {G}, p = {P_HIGH}. Prop. 4.3's bound ((G-1)/G) p(1-p) (mu_h - mu_l)^2 (iid tokens) from E1's held-out "
        f"mu_h, mu_l: {res['bound']:.4f}; the last column takes mu_h, mu_l from the row's own rollouts (the "
        "training tasks of E2).",
        "",
        "| init + algorithm (tokens) | groups | zero-variance groups | mean within-group variance | reward "
        "(high / low token) | groups with one token only | Prop. 4.3 bound from this row |",
        "|---|---:|---|---|---|---:|---:|",
    ]
    names = {
        "sft_grpo": "SFT + GRPO",
        "rctp_rcgrpo_iid": "RCTP-FT + RC-GRPO (iid)",
        "rctp_rcgrpo_stratified": "RCTP-FT + RC-GRPO (stratified)",
    }
    for name, s in e2.items():
        by_token = f"{s['reward_mean']:.3f}" + (
            f" ({s['reward_high']:.3f} / {s['reward_low']:.3f})" if "reward_high" in s else ""
        )
        lines.append(
            f"| {names[name]} | {s['groups']} | {_fmt_ci(s['zero_variance'], s['zero_variance_ci'], 2)} | "
            f"{_fmt_ci(s['variance'], s['variance_ci'], 4)} | {by_token} | "
            f"{s['one_token_groups']:.2f} | {s['bound']:.4f} |"
            if "bound" in s
            else f"| {names[name]} | {s['groups']} | {_fmt_ci(s['zero_variance'], s['zero_variance_ci'], 2)} | "
            f"{_fmt_ci(s['variance'], s['variance_ci'], 4)} | {by_token} | - | - |"
        )
    if res["e3_rows"]:
        lines += [
            "",
            f"## E3: the 2x2 ablation, {args.steps} steps, {args.seeds} seeds",
            "",
            "Held-out success: greedy episodes on the 120 held-out tasks (the runs' in-training evaluation), with "
            "the high token where the run is reward-conditioned (an RCTP-FT init, or RC-GRPO) and none for SFT + "
            "GRPO; step 0 is the initial model evaluated the same way. The other columns are the training "
            "rollouts' metrics (metrics.jsonl).",
            "",
            *res["e3_rows"],
            "",
            "![training dynamics](experiments/e3_dynamics.png)",
        ]
    lines += ["", "## Time", "", "| stage | seconds |", "|---|---:|"]
    runs = {k: v for k, v in seconds.items() if k != "wall"}
    lines += [f"| {k} | {v:.0f} |" for k, v in runs.items()]
    lines += [f"| total (the commands' seconds added up) | {sum(runs.values()):.0f} |"]
    if "wall" in seconds:
        threads = f", {run['threads']} torch thread{'s' if run['threads'] > 1 else ''} each" if run else ""
        how = (
            f"{jobs} command{'s' if jobs > 1 else ''} at once{threads}"
            if jobs
            else "invocations run with different --jobs, added up"
        )
        lines += [f"| wall clock ({how}) | {seconds['wall']:.0f} |"]
    return "\n".join(lines)


START, END = "<!-- experiment:start -->", "<!-- experiment:end -->"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "experiment")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "experiments.md")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--e1-samples", type=int, default=4)
    p.add_argument("--e2-groups", type=int, default=60)
    p.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="commands run at once, the cores shared out between them "
        "(default 2: on 2 cores, two one-thread runs do more than one two-thread run)",
    )
    p.add_argument("--fresh", action="store_true", help="remove --out first")
    p.add_argument("--report-only", action="store_true", help="recompute the report from --out, run nothing")
    args = p.parse_args(argv)
    if args.seeds and (args.eval_every <= 0 or args.steps % args.eval_every):
        p.error(
            f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every} (E3 reads the last "
            "step's held-out evaluation)"
        )
    if args.fresh and args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run_all(args)
    seconds = json.loads((args.out / "seconds.json").read_text()) if (args.out / "seconds.json").is_file() else {}
    run = json.loads((args.out / "run.json").read_text()) if (args.out / "run.json").is_file() else None
    res = report(
        args.out, args.seeds, args.steps, args.eval_every, plot=args.doc.parent / "experiments" / "e3_dynamics.png"
    )
    machine, ncores, jobs = (run["machine"], run["cores"], run["jobs"]) if run else (cpu_name(), cores(), args.jobs)
    date = (run or {}).get("date", f"{dt.date.today():%Y-%m-%d}")
    header = (
        f"Measured {date} on {machine}, {ncores} cores, torch CPU. Command: "
        f"`python -m scripts.experiment --seeds {args.seeds} --steps {args.steps} --eval-every {args.eval_every} "
        f"--e1-samples {args.e1_samples} --e2-groups {args.e2_groups} --jobs {jobs}`; outputs in {args.out.name}/."
    )
    section = "\n".join([START, header, "", render(res, args, seconds, run), END])
    write_section(args.doc, section, START, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
