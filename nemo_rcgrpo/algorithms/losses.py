"""Pure loss functions. Each takes per-token values and returns (loss, detached metrics).

The normaliser is the number of valid (mask=1) tokens of the whole optimizer
step across micro-batches and ranks, so splitting a batch into micro-batches
(or over ranks) does not change the loss or its gradient.
"""

from __future__ import annotations

import torch


def sft_loss(token_logprobs: torch.Tensor, batch: dict[str, torch.Tensor], num_valid_tokens: float):
    """Negative log-likelihood of the assistant tokens (stage 1: SFT and RCTP-FT).

    token_logprobs: [B, T] log p(token_t | tokens_<t); batch["loss_mask"]: [B, T] in {0, 1}.
    RCTP-FT is the same objective on reward-conditioned data: the reward token
    sits in the (masked) user message, so this is log p(trajectory | goal).
    """
    mask = batch["loss_mask"].to(token_logprobs.dtype)  # [B, T]
    nll_sum = -(token_logprobs * mask).sum()  # scalar
    loss = nll_sum / max(num_valid_tokens, 1.0)
    return loss, {"nll_sum": nll_sum.detach().item(), "tokens": mask.sum().item()}
