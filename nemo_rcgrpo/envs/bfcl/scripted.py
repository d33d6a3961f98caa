"""BFCL's plans for the scripted generator (``generation.backend=scripted``, `generation/scripted.py`), which asks a
suite for them through its ``scripted_messages`` capability (`suite.py: BFCLSuite.scripted_messages`).

A success plays the task's ground truth as the expert trajectories of `prepare-data` do (`trajectories.py: play`,
in the env's episode mode); a failure is a verified reward-0 perturbation of it, built by `failures.py` as the
failure trajectories are (the preferred ``generation.scripted.failure_type`` first, then the shipped types).
"""

from __future__ import annotations

import random

from nemo_rcgrpo.envs.bfcl.failures import make_failure
from nemo_rcgrpo.envs.bfcl.reward import GoldReplay
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan, play
from nemo_rcgrpo.types import Message


def scripted_messages(
    task: BFCLTask, gold: GoldReplay, success: bool, variant: int, mode: str, failure_type: str
) -> list[Message] | None:
    """The conversation of a scripted rollout of ``task`` in ``mode`` episodes: its ground truth played, or
    (``success`` False) the failure ``variant`` (the seed of the perturbation) of ``failure_type``; None where no
    reward-0 perturbation could be built."""
    if success:
        return play(task, gold_plan(task), mode, gold=gold).messages
    failure = make_failure(task, gold_plan(task), failure_type, random.Random(variant), {"mode": mode, "gold": gold})
    return None if failure is None else failure.played.messages
