"""`rcgrpo eval`: BFCL v4 multi-turn evaluation under the paper's or the official protocol.

    rcgrpo eval policy=oracle protocol=paper out_dir=runs/eval/oracle
    rcgrpo eval policy=checkpoint checkpoint.path=runs/rcgrpo_smollm_cpu protocol=bfcl limit=5 out_dir=...
    rcgrpo eval policy=endpoint endpoint.url=http://host:8000/v1 endpoint.model=NAME protocol=bfcl out_dir=...

Protocols:
- ``paper``: the held-out tasks of the scenario split (80 of 800), merged
  episodes, success = R_state x R_action = 1; checkpoints are conditioned on
  ``reward_token`` (auto: high when the model's training record says it was reward-conditioned, else none).
- ``bfcl``: all 800 entries (or ``categories`` / ``tasks`` / ``limit``),
  per-turn episodes, success = the official checker's verdict.

Outputs in ``out_dir``: results.json (config, model, accuracies in percent,
per-task outcomes with the failure reason), results.md (the table) and
trajectories.jsonl (every episode, for reading).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from nemo_rcgrpo.data.rl_tasks import find_pointers, load_pointers
from nemo_rcgrpo.envs.interfaces import Suite
from nemo_rcgrpo.envs.sources import category_key, source_categories
from nemo_rcgrpo.evaluation.config import EvalConfig
from nemo_rcgrpo.evaluation.policies import make_policy, official_pipeline
from nemo_rcgrpo.utils.bounded import bounded_line
from nemo_rcgrpo.utils.config import ConfigError

SAMPLE_SEED_STRIDE = 1_000_003


# ---------------------------------------------------------------------- tasks
def select_tasks(cfg: EvalConfig, suite: Suite) -> list[str]:
    """The protocol's task ids (paper: the held-out split; bfcl: every entry), filtered by categories and limit."""
    if cfg.tasks:
        missing = [t for t in cfg.tasks if t not in suite.tasks]
        if missing:
            raise ConfigError(f"tasks not in task_source={cfg.task_source}: {missing[:5]}")
        ids = list(cfg.tasks)
    elif cfg.protocol == "paper":
        ids = held_out_ids(cfg, suite)
    else:
        ids = list(suite.tasks)
    # the held-out split names tasks of every category; the suite holds only the chosen ones. Only the categories
    # the task source declares are chosen from: a task of another category is kept (as in training, where the
    # suite is given the categories and decides)
    declared = source_categories(cfg.task_source) or ()
    chosen = set(cfg.categories or declared)
    ids = [t for t in ids if t in suite.tasks and (suite[t].category in chosen or suite[t].category not in declared)]
    if cfg.limit is not None:
        taken: dict[str, int] = defaultdict(int)
        kept = []
        for t in ids:
            cat = suite[t].category
            if taken[cat] < cfg.limit:
                kept.append(t)
                taken[cat] += 1
        ids = kept
    if not ids:
        raise ConfigError("no tasks to evaluate (check categories, tasks and limit)")
    return ids


def held_out_ids(cfg: EvalConfig, suite: Suite) -> list[str]:
    """The paper protocol's tasks: the data's split.json (prepare-data's); for a suite without split() whose data
    has no split.json (a plugin's own data script) the data's held-out RL pointers, rl_test.jsonl; without data_dir
    the split recomputed from split_seed."""
    if cfg.data_dir:
        path = Path(cfg.data_dir) / "split.json"
        pointers = (
            None if callable(getattr(suite, "split", None)) or path.is_file() else find_pointers(cfg.data_dir, "test")
        )
        if pointers is not None:
            return list(load_pointers(pointers)["task_id"])
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found; prepare the data (rcgrpo prepare-data out_dir={cfg.data_dir}) "
                f"or drop data_dir to recompute the split from split_seed"
            )
        try:
            return list(json.loads(path.read_text())["test"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{path} is not a split written by prepare-data: {e}") from None
    from nemo_rcgrpo.envs.splits import split_by_scenario

    split = (
        suite.split
        if callable(getattr(suite, "split", None))
        else (lambda seed, fraction: split_by_scenario(suite, seed, fraction))
    )
    return split(cfg.split_seed, cfg.test_fraction).to_json(suite)["test"]


# ---------------------------------------------------------------------- scoring
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(records: Sequence[dict[str, Any]], samples: int = 1, order=None) -> dict[str, Any]:
    """Accuracies in percent: overall (over tasks), per category, mean over categories; pass@k with samples > 1.
    ``order``: the sort key of the categories (the suite's, `envs/sources.py: category_key`; default by name)."""
    order = order or (lambda category: (0, category))
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r)
    task_acc = {t: statistics.fmean(r["success"] for r in rs) for t, rs in by_task.items()}
    category = {t: rs[0]["category"] for t, rs in by_task.items()}
    cats: dict[str, list[float]] = defaultdict(list)
    for t, acc in task_acc.items():
        cats[category[t]].append(acc)
    out: dict[str, Any] = {
        "overall": 100.0 * statistics.fmean(task_acc.values()) if task_acc else 0.0,
        "categories": {
            c: {"accuracy": 100.0 * statistics.fmean(v), "tasks": len(v)}
            for c, v in sorted(cats.items(), key=lambda kv: order(kv[0]))
        },
        "tasks": len(task_acc),
        "episodes": len(records),
    }
    out["category_mean"] = statistics.fmean(c["accuracy"] for c in out["categories"].values()) if cats else 0.0
    if samples > 1:
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, samples) if k <= samples})
        out["pass_at_k"] = {
            str(k): 100.0
            * statistics.fmean(pass_at_k(len(rs), sum(r["success"] for r in rs), k) for rs in by_task.values())
            for k in ks
        }
    return out


