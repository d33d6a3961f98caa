"""`rcgrpo`: the project's command line.

Subcommands:
  score          replay tool calls (JSONL) through the BFCL environment and score them (--task-source)
  prepare-data   build the SFT / RCTP-FT / RL datasets (Hydra overrides: out_dir=... seed=...)
  train          a training recipe (--config-name NAME key=value ...), as nemo_rcgrpo/train.py
  plot           training-dynamics PNG from runs' metrics.jsonl
  report         one self-contained HTML page of a run: config, plots, eval table, every rollout (filters)
  eval           evaluate a policy on BFCL v4 multi-turn (policy=... protocol=paper|bfcl out_dir=...)
  compare        several eval results side by side: Markdown table and bar chart
  serve          a vLLM server on a policy export, for runs with generation.vllm.url=http://HOST:PORT
  layout         a recipe's GPU layout as shell variables (for the launchers)
  plugins        every pluggable kind (@register) and its registered names, a user's modules included
  convert        weights: HF folder <-> Megatron-Core state dicts (hf-to-megatron IN OUT --tp N | megatron-to-hf IN OUT)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from typing import Any

from tqdm import tqdm


def _score(args: argparse.Namespace) -> int:
    from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, BFCLDataError
    from nemo_rcgrpo.envs.sources import make_suite
    from nemo_rcgrpo.registry import load_plugins
    from nemo_rcgrpo.score import OutputBudget, ground_truth_lines, read_lines, score_lines, summary_table
    from nemo_rcgrpo.score import write_scores
    from nemo_rcgrpo.utils.config import ConfigError

    try:
        load_plugins(args.plugins or [])
        suite = make_suite(args.task_source, args.categories or CATEGORIES)
    except (BFCLDataError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    source = None
    if args.ground_truth:
        lines: Any = ground_truth_lines(suite)
        total = len(suite)
    elif args.input:
        try:
            source = Path(args.input).open("rb")
        except OSError as e:
            print(f"error: cannot read {args.input}: {e.strerror}", file=sys.stderr)
            return 2
        lines, total = read_lines(source), None
    else:
        print("error: give IN.jsonl (and OUT.jsonl), or --ground-truth", file=sys.stderr)
        return 2
    out_path = Path(args.output) if args.output else None
    if out_path is not None:
        if out_path.is_dir():
            print(f"error: OUT {out_path} is a directory; give a file path", file=sys.stderr)
            if source is not None:
                source.close()
            return 2
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            probe = out_path.with_name(out_path.name + ".partial")
            probe.open("w").close()
        except OSError as e:
            print(f"error: cannot write {out_path}: {e.strerror or e}", file=sys.stderr)
            if source is not None:
                source.close()
            return 2
    try:
        progress = tqdm(lines, desc="scoring", unit="traj", total=total, file=sys.stderr, disable=args.quiet)
        budget = OutputBudget()  # OUT is bounded in proportion to the input (docs/scoring.md)
        summary = write_scores(score_lines(suite, budget.count(progress), arg_types=args.arg_types), out_path, budget)
    except OSError as e:
        print(f"error: while scoring: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        if source is not None:
            source.close()
    if args.summary or not args.output:
        print(summary_table(summary.rows))
    if summary.bad:
        print(f"{summary.bad} line(s) could not be scored (see 'error' in the output)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rcgrpo", description="RC-GRPO for multi-turn tool calling on BFCL v4",
        epilog="first run (about a minute): rcgrpo train --config-name smoke_rl, then rcgrpo report runs/smoke_rl; "
               "rcgrpo train --help lists the recipes and settings")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare-data", help="build the datasets (Hydra overrides, e.g. out_dir=data/x seed=1)")
    sub.add_parser("train", help="train a recipe: --config-name NAME plus key=value overrides (--help lists recipes)")
    sub.add_parser("plot", help="plot training dynamics of runs: rcgrpo plot RUN [RUN ...] --out PNG")
    sub.add_parser("report", help="one HTML page of a run (config, plots, eval, every rollout): rcgrpo report RUN -o FILE")
    sub.add_parser("eval", help="evaluate: policy=oracle|null|checkpoint|endpoint protocol=paper|bfcl out_dir=PATH")
    sub.add_parser("compare", help="compare eval results: rcgrpo compare RESULT [RESULT ...] --out PATH")
    sub.add_parser("serve", help="vLLM server for rollouts: rcgrpo serve MODEL [--port 8000 --tp 1 ...] (see --help)")
    sub.add_parser("layout", help="GPU layout of a recipe as shell variables: --config-name NAME [overrides]")
    sub.add_parser("plugins", help="every pluggable kind and its registered names: rcgrpo plugins [plugins=[mod,...]]")

    p = sub.add_parser("score", help="score recorded tool calls with the paper's reward and BFCL's checker")
    p.add_argument("input", nargs="?", help='JSONL of {"id", "turns": [[call, ...], ...]}')
    p.add_argument("output", nargs="?", help="JSONL of per-line scores (omit to print only the summary)")
    p.add_argument("--ground-truth", action="store_true", help="score the ground truth itself (a self-check)")
    p.add_argument("--categories", nargs="+", help="restrict to these BFCL categories (default: all four)")
    p.add_argument("--task-source", default="bfcl", help="the registered task source whose tasks the lines name "
                   "(default bfcl: BFCL v4 multi-turn; bfcl_micro; a plugin's, with --plugins)")
    p.add_argument("--plugins", nargs="+", metavar="MODULE", help="modules to import first (they may register a "
                   "task source)")
    p.add_argument("--arg-types", choices=("bfcl", "strict"), default="bfcl",
                   help="argument type checking: 'bfcl' lets the API judge (leaderboard behaviour), "
                   "'strict' rejects values that do not match the documented type")
    p.add_argument("--summary", action="store_true", help="print the per-category table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_score)

    from nemo_rcgrpo.models.megatron.cli_convert import add_parser as add_convert

    add_convert(sub)
    return parser


HYDRA_COMMANDS = {"prepare-data": "nemo_rcgrpo.prepare_data", "train": "nemo_rcgrpo.train",
                  "plot": "nemo_rcgrpo.utils.plots", "report": "nemo_rcgrpo.utils.report", "eval": "nemo_rcgrpo.evaluation.run",
                  "compare": "nemo_rcgrpo.evaluation.compare", "serve": "nemo_rcgrpo.generation.vllm_server", "layout": "nemo_rcgrpo.launch",
                  "plugins": "nemo_rcgrpo.registry"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in HYDRA_COMMANDS:  # Hydra entries take key=value overrides, not argparse flags
        import importlib

        return importlib.import_module(HYDRA_COMMANDS[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
