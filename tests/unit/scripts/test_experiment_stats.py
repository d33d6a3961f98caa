"""scripts/experiment.py: the numbers of docs/experiments.md are recomputed from the run's outputs, here on
hand-made dumps with hand-computed answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def exp():
    from scripts import experiment

    return experiment


def _dump(path: Path, groups: list[list[tuple[float, str | None]]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g, group in enumerate(groups):
            for reward, token in group:
                f.write(
                    json.dumps({"task_id": f"micro_{g}", "group": g, "reward": reward, "reward_token": token}) + "\n"
                )
    return path


def test_variance_statistics_from_a_rollout_dump(exp, tmp_path):
    groups = [
        [(1.0, "high"), (1.0, "high"), (0.0, "low"), (0.0, "low"), (0.0, "high")],  # var 0.24
        [(0.0, "low")] * 5,  # zero variance, one token only
        [(1.0, "high")] * 4 + [(0.0, "low")],
    ]  # var 0.16
    stats = exp.variance_stats(exp.groups_of(_dump(tmp_path / "step_1.jsonl", groups)))
    assert stats["groups"] == 3
    assert stats["zero_variance"] == pytest.approx(1 / 3)
    assert stats["variance"] == pytest.approx((0.24 + 0.0 + 0.16) / 3)
    assert stats["one_token_groups"] == pytest.approx(1 / 3)
    assert stats["reward_high"] == pytest.approx(6 / 7) and stats["reward_low"] == pytest.approx(0.0)
    lo, hi = stats["variance_ci"]
    assert lo <= stats["variance"] <= hi and 0.0 <= lo and hi <= 0.24 + 1e-12


def test_the_prop_4_3_bound(exp):
    assert exp.prop43_bound(0.8, 0.2) == pytest.approx(4 / 5 * 0.25 * 0.36)
    assert exp.prop43_bound(0.5, 0.5) == 0.0
    assert exp.prop43_bound(1.0, 0.0, p=0.5, group_size=2) == pytest.approx(0.125)


def test_success_rates_and_intervals_over_tasks(exp, tmp_path):
    path = tmp_path / "trajectories.jsonl"
    rows = [("a", 1), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 0)]
    path.write_text("".join(json.dumps({"task_id": t, "success": bool(s)}) + "\n" for t, s in rows))
    r = exp.rate(exp.success_by_task(path))
    assert (r["mean"], r["tasks"], r["episodes"]) == (pytest.approx(0.5), 3, 6)
    assert 0.0 <= r["ci"][0] <= 0.5 <= r["ci"][1] <= 1.0
    assert exp.bootstrap_ci([0.3]) == (0.3, 0.3)


def _episodes(path: Path, successes: dict[str, list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"task_id": t, "success": bool(s), "reward": float(s)}) + "\n"
            for t, ss in successes.items()
            for s in ss
        )
    )


def test_report_and_render_on_outputs_of_the_real_formats(exp, tmp_path):
    """The whole report from folders laid out as the commands write them: eval trajectories (with ``success``),
    rollout dumps, in-training eval dumps (``reward``, no ``success``) and metrics.jsonl, one run never having
    reward variance (no entropy_reward_corr)."""
    import argparse

    out = tmp_path
    _episodes(out / "e1_high" / "trajectories.jsonl", {"a": [1, 1], "b": [1, 0]})
    _episodes(out / "e1_low" / "trajectories.jsonl", {"a": [0, 0], "b": [1, 0]})
    _episodes(out / "e1_sft" / "trajectories.jsonl", {"a": [1, 0], "b": [0, 0]})
    for name, _, _ in exp.INIT_EVALS:
        _episodes(out / name / "trajectories.jsonl", {"a": [1], "b": [0]})
    for name, *_ in exp.E2_CONDITIONS:
        _dump(out / "e2" / name / "rollouts" / "step_1.jsonl", [[(1.0, "high"), (0.0, "low")] * 2 + [(1.0, "high")]])
    steps = 2
    for model, algo in exp.CONDITIONS:
        run = out / "e3" / f"{model}_{algo}_s1"
        (run / "eval").mkdir(parents=True)
        (run / "eval" / f"step_{steps}.jsonl").write_text(
            "".join(json.dumps({"step": steps, "task_id": t, "reward": r}) + "\n" for t, r in (("a", 1.0), ("b", 0.0)))
        )
        rows = [{"step": s, "zero_variance_fraction": 0.5, "reward_mean": 0.4, "entropy": 0.3} for s in (1, 2)]
        if (model, algo) != ("sft", "grpo"):
            for row in rows:
                row["entropy_reward_corr"] = -0.2
        rows.append({"step": 2, "eval_accuracy": 50.0})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = exp.report(out, seeds=1, steps=steps, eval_every=2, plot=tmp_path / "plot.png")
    assert res["e1"]["high"]["mean"] == pytest.approx(0.75) and res["e1"]["low"]["mean"] == pytest.approx(0.25)
    assert res["bound"] == pytest.approx(exp.prop43_bound(0.75, 0.25))
    assert set(res["e2"]) == {name for name, *_ in exp.E2_CONDITIONS}
    # each group: high, low, high, low, high with rewards 1, 0, 1, 0, 1 -> mu_h 1, mu_l 0; variance 0.24 > 0.2
    s = res["e2"]["rctp_rcgrpo_iid"]
    assert (s["reward_high"], s["reward_low"], s["bound"]) == (1.0, 0.0, pytest.approx(exp.prop43_bound(1.0, 0.0)))
    assert s["variance"] == pytest.approx(0.24) and s["bound"] == pytest.approx(0.2)
    text = exp.render(res, argparse.Namespace(e1_samples=2, steps=steps, seeds=1), {"data": 1.0})
    table = [l for l in text.splitlines() if l.startswith("| SFT") or l.startswith("| RCTP")]
    e3 = [l for l in table if l.count("|") == 9]
    assert len(e3) == 4 and all(" 0.500 " in l for l in e3)  # held-out success 1 of 2 at the last step
    assert "- (no step with reward variance)" in next(l for l in e3 if l.startswith("| SFT + GRPO"))
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "mu_h - mu_l = +0.500 (goal: at least 0.3: met)" in text


def test_jobs_start_only_after_what_they_read(exp, tmp_path, monkeypatch):
    """The runner starts a job once its dependencies have finished, two at a time, and stops starting new
    ones after a failure; the experiment's own jobs depend on the stage-1 model each reads."""
    import threading
    import time

    events, lock = [], threading.Lock()

    def fake(self, name, args, done):
        with lock:
            events.append(("start", name))
        time.sleep({"a": 0.2, "b": 0.05}.get(name, 0.01))
        if name == "bad":
            raise SystemExit("bad failed")
        with lock:
            events.append(("end", name))

    monkeypatch.setattr(exp.Runner, "rcgrpo", fake)
    r = exp.Runner(tmp_path, jobs=2)
    Job = exp.Job
    r.run(
        [
            Job("a", [], tmp_path),
            Job("b", [], tmp_path),
            Job("c", [], tmp_path, ("b",)),
            Job("d", [], tmp_path, ("a", "c")),
        ]
    )
    order = [e for e in events]
    assert order.index(("start", "c")) > order.index(("end", "b"))
    assert order.index(("start", "d")) > max(order.index(("end", "a")), order.index(("end", "c")))
    assert order.index(("start", "c")) < order.index(("end", "a"))  # c did not wait for a
    events.clear()
    with pytest.raises(SystemExit, match="bad failed"):
        r.run([Job("bad", [], tmp_path), Job("a", [], tmp_path), Job("after", [], tmp_path, ("bad",))])
    assert ("start", "after") not in events and ("end", "a") in events  # the running one finished
    with pytest.raises(ValueError, match="unknown"):
        r.run([Job("x", [], tmp_path, ("nope",))])

    import argparse

    jobs = exp.experiment_jobs(
        argparse.Namespace(out=tmp_path, seeds=2, steps=10, eval_every=5, e1_samples=2, e2_groups=50)
    )
    by = {j.name: j for j in jobs}
    assert len(by) == len(jobs) == 1 + 2 + 2 * 4 + 3 + 6
    for j in jobs:
        if j.name == "data":
            continue
        reads = [a for a in j.args if a.startswith(("model.path=", "checkpoint.path="))]
        want = ("data",) if j.name.startswith("stage1_") else (f"stage1_{reads[0].split('/')[-2]}",)
        assert j.deps == want, j.name


