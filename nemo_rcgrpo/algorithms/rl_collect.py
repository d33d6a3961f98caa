"""The rollout groups of one RL step (steps 1-4 of `recipes/rl.py`): the next training tasks of a seeded
per-epoch shuffle, a reward token for each rollout of a conditioned stage, the rollouts, and the group filter's
rounds (a stage's keep_group or ``rl.group_filter``: a refused group is never trained on and a new task is rolled
out in its place, for up to ``rl.group_filter_refills`` more rounds).

A rollout that failed (an exception or a value that breaks the plugin contract, `rollout/multi_turn.py`) pays 0 and
carries its ``error``; a step whose rollouts all failed stops the run (there is nothing to learn from, and training
on its zero advantages would hide the bug), and one in which more than ``rl.max_failed_share`` failed says so on
stderr."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from nemo_rcgrpo.algorithms.rl_batch import RolloutGroup
from nemo_rcgrpo.config_schema import RLConfig
from nemo_rcgrpo.registry import lookup
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec
from nemo_rcgrpo.stages import Stage, group_filter, has_variance
from nemo_rcgrpo.utils.banner import say


@dataclass(frozen=True)
class StepRollouts:
    """What collection hands the step: the groups to train on, the timing and filter stats, and the task cursor
    after the tasks it drew (the trainer keeps and checkpoints it)."""

    groups: list[RolloutGroup]
    stats: dict[str, float]
    cursor: int


class RolloutsFailed(ValueError):
    """Every rollout of a step failed; ``trajectories`` (all of them, in group order) go into the step's dump."""

    def __init__(self, message: str, trajectories: list):
        super().__init__(message)
        self.trajectories = trajectories


def check_failures(stage: str, step: int, trajectories: Sequence[Any], max_share: float) -> str | None:
    """Raise RolloutsFailed when every one of ``trajectories`` (step ``step``, counted from 1) failed; the warning
    line when more than ``max_share`` of them failed; None otherwise."""
    failed = [t for t in trajectories if t.error is not None]
    if not failed:
        return None
    first = f"first: task {failed[0].task_id}: {failed[0].error}"
    if len(failed) == len(trajectories):
        raise RolloutsFailed(
            f"{stage} step {step}: all {len(failed)} rollouts failed, nothing to train on ({first}); "
            f"every rollout's error is in rollouts/step_{step}.jsonl",
            list(trajectories),
        )
    if len(failed) > max_share * len(trajectories):
        return (
            f"WARNING: {stage} step {step}: {len(failed)} of {len(trajectories)} rollouts failed (more than "
            f"rl.max_failed_share={max_share:g}) and pay reward 0; {first}"
        )
    return None


def shuffled_tasks(task_ids: Sequence[str], cursor: int, n: int, seed: int) -> list[str]:
    """Tasks ``cursor .. cursor + n - 1`` of the endless sequence of per-epoch shuffles of ``task_ids`` (epoch e is
    shuffled with seed ``seed * 7919 + e``): deterministic, and resumable from the cursor alone."""
    out = []
    for position in range(cursor, cursor + n):
        epoch, index = divmod(position, len(task_ids))
        order = list(task_ids)
        random.Random(seed * 7_919 + epoch).shuffle(order)
        out.append(order[index])
    return out


def rollout_specs(
    rl: RLConfig, conditioned: bool, suite: Any, task_ids: Sequence[str], first_group: int, rng: random.Random
) -> list[RolloutSpec]:
    """G rollouts per task, in group order; a conditioned stage's each get a token from rl.reward_token_sampling."""
    if conditioned:
        sampler = lookup("reward_token_sampler", rl.reward_token_sampling)
        tokens = sampler(len(task_ids), rl.group_size, rl.p_high, rng)
    else:
        tokens = [[None] * rl.group_size for _ in task_ids]
    return [RolloutSpec(suite[t], first_group + g, tok) for g, t in enumerate(task_ids) for tok in tokens[g]]


def collect_groups(
    rl: RLConfig,
    spec: Stage,
    engine: RolloutEngine,
    suite: Any,
    task_ids: Sequence[str],
    cursor: int,
    step: int,
    rng: random.Random,
    seed: int,
    stage: str = "rl",
) -> StepRollouts:
    """``rl.tasks_per_step`` groups of G trajectories (fewer only when a group filter's rounds ran out and
    ``rl.group_filter_shortfall=train``), with the step's generation / env / reward seconds and filter counts. Tasks are
    drawn from ``cursor`` on in the seeded per-epoch shuffle of ``task_ids`` (``shuffled_tasks``); the stage's
    spec (``spec``, registered or not) says whether rollouts get reward tokens and which groups are kept;
    ``stage``: its name in messages."""
    stats = {
        "generation_seconds": 0.0,
        "env_seconds": 0.0,
        "reward_seconds": 0.0,
        "dropped_zero_variance_groups": 0.0,
        "sampled_groups": 0.0,
    }
    groups: list[RolloutGroup] = []
    keep = group_filter(spec, rl.group_filter)  # None: every group is trained on
    filtering = keep is not None
    rounds = 1 + (rl.group_filter_refills if filtering else 0)
    dropped = zero_sampled = 0
    sampled: list[Any] = []  # every trajectory of the step, for the failure count
    for round_index in range(rounds):
        need = rl.tasks_per_step - len(groups)
        if need <= 0:
            break
        drawn = shuffled_tasks(task_ids, cursor, need, seed)
        cursor += need
        specs = rollout_specs(rl, spec.conditioned, suite, drawn, len(groups), rng)
        trajs, timings = engine.rollout_timed(specs, seed=seed + 100_003 * step + 1_009 * round_index)
        for part in ("generation", "env", "reward"):
            stats[f"{part}_seconds"] += timings[part]
        sampled += trajs
        check_failures(stage, step + 1, sampled, 1.0)  # all failed so far: stop before any filter or update
        for g in range(need):
            group = trajs[g * rl.group_size : (g + 1) * rl.group_size]
            rewards = [t.reward for t in group]
            stats["sampled_groups"] += 1
            zero_sampled += len(set(rewards)) == 1
            if filtering and not keep(rewards):
                dropped += 1  # never trained on; a new task in the next round
                stats["dropped_zero_variance_groups"] += len(set(rewards)) == 1
                continue
            groups.append(group)
    warning = check_failures(stage, step + 1, sampled, rl.max_failed_share)
    if warning:
        say(warning)
    stats["failed_rollouts"] = float(sum(t.error is not None for t in sampled))
    if filtering:  # the zero-variance share of everything sampled, before the filter
        stats["dropped_groups"] = float(dropped)
        stats["zero_variance_fraction_sampled"] = zero_sampled / stats["sampled_groups"]
    if filtering and len(groups) < rl.tasks_per_step and (rl.group_filter_shortfall == "error" or not groups):
        what = "have reward variance" if keep is has_variance else "pass its group filter"
        zero = int(stats["dropped_zero_variance_groups"])
        also = "" if dropped == zero else f", {dropped} in all"
        raise ValueError(
            f"{stage}: {len(groups)} of rl.tasks_per_step={rl.tasks_per_step} groups {what} "
            f"after {rounds} rounds ({zero} zero-variance groups dropped{also}, none is trained "
            "on); raise rl.group_filter_refills"
            + ("" if not groups else ", or set rl.group_filter_shortfall=train to train on fewer groups")
        )
    return StepRollouts(groups, stats, cursor)