def markdown_table(summary: dict[str, Any], title: str) -> str:
    lines = [f"### {title}", "", "| category | tasks | accuracy (%) |", "|---|---:|---:|"]
    for cat, v in summary["categories"].items():
        lines.append(f"| {cat} | {v['tasks']} | {v['accuracy']:.1f} |")
    lines.append(f"| **overall** | {summary['tasks']} | **{summary['overall']:.1f}** |")
    for k, v in summary.get("pass_at_k", {}).items():
        lines.append(f"| pass@{k} | {summary['tasks']} | {v:.1f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- policies
# ---------------------------------------------------------------------- run
def _load_done(path: Path) -> list[dict]:
    """Episodes already in a trajectories.jsonl (a torn last line is dropped)."""
    if not path.is_file():
        return []
    done = []
    for line in path.read_text().splitlines():
        try:
            done.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return done


def evaluate(cfg: EvalConfig, suite: Suite | None = None) -> dict[str, Any]:
    from nemo_rcgrpo.utils.run_lock import check_writable

    out_dir = Path(cfg.out_dir)
    check_writable(out_dir, "out_dir")  # before any model loads
    if (out_dir / "results.json").exists() and not (cfg.overwrite or cfg.resume):
        raise FileExistsError(
            f"{out_dir}/results.json exists; choose another out_dir, set overwrite=true, "
            f"or resume=true to finish an incomplete evaluation"
        )
    if cfg.data_dir:  # a model trained on one task source is evaluated on that source's held-out tasks
        from nemo_rcgrpo.data.consistency import DataMismatchError, check_task_source

        try:
            check_task_source(cfg.data_dir, cfg.task_source, setting="task_source")
        except DataMismatchError as e:
            raise ConfigError(str(e)) from None
    if suite is None:
        from nemo_rcgrpo.envs.sources import make_suite

        suite = make_suite(cfg.task_source, cfg.categories)
    task_ids = select_tasks(cfg, suite)
    out_dir.mkdir(parents=True, exist_ok=True)
    traj_path = out_dir / "trajectories.jsonl"
    records = _load_done(traj_path) if cfg.resume else []
    wanted = set(task_ids)
    records = [r for r in records if r["task_id"] in wanted and r["sample"] < cfg.samples]
    done = {(r["task_id"], r["sample"]) for r in records}
    if cfg.resume:  # rewrite the kept episodes (drops a torn line), then append
        traj_path.write_text("".join(bounded_line(r) + "\n" for r in records))
    random.seed(cfg.seed)
    policy = make_policy(cfg, suite)
    described = policy.description  # what the policy says of itself: the model, the reward token (`auto` resolved)
    model = described.get("source") or described.get("model")
    print(
        f"eval    policy {cfg.policy}"
        + (f" ({model}, reward token {described['reward_token']})" if "reward_token" in described else "")
        + f", {cfg.protocol} protocol"
        + (f" ({described['pipeline']}, {described['handler']})" if "pipeline" in described else "")
        + f": {len(task_ids)} tasks x {cfg.samples} sample(s) of "
        + f"{sorted({suite[t].category for t in task_ids}, key=category_key(suite))}"
        + (f", {len(done)} episodes kept from the incomplete run" if cfg.resume else "")
        + f"; results in {out_dir}",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    bar = tqdm(
        total=len(task_ids) * cfg.samples,
        initial=len(done),
        desc=f"eval {cfg.policy}/{cfg.protocol}",
        unit="episode",
        disable=not cfg.progress,
        file=sys.stderr,
    )
    error = None
    try:
        lock = threading.Lock()
        with traj_path.open("a" if cfg.resume else "w") as traj_file:

            def on_done(rec: dict) -> None:
                with lock:
                    traj_file.write(bounded_line(rec) + "\n")  # tool results clipped past the cap (utils/bounded.py)
                    traj_file.flush()
                    bar.update(1)

            for sample in range(cfg.samples):
                todo = [t for t in task_ids if (t, sample) not in done]
                if todo:
                    records += policy.run(
                        suite, task_ids, sample, cfg.seed + SAMPLE_SEED_STRIDE * sample, on_done, only=set(todo)
                    )
    except (RuntimeError, OSError) as e:  # a dead endpoint or server: keep what was scored, then report
        error = f"{type(e).__name__}: {e}"
        records = _load_done(traj_path)
    finally:
        bar.close()
        policy.close()
    seconds = time.perf_counter() - started
    summary = summarize(records, cfg.samples, category_key(suite))
    result = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "protocol": cfg.protocol,
        "policy": policy.description,
        "config": cfg.to_dict(),
        "tasks_title": getattr(suite, "title", None) or f"task source {cfg.task_source}",
        "complete": error is None,
        **({"error": error} if error else {}),
        **summary,
        "mean_accuracy": 100.0 * statistics.fmean(r["success"] for r in records) if records else 0.0,
        "seconds": seconds,
        "episodes_per_minute": 60.0 * len(records) / seconds if seconds > 0 else None,
        "per_task": _per_task(records),
    }
    title = f"{describe(result)} — {cfg.protocol} protocol"
    table = markdown_table(summary, title)
    pipeline = official_pipeline(cfg)
    official = pipeline.finish(records, cfg, out_dir) if pipeline is not None else None
    if official is not None:  # the env's own pipeline ran (BFCL's): its scores, its files, its table
        key, scores, official_table = official
        result[key] = scores
        table += official_table
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "results.md").write_text(table)
    if official is not None:
        result["official_table"] = official_table  # for the command's summary, not results.json
    if error:
        raise EvaluationIncomplete(
            f"{error} (scored {len(records)} of {len(task_ids) * cfg.samples} episodes; partial results in {out_dir})"
        )
    return result


