"""Pick the policy backend from ``policy.backend`` (torch | megatron) with one call for both trainers."""

from __future__ import annotations

from typing import Callable

import torch

from nemo_rcgrpo.utils.dist import DistInfo, all_reduce_sum


def make_policy(cfg, model: torch.nn.Module, dist: DistInfo, total_steps: int):
    """TorchPolicy or MegatronPolicy around ``model`` (an HF model with the reward tokens already added)."""
    if cfg.policy.backend == "megatron":
        from nemo_rcgrpo.models.megatron.policy import MegatronPolicy

        return MegatronPolicy(model, cfg, dist, total_steps)
    from nemo_rcgrpo.models.torch_policy import TorchPolicy

    return TorchPolicy(model, cfg.trainer, dist, total_steps, cfg.model.gradient_checkpointing)


def data_parallel(policy, dist: DistInfo) -> tuple[DistInfo, Callable[[float], float]]:
    """The data-parallel view the trainer splits batches by, and a sum over data-parallel replicas.

    Torch backend: every rank is a replica. Megatron: the ranks of one tensor-parallel group share micro-batches.
    """
    if hasattr(policy, "data_parallel"):
        return policy.data_parallel()
    return dist, lambda value: all_reduce_sum(value, dist)


def hf_module(policy) -> torch.nn.Module | None:
    """The HF model holding the current weights (Megatron: synced onto rank 0; a collective; None elsewhere)."""
    if hasattr(policy, "sync_hf_model"):
        return policy.sync_hf_model()
    return policy.module
