"""A vLLM OpenAI-compatible server as the rollout generator: launch, attach, weight sync, `rcgrpo serve`.

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
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from nemo_rcgrpo.generation.base import Completion, SamplingParams
from nemo_rcgrpo.generation.vllm_client import GeneratorError, GeneratorUnavailable, VLLMClient, WeightSyncError
from nemo_rcgrpo.utils.dist import free_port  # noqa: F401 - also importable from here, as before
from nemo_rcgrpo.utils.weight_stream import WeightStream

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
@dataclass
class ServerSpec:
    model: str  # local HF folder (weights + tokenizer)
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    tp: int = 1
    dtype: str = "float32"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    kv_cache_gib: int = 2  # CPU builds: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = False
    devices: str | None = None  # CUDA_VISIBLE_DEVICES
    python: str | None = None  # an interpreter with vLLM installed (default: this one)
    worker_extension: bool = True  # load vllm_worker.WeightReceiver into the workers (the collective transfer)
    extension_dir: str | None = None  # where its standalone copy is written (default: beside the log)
    extra_args: tuple[str, ...] = field(default_factory=tuple)


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process: start, wait for health, stop."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec, self.log_path = spec, Path(log_path)
        self.port = spec.port or free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        s = self.spec
        cmd = [s.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model,
               "--served-model-name", SERVED_NAME, "--host", s.host, "--port", str(self.port),
               "--tensor-parallel-size", str(s.tp), "--dtype", s.dtype, "--seed", str(s.seed),
               "--gpu-memory-utilization", str(s.gpu_memory_utilization),
               "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log"]
        if s.max_model_len:
            cmd += ["--max-model-len", str(s.max_model_len)]
        if s.enforce_eager:
            cmd.append("--enforce-eager")
        if s.worker_extension:
            cmd += ["--worker-extension-cls", f"{EXTENSION_MODULE}.WeightReceiver"]
        return cmd + list(s.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(self.spec.kv_cache_gib))
        if self.spec.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.spec.devices
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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.spec.worker_extension:
            self._write_extension()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        (self.log_path.parent / "server.pid").write_text(f"{self.proc.pid}\n")
        client = VLLMClient(self.url)
        deadline = time.monotonic() + timeout
        while not client.healthy():
            if (why := self.exit_reason()) is not None:
                raise GeneratorUnavailable(f"vLLM server did not start: {why}")
            if time.monotonic() > deadline:
                self.stop()
                raise GeneratorUnavailable(f"vLLM server {self.url} not healthy after {timeout:.0f} s "
                                           f"(generation.vllm.startup_timeout); log: {self.log_path}")
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
def _save(tensors: dict[str, torch.Tensor], folder: Path, dtypes: dict[str, torch.dtype] | None = None) -> None:
    """One safetensors file; names sharing storage (tied embeddings) are written as separate copies."""
    from safetensors.torch import save_file

    cpu, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu", (dtypes or {}).get(name, t.dtype)).contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        cpu[name] = t.clone() if key in seen else t
        seen.add(key)
    save_file(cpu, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _manifest(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                out[name] = (tuple(sl.get_shape()), getattr(torch, _ST_DTYPES.get(sl.get_dtype(), "float32")))
    return out


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64", "I32": "int32"}


def _atomic_write(folder: Path, write) -> Path:
    from nemo_rcgrpo.utils.atomic import staged_folder

    with staged_folder(folder) as tmp:
        write(tmp)
    return folder


class FolderSync:
    """Weights through the filesystem: checked, written to ``weight_dir/v<version>``, reloaded by every worker."""

    def __init__(self, client: VLLMClient, weight_dir: Path, rpc_timeout: float):
        self.client, self.weight_dir, self.rpc_timeout = client, Path(weight_dir), rpc_timeout
        self.manifest: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self.serving: Path | None = None  # the folder the server holds now (rollback target)

    def check(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The tensors to write, in the served names, copied to host memory as they arrive (a GPU policy's stream
        never holds the whole model on its device); WeightSyncError (before anything is sent) if they do not fit."""
        tensors = {n: t.detach().cpu() for n, t in weights}
        self.check_meta([(n, tuple(t.shape)) for n, t in tensors.items()])
        return tensors

    def check_meta(self, meta) -> None:
        """WeightSyncError unless ``meta`` ([(name, shape, ...)]) has the served model's names and shapes."""
        if self.manifest is None:
            return
        shapes = {m[0]: tuple(m[1]) for m in meta}
        unknown = sorted(set(shapes) - set(self.manifest))
        missing = sorted(set(self.manifest) - set(shapes))
        wrong = [f"{n} {s} (served {self.manifest[n][0]})" for n, s in shapes.items()
                 if n in self.manifest and s != self.manifest[n][0]]
        if unknown or missing or wrong:
            raise WeightSyncError("weights do not fit the served model: " + "; ".join(
                f"{what} {items[:3]}{' ...' if len(items) > 3 else ''}" for what, items in
                (("unknown", unknown), ("missing", missing), ("wrong shape", wrong)) if items) +
                "; nothing was sent, the previous weights are still serving")

    def push(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        if isinstance(weights, (str, Path)):
            folder = Path(weights)
            if self.manifest is not None and _manifest(folder) != self.manifest:
                raise WeightSyncError(f"{folder}: tensors differ from the served model's names/shapes/dtypes; "
                                      f"nothing was sent, the previous weights are still serving")
        else:
            tensors = self.check(weights)
            dtypes = {n: d for n, (_, d) in (self.manifest or {}).items()}
            folder = _atomic_write(self.weight_dir / f"v{version}", lambda tmp: _save(tensors, tmp, dtypes))
        self.reload(folder, version)
        if self.manifest is None:
            self.manifest = _manifest(folder)

    def reload(self, folder: Path, version: int) -> None:
        previous = self.serving
        self.client.pause()
        try:
            try:
                self.client.collective_rpc("reload_weights", {"weights_path": str(folder.resolve())}, self.rpc_timeout)
            except GeneratorUnavailable:
                raise
            except GeneratorError as e:
                self._roll_back(previous, version, e)
        finally:
            self.client.resume()
        self.serving = folder
        self.keep_only(folder)

    def keep_only(self, folder: Path) -> None:
        """Delete every weight folder but ``folder`` (the one being served)."""
        for old in self.weight_dir.glob("v*"):
            if old.is_dir() and old.resolve() != folder.resolve() and old.name[1:].isdigit():
                shutil.rmtree(old, ignore_errors=True)

    def _roll_back(self, previous: Path | None, version: int, error: GeneratorError):
        if previous is None:
            raise WeightSyncError(f"weight update to version {version} failed on the server: {error}") from None
        try:
            self.client.collective_rpc("reload_weights", {"weights_path": str(previous.resolve())}, self.rpc_timeout)
        except GeneratorError as again:
            raise GeneratorUnavailable(f"weight update to version {version} failed ({error}) and reloading the "
                                       f"previous weights {previous} failed too ({again}): restart the server") from None
        raise WeightSyncError(f"weight update to version {version} failed on the server ({error}); "
                              f"the previous weights ({previous.name}) are still serving") from None


def _with_lm_head(weights: Iterable[tuple[str, torch.Tensor]], tied: bool) -> dict[str, torch.Tensor]:
    """The tensors as a dict; a tied model gets ``lm_head.weight`` (a copy of the embedding) where the source
    omits it, as Megatron's export does: the served model is untied, so its output layer must be sent too."""
    tensors = {n: t.detach().cpu() for n, t in weights}  # host copies as they arrive: the folder is written from them
    embed = tensors.get("model.embed_tokens.weight")
    if tied and embed is not None and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = embed.detach().clone()
    return tensors


def _stream_with_lm_head(weights, tied: bool) -> WeightStream:
    """``_with_lm_head`` for a stream: the embedding is sent a second time, last, as ``lm_head.weight``."""
    stream = weights if isinstance(weights, WeightStream) else WeightStream.of(weights)
    names = {m[0]: m for m in stream.meta}
    embed = names.get("model.embed_tokens.weight")
    if not tied or embed is None or "lm_head.weight" in names:
        return stream

    def export():
        kept = None
        for name, tensor in stream:
            kept = tensor if name == embed[0] else kept
            yield name, tensor
        yield "lm_head.weight", kept

    return WeightStream(stream.meta + [("lm_head.weight", embed[1], embed[2])], export)


# ---------------------------------------------------------------------- generator
def managed_server_devices(devices: str | None, visible: list[str] | None, local_world: int,
                           generation_gpus: int) -> str | None:
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
            raise GeneratorError(f"a vLLM server started by the run needs GPUs of its own: the trainer's {local_world} "
                                 f"process(es) use GPU(s) {','.join(trainer)} of {','.join(visible)}; set "
                                 f"layout.generation_gpus to at most {len(spare)} (and start fewer trainer processes), "
                                 f"or generation.vllm.devices")
        return ",".join(spare[len(spare) - generation_gpus:])
    shared = [d for d in devices.split(",") if d.strip() in trainer]
    if shared:
        raise GeneratorError(f"generation.vllm.devices={devices} includes GPU(s) {','.join(shared)} that trainer ranks "
                             f"use ({','.join(trainer)}): a server and a trainer rank cannot share a GPU")
    return devices


def _visible_gpus() -> list[str] | None:
    if not torch.cuda.is_available():
        return None
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in env.split(",") if d.strip()] if env else [str(i) for i in range(torch.cuda.device_count())]


