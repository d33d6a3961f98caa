"""Many vLLM engines behind one generator, without vLLM (generation/vllm_engines.py, the syncs' fan-out, the engines'
devices and cores): placement by hand, the pool over fake clients, and the collective transfer into fake engines whose
workers run the real ``WeightReceiver`` over a real gloo group. Real servers: tests/vllm/test_vllm_engines.py."""

from __future__ import annotations

import threading

import pytest
import torch

from nemo_rcgrpo.generation.base import Completion, SamplingParams
from nemo_rcgrpo.generation.vllm_client import GeneratorError, GeneratorUnavailable, WeightSyncError
from nemo_rcgrpo.generation.vllm_engines import EnginePool, Placement
from nemo_rcgrpo.generation.vllm_server import engine_cores, engine_count, engine_devices
from nemo_rcgrpo.generation.vllm_sync import FolderSync
from nemo_rcgrpo.generation.vllm_worker import WeightReceiver
from nemo_rcgrpo.generation.weight_transfer import CollectiveSync, group_ranks


def test_a_group_stays_on_its_engine_and_new_groups_go_to_the_least_loaded():
    p = Placement(2)
    # a: 2 prompts -> engine 0 (loads 2, 0); b -> 1 (2, 2); c -> 0 on the tie (3, 2)
    assert p.assign(["a", "a", "b", "b", "c"], [0, 0]) == [0, 0, 1, 1, 0]
    # the next turn: c stays on 0 whatever the load; d goes where fewer requests are in flight
    assert p.assign(["c", "d"], [0, 0]) == [0, 1]
    assert p.assign(["e", "c"], [5, 0]) == [1, 0]
    assert p.assign(["f"], [0, 3]) == [0]
    p.drop(0)  # engine 0 is gone: its groups are placed again, on engine 1
    assert p.alive == [1] and p.assign(["a", "c", "b"], [0, 9]) == [1, 1, 1]
    p.drop(1)
    with pytest.raises(GeneratorUnavailable, match="no vLLM engine is left"):
        p.assign(["a"], [0, 0])


def test_placement_forgets_the_oldest_groups_past_its_memory():
    p = Placement(3, remember=2)
    p.assign(["a"], [0, 0, 0])
    p.assign(["b"], [0, 0, 0])
    p.assign(["a"], [0, 0, 0])  # a used again: b is now the oldest
    p.assign(["c"], [0, 0, 0])
    assert list(p.where) == ["a", "c"]


class FakeClient:
    """An engine's client: completions name the engine and the prompt's index in the whole call."""

    def __init__(self, engine: int, fail: bool = False):
        self.engine, self.fail, self.url = engine, fail, f"http://127.0.0.1:{9000 + engine}"
        self.seen: list[list[int]] = []
        self.calls: list[str] = []
        self.version = "0"

    def generate(self, prompts, params, indices=None):
        if self.fail:
            raise GeneratorUnavailable(f"vLLM server {self.url} is gone: its process exited with code -9")
        self.seen.append(list(indices))
        return [Completion([self.engine, i], [0.0, 0.0], "stop") for i in indices]

    dead = False  # its process is gone: control calls fail, /health does not answer

    def healthy(self):
        return not (self.dead or self.fail)

    def pause(self):
        if self.dead:
            raise GeneratorUnavailable(f"vLLM server {self.url} is not answering after 1 tries")
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def collective_rpc(self, method, kwargs, timeout):
        self.calls.append(method)
        if self.fail and method == "reload_weights" and "v2" in kwargs["weights_path"]:
            raise GeneratorError(f"{self.url}: reload failed")
        return {"results": [None]}


