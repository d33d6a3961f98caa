"""The training loops, registered by name (kind ``loop``): a stage (`stages.py`) names the one that trains it and
``rcgrpo train`` runs it. Each entry imports its loop when it runs, so that a config is validated without them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from nemo_rcgrpo.registry import register
from nemo_rcgrpo.stages import Loop


def stage1_loop(cfg, recipe: str | None = None) -> dict[str, Any]:
    """Supervised training on prepared rows (SFT, RCTP-FT): `recipes/stage1.py`."""
    from nemo_rcgrpo.recipes.stage1 import run_stage1

    return run_stage1(cfg, recipe=recipe)


def rl_loop(cfg, recipe: str | None = None) -> dict[str, Any]:
    """Rollouts, group advantages and the policy loss (GRPO, RC-GRPO, ...): `recipes/rl.py`; first stage 1 where
    its initial model is still to be trained (`stage1_first`)."""
    from nemo_rcgrpo.recipes.rl import run_rl

    stage1_first(cfg)
    return run_rl(cfg, recipe=recipe)


def stage1_first(cfg) -> None:
    """rl.stage1_recipe: train the initial model first (a whole stage-1 run of that recipe, into model.path's
    parent) when model.path does not exist yet. One recipe never runs another: the chain is the launcher's."""
    if cfg.rl.stage1_recipe is None or Path(cfg.model.path).exists():
        return
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.recipes.stage1 import run_stage1
    from nemo_rcgrpo.utils.config import compose

    overrides = [
        f"run_dir={Path(cfg.model.path).parent}",
        f"data.dir={cfg.data.dir}",
        f"seed={cfg.seed}",
        f"logging.progress={str(cfg.logging.progress).lower()}",
        f"plugins=[{','.join(cfg.plugins)}]",
        *cfg.rl.stage1_overrides,
    ]
    stage1 = TrainConfig.from_dict(compose(cfg.rl.stage1_recipe, overrides))
    if os.environ.get("RANK", "0") == "0":  # before init_distributed: every torchrun rank gets here
        print(
            f"{cfg.model.path} does not exist: training rl.stage1_recipe={cfg.rl.stage1_recipe} first", file=sys.stderr
        )
    import contextlib

    from nemo_rcgrpo.utils.run_lock import check_writable, run_lock

    check_writable(stage1.run_dir, "the stage-1 run_dir")
    same = Path(stage1.run_dir).resolve() == Path(cfg.run_dir).resolve()  # held already by this invocation
    with contextlib.nullcontext() if same else run_lock(stage1.run_dir, int(os.environ.get("RANK", "0"))):
        run_stage1(stage1, recipe=cfg.rl.stage1_recipe)  # its own folder: one writer there too


register("loop", "stage1")(Loop(stage1_loop, rl=False))
register("loop", "rl")(Loop(rl_loop, rl=True))
