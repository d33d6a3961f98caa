"""Benchmark: evaluation throughput (episodes per minute) of a checkpoint through each generator.

The same tasks, budgets and greedy decoding with ``generation.backend=hf``
(in-process) and ``generation.backend=vllm`` (the vLLM server, started by the
generator) in one run; the ratio is vllm / hf. The default model is SmolLM2
(with reward tokens added), paper protocol, ``--limit`` tasks per category.

    python scripts/bench/eval_throughput.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_replay import cpu_name, emit  # noqa: E402

from nemo_rcgrpo.evaluation.run import main as eval_main  # noqa: E402
from nemo_rcgrpo.generation import GENERATORS  # noqa: E402

START, END = "<!-- bench:eval_throughput:start -->", "<!-- bench:eval_throughput:end -->"


def run(backend: str, args, root: Path) -> dict:
    out = root / backend
    argv = ["policy=checkpoint", f"checkpoint.path={args.model}", f"protocol={args.protocol}", f"limit={args.limit}",
            f"max_new_tokens={args.max_new_tokens}", f"max_turns={args.max_turns}",
            f"max_total_tokens={args.max_total_tokens}", "chat.tool_description=compact", "progress=false",
            f"generation.backend={backend}", f"out_dir={out}", "reward_token=high", *args.override]
    rc = eval_main(argv)
    if rc != 0:
        raise SystemExit(f"eval with generation.backend={backend} failed (exit {rc})")
    r = json.loads((out / "results.json").read_text())
    tokens = sum(json.loads(l)["generated_tokens"] for l in (out / "trajectories.jsonl").read_text().splitlines())
    return {"seconds": r["seconds"], "episodes": r["episodes"], "per_min": r["episodes_per_minute"],
            "tokens": tokens, "accuracy": r["overall"]}


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
    backends = [b for b in args.backends if b in GENERATORS]
    skipped = [b for b in args.backends if b not in GENERATORS]
    root = Path(tempfile.mkdtemp(prefix="rcgrpo-bench-eval-"))
    try:
        results = {b: run(b, args, root) for b in backends}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = results.get("hf")
    rows = [START, "## Evaluation throughput (`scripts/bench/eval_throughput.py`)", "",
            f"{dt.date.today().isoformat()}, {cpu_name()}, Python {platform.python_version()}; model {args.model}, "
            f"{args.protocol} protocol, {args.limit} tasks per category, greedy, max_new_tokens "
            f"{args.max_new_tokens}, max_turns {args.max_turns}; wall time of `rcgrpo eval` after model loading "
            f"(vLLM: server already started). Same tasks and budgets for every generator, one run.", "",
            "| generator | episodes | seconds | episodes/min | generated tokens | tokens/s | vs hf |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for b, r in results.items():
        ratio = f"{r['per_min'] / base['per_min']:.2f}x" if base else "-"
        rows.append(f"| {b} | {r['episodes']} | {r['seconds']:.1f} | {r['per_min']:.2f} | {r['tokens']} | "
                    f"{r['tokens'] / r['seconds']:.1f} | {ratio} |")
    if skipped:
        rows += ["", f"Not measured (generator not available here): {', '.join(skipped)}."]
    rows.append(END)
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
