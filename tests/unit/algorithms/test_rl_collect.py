"""A step's rollout groups (algorithms/rl_collect.py) over a fake engine: the task cursor flows in and out (a resumed
run draws what the uninterrupted one drew), the group filter's rounds replace refused groups with new tasks and
then train on fewer or stop, and a conditioned stage's rollouts carry the sampler's tokens; failed rollouts warn
past their share and stop the step when all failed; the held-out tasks are a seeded sample stratified by category."""

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from nemo_rcgrpo.algorithms.rl_collect import RolloutsFailed, check_failures, collect_groups, shuffled_tasks
from nemo_rcgrpo.config_schema import RLConfig
from nemo_rcgrpo.stages import Stage, stage_of

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
            flat = getattr(self, "flat_by_task", {}).get(s.task.id, self.flat)
            reward = float(i % 2 == 0) if s.task.id in self.varied else flat
            error = "boom" if s.task.id in self.failing else None
            trajs.append(
                SimpleNamespace(
                    task_id=s.task.id, group=s.group, reward_token=s.reward_token, reward=reward, error=error
                )
            )
        return trajs, {"generation": 1.0, "env": 0.5, "reward": 0.25}


def _rl(**kw):
    return replace(RLConfig(), **{"group_size": 2, "tasks_per_step": 2, **kw})


def _collect(engine, stage="grpo", cursor=0, step=0, seed=3, **kw):
    return collect_groups(
        _rl(**kw), stage_of(stage), engine, SUITE, TASKS, cursor, step, random.Random(0), seed, stage=stage
    )


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
    assert (first.stats["generation_seconds"], first.stats["env_seconds"], first.stats["reward_seconds"]) == (
        1.0,
        0.5,
        0.25,
    )
    # one engine call for a step without a filter; groups numbered 0, 1, ... in the order drawn
    assert len(engine.calls) == 2 and [g for _, g, _ in engine.calls[0][0]] == [0, 0, 1, 1]
    assert [[t.group for t in g] for g in first.groups] == [[0, 0], [1, 1]]
    # epochs wrap: 7 tasks, the 4th step's tasks cross into epoch 1 (a new shuffle)
    late = _collect(engine, cursor=6, step=3)
    assert [g[0].task_id for g in late.groups] == shuffled_tasks(TASKS, 6, 2, 3) and late.cursor == 8


def test_refused_groups_are_replaced_by_new_tasks_for_the_rounds_then_the_step_trains_on_fewer():
    order = shuffled_tasks(TASKS, 0, 7, 3)
    engine = FakeEngine(varied=order[2:3])  # only the third task drawn has reward variance
    out = _collect(engine, stage="dapo_filter", group_filter_refills=2)
    # round 1: tasks 1-2 (both flat: dropped); round 2: tasks 3-4 (task 3 kept); round 3: task 5 (dropped)
    assert [[c[0] for c in call[0][::2]] for call in engine.calls] == [order[0:2], order[2:4], order[4:5]]
    assert [g[0].task_id for g in out.groups] == [order[2]] and out.cursor == 5
    assert out.stats["dropped_groups"] == 4 and out.stats["dropped_zero_variance_groups"] == 4
    assert out.stats["sampled_groups"] == 5 and out.stats["zero_variance_fraction_sampled"] == 4 / 5
    assert [s.group for s in out.groups[0]] == [0, 0]  # numbered among the groups kept so far
    with pytest.raises(ValueError, match="1 of rl.tasks_per_step=2 groups have reward variance after 3 rounds"):
        _collect(
            FakeEngine(varied=order[2:3]), stage="dapo_filter", group_filter_refills=2, group_filter_shortfall="error"
        )
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
    # step 4 (counted from 1 in every message and dump name; the loop passes the steps done, 3)
    with pytest.raises(RolloutsFailed, match=r"^grpo step 4: all 4 rollouts failed.*rollouts/step_4\.jsonl$") as e:
        _collect(FakeEngine(failing=TASKS), step=3)
    assert len(e.value.trajectories) == 4


def test_failed_rollouts_are_counted_and_warned_about_with_the_step_number(capsys):
    order = shuffled_tasks(TASKS, 0, 3, 3)
    out = _collect(FakeEngine(varied=TASKS, failing=order[:1]), step=5, max_failed_share=0.25, tasks_per_step=3)
    assert out.stats["failed_rollouts"] == 2.0  # the first task's 2 rollouts, of 6
    assert "WARNING: grpo step 6: 2 of 6 rollouts failed" in capsys.readouterr().err


def test_a_filter_that_finds_every_group_stops_after_one_round():
    # every group has variance: one round, no error even with group_filter_shortfall=error, no empty round after it
    engine = FakeEngine(varied=TASKS)
    out = _collect(engine, stage="dapo_filter", group_filter_refills=3, group_filter_shortfall="error")
    assert len(out.groups) == 2 and len(engine.calls) == 1 and out.stats["dropped_groups"] == 0


