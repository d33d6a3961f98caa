"""Launchers and containers: lint, and the commands the sbatch scripts would run for 1 and 4 nodes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.utils.config import ConfigError, compose

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = [
    REPO / "scripts/slurm/rcgrpo_1node.sbatch",
    REPO / "scripts/slurm/rcgrpo_multinode.sbatch",
    REPO / "scripts/slurm/common.sh",
    REPO / "scripts/launch_local.sh",
]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make install` installs it (dev extra)")
    return path


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_pass_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    result = subprocess.run([_tool("shellcheck"), "-x", str(script)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_dockerfiles_pass_hadolint_and_cpu_image_installs_like_make_test():
    for name in ("Dockerfile", "Dockerfile.cpu"):
        result = subprocess.run([_tool("hadolint"), str(REPO / "containers" / name)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
    cpu = (REPO / "containers/Dockerfile.cpu").read_text()
    assert "RUN make install" in cpu and 'CMD ["make", "test"]' in cpu
    gpu = (REPO / "containers/Dockerfile").read_text()
    assert "nvcr.io/nvidia/pytorch" in gpu and "'.[megatron]'" in gpu and "['vllm']" in gpu
    # NGC's PIP_CONSTRAINT would pin the vLLM venv to NGC's torch; the base has no python3-venv
    assert "PIP_CONSTRAINT='' xargs /opt/vllm/bin/pip install" in gpu and "python3-venv" in gpu
    assert "python containers/ngc_constraints.py > /tmp/ngc-constraints.txt" in gpu and "pip freeze |" not in gpu


def test_the_ngc_constraints_file_pins_the_image_torch_even_when_installed_from_files():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ngc_constraints", REPO / "containers" / "ngc_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # what an NGC image holds (`pip freeze` prints these as `name @ file:///opt/...`: a grep for name== finds none)
    ngc = [
        ("torch", "2.9.0a0+50eac811a6.nv25.09"),
        ("transformer_engine", "2.7.0+4c9b1e1"),
        ("apex", "0.1"),
        ("flash_attn", "2.7.4.post1"),
        ("numpy", "1.26.4"),
        ("Transformer-Engine-Torch", "2.7.0"),
    ]
    assert module.constraints(ngc) == [
        "apex==0.1",
        "flash_attn==2.7.4.post1",
        "torch==2.9.0a0+50eac811a6.nv25.09",
        "transformer_engine==2.7.0+4c9b1e1",
        "Transformer-Engine-Torch==2.7.0",
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO / "containers" / "ngc_constraints.py")], capture_output=True, text=True
    )
    import torch

    assert proc.returncode == 0 and f"torch=={torch.__version__}" in proc.stdout.split(), proc.stderr


def _render(tmp_path, script, nodes, **env):
    """Run a launcher with DRY_RUN=1 and a fake scontrol; returns the printed commands."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text(
        f"#!/bin/bash\n[[ $1 == show && $2 == hostnames ]] && printf 'gpu%s\\n' $(seq 1 {nodes})\n"
    )
    (fake / "scontrol").chmod(0o755)
    full = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "DRY_RUN": "1",
        "REPO": str(REPO),
        "RUN_ROOT": str(tmp_path / "runs"),
        "PYTHON": sys.executable,
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": f"gpu[1-{nodes}]",
        "SLURM_JOB_NUM_NODES": str(nodes),
        **env,
    }
    result = subprocess.run(["bash", str(REPO / script)], env=full, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]


def test_one_node_commands(tmp_path):
    lines = _render(
        tmp_path, "scripts/slurm/rcgrpo_1node.sbatch", 1, MODEL_PATH="/models/llama", CONFIG="rcgrpo_llama8b"
    )
    plan = TrainConfig.from_dict(compose("rcgrpo_llama8b")).parallel_plan()
    gen = plan.generation_gpus
    assert gen > 0 and plan.train_gpus_per_node == 8 - gen
    data, stage1, serve, wait, stage2, *evals = lines
    assert "--engines 1" in serve  # the recipe's 2 generation GPUs at TP=2: one engine
    assert "prepare-data" in data
    assert "torchrun --standalone --nproc-per-node=8" in stage1 and "--config-name rctp_llama8b" in stage1
    assert "model.path=/models/llama" in stage1
    assert "serve " + str(tmp_path / "runs/rctp_llama8b/hf") in serve and serve.endswith("&")
    assert "--devices " + "\\,".join(str(i) for i in range(8 - gen, 8)) in serve
    assert wait == "wait_for_server http://gpu1:8000"
    assert "CUDA_VISIBLE_DEVICES=" + "\\,".join(str(i) for i in range(8 - gen)) in stage2
    assert f"--nproc-per-node={8 - gen}" in stage2 and "generation.vllm.url=http://gpu1:8000" in stage2
    assert f"model.path={tmp_path}/runs/rctp_llama8b/hf" in stage2 and "/models/llama" not in stage2
    assert [("protocol=paper" in e, "protocol=bfcl" in e) for e in evals] == [(True, False), (False, True)]
    # once data and the stage-1 export exist (a requeued job), those steps are skipped
    (tmp_path / "runs/data/bfcl_v4").mkdir(parents=True)
    (tmp_path / "runs/data/bfcl_v4/split.json").write_text("{}")
    (tmp_path / "runs/rctp_llama8b/hf").mkdir(parents=True)
    (tmp_path / "runs/rctp_llama8b/hf/config.json").write_text("{}")
    again = _render(tmp_path, "scripts/slurm/rcgrpo_1node.sbatch", 1, CONFIG="rcgrpo_llama8b")
    assert again[0].startswith("srun") and " serve " in again[0]