def test_the_pool_keeps_order_and_seeds_and_places_a_dead_engines_prompts_again(capsys):
    pool = EnginePool([FakeClient(0), FakeClient(1)])
    out = pool.generate([[1], [2], [3], [4]], SamplingParams(), groups=["a", "a", "b", "b"])
    assert [c.token_ids for c in out] == [[0, 0], [0, 1], [1, 2], [1, 3]]  # the index of the whole call: its seed
    assert pool.in_flight == [0, 0]
    pool.clients[0].fail = True
    out = pool.generate([[1], [2], [3]], SamplingParams(), groups=["a", "b", "a"])
    assert [c.token_ids for c in out] == [[1, 0], [1, 1], [1, 2]]  # group a moved to engine 1 with its indices
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM engine 0 (http://127.0.0.1:9000) is gone" in err and "with 1 engine" in err
    assert [c.url for c in pool.live] == ["http://127.0.0.1:9001"]
    pool.clients[1].fail = True
    with pytest.raises(GeneratorUnavailable, match="9001 is gone"):  # the last one: the run stops cleanly
        pool.generate([[1]], SamplingParams())


def test_a_slow_engine_that_still_answers_is_kept_and_its_error_raised():
    clients = [FakeClient(0), FakeClient(1)]
    pool = EnginePool(clients)

    def timed_out(prompts, params, indices=None):
        raise GeneratorUnavailable("vLLM server http://127.0.0.1:9001 is not answering after 4 tries (ReadTimeout)")

    clients[1].generate = timed_out  # its /health still answers
    with pytest.raises(GeneratorUnavailable, match="ReadTimeout"):
        pool.generate([[1], [2]], SamplingParams(), groups=["a", "b"])
    assert len(pool.live) == 2 and pool.in_flight == [0, 0] and not pool.lost


def test_placement_never_forgets_a_group_of_the_call_it_places():
    p = Placement(2, remember=3)
    keys = ["a", "b", "c", "d", "e"]
    first = p.assign(keys, [0, 0])  # more new groups than it remembers: all placed, all kept for their next turn
    assert first == [0, 1, 0, 1, 0] and list(p.where) == keys
    assert p.assign(["e", "f"], [0, 0]) == [0, 1] and list(p.where) == ["d", "e", "f"]  # then the oldest go
    assert p.assign(["g"], [0, 5], remember=False) == [0] and "g" not in p.where


def test_without_groups_each_prompt_goes_to_the_least_loaded_engine():
    clients = [FakeClient(0), FakeClient(1), FakeClient(2)]
    pool = EnginePool(clients)
    out = pool.generate([[1]] * 5, SamplingParams())
    assert [c.token_ids[0] for c in out] == [0, 1, 2, 0, 1] and not pool.placement.where  # nothing to remember


def test_a_folder_reaches_every_engine_and_one_failure_rolls_all_back(tmp_path):
    clients = [FakeClient(0), FakeClient(1)]
    sync = FolderSync(EnginePool(clients), tmp_path, 10.0)
    (tmp_path / "v1").mkdir()
    sync.reload(tmp_path / "v1", 1)
    assert sync.version == 1 and all(c.calls == ["pause", "reload_weights", "resume"] for c in clients)
    clients[1].fail = True  # engine 1 refuses version 2: both go back to version 1's folder
    (tmp_path / "v2").mkdir()
    with pytest.raises(WeightSyncError, match="v1.* still serving"):
        sync.reload(tmp_path / "v2", 2)
    assert sync.version == 1 and all(
        c.calls[3:] == ["pause", "reload_weights", "reload_weights", "resume"] for c in clients
    )


def test_engines_split_the_servers_gpus_and_this_machines_cores():
    assert engine_devices("4,5,6,7", 2, 2) == ["4,5", "6,7"]
    assert engine_devices("0,1,2,3,4,5,6,7", 1, 8) == [str(i) for i in range(8)]
    assert engine_devices(None, 1, 2) == [None, None]  # CPU engines
    with pytest.raises(GeneratorError, match="engines=2 x tp=2 needs 4 GPUs"):
        engine_devices("6,7", 2, 2)
    assert engine_count("auto", "4,5,6,7", 2) == 2 and engine_count("auto", "0,1,2,3,4,5,6,7", 1) == 8
    assert engine_count("auto", None, 1) == 1 and engine_count(2, None, 1) == 2  # CPU: one unless asked
    assert engine_cores(1, [0, 1]) == [None]
    assert engine_cores(2, [0, 1]) == ["0", "1"]
    assert engine_cores(2, [0, 1, 2, 3, 4]) == ["0-2", "3-4"]
    assert engine_cores(2, [0, 2, 5, 7]) == ["0,2", "5,7"]
    assert engine_cores(2, [0, 1, 2, 3, 4, 5, 6, 7], tp=2) == ["0-1|2-3", "4-5|6-7"]  # a run per TP worker
    with pytest.raises(GeneratorError, match="3 CPU engines of tp=1 need 3 cores, this process has 2"):
        engine_cores(3, [0, 1])


class FakeRunner:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator):
        self.loaded = {n: t.clone() for n, t in weights_iterator}


class FakeWorker(WeightReceiver):
    def __init__(self, rank: int):
        self.rank, self.device, self.model_runner = rank, torch.device("cpu"), FakeRunner()