class EvaluationIncomplete(RuntimeError):
    pass


def describe(result: dict[str, Any]) -> str:
    p = result["policy"]
    if p["policy"] == "checkpoint":
        return f"{p['source']} ({p['generator']}, token {p['reward_token']})"
    if p["policy"] == "endpoint":
        return f"{p['model']} @ {p['url']}" + (f" (token {p['reward_token']})" if "reward_token" in p else "")
    return p["policy"]


def _per_task(records: list[dict]) -> list[dict]:
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r)
    return [
        {
            "task_id": t,
            "category": rs[0]["category"],
            "successes": sum(r["success"] for r in rs),
            "samples": len(rs),
            "outcomes": [
                {
                    "sample": r["sample"],
                    "seed": r["seed"],
                    "success": r["success"],
                    "reward": r["reward"],
                    "official_valid": r["official_valid"],
                    "failure_reason": r["failure_reason"],
                }
                for r in sorted(rs, key=lambda r: r["sample"])
            ],
        }
        for t, rs in by_task.items()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from nemo_rcgrpo.utils.cli_help import resolve
    from nemo_rcgrpo.utils.run_command import run_command
    from nemo_rcgrpo.utils.run_lock import DiskFull, check_writable, run_lock

    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = None

    def run() -> int:
        nonlocal cfg
        resolved = resolve("eval", argv, EvalConfig)
        if resolved is None:  # --help or --cfg job
            return 0
        cfg = resolved[1]
        check_writable(cfg.out_dir, "out_dir")
        with run_lock(cfg.out_dir):  # one evaluation per out_dir
            result = evaluate(cfg)
        print(
            markdown_table(result, f"{describe(result)} — {cfg.protocol} protocol") + result.get("official_table", "")
        )
        print(f"results: {cfg.out_dir}/results.json, results.md, trajectories.jsonl")
        return 0

    def disk_full(e: OSError) -> str:  # DiskFull names what it was writing; another full disk, the results folder
        where = cfg.out_dir if cfg is not None else "out_dir"
        return str(e) if isinstance(e, DiskFull) else f"no space left on device while writing the results in {where}"

    return run_command(run, disk_full=disk_full)


if __name__ == "__main__":
    sys.exit(main())
