"""The Megatron backend (TP=2 under torchrun, gloo) with generation=vllm (a server the run starts on rank 0):
two RC-GRPO steps end to end, weights synced to the server through versioned folders, the server gone at the end.
This is the GPU recipes' combination (conf/rl_gpu_defaults.yaml), on CPU with the tiny Llama (tied embeddings)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.utils.logging import read_metrics
from tests.megatron.helpers import free_port

pytestmark = [pytest.mark.megatron, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
GROUP, TASKS = 2, 2


def _gone(pid: int) -> bool:
    """True when neither the process nor anything in its process group (the engine workers) is left."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _run(data_dir, run_dir) -> subprocess.CompletedProcess:
    args = [
        "--config-name=rcgrpo_smollm_cpu",
        "model.path=tiny-llama",
        "rl.stage1_recipe=null",
        f"data.dir={data_dir}",
        f"run_dir={run_dir}",
        f"rl.group_size={GROUP}",
        f"rl.tasks_per_step={TASKS}",
        "rl.max_turns=2",
        "rl.sampling.max_new_tokens=16",
        "rl.max_total_tokens=1536",
        "trainer.lr=1e-3",
        "trainer.max_steps=2",
        # the random model's rewards are all 0 (zero advantages, and the KL term is 0 on step 1): weight decay
        # makes step 1 move the weights for sure, so step 2's KL and the synced weights have something to show
        "trainer.weight_decay=0.1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "policy.backend=megatron",
        "policy.megatron.tp=2",
        "layout.gpus_per_node=2",
        "generation=vllm",
        "generation.vllm.enforce_eager=true",
        "generation.vllm.kv_cache_gib=1",
        # the folder path, so that the served tensors can be read back and compared below (the collective
        # path, the default, is tests/vllm/test_vllm_generator.py's: received = sent, served = HF)
        "generation.vllm.weight_sync=folder",
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    return subprocess.run(
        [*launch, str(REPO / "nemo_rcgrpo" / "train.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        cwd=REPO,
        timeout=600,
    )


def _check_served_weights(run_dir: Path) -> None:
    """The last served folder holds exactly the trained weights (step 2's checkpoint and the hf/ export), with the
    tied embedding served as its own lm_head (the server is untied so that a reload refreshes its output layer)."""
    from safetensors.torch import load_file

    from nemo_rcgrpo.models.hf import load_model

    assert sorted(p.name for p in (run_dir / "generator").glob("v*")) == ["v2"]  # only the folder being served
    served = load_file(run_dir / "generator" / "v2" / "model.safetensors")
    trained = torch.load(run_dir / "checkpoints" / "step_2" / "model.pt", weights_only=True)
    exported = load_file(run_dir / "hf" / "model.safetensors")
    assert "lm_head.weight" not in trained  # Megatron's export of a tied model has no output layer of its own
    assert set(served) == set(trained) | {"lm_head.weight"}
    assert all(torch.equal(served[k], trained[k]) for k in trained)
    assert all(torch.equal(served[k], exported[k]) for k in exported if k in served)
    assert torch.equal(served["lm_head.weight"], trained["model.embed_tokens.weight"])
    initial = load_model("tiny-llama").state_dict()
    vocab = initial["model.embed_tokens.weight"].shape[0]
    assert served["model.embed_tokens.weight"].shape[0] == vocab + 2  # the reward tokens, no vocabulary padding
    moved = max(float((served[k][: initial[k].shape[0]] - initial[k]).abs().max()) for k in trained)
    assert moved > 1e-4


def test_two_rcgrpo_steps_megatron_tp2_with_vllm(data_dir, tmp_path):
    run_dir = tmp_path / "rl"
    proc = _run(data_dir, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rcgrpo: 2 steps" in proc.stdout
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["rollouts"] == GROUP * TASKS and m["tokens"] > 0, m
        assert m["generation_seconds"] > 0 and m["weight_sync_seconds"] > 0, m
    # step 1 trains from the reference weights (KL 0); step 2's rollouts and logprobs come from the updated policy
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-7) and metrics[1]["kl"] > 0
    assert all(len(p.read_text().splitlines()) == GROUP * TASKS for p in (run_dir / "rollouts").iterdir())
    _check_served_weights(run_dir)
    # vLLM only warns when a reload skips a layer that has weights (a tied output layer did): none may be skipped
    log = (run_dir / "generator" / "server.log").read_text(errors="replace")
    skipped = [line for line in log.splitlines() if "Failed to load weights" in line and "RotaryEmbedding" not in line]
    assert log.count("Reloading and processing weights") == 2 and not skipped, skipped
    server_pid = int((run_dir / "generator" / "server.pid").read_text())
    assert _gone(server_pid)
