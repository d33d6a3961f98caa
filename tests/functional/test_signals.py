"""Real signals sent to real runs: the step finishes, a checkpoint is written, one line, exit 128 + signal."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _start(data_dir, run_dir, *extra):
    args = ["--config-name=sft_smollm_cpu", "model.path=tiny-qwen2", f"run_dir={run_dir}", f"data.dir={data_dir}",
            "chat.max_length=900", "data.max_examples=64", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
            "trainer.epochs=20", "trainer.max_steps=40", "trainer.save_every=1000", "trainer.export_hf=false", "logging.progress=false",
            "logging.tensorboard=false", *extra]
    return subprocess.Popen([sys.executable, str(REPO / "nemo_rcgrpo" / "train.py"), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE), args


def _wait_for_steps(run_dir, n, proc, timeout=240):
    path = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def _steps(run_dir):
    return [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 138)])
def test_a_signal_stops_after_the_step_with_a_checkpoint(data_dir, tmp_path, sig, code):
    run_dir = tmp_path / "r"
    proc, args = _start(data_dir, run_dir)
    _wait_for_steps(run_dir, 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    name = signal.Signals(sig).name
    assert last.startswith(f"stopped by {name} after step ") and "to resume, run the same command again" in last, last
    step = int(last.split("after step ")[1].split()[0])
    assert 2 <= step < 40 and f"checkpoints/step_{step}" in last
    from nemo_rcgrpo.utils.checkpoint import latest_checkpoint

    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step_{step}"  # complete, and the newest
    assert _steps(run_dir) == list(range(1, step + 1))  # the stopped step is logged once
    if sig == signal.SIGTERM:  # the same command (its entry point, in this process) resumes and finishes, each step once
        from nemo_rcgrpo.train import main

        assert main(args) == 0
        assert _steps(run_dir) == list(range(1, 41))


def test_a_second_ctrl_c_abandons_the_step(data_dir, tmp_path):
    run_dir = tmp_path / "r"
    proc, _ = _start(data_dir, run_dir, "trainer.save_every=1")
    _wait_for_steps(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(("interrupted", "stopped by SIGINT")) and "run the same command again" in last, last
    # whatever was abandoned, every checkpoint left is complete
    from nemo_rcgrpo.utils.checkpoint import latest_checkpoint

    assert latest_checkpoint(run_dir) is not None


@pytest.mark.parametrize("k", [0, 1])
def test_sigterm_stops_an_rl_run_after_its_step(data_dir, tmp_path, k):
    """k = 1: the signal comes while the next step's rollouts are being generated ahead; the run still stops
    after the step it was training, and what was generated ahead is dropped (no dump of a later step)."""
    run_dir = tmp_path / "rl"
    args = ["--config-name=rcgrpo_smollm_cpu", "model.path=tiny-llama", "rl.stage1_recipe=null",
            f"data.dir={data_dir}", f"run_dir={run_dir}", "rl.group_size=2", "rl.tasks_per_step=1", "rl.max_turns=4",
            "rl.sampling.max_new_tokens=64", "rl.max_total_tokens=4096", "trainer.max_steps=20",
            "trainer.save_every=1000", "trainer.export_hf=false", "logging.progress=false", "logging.tensorboard=false",
            "generation=scripted", "env.categories=[base]", f"rl.max_staleness={k}"]
    proc = subprocess.Popen([sys.executable, str(REPO / "nemo_rcgrpo" / "train.py"), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_steps(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    step = int(last.split("after step ")[1].split()[0])
    assert last.startswith("stopped by SIGTERM") and f"checkpoints/step_{step}" in last, last
    assert _steps(run_dir) == list(range(1, step + 1)) and (run_dir / "rollouts" / f"step_{step}.jsonl").exists()  # dumps count from 1, as metrics
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == sorted(
        f"step_{s}.jsonl" for s in range(1, step + 1))
