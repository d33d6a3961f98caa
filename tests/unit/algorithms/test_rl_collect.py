"""A step's rollout groups (algorithms/rl_collect.py) over a fake engine: the task cursor flows in and out (a resumed
run draws what the uninterrupted one drew), the group filter's rounds replace refused groups with new tasks and
then train on fewer or stop, and a conditioned stage's rollouts carry the sampler's tokens."""

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from nemo_rcgrpo.algorithms.rl_collect import RolloutsFailed, collect_groups, shuffled_tasks
from nemo_rcgrpo.config_schema import RLConfig

TASKS = [f"t{i}" for i in range(7)]
SUITE = {t: SimpleNamespace(id=t, category="base") for t in TASKS}


class FakeEngine:
    """Rewards by task: ``varied`` tasks alternate 1, 0 within a group; the others pay ``flat`` to every rollout.
    Records each call's specs and seed."""

    def __init__(self, varied=(), flat=0.0, failing=()):
        self.varied, self.flat, self.failing, self.calls = set(varied), flat, set(failing), []

    def rollout_timed(self, specs, seed=None):
        self.calls.append(([(s.task.id, s.group, s.reward_token) for s in specs], seed))
        trajs = []
        for i, s in enumerate(specs):
            reward = float(i % 2 == 0) if s.task.id in self.varied else self.flat
            error = "boom" if s.task.id in self.failing else None
            trajs.append(SimpleNamespace(task_id=s.task.id, group=s.group, reward_token=s.reward_token,
                                         reward=reward, error=error))
        return trajs, {"generation": 1.0, "env": 0.5, "reward": 0.25}


def _rl(**kw):
    return replace(RLConfig(), group_size=2, tasks_per_step=2, **kw)


def _collect(engine, stage="grpo", cursor=0, step=0, seed=3, **kw):
    return collect_groups(_rl(**kw), stage, engine, SUITE, TASKS, cursor, step, random.Random(0), seed)


def test_the_cursor_flows_in_and_out_and_a_resumed_step_draws_the_same_tasks():
    engine = FakeEngine(varied=TASKS)
    first = _collect(engine, step=0)
    assert first.cursor == 2 and [g[0].task_id for g in first.groups] == shuffled_tasks(TASKS, 0, 2, 3)
    second = _collect(engine, cursor=first.cursor, step=1)
    assert second.cursor == 4 and [g[0].task_id for g in second.groups] == shuffled_tasks(TASKS, 2, 2, 3)
    resumed = FakeEngine(varied=TASKS)  # a new process from the checkpointed cursor
    again = _collect(resumed, cursor=first.cursor, step=1)
    assert resumed.calls == engine.calls[1:] and again.cursor == second.cursor
    # the timings are the engine's returned ones, summed over rounds
    assert first.stats["generation_seconds"] == 1.0 and first.stats["reward_seconds"] == 0.25
    # epochs wrap: 7 tasks, the 4th step's tasks cross into epoch 1 (a new shuffle)
    late = _collect(engine, cursor=6, step=3)
    assert [g[0].task_id for g in late.groups] == shuffled_tasks(TASKS, 6, 2, 3) and late.cursor == 8


def test_refused_groups_are_replaced_by_new_tasks_for_the_rounds_then_the_step_trains_on_fewer():
    order = shuffled_tasks(TASKS, 0, 7, 3)
    engine = FakeEngine(varied=order[2:3])  # only the third task drawn has reward variance
    out = _collect(engine, stage="dapo_filter", dapo_max_rounds=2)
    # round 1: tasks 1-2 (both flat: dropped); round 2: tasks 3-4 (task 3 kept); round 3: task 5 (dropped)
    assert [[c[0] for c in call[0][::2]] for call in engine.calls] == [order[0:2], order[2:4], order[4:5]]
    assert [g[0].task_id for g in out.groups] == [order[2]] and out.cursor == 5
    assert out.stats["dropped_groups"] == 4 and out.stats["dropped_zero_variance_groups"] == 4
    assert out.stats["sampled_groups"] == 5 and out.stats["zero_variance_fraction_sampled"] == 4 / 5
    assert [s.group for s in out.groups[0]] == [0, 0]  # numbered among the groups kept so far
    with pytest.raises(ValueError, match="1 of rl.tasks_per_step=2 groups have reward variance after 3 rounds"):
        _collect(FakeEngine(varied=order[2:3]), stage="dapo_filter", dapo_max_rounds=2, dapo_shortfall="error")
    # without a filter every group is trained on, in one round
    plain = _collect(FakeEngine())
    assert len(plain.groups) == 2 and plain.cursor == 2 and "dropped_groups" not in plain.stats


def test_a_conditioned_stage_draws_a_token_per_rollout_and_an_unconditioned_none():
    engine = FakeEngine(varied=TASKS)
    _collect(engine, stage="rcgrpo", reward_token_sampling="stratified")
    tokens = [t for _, _, t in engine.calls[0][0]]
    assert sorted(tokens[:2]) == [False, True] and sorted(tokens[2:]) == [False, True]  # both in every group
    engine = FakeEngine(varied=TASKS)
    _collect(engine, stage="grpo")
    assert {t for _, _, t in engine.calls[0][0]} == {None}


def test_a_step_whose_rollouts_all_failed_stops_with_them():
    with pytest.raises(RolloutsFailed) as e:
        _collect(FakeEngine(failing=TASKS))
    assert len(e.value.trajectories) == 4