class VLLMGenerator:
    """The ``Generator`` over a vLLM server (managed or attached); started on first use."""

    def __init__(self, vcfg: Any, *, model: Any, tokenizer: Any, weight_dir: Path, dtype: str,
                 reward_tokens: tuple[str, ...] = (), model_path: str | None = None, generation_gpus: int = 0):
        self.vcfg, self.model, self.tokenizer, self.model_path = vcfg, model, tokenizer, model_path
        self.generation_gpus = generation_gpus  # layout.generation_gpus: a managed server's GPUs when devices is unset
        self.weight_dir, self.reward_tokens = Path(weight_dir), reward_tokens
        self.dtype = dtype if vcfg.dtype == "auto" else vcfg.dtype
        self.version = 0
        self.server: VLLMServer | None = None
        self.client: VLLMClient | None = None
        self.sync: FolderSync | CollectiveSync | None = None
        self._tied: bool | None = None

    @property
    def weight_sync(self) -> str:
        """'collective' (auto; also 'nccl', which insists on NCCL) or 'folder'."""
        return "folder" if self.vcfg.weight_sync == "folder" else "collective"

    def start(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, version: int = 0) -> None:
        """Attach to ``url``, or serve ``weights`` (default: the model's own) from ``weight_dir/v<version>``."""
        if self.client is not None:
            return
        v = self.vcfg
        folder = None
        if v.url:
            url, alive = v.url, None
        else:
            devices = managed_server_devices(v.devices, _visible_gpus(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                             self.generation_gpus)
            folder = self._write_initial(weights if weights is not None else self.model.state_dict().items(), version)
            spec = ServerSpec(model=str(folder.resolve()), host=v.host, port=v.port, tp=v.tp, dtype=self.dtype,
                              max_model_len=v.max_model_len, gpu_memory_utilization=v.gpu_memory_utilization,
                              seed=v.seed, kv_cache_gib=v.kv_cache_gib, enforce_eager=v.enforce_eager,
                              devices=devices, python=v.python, worker_extension=self.weight_sync == "collective",
                              extra_args=tuple(v.extra_args))
            self.server = VLLMServer(spec, self.weight_dir / "server.log")
            try:
                url = self.server.start(v.startup_timeout)
            except BaseException:
                self.server.stop()
                raise
            alive = self.server.exit_reason
        client = VLLMClient(url, request_timeout=v.request_timeout, max_retries=v.max_retries,
                            max_concurrency=v.max_concurrency, alive=alive)
        if not client.healthy() and v.url:
            raise GeneratorUnavailable(f"vLLM server {url} (generation.vllm.url) is not answering /health; "
                                       f"start it with `rcgrpo serve MODEL --port ...` or set generation.vllm.url=null")
        self._check_reward_tokens(client)
        folders = FolderSync(client, self.weight_dir, v.request_timeout)
        if folder is not None:
            folders.manifest, folders.serving = _manifest(folder), folder
            folders.keep_only(folder)  # folders of an earlier server (a resumed run) are stale
        self.sync = folders
        if self.weight_sync == "collective":
            from nemo_rcgrpo.generation.weight_transfer import CollectiveSync

            self.sync = CollectiveSync(client, v.nccl_master, v.request_timeout, folders,
                                       backend="nccl" if v.weight_sync == "nccl" else None,
                                       default_dtype=DTYPES[self.dtype])
        self.client = client
        client.set_weight_version(version)
        self.version = version

    def _write_initial(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
        """The served folder: config, tokenizer, weights. Tied embeddings are served untied (lm_head written as
        its own tensor): vLLM's in-place reload on CPU refreshes the embedding but not a tied output layer."""
        config = self._hf_config()
        tensors = _with_lm_head(weights, self.tied)
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None:
            config.vocab_size = int(embed.shape[0])  # reward tokens (and any vocabulary padding) included
        if self.tied and "lm_head.weight" in tensors:
            config.tie_word_embeddings = False

        def write(tmp: Path) -> None:
            config.save_pretrained(tmp)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            _save(tensors, tmp, {n: DTYPES[self.dtype] for n, t in tensors.items() if t.is_floating_point()})

        return _atomic_write(self.weight_dir / f"v{version}", write)

    def _hf_config(self):
        """A copy of the policy's HF config (from the model, else from ``model_path``)."""
        import copy

        config = getattr(self.model, "config", None)
        if hasattr(config, "save_pretrained"):
            return copy.deepcopy(config)
        from transformers import AutoConfig  # not an HF module: the config of the model it was built from

        from nemo_rcgrpo.models.hf import resolve_model_path

        return AutoConfig.from_pretrained(str(resolve_model_path(self.model_path)), local_files_only=True)

    @property
    def tied(self) -> bool:
        """Whether the policy ties its output layer to the embedding (then it is served untied)."""
        if self._tied is None:
            self._tied = bool(getattr(self._hf_config(), "tie_word_embeddings", False))
        return self._tied

    def _check_reward_tokens(self, client: VLLMClient) -> None:
        """The served tokenizer must map each reward token to the trainer's single id (the stage-1 export as is)."""
        for token in self.reward_tokens:
            ours = self.tokenizer.convert_tokens_to_ids(token)
            served = client.tokenize(token)
            if served != [ours]:
                raise GeneratorError(f"the served tokenizer at {client.url} encodes reward token {token!r} as "
                                     f"{served}, the trainer's as [{ours}]: serve the policy's own export "
                                     f"(a stage-1 run's hf/ folder) with its tokenizer")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.start()
        return self.client.generate(prompts, params)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        """Push new weights as ``version``. Before the first use this starts the server on them instead."""
        if not isinstance(weights, (str, Path)):
            if self.client is None and not self.vcfg.url:
                self.start(weights, version)  # the served folder gets the untied output layer there
                return
            weights = _stream_with_lm_head(weights, self.tied)
        self.start()
        self.sync.push(weights, version)
        self.client.set_weight_version(version)
        self.version = version

    def close(self) -> None:
        if self.sync is not None and hasattr(self.sync, "close"):
            self.sync.close()
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.client = self.sync = None


def make_vllm_generator(cfg: Any, model: Any, tokenizer: Any) -> VLLMGenerator:
    """The generator of ``generation=vllm`` from a `PolicySetup` (``cfg``): a started or an attached server."""
    v = cfg.generation.vllm
    weight_dir = Path(v.weight_dir) if v.weight_dir else Path(cfg.run_dir) / "generator"
    tokens = (cfg.reward_tokens.high, cfg.reward_tokens.low) if cfg.model.reward_tokens == "special" else ()
    return VLLMGenerator(v, model=model, tokenizer=tokenizer, weight_dir=weight_dir, dtype=cfg.model.dtype,
                         reward_tokens=tokens, model_path=cfg.model.path, generation_gpus=cfg.generation_gpus)


# ---------------------------------------------------------------------- rcgrpo serve
def main(argv: list[str] | None = None) -> int:
    """`rcgrpo serve MODEL`: a vLLM server for attached runs (generation.vllm.url=http://HOST:PORT)."""
    p = argparse.ArgumentParser(prog="rcgrpo serve", description="serve a policy export with vLLM for RL rollouts")
    p.add_argument("model", help="local HF folder (a stage-1 run's hf/ export) or a model name (smollm2, tiny-llama)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="CPU builds: KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--enforce-eager", action="store_true", help="no graph compilation (faster start)")
    p.add_argument("--devices", default=None, help="CUDA_VISIBLE_DEVICES for the server, e.g. 4,5,6,7")
    p.add_argument("--weight-transfer", choices=("collective", "nccl", "none"), default="collective",
                   help="collective (nccl: the same): load the worker extension that receives weights from the trainer "
                        "(weight_sync=auto|collective|nccl); none: folder reloads only (weight_sync=folder)")
    p.add_argument("--reward-tokens", nargs="*", default=["<|high_reward|>", "<|low_reward|>"],
                   help="tokens the served tokenizer must have (empty: no check)")
    p.add_argument("--log", default=None, help="server log file (default: stderr of this command)")
    p.add_argument("--python", default=os.environ.get("RCGRPO_VLLM_PYTHON"),
                   help="interpreter with vLLM installed (default: $RCGRPO_VLLM_PYTHON, else this one; the GPU "
                   "container sets it to its vLLM venv)")
    args = p.parse_args(argv)
    from nemo_rcgrpo.models.hf import ModelFilesError, load_tokenizer, resolve_model_path

    try:
        folder = resolve_model_path(args.model)
        tokenizer = load_tokenizer(str(folder))
    except ModelFilesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    missing = [t for t in args.reward_tokens if t not in tokenizer.get_vocab()]
    if missing:
        print(f"error: {folder} has no reward tokens {missing}: serve a stage-1 export (its hf/ folder), or pass "
              f"--reward-tokens with no value to serve it anyway", file=sys.stderr)
        return 2
    spec = ServerSpec(model=str(folder), host=args.host, port=args.port, tp=args.tp, dtype=args.dtype,
                      max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                      seed=args.seed, kv_cache_gib=args.kv_cache_gib, enforce_eager=args.enforce_eager,
                      devices=args.devices, python=args.python, worker_extension=args.weight_transfer != "none")
    log = Path(args.log) if args.log else Path("/dev/stderr")
    server = VLLMServer(spec, log)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        server.start(timeout=1800)
        print(f"serving {folder} at {server.url} (generation.vllm.url={server.url.replace('0.0.0.0', socket.getfqdn())})",
              flush=True)
        while not stop and server.exit_reason() is None:
            time.sleep(1.0)
    except GeneratorUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0 if stop or server.proc is None or server.proc.returncode in (0, -signal.SIGTERM) else 1


if __name__ == "__main__":
    sys.exit(main())
