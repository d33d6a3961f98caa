"""Many vLLM engines behind one generator (``generation.vllm.engines``, or a list of ``generation.vllm.url``).

Each engine is a separate vLLM server (its own process, API server and TP group), reached by its own
``VLLMClient``. The project routes requests itself (docs/vllm.md says why vLLM's data-parallel mode does not cover
what a GRPO step needs):

- ``Placement`` (pure): every prompt of one group, and every turn of its rollouts, goes to the engine that group was
  first given, so that the group's prompt is prefilled once there (prefix caching); a group seen for the first time
  goes to the engine with the fewest requests in flight, counting the ones placed in the same call.
- ``EnginePool.generate``: one call's prompts split by engine, all engines asked at once; an engine that is gone
  (``GeneratorUnavailable``: its process exited, or no answer after the retries) is dropped, said in one line, and
  its prompts are placed again on the others; when none is left the call fails with the last engine's
  ``GeneratorUnavailable``.
  Request seeds are the prompt's index in the whole call (``seed + i``), whichever engine serves it, so sampling
  does not depend on the number of engines.
- ``EnginePool`` is also what the weight syncs address (`vllm_sync.FolderSync`, `weight_transfer.CollectiveSync`):
  its live clients (``live``).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, OrderedDict
from typing import Any, Hashable, Sequence

from nemo_rcgrpo.generation.base import Completion, SamplingParams
from nemo_rcgrpo.generation.vllm_client import GeneratorUnavailable, VLLMClient

REMEMBERED_GROUPS = 1 << 16  # group -> engine entries kept (the oldest forgotten first)


class Placement:
    """Which engine serves each prompt (the module docstring): sticky per group, least loaded for a new group."""

    def __init__(self, engines: int, remember: int = REMEMBERED_GROUPS):
        if engines < 1:
            raise ValueError(f"{engines} engines: at least 1")
        self.alive = list(range(engines))
        self.where: OrderedDict[Hashable, int] = OrderedDict()  # group -> engine, most recently used last
        self.remember = remember

    def assign(self, groups: Sequence[Hashable], in_flight: Sequence[int], remember: bool = True) -> list[int]:
        """The engine of each prompt, by its group key; ``in_flight``: each engine's requests in flight now;
        ``remember=False``: the keys are prompts of their own, placed and forgotten."""
        if not self.alive:
            raise GeneratorUnavailable("no vLLM engine is left")
        load = {e: in_flight[e] for e in self.alive}
        placed: dict[Hashable, int] = {}
        for g in groups:  # groups placed before keep their engine
            if g not in placed and (e := self.where.get(g)) is not None:
                placed[g] = e
                self.where.move_to_end(g)
        for g in groups:
            if g in placed:
                load[placed[g]] += 1
        new = Counter(g for g in groups if g not in placed)
        for g in new:  # first seen first, each to the least loaded engine (the lowest index on a tie)
            placed[g] = e = min(self.alive, key=lambda k: (load[k], k))
            load[e] += new[g]
            if remember:
                self.where[g] = e
        while len(self.where) > self.remember:  # the oldest first, never a group of this call
            oldest = next(iter(self.where))
            if oldest in placed:
                break
            del self.where[oldest]
        return [placed[g] for g in groups]

    def drop(self, engine: int) -> None:
        """``engine`` is gone: its groups are placed again when next seen."""
        if engine in self.alive:
            self.alive.remove(engine)
        for g in [g for g, e in self.where.items() if e == engine]:
            del self.where[g]


class EnginePool:
    """The engines' clients and their placement (the module docstring); thread-safe (rollouts generated ahead call
    ``generate`` from their own thread while an update waits)."""

    def __init__(self, clients: Sequence[VLLMClient], on_lost: Any = None):
        """``on_lost(index, why)``: called once when an engine is dropped (a managed generator stops its server)."""
        self.clients = list(clients)
        self.placement = Placement(len(self.clients))
        self.in_flight = [0] * len(self.clients)
        self.on_lost = on_lost
        self.lost: dict[int, str] = {}
        self._lock = threading.Lock()
        self._calls = 0

    @property
    def live(self) -> list[VLLMClient]:
        """The live engines' clients, in engine order."""
        return [self.clients[e] for e in self.placement.alive]

    def lose(self, engine: int, error: GeneratorUnavailable) -> None:
        """Drop ``engine`` (one line on stderr, once); ``error`` raised again when it was the last one."""
        why = str(error)
        with self._lock:
            first = engine not in self.lost
            if first:
                self.lost[engine] = why
                self.placement.drop(engine)
            left = len(self.placement.alive)
        if not left:
            raise error
        if not first:
            return
        print(
            f"warning: vLLM engine {engine} ({self.clients[engine].url}) is gone ({why}); going on with {left} "
            f"engine(s)",
            file=sys.stderr,
            flush=True,
        )
        if self.on_lost is not None:
            self.on_lost(engine, why)

    def prune(self) -> int:
        """Drop the live engines that do not answer ``/health`` (before a weight update, which needs every engine it
        addresses); the number dropped. GeneratorUnavailable when none answers."""
        dropped = 0
        for e in list(self.placement.alive):
            client = self.clients[e]
            if not client.healthy():
                why = client.alive() if callable(getattr(client, "alive", None)) else None
                self.lose(e, GeneratorUnavailable(f"vLLM server {client.url} is gone: {why or 'no answer on /health'}"))
                dropped += 1
        return dropped

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, groups: Sequence[Hashable] | None = None
    ) -> list[Completion]:
        """Completions in the order of ``prompts``; ``groups``: one key per prompt (None: each prompt its own)."""
        with self._lock:
            self._calls += 1
            call = self._calls
        keys = list(groups) if groups is not None else [("prompt", call, i) for i in range(len(prompts))]
        remember = groups is not None  # a prompt of its own is placed, not remembered
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} group keys for {len(prompts)} prompts")
        out: list[Completion | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            with self._lock:  # placed and counted in flight at once: a concurrent call sees this one's load
                engines = self.placement.assign([keys[i] for i in pending], self.in_flight, remember=remember)
                share: dict[int, list[int]] = {}
                for i, e in zip(pending, engines):
                    share.setdefault(e, []).append(i)
                for e, indices in share.items():
                    self.in_flight[e] += len(indices)
            pending = self._run(share, prompts, params, out)
        return out  # type: ignore[return-value]

    def _run(self, share: dict[int, list[int]], prompts, params: SamplingParams, out: list) -> list[int]:
        """Each engine's share at once; the indices to place again (those of engines that are gone)."""
        errors: dict[int, BaseException] = {}

        def ask(e: int, indices: list[int]) -> None:
            try:
                done = self.clients[e].generate([prompts[i] for i in indices], params, indices=indices)
                for i, c in zip(indices, done):
                    out[i] = c
            except BaseException as error:  # noqa: BLE001 - re-raised (or the engine dropped) below
                errors[e] = error
            finally:
                with self._lock:
                    self.in_flight[e] -= len(indices)

        threads = [threading.Thread(target=ask, args=(e, idx), daemon=True) for e, idx in share.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        again = []
        for e, error in errors.items():
            if not isinstance(error, GeneratorUnavailable) or self.clients[e].healthy():
                raise error  # a refused request, or a slow engine that still answers: not a lost engine
            self.lose(e, error)
            again += share[e]
        return sorted(again)
