"""scripts/gpu_check.sh --dry-run validates the GPU check's plan on CPU, and fails when the plan does not hold."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_passes_here():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "7 steps (setup, a_stage1, b_megatron, c_rl_torch, c_rl_megatron, d_resume, e_torch_vs_bare); plan ok" in proc.stdout


def test_dry_run_reports_a_bad_override_and_a_wheel_pin_that_was_not_tested(tmp_path, monkeypatch):
    gpu_check = _module()  # the plan as shipped holds: test_dry_run_passes_here
    wheels = tmp_path / "wheels.txt"
    wheels.write_text("megatron-core==0.0.1\nbfcl-eval==2026.3.23\nnot-a-package-here==1.0\n")
    monkeypatch.setattr(gpu_check, "WHEELS", wheels)
    real_plan = gpu_check.plan

    def broken_plan(work, rehearse=False):
        steps = real_plan(work, rehearse)
        steps[1]["overrides"] = [*steps[1]["overrides"], "trainer.lr=fast"]
        return steps

    monkeypatch.setattr(gpu_check, "plan", broken_plan)
    problems = gpu_check.dry_run(tmp_path)
    assert len(problems) == 3, problems
    assert problems[0].startswith("a_stage1: smoke_stage1") and "trainer.lr" in problems[0]
    assert "megatron-core==0.0.1, but 0.16.1 is installed" in problems[1]
    assert "not-a-package-here is not installed here" in problems[2]


def test_the_plan_runs_in_priority_order_within_the_device_limit():
    gpu_check = _module()
    steps = gpu_check.plan(Path("/tmp/work"))
    assert [s["name"] for s in steps][:3] == ["setup", "a_stage1", "b_megatron"]
    # one device command may run 10 minutes: the whole check stays under 9 with its own deadline
    assert gpu_check.DEADLINE_S <= 540
    stage1 = next(s for s in steps if s["name"] == "a_stage1")["overrides"]
    assert "model.dtype=bfloat16" in stage1 and "trainer.lr=1.0e-5" in stage1
    megatron = next(s for s in steps if s["name"] == "c_rl_megatron")["overrides"]
    assert "policy.backend=megatron" in megatron
