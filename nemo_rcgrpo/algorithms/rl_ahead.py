"""Rollouts generated ahead with bounded staleness (``rl.max_staleness: k``; the loop in `recipes/rl.py`).

A thread collects the steps' rollouts in order while the trainer trains, through the same collection as the
synchronous loop (``collect(step, cursor)``: tasks from the task cursor, the step's seeded rng, the group
filter's rounds), so the task sequence, reward tokens and filters are the synchronous loop's. Step t's
collection (counted from 1) starts only once t - 1 - k steps are trained: its rollouts start on weights at most
k versions behind the weights that train on them (t - 1 updates), and the version of each rollout's first turn
is its staleness's origin (a rollout may span an update: `generation/gated.py`). At k = 0 the loop does not use
this.

The trainer takes step t's rollouts with ``get(t)`` (waiting for them where they are not there yet) and says
``trained(t)`` after step t's update and weight sync. An error of a collection (a failed step, a dead server) is
raised by ``get`` of that step. What was collected ahead of the last trained step when the run stops is
dropped: the checkpoint's task cursor is that of the trained steps, so a resumed run draws the same tasks
again.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable, Sequence

from nemo_rcgrpo.algorithms.rl_collect import StepRollouts


class AheadCollector:
    def __init__(
        self,
        collect: Callable[[int, int], StepRollouts],
        first_step: int,
        last_step: int,
        cursor: int,
        max_staleness: int,
    ):
        """``collect(step, cursor)``: step ``step``'s rollouts from task ``cursor`` on; steps ``first_step`` ..
        ``last_step`` are collected (``first_step - 1`` are trained)."""
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: rollouts are generated ahead only at 1 or more")
        self._collect, self.k = collect, max_staleness
        self.first, self.last = first_step, last_step
        self._cond = threading.Condition()
        self._ready: dict[int, StepRollouts | BaseException] = {}
        self._trained = first_step - 1
        self._stopped = False
        self.started_after: dict[int, int] = {}  # step -> the steps trained when its collection started
        self._thread = threading.Thread(target=self._produce, args=(cursor,), name="rollouts-ahead", daemon=True)
        self._thread.start()

    def _produce(self, cursor: int) -> None:
        for step in range(self.first, self.last + 1):
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._trained >= step - 1 - self.k)
                if self._stopped:
                    return
                self.started_after[step] = self._trained
            try:
                out: StepRollouts | BaseException = self._collect(step, cursor)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer, raised by get(step)
                out = e
            with self._cond:
                self._ready[step] = out
                self._cond.notify_all()
            if isinstance(out, BaseException):
                return
            cursor = out.cursor

    def get(self, step: int) -> tuple[StepRollouts, float]:
        """(step ``step``'s rollouts, the seconds waited for them); its collection's error, raised."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready)
            out = self._ready.pop(step)
        if isinstance(out, BaseException):
            raise out
        return out, time.perf_counter() - t0

    def trained(self, step: int) -> None:
        """Step ``step`` is trained and the generator holds its weights: collections up to step + 1 + k may start."""
        with self._cond:
            self._trained = step
            self._cond.notify_all()

    def close(self, timeout: float = 0.0) -> None:
        """Start no further collection; one in flight ends with its generator (closed after this) or the process."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if timeout:
            self._thread.join(timeout)


def staleness_metrics(groups: Sequence[Sequence[Any]], step: int) -> dict[str, float]:
    """A step's staleness (step ``step``, from 1, trains on weights of version step - 1): of each rollout, step - 1
    minus the version of its first turn; ``spanning_rollouts``: rollouts whose turns ran on more than one version."""
    trajs = [t for g in groups for t in g if t.weight_version is not None]
    ages = [step - 1 - t.weight_version for t in trajs]
    return {
        "staleness_mean": statistics.fmean(ages) if ages else 0.0,
        "staleness_max": float(max(ages, default=0)),
        "spanning_rollouts": float(sum(len(set(t.turn_versions)) > 1 for t in trajs)),
    }