def test_the_shortfall_message_says_what_was_dropped_and_what_to_change():
    order = shuffled_tasks(TASKS, 0, 7, 3)
    # not_all_failed keeps a group with a success: every group here is flat, the first task's pays 1 (kept), the
    # others 0 (dropped, each a zero-variance group)
    engine = FakeEngine(flat=0.0, varied=())
    engine.flat_by_task = {order[0]: 1.0}
    with pytest.raises(ValueError) as e:
        _collect(
            engine, stage="grpo", group_filter="not_all_failed", group_filter_refills=1, group_filter_shortfall="error"
        )
    assert "1 of rl.tasks_per_step=2 groups pass its group filter after 2 rounds" in str(e.value)
    assert "(2 zero-variance groups dropped, none is trained on)" in str(e.value)  # every drop was flat: no "in all"
    assert str(e.value).endswith(
        "raise rl.group_filter_refills, or set rl.group_filter_shortfall=train to train on fewer groups"
    )
    # none found: training on fewer is no way out, so the message does not offer it
    with pytest.raises(ValueError) as e:
        _collect(FakeEngine(), stage="dapo_filter", group_filter_refills=1, group_filter_shortfall="train")
    assert str(e.value).endswith("raise rl.group_filter_refills") and "0 of rl.tasks_per_step=2 groups" in str(e.value)


def test_failed_rollouts_of_a_step_warn_past_the_share_and_stop_when_all_failed():
    trajs = [SimpleNamespace(task_id=f"t{g}", error=None) for g in range(4)]
    assert check_failures("rcgrpo", 3, trajs, 0.25) is None  # none failed
    trajs[1].error = "PluginContractError: env x: reward().value is None"
    assert check_failures("rcgrpo", 3, trajs, 0.25) is None  # 1 of 4 = 0.25: not more than the share
    trajs[2].error = "RuntimeError: boom"
    assert check_failures("rcgrpo", 3, trajs, 0.25) == (  # 2 of 4 = 0.5 > 0.25
        "WARNING: rcgrpo step 3: 2 of 4 rollouts failed (more than rl.max_failed_share=0.25) and pay reward 0; "
        "first: task t1: PluginContractError: env x: reward().value is None"
    )
    assert check_failures("rcgrpo", 3, trajs, 0.5) is None
    for t in trajs:
        t.error = t.error or "KeyError: 'function'"
    with pytest.raises(
        RolloutsFailed,
        match=r"^rcgrpo step 3: all 4 rollouts failed, nothing to train on \(first: "
        r"task t0: KeyError: 'function'\); every rollout's error is in "
        r"rollouts/step_3.jsonl$",
    ) as e:
        check_failures("rcgrpo", 3, trajs, 1.0)
    assert e.value.trajectories == trajs


def test_rollout_seeds_differ_across_steps_and_rounds_and_repeat():
    """The engine's sampling seed per round: a new one for every step and every filter round, the same one when the
    same step is drawn again (a resumed run samples what the uninterrupted one sampled)."""
    order = shuffled_tasks(TASKS, 0, 7, 3)
    seeds = []
    for step in (0, 1):
        engine = FakeEngine(varied=order[2:3])  # two filter rounds at least
        _collect(engine, stage="dapo_filter", group_filter_refills=2, step=step)
        seeds.append([seed for _, seed in engine.calls])
    assert len(seeds[0]) == 3 and len({*seeds[0], *seeds[1]}) == 6  # 3 rounds x 2 steps, all different
    again = FakeEngine(varied=order[2:3])
    _collect(again, stage="dapo_filter", group_filter_refills=2, step=1)
    assert [seed for _, seed in again.calls] == seeds[1]
    # the task order: another for the next epoch and for another run seed, the same for the same ones
    epoch0 = shuffled_tasks(TASKS, 0, 7, 3)
    assert sorted(epoch0) == sorted(TASKS) and epoch0 == shuffled_tasks(TASKS, 0, 7, 3)
    assert shuffled_tasks(TASKS, 7, 7, 3) != epoch0 and shuffled_tasks(TASKS, 0, 7, 4) != epoch0


def test_collection_takes_the_stages_spec_registered_or_not():
    """The spec, not a name looked up inside: an unregistered stage's own keep_group decides which groups train,
    and its name is the one the messages carry."""
    drawn = shuffled_tasks(TASKS, 0, 2, 3)
    engine = FakeEngine(varied=drawn[:1], flat=1.0)  # the first drawn task's group has a failure; the other pays 1
    picky = Stage("rl", keep_group=lambda rewards: min(rewards) == 1.0, description="only all-successful groups")
    out = collect_groups(
        _rl(group_filter_refills=0), picky, engine, SUITE, TASKS, 0, 0, random.Random(0), 3, stage="picky"
    )
    assert [g[0].task_id for g in out.groups] == drawn[1:] and out.stats["dropped_groups"] == 1.0
    with pytest.raises(RolloutsFailed, match="^picky step 1: all 4 rollouts failed"):
        collect_groups(_rl(), picky, FakeEngine(failing=TASKS), SUITE, TASKS, 0, 0, random.Random(0), 3, stage="picky")
