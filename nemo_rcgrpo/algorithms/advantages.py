"""Group-relative advantages (GRPO; RC-GRPO uses them unchanged, over the whole group regardless of token).

    A_j = (R_j - mean_g) / (std_g + eps)        baseline="mean", scale="std" (default)
    A_j = R_j - mean_{k != j} R_k                 baseline="leave_one_out" (RLOO)
    scale="none" drops the division by the std (Dr. GRPO).

std_g is the unbiased sample standard deviation (torch.std), as in TRL and verl.
A group whose rewards are all equal gets A = 0 (no NaN): the case RC-GRPO exists to avoid.
"""

from __future__ import annotations

import torch

from nemo_rcgrpo.registry import lookup, register


@register("advantage_baseline", "mean")
def mean_baseline(r: torch.Tensor) -> torch.Tensor:
    return r - r.mean(dim=1, keepdim=True)  # [N, G]


@register("advantage_baseline", "leave_one_out")
def leave_one_out_baseline(r: torch.Tensor) -> torch.Tensor:
    g = r.shape[1]
    if g < 2:
        raise ValueError("leave_one_out needs group_size >= 2")
    return r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)  # [N, G]


@register("advantage_scale", "std")
def std_scale(r: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])  # [N, 1]
    return centred / (std + eps)


@register("advantage_scale", "none")
def no_scale(r: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    return centred


def group_advantages(
    rewards: torch.Tensor, *, baseline: str = "mean", scale: str = "std", eps: float = 1e-6
) -> torch.Tensor:
    """rewards: [num_groups, G] -> advantages [num_groups, G]; baseline and scale are registered names
    (``advantage_baseline`` / ``advantage_scale``), applied to the rewards in float64."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    centred = lookup("advantage_baseline", baseline)(r)  # [N, G]
    adv = lookup("advantage_scale", scale)(r, centred, eps)  # [N, G]
    if tuple(adv.shape) != tuple(r.shape):
        raise ValueError(f"advantage {baseline}/{scale} returned shape {tuple(adv.shape)} for rewards {tuple(r.shape)}")
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def zero_variance_fraction(rewards: torch.Tensor) -> float:
    """Share of groups whose rewards are all equal (every advantage 0)."""
    return float((rewards.max(dim=1).values == rewards.min(dim=1).values).float().mean())