def test_commands_get_the_allocator_settings_unless_the_user_set_them(exp, tmp_path, monkeypatch):
    """Each command runs with ALLOCATOR_ENV (glibc keeps freed memory) and the runner's thread share; a variable
    the user set wins over ALLOCATOR_ENV; a failed command raises with its log's tail."""
    seen = []

    def fake_call(cmd, stdout, stderr, cwd, env):
        seen.append(env)
        stdout.write("last line\n")
        return 0 if len(seen) == 1 else 3

    monkeypatch.setattr(exp.subprocess, "call", fake_call)
    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    r = exp.Runner(tmp_path, jobs=2)
    r.rcgrpo("one", ["train"], tmp_path / "never")
    env = seen[0]
    assert env["MALLOC_MMAP_MAX_"] == exp.ALLOCATOR_ENV["MALLOC_MMAP_MAX_"] == "0"
    assert env["MALLOC_TRIM_THRESHOLD_"] == "123"  # the user's
    assert env["OMP_NUM_THREADS"] == str(max(1, exp.cores() // 2))
    assert "one" in json.loads((tmp_path / "seconds.json").read_text())
    with pytest.raises(SystemExit, match="(?s)two failed .exit 3.*last line"):
        r.rcgrpo("two", ["train"], tmp_path / "never")


def test_the_wall_clock_is_labelled_with_how_the_commands_ran(exp):
    """render() labels the wall clock with run.json's jobs and threads (how the commands ran), not with the
    --jobs of a later --report-only invocation."""
    import argparse

    res = {
        "e1": {k: {"mean": 0.1, "ci": (0.0, 0.2), "tasks": 2} for k in ("high", "low", "sft")},
        "bound": 0.0,
        "e2": {},
        "e3_rows": [],
    }
    args = argparse.Namespace(e1_samples=2, steps=2, seeds=1, jobs=5)
    text = exp.render(res, args, {"data": 2.0, "wall": 10.0}, {"jobs": 2, "threads": 1})
    assert "| wall clock (2 commands at once, 1 torch thread each) | 10 |" in text
    assert "| wall clock (5 commands at once) | 10 |" in exp.render(res, args, {"data": 2.0, "wall": 10.0})
