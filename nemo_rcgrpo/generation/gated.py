"""A generator shared by the rollout thread and the trainer (rollouts generated ahead, ``rl.max_staleness`` >= 1).

Each ``generate`` call and each weight update hold one lock, so a weight update at a step boundary waits for the
call in flight (its requests finish on the weights they started on: none is cut or re-issued), holds the next
call back only while the weights move, and the rollout thread then continues on the new version. Every
completion records the version that produced it (``Completion.version``): with the lock, one call runs on one
version. The seconds calls waited for an update and updates waited for a call are counted
(``take_waits``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Iterable

import torch

from nemo_rcgrpo.generation.base import Completion, Generator, SamplingParams, places_groups
from nemo_rcgrpo.generation.vllm_client import GeneratorError


class GatedGenerator:
    """``generator`` behind one lock (`Generator` itself)."""

    def __init__(self, generator: Generator):
        self.inner = generator
        self.shares_policy_weights = generator.shares_policy_weights
        self.places_groups = places_groups(generator)
        self._lock = threading.Lock()
        self._closed = False
        self._waits = {"generation_blocked_seconds": 0.0, "update_waited_seconds": 0.0}

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, groups: list | None = None
    ) -> list[Completion]:
        """The inner generator's completions (``groups`` handed on where it places groups), each with its version."""
        asked = time.perf_counter()
        with self._lock:
            if self._closed:  # the run has ended: a collection still in flight stops here (a closed server
                raise GeneratorError("the generator is closed: the run has ended")  # would start again)
            self._waits["generation_blocked_seconds"] += time.perf_counter() - asked
            version = self.inner.version
            out = (
                self.inner.generate(prompts, params, groups)
                if self.places_groups
                else self.inner.generate(prompts, params)
            )
        return [dataclasses.replace(c, version=version) for c in out]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        asked = time.perf_counter()
        with self._lock:  # after the call in flight; the next waits until the weights have moved
            self._waits["update_waited_seconds"] += time.perf_counter() - asked
            self.inner.update_weights(weights, version)

    def take_waits(self) -> dict[str, float]:
        """The waits since the last call: ``generation_blocked_seconds`` (calls held back by updates, and by each
        other) and ``update_waited_seconds`` (updates held back by a call in flight)."""
        with self._lock:
            out, self._waits = self._waits, dict.fromkeys(self._waits, 0.0)
        return out

    def close(self) -> None:
        """No call starts after this; one in flight ends with the inner generator's close (not under the lock:
        closing is what ends a call that hangs)."""
        self._closed = True
        self.inner.close()
