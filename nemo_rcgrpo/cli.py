"""`rcgrpo`: the project's command line.

Subcommands:
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

and every registered ``command`` (kind ``command``: ``fn(argv) -> exit code``): the shipped environments add
``score`` (BFCL's: replay tool calls from JSONL through the environment and score them, `envs/bfcl/score.py`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rcgrpo",
        description="RC-GRPO for multi-turn tool calling on BFCL v4",
        epilog="first run (about a minute): rcgrpo train --config-name smoke_rl, then rcgrpo report runs/smoke_rl; "
        "rcgrpo train --help lists the recipes and settings",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare-data", help="build the datasets (Hydra overrides, e.g. out_dir=data/x seed=1)")
    sub.add_parser("train", help="train a recipe: --config-name NAME plus key=value overrides (--help lists recipes)")
    sub.add_parser("plot", help="plot training dynamics of runs: rcgrpo plot RUN [RUN ...] --out PNG")
    sub.add_parser(
        "report", help="one HTML page of a run (config, plots, eval, every rollout): rcgrpo report RUN -o FILE"
    )
    sub.add_parser("eval", help="evaluate: policy=oracle|null|checkpoint|endpoint protocol=paper|bfcl out_dir=PATH")
    sub.add_parser("compare", help="compare eval results: rcgrpo compare RESULT [RESULT ...] --out PATH")
    sub.add_parser("serve", help="vLLM server for rollouts: rcgrpo serve MODEL [--port 8000 --tp 1 ...] (see --help)")
    sub.add_parser("layout", help="GPU layout of a recipe as shell variables: --config-name NAME [overrides]")
    sub.add_parser("plugins", help="every pluggable kind and its registered names: rcgrpo plugins [plugins=[mod,...]]")

    from nemo_rcgrpo.models.megatron.cli_convert import add_parser as add_convert

    add_convert(sub)
    for name, command in sorted(_commands().items()):  # an environment's commands (rcgrpo score ...)
        sub.add_parser(name, help=getattr(command, "help", None), add_help=False)
    return parser


def _commands() -> dict[str, Any]:
    """The registered commands (the shipped environments', and the plugins' of the entry point group); a name the
    CLI has already is not one of them."""
    from nemo_rcgrpo.registry import load_plugins, table

    load_plugins([])  # the entry points of nemo_rcgrpo.plugins: a plugin package's commands
    return {name: fn for name, fn in table("command").items() if name not in {"convert", *HYDRA_COMMANDS}}


HYDRA_COMMANDS = {
    "prepare-data": "nemo_rcgrpo.prepare_data",
    "train": "nemo_rcgrpo.train",
    "plot": "nemo_rcgrpo.utils.plots",
    "report": "nemo_rcgrpo.utils.report",
    "eval": "nemo_rcgrpo.evaluation.run",
    "compare": "nemo_rcgrpo.evaluation.compare",
    "serve": "nemo_rcgrpo.generation.vllm_server",
    "layout": "nemo_rcgrpo.launch",
    "plugins": "nemo_rcgrpo.registry",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in HYDRA_COMMANDS:  # Hydra entries take key=value overrides, not argparse flags
        import importlib

        return importlib.import_module(HYDRA_COMMANDS[argv[0]]).main(argv[1:])
    if argv and argv[0] in _commands():  # a registered command parses its own arguments
        return _commands()[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
