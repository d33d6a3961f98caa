"""WeightStream (utils/weight_stream.py): announced tensors, fresh passes, unfinished passes finished; the pass
protocol of ``sync_generator`` between two real ranks; a tied model's output layer added to a stream."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.generation.vllm_sync import _stream_with_lm_head
from nemo_rcgrpo.utils.weight_stream import WeightStream, plan_buckets
from tests.megatron.helpers import free_port

REPO = Path(__file__).resolve().parents[3]


def _counted(n=3):
    made = []

    def export():
        for i in range(n):
            made.append(i)
            yield f"w{i}", torch.full((2,), float(len(made)))

    return export, made


def test_buckets_by_bytes_and_key():
    assert plan_buckets([(40, "f"), (40, "f"), (120, "f"), (8, "b"), (8, "b"), (4, "f")], 100) == [
        (0, 2),
        (2, 3),
        (3, 5),
        (5, 6),
    ]
    assert plan_buckets([], 10) == []


def test_each_pass_is_a_fresh_export_and_an_unfinished_one_is_finished_first():
    export, made = _counted()
    calls = []
    stream = WeightStream([(f"w{i}", (2,), torch.float32) for i in range(3)], export, on_pass=calls.append)
    it = iter(stream)
    assert next(it)[0] == "w0"  # the consumer stops after one tensor ...
    second = [float(t[0]) for _, t in stream]  # ... and reads again: the first pass was finished before this one
    assert made == [0, 1, 2, 0, 1, 2] and second == [4.0, 5.0, 6.0] and calls == [1]
    stream.close()
    assert calls == [1, -1] and stream.passes == 2


def test_a_stream_nobody_read_is_run_once_on_close():
    export, made = _counted()
    calls = []
    WeightStream([(f"w{i}", (2,), torch.float32) for i in range(3)], export, on_pass=calls.append).close()
    assert made == [0, 1, 2] and calls == [-1]  # the other ranks' sends are all received


@pytest.mark.parametrize(
    "meta,why",
    [
        ([("w0", (2,), torch.float32), ("x", (2,), torch.float32)], "where x"),
        ([("w0", (3,), torch.float32)], "where w0 (3,)"),
        ([("w0", (2,), torch.float32)], "after the 1 announced"),
    ],
)
def test_a_pass_that_differs_from_its_announcement_is_refused(meta, why):
    export, made = _counted(2)
    stream = WeightStream(meta, export)
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        list(stream)
    stream.close()
    assert made[-1] == 1  # the export still ran to its end


def test_a_tied_models_stream_gets_the_output_layer_last():
    embed, norm = torch.randn(5, 2), torch.ones(2)
    stream = _stream_with_lm_head(
        WeightStream.of({"model.embed_tokens.weight": embed, "model.norm.weight": norm}), True
    )
    assert [m[0] for m in stream.meta] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    got = dict(stream)
    assert torch.equal(got["lm_head.weight"], embed) and list(got) == [m[0] for m in stream.meta]
    untied = _stream_with_lm_head(WeightStream.of({"model.embed_tokens.weight": embed}), False)
    assert [m[0] for m in untied.meta] == ["model.embed_tokens.weight"]


def test_no_rank_is_left_waiting_whatever_the_generator_does(tmp_path):
    """Two gloo ranks; rank 1 sends what rank 0's export yields. Rank 0's generator reads part of a pass and
    reads again, raises after one tensor, or raises before reading: both ranks finish every case."""
    out = tmp_path / "stream.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            str(REPO / "tests" / "unit" / "utils" / "stream_worker.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=90,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    # read twice: the second pass is a fresh export (rank 1 sent 20.0.. in its second pass)
    assert r["read_twice"] == {"passes": [2, 2], "error": None, "seen": [[10.0], [20.0, 21.0, 22.0, 23.0]]}
    assert r["raise_after_one"] == {"passes": [1, 1], "error": "failed after one tensor", "seen": [[10.0]]}
    assert r["raise_at_once"] == {"passes": [1, 1], "error": "refused before reading", "seen": []}
