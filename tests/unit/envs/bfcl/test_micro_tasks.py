"""bfcl_micro (envs/bfcl/micro.py) and the task-source seam (envs/sources.py): generated tasks on the real BFCL
classes, scored by the real executor and reward; one setting picks the tasks for prepare-data, RL and eval."""

from __future__ import annotations

import random

import pytest

from nemo_rcgrpo.data.consistency import DataMismatchError, check_task_source
from nemo_rcgrpo.envs.bfcl import micro
from nemo_rcgrpo.envs.bfcl.env import BFCLEnv
from nemo_rcgrpo.envs.bfcl.failures import make_failure
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan, play
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_suite
from nemo_rcgrpo.registry import names, register, table
from nemo_rcgrpo.utils.config import ConfigError


@pytest.fixture(scope="module")
def suite():
    return make_suite("bfcl_micro", ["base"])


def test_the_family_is_fixed_and_split_by_id(suite):
    again = make_suite("bfcl_micro", ["base"])
    assert len(suite) == micro.NUM_TRAIN + micro.NUM_TEST
    assert [(t.id, t.turns, t.ground_truth) for t in suite] == [(t.id, t.turns, t.ground_truth) for t in again]
    split = suite.split(seed=7, test_fraction=0.5).to_json(suite)  # the family's own split, whatever is asked
    assert split["test"] == [f"micro_{n}" for n in range(micro.NUM_TRAIN, micro.NUM_TRAIN + micro.NUM_TEST)]
    assert {micro.kind_of(t) for t in suite} == {k.name for k in micro.KINDS}
    assert len(make_suite("bfcl_micro", ["miss_func"])) == 0  # every micro task is a base task


def test_held_out_tasks_are_new_wording_or_new_parameters(suite):
    def wording(task):
        kind = micro.KINDS[task.scenario % len(micro.KINDS)]
        text = task.turns[0][0]["content"]
        return next(i for i, p in enumerate(kind.phrasings) if text.startswith(p.split("{")[0]))

    train = {(micro.kind_of(t), t.turns[0][0]["content"]) for t in suite if t.scenario < micro.NUM_TRAIN}
    held_out = [t for t in suite if t.scenario >= micro.NUM_TRAIN]
    assert not [t.id for t in held_out if (micro.kind_of(t), t.turns[0][0]["content"]) in train]
    assert all(wording(t) < 2 for t in suite if t.scenario < micro.NUM_TRAIN)  # the third wording: held-out only
    share = sum(wording(t) == 2 for t in held_out) / len(held_out)
    assert 0.5 <= share < 1.0


def test_every_ground_truth_scores_one_and_every_failure_type_zero(suite):
    rng = random.Random(0)
    kinds_failed = set()
    for task in suite:
        gold = suite.gold(task)
        expert = play(task, gold_plan(task), gold=gold, mode="merged")
        assert expert.reward.value == 1.0, (task.id, expert.reward.details)
        for failure_type in ("wrong_tool", "wrong_param", "premature_termination"):
            failure = make_failure(task, gold_plan(task), failure_type, rng, {"mode": "merged", "gold": gold}, 20)
            assert failure is not None and failure.played.reward.value == 0.0, (task.id, failure_type)
            kinds_failed.add((micro.kind_of(task), failure.failure_type))
    assert {k for k, _ in kinds_failed} == {k.name for k in micro.KINDS}


def test_the_reward_is_the_real_state_and_action_check(suite):
    mkdir = next(t for t in suite if micro.kind_of(t) == "mkdir")
    name = mkdir.ground_truth[0][0].split("'")[1]
    env = BFCLEnv(mode="merged")
    env.reset(mkdir, gold=suite.gold(mkdir))
    env.step([{"name": "mkdir", "arguments": {"dir_name": name + "x"}}])
    reward = env.reward()
    assert reward.value == 0.0 and not reward.state_ok and not reward.actions_ok
    add = next(t for t in suite if micro.kind_of(t) == "add")
    a, b = (int(x.split("=")[1]) for x in add.ground_truth[0][0][4:-1].split(", "))
    env = BFCLEnv(mode="merged")
    env.reset(add, gold=suite.gold(add))
    result = env.step([{"name": "add", "arguments": {"a": a, "b": b}}])
    assert str(a + b) in result.observations[0].content
    assert env.reward().value == 1.0
    # a tool of the class that the task does not offer is refused, not run
    env = BFCLEnv(mode="merged")
    env.reset(add, gold=suite.gold(add))
    result = env.step([{"name": "divide", "arguments": {"a": a, "b": b}}])
    assert not result.observations[0].ok and env.reward().value == 0.0