def test_four_node_commands(tmp_path):
    lines = _render(
        tmp_path,
        "scripts/slurm/rcgrpo_multinode.sbatch",
        4,
        CONFIG="rcgrpo_qwen7b",
        GEN_NODES="1",
        IMAGE="/images/nemo-rcgrpo.sqsh",
    )
    waits = [l for l in lines if l.startswith("wait_for_server")]
    data, stage1, serve, stage2, *evals = [l for l in lines if l not in waits]
    # 1 generation node: all 8 of its GPUs, 4 engines of TP=2, each waited for
    assert "--engines 4 --devices 0\\,1\\,2\\,3\\,4\\,5\\,6\\,7" in serve
    assert waits == [f"wait_for_server http://gpu1:{8000 + i}" for i in range(4)]
    assert "--nodelist=gpu2" in data and "--container-image=/images/nemo-rcgrpo.sqsh" in data
    for train in (stage1, stage2):
        assert "--nodes=3" in train and "--nodelist=gpu2\\,gpu3\\,gpu4" in train
        assert "--nnodes=3 --nproc-per-node=8" in train and "--rdzv-endpoint=gpu2:29500" in train
        assert "--rdzv-backend=c10d" in train and "--rdzv-id=77" in train
    assert "--config-name rctp_qwen7b" in stage1 and "--config-name rcgrpo_qwen7b" in stage2
    assert "--nodelist=gpu1" in serve and "--weight-transfer collective" in serve
    assert "layout.generation_nodes=1" in stage2 and "layout.generation_gpus=8" in stage2
    assert len(evals) == 2


def _engines_started(lines: list[str]) -> list[str]:
    """``host:port`` of every engine the rendered serve commands start (RCGRPO_ENGINES_PER_NODE from --engines)."""
    out = []
    for line in lines:
        if " serve " not in line:
            continue
        words = line.replace("\\", "").split()
        host = next((w.split("=")[1] for w in words if w.startswith("--nodelist=")), "gpu1")
        port, engines = int(words[words.index("--port") + 1]), int(words[words.index("--engines") + 1])
        devices = words[words.index("--devices") + 1].split(",")
        tp = int(words[words.index("--tp") + 1])
        assert len(devices) == engines * tp  # every GPU given to the command is in an engine
        out += [f"{host}:{port + i}" for i in range(engines)]
    return out


def test_one_node_with_two_engines_starts_both_and_the_run_attaches_to_both(tmp_path):
    lines = _render(
        tmp_path, "scripts/slurm/rcgrpo_1node.sbatch", 1, CONFIG="rcgrpo_llama8b", OVERRIDES="layout.generation_gpus=4"
    )
    serve = next(l for l in lines if " serve " in l)
    assert "--engines 2 --devices 4\\,5\\,6\\,7" in serve and "--tp 2" in serve
    assert _engines_started(lines) == ["gpu1:8000", "gpu1:8001"]
    assert [l for l in lines if l.startswith("wait_for_server")] == [
        "wait_for_server http://gpu1:8000",
        "wait_for_server http://gpu1:8001",
    ]
    stage2 = next(l for l in lines if "--config-name rcgrpo_llama8b" in l)
    assert "CUDA_VISIBLE_DEVICES=0\\,1\\,2\\,3" in stage2 and "--nproc-per-node=4" in stage2
    assert "generation.vllm.url=\\[http://gpu1:8000\\,http://gpu1:8001\\]" in stage2
    evals = [l for l in lines if " eval " in l]
    assert len(evals) == 2 and all("generation.vllm.url=\\[http://gpu1:8000\\,http://gpu1:8001\\]" in e for e in evals)


