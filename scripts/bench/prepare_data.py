"""Benchmark: `rcgrpo prepare-data` for all 800 entries on ONE core.

Runs the real command in a subprocess pinned to one CPU (taskset, and
single-threaded tokenizers), with the SmolLM2 tokenizer already cached (the
one-time GGUF conversion is timed separately), and a second time without
token statistics to show what they cost. Target: under 60 s.

Writes a section to docs/benchmarks.md (replacing an earlier one).
Usage: python -m scripts.bench.prepare_data [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench._common import cpu_name, emit

START, END = "<!-- bench:prepare_data:start -->", "<!-- bench:prepare_data:end -->"


def timed_run(out_dir: Path, *overrides: str) -> float:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nemo_rcgrpo.cli", "prepare-data", f"out_dir={out_dir}", "progress=false", *overrides]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from nemo_rcgrpo.models.hf import SMOLLM2_DIR, cache_dir, smollm2_tokenizer_dir

    t0 = time.perf_counter()
    fresh = not (cache_dir() / SMOLLM2_DIR).exists()
    smollm2_tokenizer_dir()
    convert_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        full = timed_run(Path(tmp) / "full")
        no_tokens = timed_run(Path(tmp) / "no_tokens", "tokenizer=null")
        sizes = {p.name: p.stat().st_size for p in (Path(tmp) / "full").iterdir()}
    total_mb = sum(sizes.values()) / 1e6
    rows = [
        START,
        "## Data preparation (`scripts/bench/prepare_data.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, pinned to 1 core (taskset, single-threaded "
        f"tokenizers); Python {platform.python_version()}.",
        "- Work: `rcgrpo prepare-data` for all 800 entries, default settings (merged episodes, seed 1234): "
        f"800 expert + 800 verified failure trajectories, 1600 RCTP lines, RL pointers, stats; {total_mb:.0f} MB written.",
        "",
        "| run | seconds | vs 60 s target |",
        "|---|---:|---:|",
        f"| full, token statistics with the cached SmolLM2 tokenizer | {full:.1f} | {full / 60:.2f} |",
        f"| without token statistics (`tokenizer=null`) | {no_tokens:.1f} | {no_tokens / 60:.2f} |",
        "",
        f"One-time SmolLM2 tokenizer conversion from the GGUF: {convert_s:.1f} s"
        + (
            " (measured now)."
            if fresh
            else " (already cached in this run, so not measured; about 12 s when fresh in an earlier run, a figure "
            "written into this script)."
        ),
        END,
    ]
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
