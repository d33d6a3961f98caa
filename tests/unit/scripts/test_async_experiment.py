"""scripts/async_experiment.py: the seed band and the verdict of docs/experiments.md's comparison of rollouts
generated ahead against the synchronous loop, recomputed from hand-made run outputs with hand-computed answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ae():
    from scripts import async_experiment

    return async_experiment


def _run(ae, out: Path, k: int, seed: int, rewards: list[float], evals: dict[int, list[float]], staleness=0.0):
    rd = ae.run_dir(out, k, seed)
    (rd / "eval").mkdir(parents=True)
    (rd / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "reward_mean": r,
                    "step_seconds": 2.0,
                    **({"staleness_mean": staleness, "spanning_rollouts": 1.0} if k else {}),
                }
            )
            + "\n"
            for s, r in enumerate(rewards, 1)
        )
    )
    for step, rs in evals.items():
        (rd / "eval" / f"step_{step}.jsonl").write_text("".join(json.dumps({"reward": r}) + "\n" for r in rs))


def test_the_band_and_the_verdict(ae, tmp_path):
    # synchronous seeds: training reward 0.2, 0.3, 0.4 (means over 2 steps); held-out success at step 2: 0.5, 0.25, 0.75
    for seed, (rw, ev) in enumerate(
        [((0.1, 0.3), [1, 0]), ((0.2, 0.4), [1, 0, 0, 0]), ((0.4, 0.4), [1, 1, 1, 0.5])], 1
    ):
        _run(ae, tmp_path, 0, seed, list(rw), {2: list(ev)})
    # ahead: rewards 0.5, 0.5, 0.2 -> mean 0.4 (on the band's edge: within); success 0, 0, 0.5 -> mean 1/6 (outside)
    for seed, (rw, ev) in enumerate([((0.5, 0.5), [0, 0]), ((0.5, 0.5), [0]), ((0.2, 0.2), [1, 0])], 1):
        _run(ae, tmp_path, 1, seed, list(rw), {2: list(ev)}, staleness=0.75)
    res = ae.report(tmp_path, seeds=3, steps=2)
    assert [r["reward"] for r in res["runs"][0]] == pytest.approx([0.2, 0.3, 0.4])
    assert [r["evals"][2] for r in res["runs"][0]] == pytest.approx([0.5, 0.25, 0.75])  # reward 0.5 is no success
    assert [r["staleness"] for r in res["runs"][1]] == [0.75] * 3 and res["runs"][1][0]["spanning"] == 2.0
    reward, success = res["checks"]["training reward"], res["checks"]["held-out success, step 2"]
    assert reward["band"] == pytest.approx((0.2, 0.4)) and reward["ahead"] == pytest.approx(0.4) and reward["within"]
    assert success["band"] == pytest.approx((0.25, 0.75)) and success["ahead"] == pytest.approx(1 / 6)
    assert not success["within"]
    text = "\n".join(ae.render(res, 2))
    assert "within the band" in text and "OUTSIDE the band" in text and "| rl.max_staleness=1 | 3 | 0.200 |" in text


def test_unfinished_runs_give_no_verdict(ae, tmp_path):
    _run(ae, tmp_path, 0, 1, [0.1, 0.2], {2: [1]})
    _run(ae, tmp_path, 1, 1, [0.1], {})  # one step of two: not finished
    res = ae.report(tmp_path, seeds=1, steps=2)
    assert res["runs"][1] == [] and "checks" not in res
    assert "Not every run has finished" in "\n".join(ae.render(res, 2))


def test_the_runs_share_stage_1_with_the_experiment(ae, tmp_path):
    import argparse

    jobs = ae.jobs(argparse.Namespace(out=tmp_path, seeds=2, steps=30, eval_every=10))
    assert [j.name for j in jobs] == ["data", "stage1_rctp", "async_k0_s1", "async_k1_s1", "async_k0_s2", "async_k1_s2"]
    run = next(j for j in jobs if j.name == "async_k1_s2")
    assert "rl.max_staleness=1" in run.args and "seed=2" in run.args and "generation=vllm" in run.args
    assert "rl.loss.correction=token_tis" in run.args  # as stage2.md advises at k >= 1; the synchronous runs: none
    assert not any(a.startswith("rl.loss.correction") for a in next(j for j in jobs if j.name == "async_k0_s2").args)
    assert f"model.path={tmp_path / 'rctp' / 'hf'}" in run.args and run.deps == ("stage1_rctp",)
