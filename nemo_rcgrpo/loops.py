"""The training loops, registered by name (kind ``loop``): a stage (`stages.py`) names the one that trains it and
``rcgrpo train`` runs it. Each entry imports its loop when it runs, so that a config is validated without them."""

from __future__ import annotations

from typing import Any

from nemo_rcgrpo.registry import register
from nemo_rcgrpo.stages import Loop


def stage1_loop(cfg, recipe: str | None = None) -> dict[str, Any]:
    """Supervised training on prepared rows (SFT, RCTP-FT): `recipes/stage1.py`."""
    from nemo_rcgrpo.recipes.stage1 import run_stage1

    return run_stage1(cfg, recipe=recipe)


def rl_loop(cfg, recipe: str | None = None) -> dict[str, Any]:
    """Rollouts, group advantages and the policy loss (GRPO, RC-GRPO, ...): `recipes/rl.py`."""
    from nemo_rcgrpo.recipes.rl import run_rl

    return run_rl(cfg, recipe=recipe)


register("loop", "stage1")(Loop(stage1_loop, rl=False))
register("loop", "rl")(Loop(rl_loop, rl=True))
