"""Runs inside the vLLM server's workers (``--worker-extension-cls``): receives weights from the trainer.

This module imports torch and nothing of vLLM or of the rest of this package, so the server's
environment (the GPU image's ``/opt/vllm`` venv) needs only this file on its path. vLLM mixes
``WeightReceiver`` into every worker; the trainer drives it through the server's ``/collective_rpc``
(``weight_transfer.CollectiveSync``):

- ``rcgrpo_versions()``: torch's and NCCL's versions in the worker (the trainer refuses an NCCL group between
  two NCCL releases, as the GPU image's trainer and vLLM venv may carry).
- ``rcgrpo_join(host, port, world_size, backend, group, timeout_s)``: every worker joins one process group
  with the trainer, through a TCP store the trainer hosts (rank 0 the trainer, ranks 1..W the workers, by
  the worker's rank in vLLM). The group is its own (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a
  ``TCPStore``): neither side's default group is touched.
- ``rcgrpo_receive(meta, buckets)``: the trainer broadcasts the weights as flat buckets (consecutive tensors of
  one dtype, ``buckets`` as [start, end) ranges over ``meta``'s [name, shape, dtype] entries); each worker
  receives them straight into its device and streams the views into
  ``model_runner.reload_weights(weights_iterator=...)``, vLLM's in-place reload (layers that vLLM repacks
  at load time included, which ``load_weights`` after start gets wrong on CPU). Returns the number of
  tensors received (and, with ``verify``, each one's float64 sum, which the trainer compares with its own).

The collective backend is the only thing that differs between CPU (gloo) and GPU (NCCL).
"""

from __future__ import annotations

import datetime
import math
from typing import Iterator

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def make_group(host: str, port: int, rank: int, world_size: int, backend: str, group: str, timeout_s: float):
    """A process group of its own over a TCP store at host:port (rank 0 hosts the store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, int(port), int(world_size), is_master=rank == 0, timeout=timeout)
    prefixed = torch.distributed.PrefixStore(group, store)
    if backend == "nccl":
        return store, torch.distributed.ProcessGroupNCCL(prefixed, rank, int(world_size))
    if backend == "gloo":
        return store, torch.distributed.ProcessGroupGloo(prefixed, rank, int(world_size), timeout)
    raise ValueError(f"weight transfer backend {backend!r}: gloo or nccl")


def broadcast(group, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
    """``tensor`` from rank 0 of ``group`` (in place on the other ranks)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([tensor], opts)
    if timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))


def numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def unpack(flat: torch.Tensor, meta: list) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of a flat bucket as the named tensors of ``meta`` ([name, shape, dtype] each, in order)."""
    offset = 0
    for name, shape, _ in meta:
        n = numel(shape)
        yield name, flat[offset : offset + n].view(*[int(d) for d in shape])
        offset += n
    if offset != flat.numel():
        raise ValueError(f"bucket of {flat.numel()} elements does not match its {len(meta)} tensors ({offset})")


def versions() -> dict:
    """torch's and NCCL's versions in this process (NCCL: None without CUDA)."""
    nccl = None
    if torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    return {"torch": torch.__version__, "nccl": nccl}


class WeightReceiver:
    """Mixed into vLLM's worker class (``--worker-extension-cls nemo_rcgrpo.generation.vllm_worker.WeightReceiver``)."""

    def rcgrpo_versions(self) -> dict:
        return versions()

    def rcgrpo_join(
        self,
        host: str,
        port: int,
        world_size: int,
        backend: str,
        group: str,
        timeout_s: float = 600.0,
        rank_offset: int = 0,
    ) -> int:
        """Join the transfer group: the trainer is rank 0, this engine's workers follow the ``rank_offset`` workers
        of the engines before it."""
        rank = 1 + int(rank_offset) + int(self.rank)
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        self._rcgrpo_store, self._rcgrpo_group = make_group(host, port, rank, world_size, backend, group, timeout_s)
        self._rcgrpo_backend = backend
        return rank

    def rcgrpo_receive(self, meta: list, buckets: list, timeout_s: float = 600.0, verify: bool = False) -> dict:
        """Receive and load one sync; {"tensors": count, "sums": [float64 sum per tensor] with ``verify``}."""
        group = getattr(self, "_rcgrpo_group", None)
        if group is None:
            raise RuntimeError("rcgrpo_receive before rcgrpo_join")
        device = self.device if self._rcgrpo_backend == "nccl" else torch.device("cpu")
        received, sums = [0], []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for start, end in buckets:
                part = meta[start:end]
                dtype = DTYPES[part[0][2]]
                total = sum(numel(shape) for _, shape, _ in part)
                flat = torch.empty(total, dtype=dtype, device=device)
                broadcast(group, flat, timeout_s)
                for name, tensor in unpack(flat, part):
                    received[0] += 1
                    if verify:
                        sums.append(float(tensor.double().sum()))
                    yield name, tensor

        self.model_runner.reload_weights(weights_iterator=stream())
        return {"tensors": received[0], "sums": sums if verify else None}
