"""Per-token KL estimators between the policy and the reference (Schulman, "Approximating KL divergence").

With log-ratio d = ref_logprob - logprob (samples drawn from the policy):
    k1 = -d                     unbiased, high variance, can be negative
    k2 = d^2 / 2                biased, low variance
    k3 = exp(d) - d - 1         unbiased, low variance, always >= 0 (default, as GRPO)

k3 is clamped to [0, K3_MAX] = [0, 10] per token, as verl's low_var_kl does: one token the policy has moved far
from the reference (exp(20) = 4.9e8) would otherwise dominate the loss and its gradient.
"""

from __future__ import annotations

import torch

from nemo_rcgrpo.registry import register


@register("kl_estimator", "k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@register("kl_estimator", "k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


K3_MAX = 10.0


@register("kl_estimator", "k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)  # exp overflow guard
    return (torch.exp(d) - d - 1.0).clamp(max=K3_MAX)
