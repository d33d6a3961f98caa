"""Group-relative advantages (GRPO; RC-GRPO uses them unchanged, over the whole group regardless of token).

    A_j = (R_j - mean_g) / (std_g + eps)        baseline="mean", scale="std" (default)
    A_j = R_j - mean_{k != j} R_k                 baseline="leave_one_out" (RLOO)
    scale="none" drops the division by the std (Dr. GRPO).

std_g is the unbiased sample standard deviation (torch.std), as in TRL and verl.
A group whose rewards are all equal gets A = 0 (no NaN): the case RC-GRPO exists to avoid.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, baseline: str = "mean", scale: str = "std",
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards: [num_groups, G] -> advantages [num_groups, G]."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    g = r.shape[1]
    if baseline == "mean":
        centred = r - r.mean(dim=1, keepdim=True)  # [N, G]
    elif baseline == "leave_one_out":
        if g < 2:
            raise ValueError("leave_one_out needs group_size >= 2")
        centred = r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)  # [N, G]
    else:
        raise ValueError(f"baseline={baseline!r}: choose 'mean' or 'leave_one_out'")
    if scale == "std":
        std = r.std(dim=1, keepdim=True) if g > 1 else torch.zeros_like(r[:, :1])  # [N, 1]
        adv = centred / (std + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale={scale!r}: choose 'std' or 'none'")
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def zero_variance_fraction(rewards: torch.Tensor) -> float:
    """Share of groups whose rewards are all equal (every advantage 0)."""
    return float((rewards.max(dim=1).values == rewards.min(dim=1).values).float().mean())