def test_four_nodes_with_two_generation_nodes_serve_on_all_sixteen_gpus(tmp_path):
    lines = _render(tmp_path, "scripts/slurm/rcgrpo_multinode.sbatch", 4, CONFIG="rcgrpo_llama8b", GEN_NODES="2")
    started = _engines_started(lines)
    assert started == [f"gpu{n}:{8000 + i}" for n in (1, 2) for i in range(4)]  # 2 nodes x 4 engines x TP=2 = 16
    serves = [l for l in lines if " serve " in l]
    assert len(serves) == 2 and all("--devices 0\\,1\\,2\\,3\\,4\\,5\\,6\\,7" in l for l in serves)
    assert sorted(l.split()[1] for l in lines if l.startswith("wait_for_server")) == sorted(
        f"http://{h}" for h in started
    )
    stage2 = next(l for l in lines if "--config-name rcgrpo_llama8b" in l)
    assert "--nodelist=gpu3\\,gpu4" in stage2 and "--nnodes=2 --nproc-per-node=8" in stage2
    urls = ",".join(f"http://{h}" for h in started).replace(",", "\\,")
    assert f"generation.vllm.url=\\[{urls}\\]" in stage2 and "layout.generation_gpus=16" in stage2
    from nemo_rcgrpo.config import TrainConfig as Config

    plan = Config.from_dict(
        compose("rcgrpo_llama8b", ["layout.nodes=4", "layout.generation_nodes=2", "layout.generation_gpus=16"])
    ).parallel_plan()
    assert (plan.generation_engines, plan.engines_per_node, plan.world_size) == (8, 4, 16)
    assert plan.engines.split() == [f"{n}:{2 * i},{2 * i + 1}" for n in (0, 1) for i in range(4)]


def test_inconsistent_layout_stops_the_job_before_anything_runs(tmp_path):
    fake_env = {"CONFIG": "rcgrpo_llama8b", "OVERRIDES": "layout.generation_gpus=9"}
    # _render's returncode assertion carries the launcher's stderr (pytest indents its lines): the validator's
    # reason, then the launcher's refusal
    reason = r"error: layout\.generation_gpus=9 must be a multiple of generation\.vllm\.tp=2\n\s*"
    with pytest.raises(AssertionError, match=reason + r"error: the layout of rcgrpo_llama8b does not validate"):
        _render(tmp_path, "scripts/slurm/rcgrpo_1node.sbatch", 1, **fake_env)


def test_local_launcher_uses_the_gpus_it_is_given(tmp_path):
    lines = _render(tmp_path, "scripts/launch_local.sh", 1, GPUS="4", CONFIG="rcgrpo_qwen7b")
    stage2 = next(l for l in lines if "--config-name rcgrpo_qwen7b" in l)
    assert not stage2.startswith("srun") and "layout.gpus_per_node=4" in stage2
    plan = TrainConfig.from_dict(compose("rcgrpo_qwen7b", ["layout.gpus_per_node=4"])).parallel_plan()
    assert f"--nproc-per-node={plan.train_gpus_per_node}" in stage2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["layout.generation_gpus=8"], "leave no training GPU"),
        (["layout.nodes=4", "layout.generation_nodes=4"], "leaves no training node"),
        (["layout.nodes=2", "layout.generation_nodes=0"], "set layout.generation_nodes"),
        (["policy.megatron.tp=4"], "not a multiple of TP x PP x CP"),
        (["generation.vllm.tp=4"], "multiple of generation.vllm.tp"),
        (
            ["layout.nodes=4", "layout.generation_nodes=2", "layout.generation_gpus=2"],
            r"must fill 2 generation node\(s\) with engines of generation.vllm.tp=2 GPUs alike: a multiple of 4",
        ),
    ],
)
def test_layout_that_does_not_add_up_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(compose("rcgrpo_llama8b", overrides)).parallel_plan()


def test_model_parallel_is_checked_by_the_launchers_not_by_hand_runs():
    # a CPU run at TP=3 (torchrun --nproc-per-node 3) does not need a layout section that matches
    cfg = TrainConfig.from_dict(compose("rctp_smollm_cpu", ["policy.backend=megatron", "policy.megatron.tp=3"]))
    with pytest.raises(ConfigError, match="not a multiple of TP x PP x CP"):
        cfg.parallel_plan()
    assert cfg.parallel_plan(model_parallel=False).world_size == 8


def test_a_layout_without_generation_gpus_stops_the_job_in_one_line(tmp_path):
    with pytest.raises(AssertionError, match=r"error: the layout of rcgrpo_llama8b gives generation no GPU"):
        _render(
            tmp_path,
            "scripts/slurm/rcgrpo_1node.sbatch",
            1,
            CONFIG="rcgrpo_llama8b",
            OVERRIDES="layout.generation_gpus=0",
        )
