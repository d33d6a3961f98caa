"""`rcgrpo layout --config-name NAME [overrides]`: a recipe's GPU layout (`nemo_rcgrpo/layout.py`) as shell
variables.

The launchers (scripts/slurm/*.sbatch, scripts/launch_local.sh) read the
process counts from the validated config instead of restating them, so a job
and its config cannot disagree:

    eval "$(rcgrpo layout --config-name rcgrpo_llama8b layout.nodes=4 layout.generation_nodes=1)"
    echo "$RCGRPO_TRAIN_NODES x $RCGRPO_TRAIN_GPUS_PER_NODE training ranks, TP=$RCGRPO_TP DP=$RCGRPO_DP"
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from nemo_rcgrpo.utils.run_command import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    return run_command(lambda: _layout(argv, as_json))


def _layout(argv: list[str], as_json: bool) -> int:
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.cli_help import resolve

    resolved = resolve("layout", argv, TrainConfig)
    if resolved is None:  # --help or --cfg job
        return 0
    name, cfg = resolved[0].name, resolved[1]
    plan = cfg.parallel_plan().as_dict()
    plan.update(
        config=name,
        stage=cfg.stage,
        run_dir=cfg.run_dir,
        model_path=cfg.model.path,
        stage1_recipe=cfg.rl.stage1_recipe or "",
        generation_backend=cfg.generation.backend,
        policy_backend=cfg.policy.backend,
    )
    if as_json:
        print(json.dumps(plan, indent=1))
    else:
        for key, value in plan.items():
            print(f"RCGRPO_{key.upper()}={shlex.quote(str(value))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
