"""Sampler corrections (kind ``sampler_correction``, setting ``rl.loss.correction``): per-token weights on the
policy loss for the gap between the policy that sampled a rollout (the generator's logprobs) and the trainer's
old logprobs, the proximal policy of decoupled PPO. The gap comes from a generator that computes differently
(vLLM's kernels, another precision) and, with generation running ahead of training, from older weights.

Each takes the detached log-ratio and the mask and returns detached weights of the same shape:

    gap_t = old_t - sampler_t                 [B, T], 0 where mask = 0; the ratio is r_t = exp(gap_t)
    none            w_t = 1
    token_tis       w_t = min(r_t, C)                                   (truncated IS per token)
    sequence_tis    w_t = min(prod_t r_t, C) = min(exp(sum_t gap_t), C)  (per rollout, on each of its tokens)
    token_mask      w_t = 1 if 1/C <= r_t <= C else 0                   (a token too far off is dropped)
    geometric_mask  w_t = 1 if 1/C <= exp(mean_t gap_t) <= C else 0     (a rollout too far off is dropped whole)

C is ``rl.loss.correction_cap``: > 0, and > 1 for a correction that declares ``keeps_within_cap`` (the masks;
a plugin's may declare it too, as an attribute of its function). The truncated forms keep every token and bound its weight (a biased, low-variance
estimate); the masks keep the on-policy gradient of what is close and drop the rest (verl's rollout IS calls these
levels token / sequence / geometric and modes truncate / mask). The step logs the weights' mean and the share of
tokens dropped.
"""

from __future__ import annotations

import math

import torch

from nemo_rcgrpo.registry import register


@register("sampler_correction", "none")
def no_correction(gap: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Every token weighs 1: the sampler's gap is only measured (the sampler metrics)."""
    return torch.ones_like(gap)


@register("sampler_correction", "token_tis")
def token_tis(gap: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(gap_t), C) per token. gap, mask: [B, T]."""
    return torch.exp(gap).clamp(max=cap)


@register("sampler_correction", "sequence_tis")
def sequence_tis(gap: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(sum_t gap_t), C) for every token of a rollout; the sum is clamped at log C first, so a long rollout
    far off does not overflow. gap, mask: [B, T]."""
    total = (gap * mask).sum(dim=1, keepdim=True)  # [B, 1]
    return torch.exp(total.clamp(max=math.log(cap))).expand_as(gap)


@register("sampler_correction", "token_mask")
def token_mask(gap: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """1 where |gap_t| <= log C, else 0. gap, mask: [B, T]."""
    return (gap.abs() <= math.log(cap)).to(gap.dtype)


token_mask.keeps_within_cap = True  # declared: it keeps the ratios in [1/C, C], so C must exceed 1


@register("sampler_correction", "geometric_mask")
def geometric_mask(gap: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """1 for every token of a rollout whose mean gap lies within [-log C, log C], else 0. gap, mask: [B, T]."""
    mean = (gap * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return (mean.abs() <= math.log(cap)).to(gap.dtype).expand_as(gap)


geometric_mask.keeps_within_cap = True
