"""BFCL's data builder (kind ``data_builder``, the task sources ``bfcl`` and ``bfcl_micro``): the stage-1 records of
`rcgrpo prepare-data`, an expert and a failure per task.

Experts play the ground truth through the environment (`trajectories.py`) and must score 1; failures are a recorded
rollout that scored 0 (``failures.rollout_files``) or a perturbed plan of a registered failure type that scores 0
(`failures.py`). The generic command (`prepare_data.py`) adds the reward-goal lines, the RL pointers, the split and
the statistics around them.
"""

from __future__ import annotations

import random
import sys
from typing import Any

from tqdm import tqdm

from nemo_rcgrpo.envs.bfcl.failures import assign_types, load_rollout_failures, make_failure
from nemo_rcgrpo.envs.bfcl.tasks import BFCLDataError
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan, play


def build_records(cfg, suite, split, rng: random.Random) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(experts, failures, extra stats) of every task of ``suite``, in its order: each record carries ``task_id``,
    ``category``, ``split``, ``mode``, ``messages`` and ``tools``; a failure also ``failure_type``,
    ``failure_detail`` and ``source``. ``cfg``: the prepare-data config (mode, closing, calls_per_message,
    failures, progress)."""
    play_kwargs = {"mode": cfg.mode, "closing": cfg.closing, "calls_per_message": cfg.calls_per_message}
    tasks = list(suite.tasks.values())
    rollouts, rollout_counts = ({}, {})
    if cfg.failures.rollout_files:
        rollouts, rollout_counts = load_rollout_failures(cfg.failures.rollout_files, suite, cfg.mode)
    failure_types = assign_types(len(tasks), cfg.failures.types, rng)

    experts, failures = [], []
    for task, preferred in tqdm(
        list(zip(tasks, failure_types)), desc="trajectories", unit="task", disable=not cfg.progress, file=sys.stderr
    ):
        gold = suite.gold(task)
        base = {"task_id": task.id, "category": task.category, "split": split.side_of(task), "mode": cfg.mode}
        plan = gold_plan(task)
        expert = play(task, plan, gold=gold, **play_kwargs)
        if expert.reward.value != 1.0:
            raise BFCLDataError(f"the ground truth of {task.id} does not score 1 ({expert.reward.details})")
        experts.append({**base, "messages": expert.messages, "tools": expert.tools})

        candidates = rollouts.get(task.id, [])
        if candidates and rng.random() < cfg.failures.rollout_fraction:
            record = candidates[rng.randrange(len(candidates))]
            failures.append(
                {
                    **base,
                    "messages": record["messages"],
                    "tools": record.get("tools", expert.tools),
                    "failure_type": record.get("failure_type", "exploration"),
                    "failure_detail": "recorded rollout",
                    "source": "rollout",
                }
            )
            continue
        failure = make_failure(task, plan, preferred, rng, {**play_kwargs, "gold": gold}, cfg.failures.max_tries)
        if failure is None:
            raise BFCLDataError(f"no perturbation of {task.id} scores 0; raise failures.max_tries")
        failures.append(
            {
                **base,
                "messages": failure.played.messages,
                "tools": failure.played.tools,
                "failure_type": failure.failure_type,
                "failure_detail": failure.detail,
                "source": failure.source,
            }
        )
    return experts, failures, ({"rollout_files": rollout_counts} if rollout_counts else {})


build_records.env = "bfcl"  # the env its records are played in (the RL pointers' "env")
