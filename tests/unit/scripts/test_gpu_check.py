"""scripts/gpu_check.sh --dry-run validates the GPU check's plan against the lent machine, and fails when a blocker
is planted: a package the machine lacks, a wheel for another Python, limits over the deadline, results outside $OUT."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ORDER = ["preflight", "setup", "b_megatron", "a_stage1", "e_torch_vs_bare", "d_resume", "c_rl_torch", "f_shared_prefix"]


@pytest.fixture(scope="module")
def gpu_check():
    from scripts import gpu_check

    return gpu_check


def test_dry_run_passes_here():
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"8 steps ({', '.join(ORDER)}), limits 530 s of 540 s; plan ok" in proc.stdout


def test_dry_run_catches_each_planted_blocker(gpu_check, tmp_path, monkeypatch):
    # the machine's list as shipped, the carried wheels without datasets; a bad override; a py311 wheel; $OUT elsewhere
    wheels = tmp_path / "wheels.txt"
    wheels.write_text("\n".join(l for l in gpu_check.WHEELS.read_text().splitlines() if not l.startswith("datasets")))
    wheel_dir = tmp_path / "gpu" / "wheels"
    wheel_dir.mkdir(parents=True)
    for name, version in gpu_check.gpu_machine.carried(wheels):
        tag = "py311-none-any" if name == "multiprocess" else "py3-none-any"
        (wheel_dir / f"{name.replace('-', '_')}-{version}-{tag}.whl").write_bytes(b"")
    real_plan = gpu_check.plan

    def planted(work, rehearse=False):
        steps = real_plan(work, rehearse)
        steps[3]["overrides"] = [*steps[3]["overrides"], "trainer.lr=fast"]
        steps[2]["limit"] += 60  # over the deadline
        return steps

    monkeypatch.setattr(gpu_check, "plan", planted)
    monkeypatch.setenv("OUT", str(tmp_path / "device_out"))
    problems = gpu_check.dry_run(tmp_path / "work", tmp_path / "elsewhere", wheels=wheels, wheel_dir=wheel_dir)
    text = "\n".join(problems)
    assert "a_stage1: smoke_stage1" in text and "trainer.lr" in text
    # the lazy `import datasets` inside the loaders is found in the source, and the steps' imports fail without it
    assert "nemo_rcgrpo/data/dataset.py:" in text and "imports datasets" in text
    assert "on the machine's packages only: import datasets: ModuleNotFoundError: No module named 'datasets'" in text
    assert "multiprocess-0.70.19-py311-none-any.whl: its tags (py311-none-any) are not for Python 3.12" in text
    assert "the step limits add up to 590 s" in text
    assert f"not under $OUT={tmp_path / 'device_out'}" in text
    assert len(problems) == 7, problems  # datasets: the source scan, the import, the schemas that need it


def test_a_wheel_pin_that_was_not_tested_here(gpu_check, tmp_path):
    wheels = tmp_path / "wheels.txt"
    wheels.write_text("megatron-core==0.0.1\nbfcl-eval==2026.3.23\nnot-a-package-here==1.0\n")
    problems = gpu_check.pin_problems(wheels)
    assert len(problems) == 2, problems
    assert "megatron-core==0.0.1, but 0.16.1 is installed" in problems[0]
    assert "not-a-package-here is not installed here" in problems[1]


def test_only_the_machines_packages_import_under_the_blocker(gpu_check):
    gm = gpu_check.gpu_machine
    owners = {
        "torch": {"torch"},
        "yaml": {"pyyaml"},
        "wandb": {"wandb"},
        "google": {"protobuf", "googleapis-x"},
        "nemo_rcgrpo": {"nemo-rcgrpo"},
        "scripts": set(),
    }
    assert gm.blocked_modules({"torch", "protobuf", "nemo-rcgrpo"}, owners) == {"yaml", "wandb"}
    # in a real process, gpu_machine imported as gpu_site/sitecustomize.py does: pyyaml is on the machine, wandb is not
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import gpu_machine; gpu_machine.install_blocker()\n"
        "import yaml\ntry:\n    import wandb\nexcept ModuleNotFoundError as e:\n    print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "scripts")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert proc.stdout.strip() == "No module named 'wandb'"


def test_wheel_tags_for_the_machine(gpu_check):
    ok = [
        "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "multiprocess-0.70.19-py312-none-any.whl",
        "dill-0.4.1-py3-none-any.whl",
        "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl",
    ]
    bad = [
        "megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl",
        "multiprocess-0.70.19-py311-none-any.whl",
        "x-1.0-cp312-cp312-macosx_11_0_arm64.whl",
        "y-1.0-cp312-cp312-manylinux_2_34_x86_64.whl",
    ]
    assert gpu_check.gpu_machine.wheel_problems([Path(n) for n in ok]) == []
    problems = gpu_check.gpu_machine.wheel_problems([Path(n) for n in bad])
    assert [p.split(":")[0] for p in problems] == bad


def test_the_plan_runs_by_value_within_the_budget(gpu_check):
    steps = gpu_check.plan(Path("/tmp/work"))
    assert [s["name"] for s in steps] == ORDER
    assert sum(s["limit"] for s in steps) + gpu_check.RESERVE_S <= gpu_check.DEADLINE_S
    assert gpu_check.DEADLINE_S + gpu_check.INSTALL_S <= gpu_check.DEVICE_LIMIT_S
    assert gpu_check.budget_problems(steps) == []
    by = {s["name"]: s for s in steps}
    assert "model.dtype=bfloat16" in by["a_stage1"]["overrides"] and "trainer.lr=1.0e-5" in by["a_stage1"]["overrides"]
    # the resume's first run is the Megatron RL step; no separate c_rl_megatron repeats it
    assert (
        "policy.backend=megatron" in by["d_resume"]["overrides"]
        and "trainer.stop_after=1" in by["d_resume"]["overrides"]
    )
    assert "trainer.stop_after=1" not in by["d_resume"]["then"]


def test_results_go_under_out_with_capped_logs(gpu_check, tmp_path, monkeypatch):
    out, logs = tmp_path / "out", tmp_path / "work" / "logs"
    out.mkdir()
    logs.mkdir(parents=True)
    (logs / "a_stage1.log").write_bytes(b"x" * (gpu_check.LOG_CAP + 1000) + b"THE END")
    gpu_check.write_results(out, logs, {"steps": {"a_stage1": {"ok": True}}})
    assert json.loads((out / "summary.json").read_text())["steps"]["a_stage1"]["ok"] is True
    with tarfile.open(out / "logs.tar.gz") as tar:
        member = tar.getmember("logs/a_stage1.log")
        data = tar.extractfile(member).read()
    assert len(data) == gpu_check.LOG_CAP and data.endswith(b"THE END")  # the tail is kept
    monkeypatch.setenv("OUT", str(out))
    assert gpu_check.output_problems(out, tmp_path / "work", 7) == []
    assert "inside" in gpu_check.output_problems(out, out / "work", 7)[0]
    monkeypatch.setattr(gpu_check, "LOG_CAP", 4 << 20)
    assert "over the device tool's 16 MiB" in gpu_check.output_problems(out, tmp_path / "work", 7)[0]
