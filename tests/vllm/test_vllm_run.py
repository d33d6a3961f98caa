"""RC-GRPO with generation=vllm (a server started by the run): killing the server mid-step (with the next
step's rollouts generated while a step trains, rl.max_staleness=1) is a clear error and the run resumes from its
last checkpoint with a fresh server; the server goes with the run; the trainer process never imports vLLM
(weights go to the server through the collective transfer)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_rcgrpo.train import main
from nemo_rcgrpo.utils.logging import read_metrics

pytestmark = pytest.mark.vllm


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_server_mid_step_then_resume(tmp_path, data_dir):
    data = data_dir
    run_dir = tmp_path / "run"
    args = [
        "--config-name=rcgrpo_smollm_cpu",
        "model.path=tiny-llama",
        "rl.stage1_recipe=null",
        f"data.dir={data}",
        f"run_dir={run_dir}",
        "rl.group_size=2",
        "rl.tasks_per_step=2",
        "rl.max_turns=2",
        "rl.sampling.max_new_tokens=16",
        "rl.max_total_tokens=1536",
        "trainer.lr=1e-3",
        "trainer.max_steps=3",
        "trainer.save_every=1",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        "generation=vllm",
        "generation.vllm.enforce_eager=true",
        "generation.vllm.kv_cache_gib=1",
        "generation.vllm.max_retries=2",
        "rl.max_staleness=1",
    ]
    repo = Path(__file__).resolve().parents[2]
    modules = tmp_path / "trainer_modules.txt"  # what the trainer process imported, written as it exits
    record = (
        f"import atexit, runpy, sys; atexit.register(lambda: open({str(modules)!r}, 'w').write("
        f"'\\n'.join(sorted(sys.modules)))); sys.argv = ['train.py', *sys.argv[1:]]; "
        f"runpy.run_path({str(repo / 'nemo_rcgrpo' / 'train.py')!r}, run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", record, *args], cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    first = run_dir / "checkpoints" / "step_1" / "trainer_state.json"
    deadline = time.time() + 400
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert first.exists(), proc.stderr.read() if proc.poll() is not None else "no checkpoint in time"
    server_pid = int((run_dir / "generator" / "server.pid").read_text())
    os.killpg(server_pid, signal.SIGKILL)  # the server and its engine, somewhere in step 2
    try:
        _, err = proc.communicate(timeout=120)  # a clear error, not a hang
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the trainer did not stop after its vLLM server was killed")
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: vLLM server http://127.0.0.1:") and "step_1 resumes" in last, last
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    imported = modules.read_text().split()
    assert "nemo_rcgrpo.generation.weight_transfer" in imported and "torch" in imported  # the record works
    assert not [m for m in imported if m == "vllm" or m.startswith("vllm.")]
    # resume: a fresh server on the step-1 weights; two more steps end to end; the server goes with the run
    assert main(args) == 0
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["weight_sync_seconds"] > 0 and m["generation_seconds"] > 0 and m["rollouts"] == 4 for m in metrics)
    new_pid = int((run_dir / "generator" / "server.pid").read_text())
    assert new_pid != server_pid and not _alive(new_pid)
    # the resumed server started from the step-1 weights (v1); steps 2 and 3 went through the process group
    assert sorted(p.name for p in (run_dir / "generator").glob("v*")) == ["v1"]
    # each rollout started at most one version behind the weights that trained on it, each turn's version recorded
    for m in metrics:
        records = [json.loads(l) for l in (run_dir / "rollouts" / f"step_{m['step']}.jsonl").read_text().splitlines()]
        assert all(
            0 <= m["step"] - 1 - r["weight_version"] <= 1 and r["turn_versions"][0] == r["weight_version"]
            for r in records
        )
        assert m["staleness_max"] <= 1 and m["update_waited_seconds"] >= 0, m


@pytest.mark.parametrize("k", [0, 1], ids=["synchronous", "ahead"])
def test_rc_grpo_with_vllm_learns_from_mixed_rewards(one_folder_plugin, one_folder_rctp, tmp_path, k):
    """Two RC-GRPO steps with generation=vllm from a policy that solves the one_folder tasks sometimes, so the
    rewards of vLLM's samples are real and mixed: the dumped advantages are the group advantages of the dumped
    rewards; step 1's loss is -sum_b A_b n_b / N (ratio 1, KL 0 against the reference). The sampler's logprobs
    (vLLM's) agree with the trainer's at both steps of the synchronous loop, so step 2 sampled from the weights step
    1 wrote. With rl.max_staleness=1 step 2's rollouts were generated while step 1 trained: recorded as version 0,
    and vLLM's logprobs of them are those of the weights before step 1's update (they differ from the trainer's)."""
    import json

    from ..conftest import ONE_FOLDER, hand_advantages

    data, stage1 = one_folder_rctp
    run = tmp_path / "rl"
    args = [
        "--config-name=micro_rcgrpo",
        f"model.path={stage1}",
        f"data.dir={data}",
        f"run_dir={run}",
        "trainer.max_steps=2",
        "trainer.lr=5e-4",
        "rl.tasks_per_step=4",
        "rl.eval_every=0",
        "rl.sampling.max_new_tokens=48",
        "rl.max_turns=2",
        "env.settings.max_steps=2",
        "trainer.export_hf=false",
        "generation=vllm",
        "generation.vllm.enforce_eager=true",
        "generation.vllm.kv_cache_gib=1",
        f"rl.max_staleness={k}",
        *ONE_FOLDER,
    ]
    assert main(args) == 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    # vLLM's logprobs of its own samples against the trainer's of the same tokens, before each update
    gaps = [m["sampler_logprob_abs_diff"] for m in metrics]
    if k == 0:
        assert all(g < 1e-4 for g in gaps), gaps  # measured 1e-7 in fp32; 0.055 with a server left on the old weights
    else:
        assert gaps[0] < 1e-4 and metrics[1]["staleness_mean"] == 1 and gaps[1] > 1e-3, (gaps, metrics[1])
    assert all(m["weight_sync_seconds"] > 0 for m in metrics)
    mixed = 0
    for step in (1, 2):
        records = [json.loads(l) for l in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(records) == 20
        assert all(r["weight_version"] == (0 if k else step - 1) for r in records)
        for g in range(4):
            group = [r for r in records if r["group"] == g]
            rewards = [r["reward"] for r in group]
            if len(set(rewards)) > 1:
                mixed += 1
                assert [r["advantage"] for r in group] == pytest.approx(hand_advantages(rewards), abs=1e-6)
            else:
                assert all(r["advantage"] == 0 for r in group)
        if step == 1:
            n = sum(r["generated_tokens"] for r in records)
            expected = -sum(r["advantage"] * r["generated_tokens"] for r in records) / n
            assert abs(expected) > 1e-4 and metrics[0]["loss"] == pytest.approx(expected, abs=1e-6)
            assert metrics[0]["kl"] == pytest.approx(0, abs=1e-9)
    assert mixed >= 2, mixed  # of 8 groups
