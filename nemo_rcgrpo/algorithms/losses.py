"""Pure loss functions. Each takes per-token values and returns (loss, detached metrics).

The normaliser is the number of valid (mask=1) tokens of the whole optimizer
step across micro-batches and ranks, so splitting a batch into micro-batches
(or over ranks) does not change the loss or its gradient.
"""

from __future__ import annotations

import torch

from nemo_rcgrpo.registry import lookup, register


@register("loss_aggregation", "token")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, num_valid_tokens: float, batch: dict) -> torch.Tensor:
    """sum_t mask * loss_t / num_valid_tokens (the update's token count)."""
    return (per_token * mask).sum() / max(num_valid_tokens, 1.0)


@register("loss_aggregation", "sequence")
def sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, num_valid_tokens: float, batch: dict) -> torch.Tensor:
    """sum_b [sum_t mask * loss_t / len_b] / num_sequences (the update's sequence count)."""
    lengths = mask.sum(dim=1).clamp(min=1.0)  # [B]
    return ((per_token * mask).sum(dim=1) / lengths).sum() / float(batch["num_sequences"])


@register("policy_loss", "clipped")
def clipped(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float):
    """PPO's clipped surrogate (GRPO, RC-GRPO): -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A).

    ratio: [B, T]; adv: [B, 1]. Returns (pg [B, T], clipped [B, T] bool: the tokens whose gradient the clip cut)."""
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)  # [B, T]
    with torch.no_grad():
        cut = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))  # [B, T]
    return pg, cut


@register("policy_loss", "unclipped")
def unclipped(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float):
    """The importance-weighted policy gradient without a trust region: -ratio * A (equal to `clipped` when each
    batch gets one update, where ratio = 1). ratio: [B, T]; adv: [B, 1]."""
    return -ratio * adv, torch.zeros_like(ratio, dtype=torch.bool)  # [B, T], nothing clipped


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


def grpo_loss(token_logprobs: torch.Tensor, batch: dict[str, torch.Tensor], num_valid_tokens: float, *,
              clip_low: float = 0.2, clip_high: float = 0.2, kl_beta: float = 0.1, kl_estimator: str = "k3",
              aggregation: str = "token", tis_cap: float | None = None, policy_loss: str = "clipped"):
    """PPO-clipped policy loss with a KL penalty to the reference (GRPO / RC-GRPO).

    batch: loss_mask [B, T] (1 on generated tokens), ref_logprobs [B, T],
    advantages [B] (one per rollout, broadcast over its tokens), old_logprobs [B, T]
    (the trainer's logprobs before the first update of the batch; absent when the
    batch gets one update: the ratio is then taken against the detached current
    logprobs, which are the old ones, so ratio = 1 with the on-policy gradient);
    for aggregation="sequence" also num_sequences (the update's count, a scalar);
    optionally sampler_logprobs [B, T] (the generator's), for the train/inference
    gap metrics and truncated importance sampling.

        ratio_t = exp(logp_t - old_t)
        pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)   (policy_loss: clipped)
        pg_t   *= min(exp(old_t - sampler_t), tis_cap)                  (tis_cap set: truncated IS)
        loss_t  = pg_t + beta * KL_t(policy || ref)
        token:    sum_t mask * loss_t / num_valid_tokens          (the update's token count)
        sequence: sum_b [sum_t mask * loss_t / len_b] / num_sequences
    """
    mask = batch["loss_mask"].to(token_logprobs.dtype)  # [B, T]
    adv = batch["advantages"].to(token_logprobs.dtype).unsqueeze(-1)  # [B, 1]
    old_logprobs = batch.get("old_logprobs")
    old = token_logprobs.detach() if old_logprobs is None else old_logprobs.to(token_logprobs.dtype)  # [B, T]
    log_ratio = (token_logprobs - old) * mask  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    pg, is_clipped = lookup("policy_loss", policy_loss)(ratio, adv, clip_low, clip_high)  # [B, T], [B, T]
    sampler = batch.get("sampler_logprobs")
    gap = None if sampler is None else (old - sampler.to(old.dtype)) * mask  # [B, T] trainer - generator, detached
    if tis_cap is not None:
        if gap is None:
            raise ValueError("tis_cap needs the generator's sampler_logprobs in the batch")
        pg = pg * torch.exp(gap).clamp(max=tis_cap)  # [B, T]
    kl = lookup("kl_estimator", kl_estimator)(token_logprobs, batch["ref_logprobs"]) * mask  # [B, T]
    per_token = pg + kl_beta * kl  # [B, T]
    loss = lookup("loss_aggregation", aggregation)(per_token, mask, num_valid_tokens, batch)
    with torch.no_grad():
        n = mask.sum()
        metrics = {
            "pg_loss_sum": float((pg * mask).sum()),
            "kl_sum": float((kl * mask).sum()),
            "clipped_tokens": float((is_clipped.to(mask.dtype) * mask).sum()),
            "ratio_sum": float((ratio * mask).sum()),
            "tokens": float(n),
        }
        if gap is not None:  # as NeMo-RL's token_mult_prob_error: mean exp(|trainer - generator logprob|)
            metrics["sampler_abs_diff_sum"] = float((gap.abs() * mask).sum())
            metrics["sampler_mult_err_sum"] = float((torch.exp(gap.abs()) * mask).sum())
    return loss, metrics
