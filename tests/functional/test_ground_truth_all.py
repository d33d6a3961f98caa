"""All 800 ground truths: reward 1, official verdict valid, observations identical to BFCL's executor."""

import uuid

from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

from nemo_rcgrpo.envs.bfcl import BFCLEnv

from ..conftest import run_turns


def test_every_ground_truth_scores_one_and_is_officially_valid(suite):
    failures = []
    for task in suite:
        env = run_turns(BFCLEnv(mode="per_turn"), task, task.ground_truth)
        reward, verdict = env.reward(), env.official_verdict()
        if reward.value != 1.0 or not verdict.valid or env.num_errors:
            failures.append((task.id, reward, verdict))
    assert failures == []
    assert len(suite) == 800


def test_every_ground_truth_scores_one_in_merged_episodes(suite):
    failures = []
    for task in suite:
        env = BFCLEnv(mode="merged")
        env.reset(task, gold=suite.gold(task))
        env.step([c for turn in task.ground_truth for c in turn] + ["done()"])
        if env.reward().value != 1.0:
            failures.append(task.id)
    assert failures == []


def test_observations_identical_to_bfcl_executor(suite):
    """BFCL's executor is eval()-based but safe on its own ground truth; compare every call."""
    compared, mismatches = 0, []
    for task in suite:
        env = run_turns(BFCLEnv(mode="per_turn"), task, task.ground_truth)
        ours = env.observations_by_turn()
        model_name = f"parity_{uuid.uuid4().hex[:8]}"  # BFCL caches instances per model name
        for turn, calls in enumerate(task.ground_truth):
            theirs, _ = execute_multi_turn_func_call(
                list(calls),
                dict(task.initial_config),
                list(task.involved_classes),
                model_name,
                task.id,
                long_context=task.long_context,
            )
            compared += len(theirs)
            if list(theirs) != ours[turn]:
                mismatches.append((task.id, turn))
    assert mismatches == []
    assert compared == sum(len(c) for t in suite for c in t.ground_truth) > 4000
