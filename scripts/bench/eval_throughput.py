"""Benchmark: evaluation throughput (episodes per minute) of a checkpoint through each generator.

The same tasks, budgets and greedy decoding with ``generation.backend=hf``
(in-process) and ``generation.backend=vllm`` (the vLLM server, started by the
generator) in one run; the ratio is vllm / hf. The default model is SmolLM2
(with reward tokens added), paper protocol, ``--limit`` tasks per category.

Measured: the seconds the policy spends on the episodes (its ``run`` calls inside
``rcgrpo eval``), after model loading and after the vLLM server has started, and
before the policy is closed: the server's shutdown is timed separately and not
counted (``rcgrpo eval``'s own ``seconds`` in results.json include it).

    python -m scripts.bench.eval_throughput --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import nemo_rcgrpo.evaluation.run as eval_run
from nemo_rcgrpo.evaluation.run import main as eval_main
from nemo_rcgrpo.registry import names
from scripts.bench._common import cpu_name, emit

START, END = "<!-- bench:eval_throughput:start -->", "<!-- bench:eval_throughput:end -->"


class TimedPolicy:
    """Wraps the evaluation policy: sums the seconds of its ``run`` calls (the episodes) and times ``close``
    (the vLLM server's shutdown) apart, so the measured seconds stop before the server is closed."""

    def __init__(self, inner):
        self.inner, self.run_seconds, self.close_seconds = inner, 0.0, 0.0

    def run(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner.run(*args, **kwargs)
        finally:
            self.run_seconds += time.perf_counter() - t0

    def close(self) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.close()
        finally:
            self.close_seconds += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextmanager
def timed_policies():
    """While active, every policy ``rcgrpo eval`` makes is a TimedPolicy (listed in the yielded list)."""
    made, original = [], eval_run.make_policy

    def make(*args, **kwargs):
        made.append(TimedPolicy(original(*args, **kwargs)))
        return made[-1]

    eval_run.make_policy = make
    try:
        yield made
    finally:
        eval_run.make_policy = original


def run(backend: str, args, root: Path) -> dict:
    out = root / backend
    argv = [
        "policy=checkpoint",
        f"checkpoint.path={args.model}",
        f"protocol={args.protocol}",
        f"limit={args.limit}",
        f"max_new_tokens={args.max_new_tokens}",
        f"max_turns={args.max_turns}",
        f"max_total_tokens={args.max_total_tokens}",
        "chat.tool_description=compact",
        "progress=false",
        f"generation.backend={backend}",
        f"out_dir={out}",
        "reward_token=high",
        *args.override,
    ]
    with timed_policies() as made:
        rc = eval_main(argv)
    if rc != 0:
        raise SystemExit(f"eval with generation.backend={backend} failed (exit {rc})")
    if len(made) != 1:
        raise SystemExit(f"expected one policy from rcgrpo eval, got {len(made)}")
    policy = made[0]
    r = json.loads((out / "results.json").read_text())
    tokens = sum(json.loads(l)["generated_tokens"] for l in (out / "trajectories.jsonl").read_text().splitlines())
    seconds = policy.run_seconds
    return {
        "seconds": seconds,
        "episodes": r["episodes"],
        "per_min": 60.0 * r["episodes"] / seconds,
        "tokens": tokens,
        "accuracy": r["overall"],
        "close_seconds": policy.close_seconds,
        "eval_seconds": r["seconds"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="Markdown file to update (default: print only)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--protocol", default="paper", choices=("paper", "bfcl"))
    parser.add_argument("--limit", type=int, default=2, help="tasks per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--override", nargs="*", default=[], help="extra eval overrides (key=value)")
    args = parser.parse_args()
    backends = [b for b in args.backends if b in names("generator")]
    skipped = [b for b in args.backends if b not in names("generator")]
    root = Path(tempfile.mkdtemp(prefix="rcgrpo-bench-eval-"))
    try:
        results = {b: run(b, args, root) for b in backends}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = results.get("hf")
    rows = [
        START,
        "## Evaluation throughput (`scripts/bench/eval_throughput.py`)",
        "",
        f"{dt.date.today().isoformat()}, {cpu_name()}, Python {platform.python_version()}; model {args.model}, "
        f"{args.protocol} protocol, {args.limit} tasks per category, greedy, max_new_tokens "
        f"{args.max_new_tokens}, max_turns {args.max_turns}; wall time of the episodes inside `rcgrpo eval`, after "
        f"model loading (vLLM: server already started) and before the generator is closed (the server's "
        f"shutdown is not counted). Same tasks and budgets for every generator, one run.",
        "",
        "| generator | episodes | seconds | episodes/min | generated tokens | tokens/s | vs hf |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b, r in results.items():
        ratio = f"{r['per_min'] / base['per_min']:.2f}x" if base else "-"
        rows.append(
            f"| {b} | {r['episodes']} | {r['seconds']:.1f} | {r['per_min']:.2f} | {r['tokens']} | "
            f"{r['tokens'] / r['seconds']:.1f} | {ratio} |"
        )
    closes = [f"{b} {r['close_seconds']:.1f} s" for b, r in results.items() if r["close_seconds"] >= 0.05]
    if closes:
        rows += ["", "Generator shutdown after the episodes (not counted above): " + ", ".join(closes) + "."]
    if skipped:
        rows += ["", f"Not measured (generator not available here): {', '.join(skipped)}."]
    rows.append(END)
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
