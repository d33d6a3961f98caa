"""The seam between the training loops and a policy backend, as a Protocol (shapes in the docstrings).

Stage 1 (`recipes/stage1.py`) and stage 2 (`recipes/rl.py`) drive a policy only through these methods,
by way of `models/factory.py`. What a loop needs to know of a backend it asks the backend (its declared
capabilities: ``module``, ``device``, ``fuses_old_logprobs``, ``share_prefix``, ``packs``, ``distributed_rl``), never its
name. Backends are registered by name (kind ``policy_backend``, setting ``policy.backend``): ``torch`` (`torch_policy.py`: one process or torchrun DDP) and
``megatron`` (`megatron/policy.py`: Megatron-Core TP x PP x DP). A batch is a frozen ``MicroBatch`` of [B, T] CPU
tensors (`data/batch.py`; an RL step's is an ``RLMicroBatch``, with what the policy loss reads); a backend moves
it to its device and hands it, as it got it, to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch

from nemo_rcgrpo.data.batch import LossStats, MicroBatch
from nemo_rcgrpo.utils.dist import DistInfo

# (token logprobs [B, T] with gradient, the micro-batch, the update's number of valid tokens over every
# micro-batch and rank) -> (scalar loss, its statistics): `algorithms/losses.py` (sft_loss, GRPOLoss)
LossFn = Callable[[torch.Tensor, MicroBatch, float], "tuple[torch.Tensor, LossStats]"]


@dataclass(frozen=True)
class TrainStepResult:
    """What one optimizer step of a policy reports."""

    stats: list[LossStats]  # the loss's record of each of this replica's micro-batches, in order
    grad_norm: float  # before clipping
    lr: float  # the learning rate of this step
    entropy_sums: list[torch.Tensor] | None = None  # with_entropy: per micro-batch the [B] token-entropy sums
    skipped: bool = False  # the gradients were not finite: no update was applied (weights, optimizer, schedule kept)


WeightMeta = list[tuple[str, tuple[int, ...], torch.dtype]]  # (HF name, shape, dtype) in export order


@runtime_checkable
class Policy(Protocol):
    # the HF model an in-process generator samples from (current after sync_hf_model); None on ranks without one
    module: torch.nn.Module | None
    device: torch.device  # where this rank computes (collectives of its own, e.g. the weight export's, use it)
    # with one update per batch the training forward pass gives the old logprobs (the detached current ones) and
    # the entropies: stage 2 runs no separate old-logprob pass
    fuses_old_logprobs: bool
    # how its forward may run a micro-batch's rows besides padded (`data/packing.py: choose_layout`): what they
    # share computed once (the prefix tree), and the rows packed as one sequence without padding
    share_prefix: bool
    packs: str | None  # "varlen" | "dense" (an N x N mask) | None
    distributed_rl: bool  # stage 2 may run in several processes (torchrun)
    # every rank takes part in export_weights / export_meta / state_dict (Megatron at world size > 1)
    export_is_collective: bool
    # checkpoints hold a backend folder written by save_sharded from every rank (Megatron's dist_checkpointing)
    sharded_checkpoints: bool
    # train_step applies no update from non-finite gradients (TrainStepResult.skipped): trainer.on_nonfinite=skip
    skips_nonfinite_updates: bool

    def logprobs(self, batch: MicroBatch, with_entropy: bool = False) -> Any:
        """No gradient: [B, T] token logprobs at the masked positions, or ([B, T], [B, T] entropies)."""

    def layout(self, batch: MicroBatch) -> Any:
        """How the micro-batch's forward runs (`data/packing.py: Layout`): its prefix tree (GroupLayout), its rows
        packed (Packed) or None (every row padded, in full); the same logprobs whichever runs."""

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, num_valid_tokens: float, with_entropy: bool = False
    ) -> TrainStepResult:
        """One optimizer step over this rank's micro-batches (none: it still joins the step's collectives): the
        loss's record of each, the gradient norm, the learning rate (with ``with_entropy`` also the entropy sums of
        the training pass)."""

    def data_parallel(self) -> tuple[DistInfo, Callable[[Any], Any]]:
        """The data-parallel view batches are split by, and a sum over the data-parallel replicas."""

    def sync_hf_model(self) -> torch.nn.Module | None:
        """The HF model holding the current weights on rank 0 (a collective where weights are sharded)."""

    def frozen_reference(self) -> Callable[[MicroBatch], torch.Tensor]:
        """Reference logprobs [B, T] (on CPU) of a frozen copy of the current weights."""

    def export_meta(self) -> WeightMeta | None:
        """What export_weights yields (rank 0; None on ranks that only take part)."""

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors in export_meta's order (for generators and exports)."""

    def state_dict(self) -> dict[str, Any]:
        """{"model": HF-named tensors (rank 0), "optimizer": ..., "scheduler": ...} for a checkpoint."""

    def load_state_dict(self, model: dict, optimizer: dict, scheduler: dict) -> None: ...

    def save_sharded(self, directory: Path) -> None:
        """Write the backend's own shards into ``directory`` (only where sharded_checkpoints)."""
