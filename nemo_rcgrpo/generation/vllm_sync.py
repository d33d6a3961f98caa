"""Weights to a vLLM server through the filesystem (``generation.vllm.weight_sync=folder``, and the collective
path's fallback): the HF-named tensors are checked against the served names and shapes (vLLM's in-place reload
crashes the engine on a wrong shape and only warns on a missing tensor, so nothing unchecked reaches it), written
to ``weight_dir/v<version>`` whole (`utils/atomic.py`), and every worker reloads them (``/collective_rpc`` of
``reload_weights(weights_path=...)``). A reload that fails on the server is rolled back to the previous folder and
raises ``WeightSyncError``: the old weights keep serving. Many engines (`vllm_engines.EnginePool`) reload the same
folder at once, and are all rolled back if one fails.
"""

from __future__ import annotations

import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from nemo_rcgrpo.generation.vllm_client import GeneratorError, GeneratorUnavailable, VLLMClient, WeightSyncError
from nemo_rcgrpo.utils.weight_stream import WeightStream


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

    with staged_folder(folder, durable=False) as tmp:  # rebuilt from the policy if lost
        write(tmp)
    return folder


class FolderSync:
    """Weights through the filesystem: checked, written to ``weight_dir/v<version>``, reloaded by every worker (a
    `generation.base.WeightSync`)."""

    def __init__(self, client: VLLMClient | Any, weight_dir: Path, rpc_timeout: float, version: int = 0):
        """``client``: one server's client, or an `vllm_engines.EnginePool` (every live engine reloads the same
        folder, and all of them are rolled back if one fails)."""
        self.client, self.weight_dir, self.rpc_timeout = client, Path(weight_dir), rpc_timeout
        self.manifest: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self.serving: Path | None = None  # the folder the server holds now (rollback target)
        self.version = version  # of the weights the server holds (set once a reload has finished)

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
        wrong = [
            f"{n} {s} (served {self.manifest[n][0]})"
            for n, s in shapes.items()
            if n in self.manifest and s != self.manifest[n][0]
        ]
        if unknown or missing or wrong:
            raise WeightSyncError(
                "weights do not fit the served model: "
                + "; ".join(
                    f"{what} {items[:3]}{' ...' if len(items) > 3 else ''}"
                    for what, items in (("unknown", unknown), ("missing", missing), ("wrong shape", wrong))
                    if items
                )
                + "; nothing was sent, the previous weights are still serving"
            )

    def push(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        if isinstance(weights, (str, Path)):
            folder = Path(weights)
            if self.manifest is not None and _manifest(folder) != self.manifest:
                raise WeightSyncError(
                    f"{folder}: tensors differ from the served model's names/shapes/dtypes; "
                    f"nothing was sent, the previous weights are still serving"
                )
        else:
            tensors = self.check(weights)
            dtypes = {n: d for n, (_, d) in (self.manifest or {}).items()}
            folder = _atomic_write(self.weight_dir / f"v{version}", lambda tmp: _save(tensors, tmp, dtypes))
        self.reload(folder, version)
        if self.manifest is None:
            self.manifest = _manifest(folder)

    def reload(self, folder: Path, version: int) -> None:
        previous, clients = self.serving, engines_of(self.client)
        with paused(clients):
            try:
                fan_out(clients, lambda c: c.collective_rpc("reload_weights", _path(folder), self.rpc_timeout))
            except GeneratorUnavailable:
                raise
            except GeneratorError as e:
                self._roll_back(previous, version, e)
        self.serving, self.version = folder, version
        self.keep_only(folder)

    def close(self) -> None:
        """Nothing held between pushes."""

    def keep_only(self, folder: Path) -> None:
        """Delete every weight folder but ``folder`` (the one being served)."""
        for old in self.weight_dir.glob("v*"):
            if old.is_dir() and old.resolve() != folder.resolve() and old.name[1:].isdigit():
                shutil.rmtree(old, ignore_errors=True)

    def _roll_back(self, previous: Path | None, version: int, error: GeneratorError):
        if previous is None:
            raise WeightSyncError(f"weight update to version {version} failed on the server: {error}") from None
        try:
            fan_out(
                engines_of(self.client), lambda c: c.collective_rpc("reload_weights", _path(previous), self.rpc_timeout)
            )
        except GeneratorError as again:
            raise GeneratorUnavailable(
                f"weight update to version {version} failed ({error}) and reloading the "
                f"previous weights {previous} failed too ({again}): restart the server"
            ) from None
        raise WeightSyncError(
            f"weight update to version {version} failed on the server ({error}); "
            f"the previous weights ({previous.name}) are still serving"
        ) from None


def engines_of(client: VLLMClient | Any) -> list[VLLMClient]:
    """The clients a sync addresses: an `EnginePool`'s live engines, or the one client."""
    live = getattr(client, "live", None)
    return list(live) if isinstance(live, list) else [client]


@contextmanager
def paused(clients: list) -> Iterator[None]:
    """Every engine paused (in-flight requests finish first) for the block, and resumed after it, even when it
    fails: an engine that cannot be paused (gone) resumes the ones paused before it, and its error is raised."""
    done = []
    try:
        for c in clients:
            c.pause()
            done.append(c)
        yield
    finally:
        failed = None
        for c in done:
            try:
                c.resume()
            except GeneratorError as e:  # raised below unless the block's own error is on its way
                failed = failed or e
        if failed is not None and sys.exc_info()[0] is None:
            raise failed


def fan_out(clients: list, call: Callable[[Any], Any]) -> list:
    """``call(client)`` on every client at once (a reload takes seconds per engine); the answers in client order,
    or the first error once all have answered (a GeneratorUnavailable before any other)."""
    if len(clients) == 1:
        return [call(clients[0])]
    answers: list = [None] * len(clients)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            answers[i] = call(clients[i])
        except BaseException as e:  # noqa: BLE001 - raised below, once every engine has answered
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if isinstance(e, GeneratorUnavailable)), errors[0])
    return answers


def _path(folder: Path) -> dict[str, str]:
    return {"weights_path": str(folder.resolve())}


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
