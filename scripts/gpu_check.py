"""The GPU check: the first GPU run of every path, by value, under one checked budget (``scripts/gpu_check.sh``).

Steps, in this order (each a subprocess with its own time limit; a failed step is recorded and the next runs):

  preflight   versions, every module a step imports, a one-line torch.compile probe on CUDA (on failure the
              later steps run with TORCH_COMPILE_DISABLE=1, said in the summary), a one-rank NCCL all-reduce,
              the measured bf16 matmul ceiling
  setup       a SmolLM2-135M-shaped model with random weights (SmolLM2's config and tokenizer, shipped under
              build/gpu/smollm2 by ``gpu_check.sh --prepare``; no weights travel)
  b_megatron  Megatron TP=1 bf16 at the Llama-3.1-8B shape, 8 layers (4 if 8 do not fit), 4 micro-batches
              of 4096 tokens per step (scripts/bench/megatron_gpu.py): forward+backward timed apart from the
              optimizer step, MFU against 989 TFLOP/s and the measured matmul, labelled with its setup
  a_stage1    torch backend, stage 1 (RCTP-FT) in bf16 with fp32 master weights: tokens/s and the share of
              the bf16 weights that changed
  e_torch_vs_bare  stage-1 tokens/s of the torch backend (bf16, fp32 masters) against a bare HF bf16 loop on the
              same batches (scripts/bench/train_throughput.py, 4 x 8 sequences a step; target >= 0.9)
  d_resume    the Megatron RL step (its per-stage seconds), a sharded checkpoint at step 1, resumed to step 2
  c_rl_torch  one RC-GRPO step, HF generator on CUDA, torch backend: per-stage seconds
  f_shared_prefix  one group (P = 5400, S = 300, G = 5) at the Llama-3.1-8B layer shape, 4 layers, bf16: the
              training forward+backward with the prompt computed once against every row in full, without and
              with gradient checkpointing (time, peak memory, the largest logprob difference;
              scripts/bench/shared_prefix_gpu.py, one timed round after one warm-up: 8 passes in all)

The limits add up to less than the deadline (the dry run checks it), so every step gets its turn; a step that
ends early leaves its time to the rest. Results come back through the device tool's ``$OUT`` (the default
``--out`` where OUT is set): ``summary.json`` (per step: ok, seconds, numbers, the log's tail; what was skipped
and why), ``versions.txt`` and ``logs.tar.gz`` (each step's log, capped), rewritten after every step. The work
folder (models, checkpoints: gigabytes) lies outside ``--out`` (``--work``).

``--dry-run`` (CPU, in ``make test``): every step's config composes and validates; every third-party module the
package and the step scripts import (function-level imports too) is on the lent machine
(scripts/gpu_machine.txt) or carried (scripts/gpu_wheels.txt), and the steps' modules import in a process where
nothing else is importable; the carried wheels' pins are the versions tested here and, once prepared, their
tags install on the machine's Python and platform; the limits fit the deadline and the deadline fits the
device's 10 minutes; the results go under ``$OUT`` and fit what the device tool brings back.

``--rehearse`` (CPU): the whole plan, tiny shapes, limits x 15, with only the machine's packages importable.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from scripts import gpu_machine

REPO = Path(__file__).resolve().parents[1]
WHEELS = gpu_machine.WHEELS
SITE = REPO / "scripts" / "gpu_site"  # sitecustomize: only the machine's packages import (dry run, rehearsal)
DEVICE_LIMIT_S = 600.0  # one device command
INSTALL_S = 45.0  # gpu_check.sh before the check: the wheels' install, the versions (measured: a few s)
DEADLINE_S = 540.0  # the check itself
RESERVE_S = 10.0  # the summary, the tarball, the last process's exit
LOG_CAP = 1 << 20  # bytes of each step's log in logs.tar.gz (its tail)
RETURN_FILE_LIMIT, RETURN_FILES = 16 << 20, ("summary.json", "versions.txt", "logs.tar.gz")
CARRY_LIMIT = 64 << 20  # what travels with the checkout
PY = sys.executable
TRAIN = [PY, str(REPO / "nemo_rcgrpo" / "train.py")]
NO_LOGS = ["logging.tensorboard=false", "logging.progress=false", "logging.wandb.enabled=false"]
# what the steps import at their start (the lazy imports are found by the dry run's scan of the source)
IMPORTS = (
    "nemo_rcgrpo.train",
    "nemo_rcgrpo.recipes.stage1",
    "nemo_rcgrpo.recipes.rl",
    "nemo_rcgrpo.prepare_data",
    "nemo_rcgrpo.models.megatron.policy",
    "nemo_rcgrpo.models.torch_policy",
    "nemo_rcgrpo.data.dataset",
    "nemo_rcgrpo.data.rl_tasks",
    "megatron.core",
    "bfcl_eval",
    "hydra",
    "omegaconf",
    "antlr4",
    "safetensors",
    "datasets",
    "scripts.bench.megatron_gpu",
    "scripts.bench.train_throughput",
    "scripts.bench.shared_prefix_gpu",
)
STEP_SCRIPTS = (
    "scripts/__init__.py",
    "scripts/gpu_check.py",
    "scripts/gpu_machine.py",
    "scripts/bench/__init__.py",
    "scripts/bench/megatron_gpu.py",
    "scripts/bench/train_throughput.py",
    "scripts/bench/_common.py",
    "scripts/bench/shared_prefix_gpu.py",
)
VERSIONS = (
    "torch",
    "transformers",
    "triton",
    "pyarrow",
    "fsspec",
    "packaging",
    "datasets",
    "dill",
    "multiprocess",
    "megatron-core",
    "bfcl-eval",
    "hydra-core",
    "omegaconf",
    "safetensors",
    "accelerate",
    "numpy",
    "huggingface-hub",
    "tokenizers",
    "transformer-engine",
    "apex",
)


def _metric_values(record: dict) -> dict:
    """A metrics.jsonl record with its non-finite values ("nan", "inf", "-inf") as floats again."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}


