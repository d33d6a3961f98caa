"""What BFCL brings to the registry, as a plugin would: its task sources, environment and settings, rewards,
failure types, data builder, official evaluation pipeline and the ``rcgrpo score`` command (its suites also script
their own rollouts for ``generation.backend=scripted``: `suite.py: BFCLSuite.scripted_messages`).

Imported by `envs/builtin.py` (the one module outside this folder that imports it). What is heavy is imported when
it is first used, inside the registered functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from nemo_rcgrpo.envs.bfcl import failures as _failures  # noqa: F401 - registers wrong_tool, wrong_param, ...
from nemo_rcgrpo.envs.bfcl import reward as _reward  # noqa: F401 - registers state_x_action, state, action
from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, category_order
from nemo_rcgrpo.registry import register

register("env_settings", "bfcl")(BFCLSettings)


@register("task_source", "bfcl")
def bfcl(categories: Iterable[str], data_dir: Path | None = None):
    from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite

    return BFCLSuite(tuple(categories), data_dir=data_dir)


@register("task_source", "bfcl_micro")
def bfcl_micro(categories: Iterable[str], data_dir: Path | None = None):
    from nemo_rcgrpo.envs.bfcl.micro import MicroSuite

    return MicroSuite(tuple(categories), data_dir=data_dir)


bfcl.categories = bfcl_micro.categories = CATEGORIES  # BFCL's, in BFCL's order (micro: its tasks are all base)
bfcl.category_order = bfcl_micro.category_order = category_order  # for results read without their suite (compare)
bfcl.title, bfcl_micro.title = "BFCL v4 multi-turn", "BFCL micro tasks"
bfcl.leaderboard_entries, bfcl_micro.leaderboard_entries = True, False  # BFCL's own pipeline plays only BFCL's entries


@register("env", "bfcl")
def bfcl_env(settings: BFCLSettings, suite):
    """BFCL's executable environment (`envs/bfcl/env.py`) with these settings, reset with the suite's memoised
    gold replay: the task sources ``bfcl``, ``bfcl_micro`` and any BFCL-like suite (``.gold``)."""
    from nemo_rcgrpo.envs.bfcl.config import BFCLOpener

    return BFCLOpener(settings, suite)


def _build_records(cfg, suite, split, rng):
    from nemo_rcgrpo.envs.bfcl.data import build_records

    return build_records(cfg, suite, split, rng)


_build_records.env = "bfcl"
register("data_builder", "bfcl")(_build_records)
register("data_builder", "bfcl_micro")(_build_records)


@register("official_pipeline", "bfcl")
def official_pipeline(cfg):
    """BFCL's own multi-turn inference pipeline under ``protocol=bfcl`` on BFCL's own entries (`leaderboard.py`)."""
    from nemo_rcgrpo.registry import lookup

    if not getattr(lookup("task_source", cfg.task_source), "leaderboard_entries", False):
        return None  # another source's tasks (bfcl_micro's, a plugin's on BFCL's env): not in BFCL's pipeline
    from nemo_rcgrpo.envs.bfcl.leaderboard import BFCLPipeline

    return BFCLPipeline()


def score(argv: list[str]) -> int:
    from nemo_rcgrpo.envs.bfcl.score import main

    return main(argv)


score.help = "score recorded tool calls with the paper's reward and BFCL's checker"
register("command", "score")(score)
