"""scripts/experiment.py: the numbers of docs/experiments.md are recomputed from the run's outputs, here on
hand-made dumps with hand-computed answers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exp():
    spec = importlib.util.spec_from_file_location("experiment_script", ROOT / "scripts" / "experiment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dump(path: Path, groups: list[list[tuple[float, str | None]]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g, group in enumerate(groups):
            for reward, token in group:
                f.write(json.dumps({"task_id": f"micro_{g}", "group": g, "reward": reward, "reward_token": token}) + "\n")
    return path


def test_variance_statistics_from_a_rollout_dump(exp, tmp_path):
    groups = [[(1.0, "high"), (1.0, "high"), (0.0, "low"), (0.0, "low"), (0.0, "high")],  # var 0.24
              [(0.0, "low")] * 5,  # zero variance, one token only
              [(1.0, "high")] * 4 + [(0.0, "low")]]  # var 0.16
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