def test_task_source_is_a_registered_choice(tmp_path):
    assert {"bfcl", "bfcl_micro"} <= set(names("task_source"))
    assert EnvConfig(task_source="bfcl_micro").task_source == "bfcl_micro"
    with pytest.raises(
        ConfigError, match=r"env.task_source='nope': no task_source of that name; registered: \['bfcl', 'bfcl_micro'"
    ):
        EnvConfig(task_source="nope")
    (tmp_path / "config.yaml").write_text("task_source: bfcl_micro\n")
    check_task_source(tmp_path, "bfcl_micro")
    with pytest.raises(DataMismatchError, match="env.task_source=bfcl but .* prepared with task_source=bfcl_micro"):
        check_task_source(tmp_path, "bfcl")
    (tmp_path / "config.yaml").write_text("mode: merged\n")  # data from before the setting: BFCL v4
    check_task_source(tmp_path, "bfcl")


def test_a_users_task_source_is_used_by_name(suite):
    picked = [t for t in suite][:3]

    class Three(type(suite)):
        def __init__(self, categories):
            self.docs, self._gold = suite.docs, {}
            self.tasks = {t.id: t for t in picked}

    try:
        register("task_source", "three_example")(lambda categories: Three(categories))
        mine = make_suite("three_example", ["base"])
        assert list(mine.tasks) == [t.id for t in picked] and mine.gold(picked[0]).actions
        assert EnvConfig(task_source="three_example").task_source == "three_example"
    finally:
        table("task_source").pop("three_example", None)


def test_prepare_data_from_the_micro_source(tmp_path):
    import json

    import yaml

    from nemo_rcgrpo.prepare_data import PrepareDataConfig, build

    out = tmp_path / "data"
    out.mkdir()
    stats = build(PrepareDataConfig(task_source="bfcl_micro", tokenizer=None, progress=False), out)
    assert stats["split"] == {
        "train": {"total": micro.NUM_TRAIN, "base": micro.NUM_TRAIN},
        "test": {"total": micro.NUM_TEST, "base": micro.NUM_TEST},
    }
    assert yaml.safe_load((out / "config.yaml").read_text())["task_source"] == "bfcl_micro"
    pointers = [json.loads(l) for l in (out / "rl_test.jsonl").read_text().splitlines()]
    assert pointers[0] == {
        "task_id": f"micro_{micro.NUM_TRAIN}",
        "category": "base",
        "env": "bfcl",
        "task_source": "bfcl_micro",
        "mode": "merged",
    }
    rctp = [json.loads(l) for l in (out / "rctp.jsonl").read_text().splitlines()]
    assert len(rctp) == 2 * (micro.NUM_TRAIN + micro.NUM_TEST) and sum(r["reward"] for r in rctp) * 2 == len(rctp)
    with pytest.raises(ConfigError, match="task_source='nope': no task_source of that name; registered"):
        PrepareDataConfig.from_dict({"task_source": "nope"})


def test_eval_refuses_data_of_another_task_source(tmp_path):
    from nemo_rcgrpo.evaluation.config import EvalConfig
    from nemo_rcgrpo.evaluation.run import evaluate

    (tmp_path / "config.yaml").write_text("task_source: bfcl_micro\n")
    cfg = EvalConfig.from_dict({"policy": "oracle", "data_dir": str(tmp_path), "out_dir": str(tmp_path / "e")})
    with pytest.raises(ConfigError, match="task_source=bfcl but .* prepared with task_source=bfcl_micro"):
        evaluate(cfg)
