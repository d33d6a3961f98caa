"""A user's plugin, outside the package: loaded by name with plugins=[rc_plugin_example]."""

import torch

from nemo_rcgrpo import register


@register("advantage_baseline", "median_example")
def median_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """A_j = R_j - median of the group (then scaled as rl.advantage.scale says)."""
    return rewards - rewards.median(dim=1, keepdim=True).values


@register("kl_estimator", "zero_example")
def no_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logprobs)
