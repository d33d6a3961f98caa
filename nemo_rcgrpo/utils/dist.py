"""Process groups from torchrun's environment; gloo on CPU, NCCL on GPU. Single process without torchrun."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def collective_timeout() -> timedelta:
    """How long a rank waits in a collective: rank 0 alone runs rollouts and evaluations while the others wait
    (NCCL's default of 10 minutes is too short for a step's rollouts); ``RCGRPO_DIST_TIMEOUT_MIN``, default 180."""
    return timedelta(minutes=float(os.environ.get("RCGRPO_DIST_TIMEOUT_MIN", "180")))


def init_distributed() -> DistInfo:
    """Join the torchrun group if launched by torchrun (WORLD_SIZE > 1), else run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=collective_timeout())
    return DistInfo(rank, world, local, device)


def all_reduce_sum(value, info: DistInfo, group=None):
    """The sum over ranks of a float, or elementwise of a tensor (a new float64 CPU tensor; the input is kept)."""
    if info.world_size == 1 and not torch.is_tensor(value):
        return value
    device = info.device if info.device.type == "cuda" else "cpu"
    if torch.is_tensor(value):
        t = value.detach().to(device=device, dtype=torch.float64).clone()
    else:
        t = torch.tensor([value], dtype=torch.float64, device=device)
    if info.world_size > 1:
        dist.all_reduce(t, group=group)
    return t.cpu() if torch.is_tensor(value) else float(t.item())


def broadcast_object(value, info: DistInfo):
    """Rank 0's ``value`` (picklable) on every rank."""
    if info.world_size == 1:
        return value
    box = [value if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it), for a server or a process group to bind."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
