"""Rollouts generated ahead with bounded staleness (``algorithms/rl_ahead.py``), with a fake collection and a fake
trainer whose speeds are set: the collection of step t never starts before t - 1 - k steps are trained, goes as far
ahead as that allows, keeps the task cursor's order, and hands its errors to the trainer."""

import time

import pytest

from nemo_rcgrpo.algorithms.rl_ahead import AheadCollector, staleness_metrics
from nemo_rcgrpo.algorithms.rl_collect import StepRollouts


def _collector(k, steps, delay=0.0, fail_at=None, first=1, cursor=0):
    seen = []

    def collect(step, cur):
        seen.append((step, cur))
        if delay:
            time.sleep(delay)
        if step == fail_at:
            raise RuntimeError(f"step {step} failed")
        return StepRollouts([], {}, cur + 2)

    return AheadCollector(collect, first, steps, cursor, k), seen


@pytest.mark.parametrize("k", [1, 2])
def test_a_fast_generator_runs_k_steps_ahead_and_no_further(k):
    ahead, seen = _collector(k, 6)
    try:
        for step in range(1, 7):
            out, _ = ahead.get(step)
            assert out.cursor == 2 * step  # the cursors follow each other in step order
            # the trainer is slow: it trains only once the thread went as far ahead as it may
            deadline = time.time() + 10
            while min(6, step + k) not in ahead.started_after and time.time() < deadline:
                time.sleep(0.005)
            time.sleep(0.02)
            assert max(ahead.started_after) == min(6, step + k)  # and not one step further
            ahead.trained(step)
    finally:
        ahead.close(timeout=5)
    assert [s for s, _ in seen] == list(range(1, 7)) and [c for _, c in seen] == [0, 2, 4, 6, 8, 10]
    for step, trained in ahead.started_after.items():
        assert trained >= step - 1 - k  # staleness at most k
        assert trained == max(0, step - 1 - k)  # as far ahead as allowed


def test_a_slow_generator_makes_the_trainer_wait():
    ahead, _ = _collector(1, 3, delay=0.15)
    waits = []
    try:
        for step in range(1, 4):
            out, waited = ahead.get(step)
            waits.append(waited)
            ahead.trained(step)
    finally:
        ahead.close(timeout=5)
    assert waits[0] >= 0.1 and all(w >= 0.0 for w in waits)
    assert all(trained >= step - 2 for step, trained in ahead.started_after.items())


def test_an_error_reaches_the_trainer_at_its_step_and_close_stops_the_thread():
    ahead, seen = _collector(1, 5, fail_at=2)
    assert ahead.get(1)[0].cursor == 2
    ahead.trained(1)
    with pytest.raises(RuntimeError, match="step 2 failed"):
        ahead.get(2)
    ahead.close(timeout=5)
    assert [s for s, _ in seen] == [1, 2]  # nothing after the failed step
    resumed, seen = _collector(1, 9, first=4, cursor=6)  # a resumed run: from the checkpoint's cursor
    assert resumed.get(4)[0].cursor == 8 and seen[0] == (4, 6)
    resumed.close(timeout=5)  # waiting for trained(4): close ends the thread
    assert not resumed._thread.is_alive()
    with pytest.raises(ValueError, match="at 1 or more"):
        AheadCollector(lambda s, c: None, 1, 2, 0, 0)


class _T:
    def __init__(self, version, turns):
        self.weight_version, self.turn_versions = version, turns


def test_staleness_counts_from_the_first_turn():
    groups = [[_T(2, [2, 3]), _T(3, [3])], [_T(1, [1, 1]), _T(None, [])]]
    m = staleness_metrics(groups, 4)  # step 4 trains on version 3
    assert m == {"staleness_mean": (1 + 0 + 2) / 3, "staleness_max": 2.0, "spanning_rollouts": 1.0}
