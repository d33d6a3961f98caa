"""Megatron-Core backend in the trainers: stage-1 losses equal the torch backend's (TP=1), a GRPO step with
TP x PP and PP x DP equal to the torch backend's, RC-GRPO with mixed rewards at PP=2 x DP=2 and TP=2 with weight
sync to the generator, and start-up errors. CPU, torchrun with gloo."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.utils.logging import read_metrics
from tests.conftest import hand_advantages
from tests.megatron.helpers import free_port

pytestmark = pytest.mark.megatron
REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _stage1_args(data_dir, run_dir, *extra):
    """rctp_smollm_cpu with its data order and seed, cut to a few short steps of 2 sequences (CPU test budget)."""
    return [
        "--config-name=rctp_smollm_cpu",
        f"run_dir={run_dir}",
        f"data.dir={data_dir}",
        "chat.max_length=900",
        "data.max_examples=16",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=1",
        "trainer.max_steps=3",
        "trainer.lr=1e-4",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]


def _train(args, nproc=1):
    launch = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
        ]
    )
    env = ENV if nproc > 1 else {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}  # one process: every core
    return subprocess.run(
        [*launch, str(REPO / "nemo_rcgrpo" / "train.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=900,
    )


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_stage1_smollm2_same_losses_torch_and_megatron(micro_data_dir, tmp_path):
    """The stage-1 trainer with either backend on the same data: same losses and gradient norms. (Megatron at
    TP=3 is checked per weight gradient against HF in test_megatron_model; at TP > 1 through the trainers by
    the TP=2 tests below and the stage-1 resharding resume of test_megatron_checkpoint.)"""
    # the bfcl_micro tasks' short trajectories (about 300 tokens; the subject is the backend, not BFCL's prompts)
    common = [
        "trainer.save_every=100",
        "trainer.export_hf=false",
        "trainer.max_steps=2",
        "env.task_source=bfcl_micro",
        "chat.tool_description=compact",
    ]
    _ok(_train(_stage1_args(micro_data_dir, tmp_path / "torch", *common)))
    _ok(_train(_stage1_args(micro_data_dir, tmp_path / "tp1", *common, "policy.backend=megatron")))
    runs = {name: read_metrics(tmp_path / name) for name in ("torch", "tp1")}
    assert [m["step"] for m in runs["torch"]] == [1, 2] and len(runs["tp1"]) == 2
    for a, b in zip(runs["torch"], runs["tp1"]):
        assert a["tokens"] == b["tokens"] and a["tokens_total"] == b["tokens_total"]  # same data
        # measured |torch - megatron| (2 CPU cores, torch 2.13, megatron-core 0.16.1): loss 6.4e-6, 2.6e-5,
        # 1.8e-5 at steps 1-3 of a 3-step run (bound ~10x the largest); grad norm, relative, 5.3e-4, 1.5e-3,
        # 3.6e-6 (the two implementations' fp32 sums; bound 2x the largest); the test runs 2 steps
        assert abs(a["loss"] - b["loss"]) <= 2e-4, (a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=3e-3) and a["lr"] == pytest.approx(b["lr"])
    # the losses move (the run trains), so equality is not that of two untouched models
    assert runs["torch"][0]["loss"] != runs["torch"][1]["loss"] and runs["torch"][1]["lr"] > 0


LAYOUTS = {"tp2-pp2": (2, 2, ["tiny-llama"]), "pp2-dp2": (1, 2, ["tiny-llama", "tiny-qwen2"])}
WORLD = 4  # processes of the one torchrun that runs both layouts


@pytest.fixture(scope="module")
def policy_steps(tmp_path_factory):
    """Both layouts of the test below in one torchrun of WORLD processes (the parallel groups made anew per layout)."""
    out = tmp_path_factory.mktemp("policy") / "policy.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={WORLD}",
            f"--master-port={free_port()}",
            str(REPO / "tests" / "megatron" / "policy_worker.py"),
            str(out),
            *(f"{tp}:{pp}:{','.join(models)}" for tp, pp, models in LAYOUTS.values()),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        cwd=REPO,
        timeout=1200,
    )
    _ok(proc)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_step_weight_sync_and_checkpoint_match_the_torch_backend(policy_steps, layout):
    """One GRPO step with tensor, pipeline and data parallelism (tied Llama, untied Qwen2): same loss, gradient norm
    and new weights as TorchPolicy on the whole batch; the generator's HF copy receives them through
    export_weights(); a reloaded checkpoint continues identically. Before it, prefix trees and packed rows as flat
    rows against the same micro-batches padded (`_check_flat_rows`)."""
    tp, pp, models = LAYOUTS[layout]
    results = [r for r in policy_steps if (r["tp"], r["pp"]) == (tp, pp)]
    assert [r["model"] for r in results] == models
    for r in results:
        assert (r["tp"], r["pp"], r["dp"]) == (tp, pp, WORLD // (tp * pp))
        assert r["old_logprob_diff"] <= 1e-5 and r["entropy_diff"] <= 1e-4 and r["one_row_entropy_diff"] <= 1e-4, r
        _check_flat_rows(r["flat"])
        assert r["loss"] == pytest.approx(r["torch_loss"], abs=1e-6) and r["loss"] != 0, r
        # the gradient norm covers the tied embedding once, although first and last stage both hold it
        assert r["grad_norm"] == pytest.approx(r["torch_grad_norm"], rel=1e-5), r
        # lr 1e-3: Adam moves every weight by about 1e-3; both backends land on the same weights
        assert r["weights_changed"] >= 5e-4 and r["weights_vs_torch"] <= 1e-4, r
        assert r["new_logprob_diff"] <= 1e-4, r
        assert r["reloaded_logprob_diff"] == 0 and r["resumed_step_loss_diff"] == 0, r
        assert r["resumed_logprob_diff"] <= 1e-6, r
        assert r["reloaded_hf_diff"] == 0, r
        assert math.isfinite(r["lonely_step_grad_norm"]) and r["lonely_step_grad_norm"] > 0, r
        _check_stream(r["stream"], tp)


def _check_flat_rows(f):
    """A prefix tree and packed rows, each run as one flat row, give the padded rows' logprobs, entropies, loss and
    gradients; a planted leak between suffixes, or a suffix whose positions restart at 0, changes the logprobs."""
    assert f["kinds"] == ["GroupLayout", "Packed"], f
    assert f["logprob_diff"] <= 1e-5 and f["entropy_diff"] <= 1e-4, f
    assert f["loss_diff"] <= 1e-6 * max(1.0, abs(f["loss"])) and f["loss"] != 0, f
    assert f["grad_rel_diff"] <= 1e-5, f
    assert f["leak_shown"] > 1e-3 and f["restart_shown"] > 1e-3, f


def _check_stream(stream, tp):
    """One weight sync to a generator: the tensors of the HF export, moved in flat buckets (a tiny model's stage is
    one bucket) by the ranks of data-parallel replica 0 only, with no per-parameter or object collective."""
    assert stream["names_equal"] and stream["max_diff"] == 0, stream
    for rank, r in enumerate(stream["ranks"]):
        c = r["calls"]
        assert c.pop("broadcast", 0) == 1, (rank, r)  # the end-of-sync flag: no further pass of the export
        if r["dp_rank"] > 0:
            assert c == {}, (rank, r)  # the other replicas hold the same weights and move none
            continue
        sender = r["pp_rank"] > 0 and r["tp_rank"] == 0
        assert c == {
            **({"gather": 1} if tp > 1 else {}),
            **({"send": 1} if sender else {}),
            **({"recv": max(p["pp_rank"] for p in stream["ranks"])} if rank == 0 else {}),
        }, (rank, r)
    # 4 KB buckets: the same tensors, in many gathers and sends (and rank 0 receives every bucket sent)
    assert stream["small_equal"], "the stream at 4 KB buckets differs from the stream at 256 MB"
    small = stream["small_ranks"]
    for rank, r in enumerate(small):
        c = r["calls"]
        assert c.get("broadcast", 0) == 1 and not {"all_gather", "broadcast_object_list"} & set(c), (rank, r)
        if r["dp_rank"] == 0 and tp > 1:
            assert c.get("gather", 0) > 3, (rank, r)
    sends = sum(r["calls"].get("send", 0) for r in small)
    assert small[0]["calls"].get("recv", 0) == sends and (sends > 3) == (max(r["pp_rank"] for r in small) > 0), small


@pytest.mark.parametrize(
    "layout",
    [["policy.megatron.pp=2", "layout.gpus_per_node=4"], ["policy.megatron.tp=2", "layout.gpus_per_node=2"]],
    ids=["pp2-dp2", "tp2"],
)
def test_two_rcgrpo_steps_with_mixed_rewards(micro_data_dir, tmp_path, layout):
    """RC-GRPO end to end with the Megatron backend: two pipeline stages x two data-parallel replicas (4 processes:
    rank 0, a first stage, generates; each replica scores and trains on its half of the micro-batches; the last
    stages compute the loss), and TP=2, each micro-batch's prompt run once (a flat row). The scripted generator gives the groups known, mixed rewards (P(success) 0.8
    with the high token, 0.2 with the low one), so the step-1 loss is the advantages' own: ratio 1 and KL 0 give
        loss = -sum_b A_b n_b / N      (n_b generated tokens of rollout b, N their sum)."""
    from safetensors.torch import load_file

    from nemo_rcgrpo.models.hf import load_model

    nproc = 4 if "policy.megatron.pp=2" in layout else 2
    args = [
        "--config-name=micro_rcgrpo",
        "model.path=tiny-llama",
        f"data.dir={micro_data_dir}",
        f"run_dir={tmp_path / 'rl'}",
        "rl.group_size=4",
        "rl.tasks_per_step=2",
        "rl.eval_every=0",
        "trainer.lr=1e-3",
        "trainer.max_steps=2",
        "trainer.save_every=1",
        "trainer.micro_batch_size=2",
        "logging.progress=false",
        "logging.tensorboard=false",
        "policy.backend=megatron",
        "generation=scripted",
        "generation.scripted.success_high=0.8",
        "generation.scripted.success_low=0.2",
        *layout,
    ]
    _ok(_train(args, nproc=nproc))
    run_dir = tmp_path / "rl"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        records = [json.loads(l) for l in (run_dir / "rollouts" / f"step_{m['step']}.jsonl").read_text().splitlines()]
        assert len(records) == 8 and m["rollouts"] == 8
        assert m["tokens"] == sum(r["generated_tokens"] for r in records)
        for g in (0, 1):
            group = [r for r in records if r["group"] == g]
            assert [r["advantage"] for r in group] == pytest.approx(
                hand_advantages([r["reward"] for r in group]), abs=1e-6
            )
        # each micro-batch (2 rows of one group) ran its prompt once, as a flat row, and the loss is still exact
        assert m["prefix_tokens_saved"] > 0 and m["forward_positions_saved"] > 0, m
        if m["step"] == 1:
            assert len({r["reward"] for r in records}) == 2  # mixed rewards in the first step
            expected = -sum(r["advantage"] * r["generated_tokens"] for r in records) / m["tokens"]
            assert abs(expected) > 1e-4 and m["loss"] == pytest.approx(expected, abs=1e-6), (m["loss"], expected)
            assert m["kl"] == pytest.approx(0, abs=1e-9) and m["grad_norm"] > 0
        # the mean entropy of a nearly uniform 49154-token distribution, whichever replica scored the trajectory
        # (a replica's missing half would show as ~5.4)
        assert 0.95 * math.log(49154) < m["entropy"] <= math.log(49154), m["entropy"]
    assert metrics[1]["kl"] > 0
    assert (run_dir / "checkpoints" / "step_2" / "trainer_state.json").is_file()
    # the export (rank 0's HF copy after the last weight sync) is the trained policy: every initial weight moved
    exported = load_file(run_dir / "hf" / "model.safetensors")
    initial = load_model("tiny-llama").state_dict()
    moved = {k: float((exported[k][: initial[k].shape[0]] - initial[k]).abs().max()) for k in exported}
    assert min(moved.values()) > 1e-4, moved
    saved = torch.load(run_dir / "checkpoints" / "step_2" / "model.pt", weights_only=True)
    assert all(torch.equal(saved[k], exported[k]) for k in exported)


def test_start_up_errors_are_one_line(data_dir, tmp_path, capfd):
    """Each refused before any process group or Megatron model is built (the TP and PP cases after reading the HF
    model's shape), so in this process, through `rcgrpo train`'s entry point, with what reaches file descriptor 2;
    the CLI's one-line error in a process of its own is tests/functional/test_train_stage1.py's."""
    import torch.distributed as dist

    from nemo_rcgrpo.train import main

    cases = [
        (
            ["policy.backend=megatron", "policy.megatron.tp=2", "layout.gpus_per_node=2"],
            "policy.megatron.tp=2: tensor-parallel size 2 does not divide the model's attention heads (9), KV heads (3)",
        ),
        (["policy.backend=megatron", "policy.megatron.fp8=hybrid"], "needs Transformer Engine"),
        (
            ["policy.backend=megatron", "policy.megatron.pp=4"],
            "policy.megatron.pp=4: pipeline-parallel size 4 does not divide the model's 30 layers",
        ),
        (["policy.backend=megatron", "policy.megatron.cp=2"], "context parallelism is not implemented"),
    ]
    for extra, message in cases:
        assert main(_stage1_args(data_dir, tmp_path / "x", *extra)) == 2, extra
        err = capfd.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("error: ") and message in err[-1], err[-5:]
        assert not (tmp_path / "x" / "checkpoints").exists() and not dist.is_initialized(), extra  # nothing started
