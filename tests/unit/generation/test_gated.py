"""The generator shared by the rollout thread and the trainer (``generation/gated.py``): a weight update waits for
the call in flight, and each completion carries the version that produced it."""

import threading
import time

from nemo_rcgrpo.generation.base import Completion, Generator, SamplingParams
from nemo_rcgrpo.generation.gated import GatedGenerator


class Slow:
    """generate() blocks until ``release`` is set; what happened is logged in order."""

    shares_policy_weights = False

    def __init__(self):
        self.version, self.log = 0, []
        self.entered, self.release = threading.Event(), threading.Event()

    def generate(self, prompts, params):
        self.log.append(("generate", self.version))
        self.entered.set()
        assert self.release.wait(10)
        return [Completion([1, 2], [-0.1, -0.2], "stop") for _ in prompts]

    def update_weights(self, weights, version):
        self.log.append(("update", version))
        self.version = version

    def close(self):
        self.log.append(("close", None))


def test_an_update_waits_for_the_call_in_flight_which_keeps_its_version():
    inner = Slow()
    gated = GatedGenerator(inner)
    assert isinstance(gated, Generator) and gated.version == 0 and not gated.shares_policy_weights
    out = {}
    rollout = threading.Thread(target=lambda: out.setdefault("first", gated.generate([[5], [6]], SamplingParams())))
    rollout.start()
    assert inner.entered.wait(10)
    update = threading.Thread(target=lambda: gated.update_weights((), 1))
    update.start()
    time.sleep(0.2)
    assert inner.log == [("generate", 0)] and update.is_alive()  # the update is held back by the call
    inner.release.set()
    rollout.join(10)
    update.join(10)
    assert inner.log == [("generate", 0), ("update", 1)]
    assert [c.version for c in out["first"]] == [0, 0]  # finished on the weights it started on
    assert [c.version for c in gated.generate([[5]], SamplingParams())] == [1] and gated.version == 1
    waits = gated.take_waits()
    assert waits["update_waited_seconds"] >= 0.2 and waits["generation_blocked_seconds"] >= 0.0
    assert gated.take_waits() == {"generation_blocked_seconds": 0.0, "update_waited_seconds": 0.0}
    gated.close()
    assert inner.log[-1] == ("close", None)


def test_no_call_starts_after_close():
    """A collection still running when the run ends must not reach a closed generator (a closed vLLM generator
    would start a server again): its next call raises."""
    import pytest

    from nemo_rcgrpo.generation.vllm_client import GeneratorError

    inner = Slow()
    inner.release.set()
    gated = GatedGenerator(inner)
    gated.close()
    with pytest.raises(GeneratorError, match="closed"):
        gated.generate([[5]], SamplingParams())
    assert ("generate", 0) not in inner.log


def test_groups_reach_an_inner_generator_that_places_them_and_no_other():
    class Placing(Slow):
        places_groups = True

        def generate(self, prompts, params, groups):
            self.log.append(("groups", list(groups)))
            return [Completion([1], [-0.1], "stop") for _ in prompts]

    placing, plain = Placing(), Slow()
    plain.release.set()
    assert GatedGenerator(placing).places_groups and not GatedGenerator(plain).places_groups
    out = GatedGenerator(placing).generate([[5], [6]], SamplingParams(), [("c", 0), ("c", 1)])
    assert placing.log == [("groups", [("c", 0), ("c", 1)])] and [c.version for c in out] == [0, 0]
    assert len(GatedGenerator(plain).generate([[5]], SamplingParams(), [("c", 0)])) == 1  # called without them
