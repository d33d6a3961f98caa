"""The collective weight transfer's pure parts (generation/weight_transfer.py, generation/vllm_worker.py); the
transfer into a real vLLM server is tests/vllm/test_vllm_generator.py."""

import threading

import torch

from nemo_rcgrpo.generation.vllm_worker import broadcast, make_group, unpack
from nemo_rcgrpo.generation.weight_transfer import nccl_mismatch, plan_buckets


def test_buckets_hold_consecutive_tensors_of_one_dtype_up_to_the_size():
    meta = [
        ("a", (10,), "float32"),
        ("b", (10,), "float32"),
        ("c", (30,), "float32"),  # 40, 40, 120 bytes
        ("d", (4,), "bfloat16"),
        ("e", (2, 2), "bfloat16"),
        ("f", (1,), "float32"),
    ]
    assert plan_buckets(meta, bucket_bytes=100) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert plan_buckets(meta, bucket_bytes=1 << 20) == [(0, 3), (3, 5), (5, 6)]  # dtype changes still split
    assert plan_buckets([], 100) == []
    covered = [i for a, b in plan_buckets(meta, 60) for i in range(a, b)]
    assert covered == list(range(len(meta)))


def test_a_bucket_unpacks_into_the_named_shapes():
    a, b = torch.arange(6.0).view(2, 3), torch.tensor([7.0, 8.0])
    flat = torch.cat([a.reshape(-1), b])
    out = dict(unpack(flat, [["w", [2, 3], "float32"], ["v", [2], "float32"]]))
    assert torch.equal(out["w"], a) and torch.equal(out["v"], b)
    try:
        list(unpack(flat, [["w", [2, 3], "float32"]]))
    except ValueError as e:
        assert "does not match" in str(e)
    else:
        raise AssertionError("a bucket longer than its tensors was accepted")


def test_an_own_gloo_group_broadcasts_without_a_default_group():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = {}

    def worker(rank):
        store, group = make_group("127.0.0.1", port, rank, 3, "gloo", "test", 30)
        t = torch.empty(4)
        broadcast(group, t, 30)
        got[rank] = t
        got[f"store{rank}"] = store

    threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    store, group = make_group("127.0.0.1", port, 0, 3, "gloo", "test", 30)
    broadcast(group, torch.tensor([1.0, 2.0, 3.0, 4.0]), 30)
    for t in threads:
        t.join(30)
    assert not torch.distributed.is_initialized()  # no default group was needed (or made)
    assert all(torch.equal(got[r], torch.tensor([1.0, 2.0, 3.0, 4.0])) for r in (1, 2))


def test_an_nccl_group_is_refused_between_two_nccl_releases():
    assert nccl_mismatch("2.21.5", [{"nccl": "2.21.5"}, {"nccl": "2.21.3"}]) is None  # same release
    assert "2.26.2" in nccl_mismatch("2.21.5", [{"nccl": "2.26.2"}])
    assert nccl_mismatch(None, [{"nccl": "2.21.5"}]) is not None  # no NCCL here
    assert nccl_mismatch("2.21.5", []) is not None  # nothing known of the workers
