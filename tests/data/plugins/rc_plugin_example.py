"""A user's plugin, outside the package: loaded by name with plugins=[rc_plugin_example]."""

import torch

from nemo_rcgrpo import register
from nemo_rcgrpo.stages import Stage


@register("advantage_baseline", "median_example")
def median_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """A_j = R_j - median of the group (then scaled as rl.advantage.scale says)."""
    return rewards - rewards.median(dim=1, keepdim=True).values


@register("kl_estimator", "zero_example")
def no_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logprobs)


def _all_but_all_zero(rewards) -> bool:
    """Keep a group unless every rollout of it failed (all-success groups are trained on, as zero advantages)."""
    return any(r > 0 for r in rewards)


# a stage of the RL loop: RC-GRPO's reward tokens, and a filter of its own
register("stage", "rcgrpo_no_all_fail_example")(Stage("rl", conditioned=True, keep_group=_all_but_all_zero,
                                                      description="RC-GRPO without all-fail groups"))