class FakeEngine:
    """An engine of ``tp`` workers, each a real ``WeightReceiver`` in a thread of its own (as vLLM's workers are)."""

    def __init__(self, i: int, tp: int):
        self.url, self.workers, self.ranks = f"http://127.0.0.1:{9100 + i}", [FakeWorker(r) for r in range(tp)], []

    def _call(self, method, path, **kw):
        assert path == "/get_world_size"
        return {"world_size": len(self.workers)}

    def pause(self):
        pass

    def resume(self):
        pass

    def collective_rpc(self, method, kwargs, timeout):
        results = [None] * len(self.workers)

        def run(r):
            results[r] = getattr(self.workers[r], method)(**kwargs)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if method == "rcgrpo_join":
            self.ranks = results
        return {"results": results}


class Versioned:
    version = 0
    manifest = None

    def check_meta(self, meta):
        pass


def _weights(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(scale))
    return {f"layer{i}.weight": torch.randn(64, 32, generator=g) * scale for i in range(6)}


@pytest.mark.parametrize("engines, tp", [(1, 1), (2, 1), (2, 2)])
def test_one_group_joins_every_worker_of_every_engine_and_the_bytes_sent_do_not_grow(engines, tp):
    fakes = [FakeEngine(i, tp) for i in range(engines)]
    pool = EnginePool(fakes)
    sync = CollectiveSync(pool, "127.0.0.1", 60.0, Versioned(), backend="gloo", bucket_bytes=3 * 64 * 32 * 4)
    sync.push(_weights(1.0).items(), 1)
    assert sync.world_size == 1 + engines * tp and group_ranks([tp] * engines) == [i * tp for i in range(engines)]
    assert sorted(r for f in fakes for r in f.ranks) == list(range(1, 1 + engines * tp))  # one rank each, none twice
    for f in fakes:
        for w in f.workers:
            assert w.model_runner.loaded.keys() == _weights(1.0).keys()
            assert all(torch.equal(w.model_runner.loaded[n], t) for n, t in _weights(1.0).items())
    # one broadcast per bucket whatever the number of engines: 6 tensors of 8 KiB in buckets of 3
    assert (sync.stats["broadcasts"], sync.stats["bytes"]) == (2, 6 * 64 * 32 * 4)
    sync.push(_weights(2.0).items(), 2)  # the group is kept between syncs
    assert sync.stats["syncs"] == 2 and sync.version == 2
    assert all(
        torch.equal(w.model_runner.loaded["layer5.weight"], _weights(2.0)["layer5.weight"])
        for f in fakes
        for w in f.workers
    )


def test_a_lost_engine_leaves_the_group_which_is_rebuilt_with_the_others(capsys):
    fakes = [FakeEngine(0, 1), FakeEngine(1, 1)]
    pool = EnginePool(fakes)
    sync = CollectiveSync(pool, "127.0.0.1", 60.0, Versioned(), backend="gloo")
    sync.push(_weights(1.0).items(), 1)
    pool.lose(1, GeneratorUnavailable("its process exited"))
    sync.push(_weights(3.0).items(), 2)
    assert sync.world_size == 2 and fakes[0].ranks == [1]
    assert torch.equal(fakes[0].workers[0].model_runner.loaded["layer0.weight"], _weights(3.0)["layer0.weight"])
    assert torch.equal(fakes[1].workers[0].model_runner.loaded["layer0.weight"], _weights(1.0)["layer0.weight"])
    assert "going on with 1 engine(s)" in capsys.readouterr().err


def test_an_engine_gone_before_an_update_leaves_the_others_running_and_is_dropped(tmp_path, capsys):
    clients = [FakeClient(0), FakeClient(1)]
    clients[1].dead = True
    sync = FolderSync(EnginePool(clients), tmp_path, 10.0)
    (tmp_path / "v1").mkdir()
    with pytest.raises(GeneratorUnavailable, match="9001"):
        sync.reload(tmp_path / "v1", 1)
    assert clients[0].calls == ["pause", "resume"]  # paused, then resumed: never left paused
    assert sync.client.prune() == 1 and [c.url for c in sync.client.live] == [clients[0].url]
    assert "vLLM engine 1 (http://127.0.0.1:9001) is gone" in capsys.readouterr().err
    sync.reload(tmp_path / "v1", 1)
    assert clients[0].calls[2:] == ["pause", "reload_weights", "resume"] and sync.version == 1