def plan(work: Path, rehearse: bool = False) -> list[dict]:
    """The steps by value: name, argv or recipe + overrides, time limit. ``rehearse`` (CPU): tiny shapes, x 15."""
    model, data, cuda = work / "smollm2-random", work / "data", not rehearse and _cuda()
    stage1 = [
        f"run_dir={work / 'stage1'}",
        f"model.path={model}",
        "model.dtype=bfloat16",
        f"data.dir={data}",
        "data.max_examples=32",
        f"trainer.max_steps={2 if rehearse else 8}",
        "trainer.save_every=8",
        "trainer.lr=1.0e-5",
        *(["chat.max_length=512"] if rehearse else []),
        *NO_LOGS,
    ]
    # stage 1's export or nothing: rl.stage1_recipe=null, so a failed a_stage1 fails these instead of training one
    rl = [
        f"model.path={work / 'stage1' / 'hf'}",
        "model.dtype=bfloat16",
        f"data.dir={data}",
        "rl.eval_every=0",
        "rl.stage1_recipe=null",
        *NO_LOGS,
    ]
    resume = [
        f"run_dir={work / 'rl_megatron'}",
        "policy.backend=megatron",
        "trainer.max_steps=2",
        "trainer.save_every=1",
        *rl,
    ]
    bench = lambda name: [PY, "-m", f"scripts.bench.{name}"]  # noqa: E731 - run from the checkout's root (cwd=REPO)
    megatron = ["--layers", "8", "--fallback-layers", "4", "--micro-batches", "4", "--steps", "5", "--warmup", "2"]
    # a batch that fills the GPU: 4 micro-batches of 8 sequences (RCTP-FT lines, compact tools, <= 2048 tokens:
    # 1165 of the 1600 fit with SmolLM2's tokenizer, 160 are needed)
    throughput = (
        ["--micro", "4", "--batch", "8", "--max-length", "2048", "--steps", "4"]
        if cuda
        else ["--micro", "2", "--batch", "1", "--max-length", "512", "--steps", "1"]
    )  # 5 lines of the data fit in 512
    steps = [
        {
            "name": "preflight",
            "limit": 40,
            "argv": [PY, "-m", "scripts.gpu_check", "--preflight", str(work / "preflight.json")],
        },
        {"name": "setup", "limit": 30, "argv": [PY, "-m", "scripts.gpu_check", "--make-model", str(model)]},
        {
            "name": "b_megatron",
            "limit": 115,
            "argv": [
                *bench("megatron_gpu"),
                *(megatron if cuda else ["--tiny"]),
                "--json",
                str(work / "megatron_gpu.json"),
            ],
        },
        {"name": "a_stage1", "limit": 70, "recipe": "smoke_stage1", "overrides": stage1},
        {
            "name": "e_torch_vs_bare",
            "limit": 70,
            "argv": [
                *bench("train_throughput"),
                "--model",
                str(model),
                "--data",
                str(data),
                "--dtype",
                "bfloat16",
                "--device",
                "cuda" if cuda else "cpu",
                *throughput,
                "--json",
                str(work / "train_throughput.json"),
            ],
        },
        # the Megatron RL step (per-stage seconds from its step 1), stopped after its checkpoint, then resumed
        {
            "name": "d_resume",
            "limit": 115,
            "recipe": "smoke_rl",
            "overrides": [*resume, "trainer.stop_after=1"],
            "then": resume,
        },
        {
            "name": "c_rl_torch",
            "limit": 60,
            "recipe": "smoke_rl",
            "overrides": [f"run_dir={work / 'rl_torch'}", "trainer.max_steps=1", "trainer.save_every=1", *rl],
        },
        {
            "name": "f_shared_prefix",
            "limit": 30,
            "argv": [
                *bench("shared_prefix_gpu"),
                *([] if cuda else ["--tiny"]),
                "--repeats",
                "1",
                "--json",
                str(work / "shared_prefix_gpu.json"),
            ],
        },
    ]
    for step in steps if rehearse else ():  # bf16 on 2 CPU cores is slow: the rehearsal checks mechanics, not time
        step["limit"] *= 15
    return steps


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def make_model(target: Path) -> None:
    """SmolLM2-135M's shape with random weights (bf16), with its tokenizer, as an HF folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = REPO / "build" / "gpu" / "smollm2"
    if not (source / "config.json").is_file():
        from nemo_rcgrpo.models.hf import smollm2_model_dir

        source = smollm2_model_dir()  # a CPU machine with the SmolLM2 wheel
    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(source), local_files_only=True).save_pretrained(target)
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))


# ---------------------------------------------------------------------------------------------- preflight
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in VERSIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def preflight(path: Path) -> dict:
    """About 20 s: versions, the steps' imports, a torch.compile probe, a one-rank all-reduce, the matmul ceiling."""
    import torch

    found: dict = {"versions": versions(), "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found["versions"].items()), flush=True)
    found["imports_failed"] = {}
    for module in IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - every import failure is recorded
            found["imports_failed"][module] = f"{type(e).__name__}: {e}"
    cuda = torch.cuda.is_available()
    if cuda:
        found["device"] = torch.cuda.get_device_name()
        t0 = time.perf_counter()
        try:  # megatron's jit_fuser is torch.compile wherever triton imports: does it compile here at all?
            y = torch.compile(lambda x: torch.nn.functional.silu(x) * x + 1)(torch.ones(64, device="cuda"))
            found["compile"] = {"ok": bool(torch.isfinite(y).all()), "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # noqa: BLE001 - a failed compile is a result of the check
            found["compile"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    found["all_reduce"] = _all_reduce("nccl" if cuda else "gloo")
    if cuda:
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        found["matmul_bf16_tflops"] = round(2 * 8192**3 * 10 / (time.perf_counter() - t0) / 1e12, 1)
    path.write_text(json.dumps(found, indent=1))
    print(json.dumps(found), flush=True)
    return found


def _all_reduce(backend: str) -> dict:
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        x = torch.ones(4, device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(x)
        ok = float(x.sum()) == 4.0
        dist.destroy_process_group()
        return {"backend": backend, "ok": ok}
    except Exception as e:  # noqa: BLE001 - a failed backend is a result of the check
        return {"backend": backend, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


# ---------------------------------------------------------------------------------------------- reading results
def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [_metric_values(json.loads(l)) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def _changed_share(before: Path, after: Path) -> float | None:
    from safetensors.torch import load_file

    a = {k: v for f in sorted(before.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(after.glob("*.safetensors")) for k, v in load_file(f).items()}
    shared = [k for k in a if k in b and a[k].shape == b[k].shape]
    total = sum(a[k].numel() for k in shared)
    return sum(int((a[k] != b[k]).sum()) for k in shared) / total if total else None


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _stage_seconds(run_dir: Path) -> dict:
    return {k: v for m in _metrics(run_dir)[:1] for k, v in m.items() if k.endswith("_seconds") or k == "tokens_per_s"}


def results(name: str, work: Path) -> dict:
    if name == "preflight":
        return {k: v for k, v in _json(work / "preflight.json").items() if k != "versions"}
    if name == "a_stage1":
        steps = [m for m in _metrics(work / "stage1") if "tokens_per_s" in m]
        return {
            "tokens_per_s": [m["tokens_per_s"] for m in steps][-3:],
            "steps": len(steps),
            "weights_changed_share_bf16": _changed_share(work / "smollm2-random", work / "stage1" / "hf"),
        }
    if name == "b_megatron":
        return _json(work / "megatron_gpu.json")
    if name == "e_torch_vs_bare":
        return _json(work / "train_throughput.json")
    if name == "f_shared_prefix":
        return _json(work / "shared_prefix_gpu.json")
    if name == "c_rl_torch":
        return {"step_1": _stage_seconds(work / "rl_torch")}
    if name == "d_resume":
        steps = _metrics(work / "rl_megatron")
        return {
            "step_1": _stage_seconds(work / "rl_megatron"),
            "steps_logged": [m.get("step") for m in steps if "step" in m],
            "checkpoints": sorted(p.name for p in (work / "rl_megatron" / "checkpoints").glob("step_*")),
        }
    return {}


# ---------------------------------------------------------------------------------------------- running
def _run(argv: list[str], limit: float, log: Path, env: dict) -> tuple[bool, float]:
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        # a session of its own: a time-out stops the step's whole process tree (data preparation, checkpoint
        # writers, torchrun's workers), so nothing of it holds GPU memory into the next step
        proc = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\n[gpu_check] timed out after {limit:.0f} s\n")
            rc = 124
    return rc == 0, time.perf_counter() - t0


def step_env(work: Path, machine_only: bool) -> dict:
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", TORCHINDUCTOR_CACHE_DIR=str(work / "inductor")
    )  # one compile cache: later processes reuse it
    if machine_only:
        env["RCGRPO_GPU_MACHINE_ONLY"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    return env


def write_results(out: Path, logs: Path, summary: dict) -> None:
    """summary.json and logs.tar.gz (every log's last LOG_CAP bytes) under ``out``: what the device brings back."""
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    with tarfile.open(out / "logs.tar.gz.part", "w:gz") as tar:
        for log in sorted(logs.glob("*.log")):
            data = log.read_bytes()[-LOG_CAP:]
            info = tarfile.TarInfo(f"logs/{log.name}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    (out / "logs.tar.gz.part").replace(out / "logs.tar.gz")


def run(out: Path, work: Path, rehearse: bool = False) -> int:
    if not (REPO / "build" / "gpu" / "smollm2" / "config.json").is_file():
        print(
            "error: build/gpu is not prepared (the model's config and the carried wheels): run "
            "`bash scripts/gpu_check.sh --prepare` first",
            file=sys.stderr,
        )
        return 2
    for old in [work, *(out / name for name in RETURN_FILES)]:  # a warm machine keeps an earlier run's files
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    logs = work / "logs"
    logs.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    env = step_env(work, machine_only=rehearse)
    start = time.perf_counter()
    summary: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rehearsal": rehearse,
        "versions": versions(),
        "deadline_s": None if rehearse else DEADLINE_S,
        "steps": {},
        "skipped": {},
    }
    (out / "versions.txt").write_text(
        "".join(
            f"{d.metadata['Name']}=={d.version}\n"
            for d in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
        )
    )
    for step in plan(work, rehearse):
        name = step["name"]
        left = (1e9 if rehearse else DEADLINE_S - RESERVE_S) - (time.perf_counter() - start)
        if left < 15:
            summary["skipped"][name] = f"the check's deadline ({DEADLINE_S:.0f} s): {left:.0f} s left"
            continue
        log = logs / f"{name}.log"
        runs = [step["argv"]] if "argv" in step else [TRAIN + ["--config-name", step["recipe"], *step["overrides"]]]
        if "then" in step:
            runs.append(TRAIN + ["--config-name", step["recipe"], *step["then"]])
        ok, seconds = True, 0.0
        for argv in runs:
            if ok:
                done, took = _run(argv, min(step["limit"] - seconds, left - seconds), log, env)
                ok, seconds = done, seconds + took
        try:
            found = results(name, work)
        except Exception as e:  # noqa: BLE001 - a result that cannot be read is recorded, not fatal
            found = {"error": f"{type(e).__name__}: {e}"}
        if name == "preflight" and not found.get("compile", {"ok": True})["ok"]:
            env["TORCH_COMPILE_DISABLE"] = "1"  # megatron's fused kernels run eagerly in every later step
            summary["torch_compile"] = "disabled after the preflight's probe failed: " + found["compile"].get(
                "error", ""
            )
        summary["steps"][name] = {
            "ok": ok,
            "seconds": round(seconds, 1),
            "limit": step["limit"],
            **found,
            "log_tail": log.read_text(errors="replace")[-1500:] if not ok else "",
        }
        print(f"[gpu_check] {name}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
        summary["seconds"] = round(time.perf_counter() - start, 1)
        write_results(out, logs, summary)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    write_results(out, logs, summary)
    print(f"[gpu_check] results: {', '.join(str(out / n) for n in RETURN_FILES)}", flush=True)
    return 0 if all(s.get("ok") for s in summary["steps"].values()) and not summary["skipped"] else 1


# ---------------------------------------------------------------------------------------------- dry run
def dry_run(
    work: Path,
    out: Path,
    machine: Path = gpu_machine.MACHINE,
    wheels: Path = WHEELS,
    wheel_dir: Path = REPO / "build" / "gpu" / "wheels",
) -> list[str]:
    """Problems with the plan on the lent machine (empty: it holds)."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    problems = []
    steps = plan(work)
    for step in steps:
        if "recipe" in step:
            for overrides in (step["overrides"], step.get("then")):
                try:
                    if overrides is not None:
                        TrainConfig.from_dict(compose(step["recipe"], overrides))
                except Exception as e:  # noqa: BLE001 - every recipe's problem is listed
                    problems.append(f"{step['name']}: {step['recipe']} {' '.join(overrides)}: {e}")
        elif step["argv"][1] == "-m" and importlib.util.find_spec(step["argv"][2]) is None:
            problems.append(f"{step['name']}: no module {step['argv'][2]}")
        elif step["argv"][1] != "-m" and not Path(step["argv"][1]).is_file():
            problems.append(f"{step['name']}: {step['argv'][1]} does not exist")
    # the packages: every import in the source (lazy ones too), then the steps' modules in a process that sees
    # only the machine's packages and the carried wheels
    allowed = gpu_machine.allowed_distributions(machine, wheels)
    files = sorted((REPO / "nemo_rcgrpo").rglob("*.py")) + [REPO / s for s in STEP_SCRIPTS]
    problems += gpu_machine.import_problems(files, allowed)
    problems += machine_imports(machine, wheels)
    problems += pin_problems(wheels)
    if wheel_dir.is_dir():  # prepared here: the wheels that will travel
        present = sorted(wheel_dir.glob("*.whl"))
        problems += gpu_machine.wheel_problems(present)
        names = {gpu_machine.normalise(p.name.split("-")[0]) for p in present}
        problems += [
            f"{wheel_dir}: no wheel of {n} (run gpu_check.sh --prepare)"
            for n, _ in gpu_machine.carried(wheels)
            if gpu_machine.normalise(n) not in names
        ]
        size = sum(p.stat().st_size for p in wheel_dir.parent.rglob("*") if p.is_file())
        if size > CARRY_LIMIT // 2:
            problems.append(
                f"{wheel_dir.parent} holds {size / 2**20:.0f} MiB: the checkout and what it carries "
                f"travel in {CARRY_LIMIT >> 20} MiB (run gpu_check.sh --prepare again)"
            )
    problems += budget_problems(steps)
    problems += output_problems(out, work, len(steps))
    return problems


def machine_imports(machine: Path, wheels: Path) -> list[str]:
    code = (
        "import sys, importlib\n"  # -c in the checkout's root (cwd=REPO): scripts and nemo_rcgrpo import from it
        "from scripts import gpu_machine; gpu_machine.install_blocker(gpu_machine.allowed_distributions("
        "gpu_machine.Path(sys.argv[1]), gpu_machine.Path(sys.argv[2])))\n"
        "bad = []\n"
        "for m in sys.argv[3:]:\n"
        "    try: importlib.import_module(m)\n"
        "    except Exception as e: bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "try:\n"  # the schemas' lazy imports (the loaders' datasets)
        "    from nemo_rcgrpo.data.dataset import features; from nemo_rcgrpo.data.rl_tasks import pointer_features\n"
        "    features(); pointer_features()\n"
        "except Exception as e: bad.append(f'the data schemas: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run(
        [PY, "-c", code, str(machine), str(wheels), *IMPORTS],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    if proc.returncode == 0:
        return []
    lines = [l for l in proc.stdout.splitlines() if l.strip()] or proc.stderr.strip().splitlines()[-1:]
    return [f"on the machine's packages only: import {l}" for l in lines]


def pin_problems(wheels: Path) -> list[str]:
    problems = []
    pins = dict(gpu_machine.carried(wheels))
    for name, version in pins.items():
        try:
            here = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{wheels.name}: {name} is not installed here, so nothing tests the version that travels")
            continue
        if here != version:
            problems.append(f"{wheels.name}: {name}=={version}, but {here} is installed and tested here")
    if "megatron-core" not in pins:
        problems.append(f"{wheels.name} does not list megatron-core")
    return problems


def budget_problems(steps: list[dict]) -> list[str]:
    total = sum(s["limit"] for s in steps)
    problems = []
    if total + RESERVE_S > DEADLINE_S:
        problems.append(
            f"the step limits add up to {total:.0f} s (+ {RESERVE_S:.0f} s to write the results), over "
            f"the {DEADLINE_S:.0f} s deadline: the last steps would never run"
        )
    if DEADLINE_S + INSTALL_S > DEVICE_LIMIT_S:
        problems.append(
            f"the deadline {DEADLINE_S:.0f} s + {INSTALL_S:.0f} s of install exceed the device's "
            f"{DEVICE_LIMIT_S:.0f} s a command"
        )
    return problems


def output_problems(out: Path, work: Path, n_steps: int) -> list[str]:
    problems = []
    target = os.environ.get("OUT")
    if target and not out.resolve().is_relative_to(Path(target).resolve()):
        problems.append(f"results go to {out}, not under $OUT={target}: the device tool brings back $OUT only")
    if work.resolve().is_relative_to(out.resolve()):
        problems.append(f"the work folder {work} is inside {out}: gigabytes the device tool would not bring back")
    if len(RETURN_FILES) > 8:
        problems.append(f"{len(RETURN_FILES)} result files: the device tool brings back 8")
    if LOG_CAP * n_steps > RETURN_FILE_LIMIT:
        problems.append(
            f"logs.tar.gz may hold {LOG_CAP * n_steps >> 20} MiB of logs, over the device tool's "
            f"{RETURN_FILE_LIMIT >> 20} MiB a file"
        )
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "build" / "gpu" / "check"
    p.add_argument("--out", type=Path, default=default_out, help="results (default: $OUT where set)")
    p.add_argument("--work", type=Path, default=Path("/tmp/rcgrpo_gpu_check"), help="models, runs, checkpoints")
    p.add_argument("--dry-run", action="store_true", help="validate the plan on any machine; train nothing")
    p.add_argument("--make-model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--preflight", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--check-wheels", type=Path, help="the wheels in this folder install on the machine (tags)")
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="run the plan on CPU with only the machine's packages importable (tiny shapes): checks the "
        "mechanics, measures nothing about GPUs",
    )
    args = p.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return 0
    if args.preflight:
        found = preflight(args.preflight)
        return 1 if found["imports_failed"] or not found["all_reduce"]["ok"] else 0
    if args.check_wheels:
        problems = gpu_machine.wheel_problems(sorted(args.check_wheels.glob("*.whl")))
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 1 if problems else 0
    if args.dry_run:
        problems = dry_run(args.work, args.out)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        steps = plan(args.work)
        print(
            f"gpu_check dry run: {len(steps)} steps ({', '.join(s['name'] for s in steps)}), limits "
            f"{sum(s['limit'] for s in steps):.0f} s of {DEADLINE_S:.0f} s; "
            f"{'plan ok' if not problems else f'{len(problems)} problems'}"
        )
        return 1 if problems else 0
    if not _cuda() and not args.rehearse:
        print("error: no CUDA device here; use --dry-run (or --rehearse) to check the plan on CPU", file=sys.stderr)
        return 2
    return run(args.out, args.work, rehearse=args.rehearse and not _cuda())


if __name__ == "__main__":
    sys.exit(main())
