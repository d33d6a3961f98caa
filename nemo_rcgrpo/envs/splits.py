"""Train/test split by scenario (the RC-GRPO paper, "Data": 720 train / 80 test).

Entries with the same number across the four categories are one scenario and
always land on the same side, so no test scenario leaks into training through
another category. Deterministic for a seed.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Split:
    """Which scenarios are held out. ``suite`` below: any task suite (`envs/interfaces.py: Suite`); a task's
    scenario is its ``.scenario`` where it has one (BFCL's: the entries of one number across the categories), else
    its ``.id`` (`scenario_of`)."""

    seed: int
    test_fraction: float
    train_scenarios: tuple[int, ...]
    test_scenarios: tuple[int, ...]

    def side(self, scenario: int) -> str:
        return "test" if scenario in self.test_scenarios else "train"

    def side_of(self, task: Any) -> str:
        """``"train"`` or ``"test"``: the side of the task's scenario."""
        return self.side(scenario_of(task))

    def to_json(self, suite: Any) -> dict[str, Any]:
        ids = {"train": [], "test": []}
        counts: dict[str, Counter] = {"train": Counter(), "test": Counter()}
        for task in suite.tasks.values():
            side = self.side_of(task)
            ids[side].append(task.id)
            counts[side][task.category] += 1
        return {
            "seed": self.seed,
            "test_fraction": self.test_fraction,
            "counts": {side: {"total": len(ids[side]), **dict(sorted(c.items()))} for side, c in counts.items()},
            "scenarios": {"train": list(self.train_scenarios), "test": list(self.test_scenarios)},
            "train": ids["train"],
            "test": ids["test"],
        }


def scenario_of(task: Any) -> Any:
    """What is held out together: the task's ``.scenario`` where it has one, else the task itself (its id)."""
    scenario = getattr(task, "scenario", None)
    return task.id if scenario is None else scenario


def split_by_scenario(suite: Any, seed: int, test_fraction: float = 0.1) -> Split:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction}: must be between 0 and 1")
    scenarios = sorted({scenario_of(t) for t in suite.tasks.values()})
    n_test = max(1, round(len(scenarios) * test_fraction))
    if n_test >= len(scenarios):
        raise ValueError(f"test_fraction={test_fraction} leaves no training scenario")
    shuffled = list(scenarios)
    random.Random(seed).shuffle(shuffled)
    test = tuple(sorted(shuffled[:n_test]))
    train = tuple(s for s in scenarios if s not in set(test))
    return Split(seed, test_fraction, train, test)
