"""Pure loss functions. Each takes per-token values and a typed micro-batch (`data/batch.py`) and returns
(loss, a typed record of summable statistics).

The normaliser is the number of valid (mask=1) tokens of the whole optimizer
step across micro-batches and ranks, so splitting a batch into micro-batches
(or over ranks) does not change the loss or its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_rcgrpo.data.batch import LossStats, MicroBatch, RLMicroBatch
from nemo_rcgrpo.registry import lookup, register


@register("loss_aggregation", "token")
def token_mean(
    per_token: torch.Tensor, mask: torch.Tensor, num_valid_tokens: float, num_sequences: float | None
) -> torch.Tensor:
    """sum_t mask * loss_t / num_valid_tokens (the update's token count)."""
    return (per_token * mask).sum() / max(num_valid_tokens, 1.0)


@register("loss_aggregation", "sequence")
def sequence_mean(
    per_token: torch.Tensor, mask: torch.Tensor, num_valid_tokens: float, num_sequences: float | None
) -> torch.Tensor:
    """sum_b [sum_t mask * loss_t / len_b] / num_sequences (the update's sequence count)."""
    if not num_sequences:
        raise ValueError("loss aggregation 'sequence' needs the update's sequence count (GRPOLoss.num_sequences)")
    lengths = mask.sum(dim=1).clamp(min=1.0)  # [B]
    return ((per_token * mask).sum(dim=1) / lengths).sum() / float(num_sequences)


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


@dataclass(frozen=True)
class NLLStats(LossStats):
    """``sft_loss``'s record: the summed negative log-likelihood and the trained tokens."""

    nll_sum: float = 0.0
    tokens: float = 0.0


def sft_loss(token_logprobs: torch.Tensor, batch: MicroBatch, num_valid_tokens: float) -> tuple[torch.Tensor, NLLStats]:
    """Negative log-likelihood of the assistant tokens (stage 1: SFT and RCTP-FT).

    token_logprobs: [B, T] log p(token_t | tokens_<t); batch.loss_mask: [B, T] in {0, 1}.
    RCTP-FT is the same objective on reward-conditioned data: the reward token
    sits in the (masked) user message, so this is log p(trajectory | goal).
    """
    mask = batch.loss_mask.to(token_logprobs.dtype)  # [B, T]
    nll_sum = -(token_logprobs * mask).sum()  # scalar
    loss = nll_sum / max(num_valid_tokens, 1.0)
    return loss, NLLStats(loss=loss.item(), nll_sum=nll_sum.item(), tokens=mask.sum().item())


@dataclass(frozen=True)
class PolicyLossStats(LossStats):
    """``GRPOLoss``'s record (sums over the micro-batch's generated tokens; ``tokens`` counts them). The sampler
    sums compare the trainer's old logprobs with the generator's (NeMo-RL's token_mult_prob_error)."""

    pg_loss_sum: float = 0.0
    kl_sum: float = 0.0
    clipped_tokens: float = 0.0
    ratio_sum: float = 0.0
    tokens: float = 0.0
    sampler_abs_diff_sum: float = 0.0
    sampler_mult_err_sum: float = 0.0
    corrected_tokens: float = 0.0  # the tokens a sampler correction weighed (0 with none)
    correction_weight_sum: float = 0.0
    correction_dropped: float = 0.0  # tokens it gave weight 0


RATIOS = ("old", "current")


@dataclass(frozen=True)
class GRPOLoss:
    """PPO-clipped policy loss with a KL penalty to the reference (GRPO / RC-GRPO), its variant fixed by its
    settings (``rl.loss``; ``ratio`` and ``num_sequences`` from the loop), never by what a batch holds.

    ``ratio``: "old" takes the ratio against ``batch.old_logprobs`` (recomputed before the first update: several
    updates per batch, or a backend that does not fuse that pass); "current" against the detached logprobs of
    this very pass, which are the old ones when the batch gets one update (ratio = 1 with the on-policy
    gradient). ``num_sequences``: the update's sequence count (aggregation "sequence").

        ratio_t = exp(logp_t - old_t)
        pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)   (policy_loss: clipped)
        pg_t   *= w_t(old - sampler)                 (correction: none | token_tis | sequence_tis | token_mask |
                                                      geometric_mask | a plugin's, cap C: algorithms/corrections.py)
        loss_t  = pg_t + beta * KL_t(policy || ref)
        token:    sum_t mask * loss_t / num_valid_tokens          (the update's token count)
        sequence: sum_b [sum_t mask * loss_t / len_b] / num_sequences
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_beta: float = 0.1
    kl_estimator: str = "k3"
    aggregation: str = "token"
    correction: str = "none"
    correction_cap: float = 2.0
    policy_loss: str = "clipped"
    ratio: str = "old"
    num_sequences: float | None = None

    def __post_init__(self) -> None:
        if self.ratio not in RATIOS:
            raise ValueError(f"GRPOLoss.ratio={self.ratio!r}: one of {RATIOS}")

    @classmethod
    def from_config(cls, loss_cfg, ratio: str) -> "GRPOLoss":
        """From the ``rl.loss`` section, with the loop's choice of ratio."""
        return cls(
            clip_low=loss_cfg.clip_low,
            clip_high=loss_cfg.clip_high,
            kl_beta=loss_cfg.kl_beta,
            kl_estimator=loss_cfg.kl_estimator,
            aggregation=loss_cfg.aggregation,
            correction=loss_cfg.correction,
            correction_cap=loss_cfg.correction_cap,
            policy_loss=loss_cfg.policy_loss,
            ratio=ratio,
        )

    def __call__(
        self, token_logprobs: torch.Tensor, batch: RLMicroBatch, num_valid_tokens: float
    ) -> tuple[torch.Tensor, PolicyLossStats]:
        """token_logprobs: [B, T] with gradient. Returns the scalar loss and its statistics."""
        if (batch.old_logprobs is None) != (self.ratio == "current"):
            raise ValueError(
                f"GRPOLoss(ratio={self.ratio!r}) got a batch "
                f"{'without' if batch.old_logprobs is None else 'with'} old_logprobs"
            )
        mask = batch.loss_mask.to(token_logprobs.dtype)  # [B, T]
        adv = batch.advantages.to(token_logprobs.dtype).unsqueeze(-1)  # [B, 1]
        old = (
            token_logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs.to(token_logprobs.dtype)
        )  # [B, T]
        ratio = torch.exp((token_logprobs - old) * mask)  # [B, T]
        pg, is_clipped = lookup("policy_loss", self.policy_loss)(ratio, adv, self.clip_low, self.clip_high)  # [B, T]
        gap = (old - batch.sampler_logprobs.to(old.dtype)) * mask  # [B, T] trainer - generator, detached
        weights = None
        if self.correction != "none":
            weights = lookup("sampler_correction", self.correction)(gap, mask, self.correction_cap)  # [B, T]
            if not (isinstance(weights, torch.Tensor) and weights.shape == gap.shape):
                raise ValueError(
                    f"sampler_correction {self.correction} returned "
                    f"{getattr(weights, 'shape', type(weights).__name__)}, not weights of shape "
                    f"{tuple(gap.shape)}"
                )
            weights = weights.detach().to(pg.dtype)
            pg = pg * weights  # [B, T]
        kl = lookup("kl_estimator", self.kl_estimator)(token_logprobs, batch.ref_logprobs) * mask  # [B, T]
        per_token = pg + self.kl_beta * kl  # [B, T]
        loss = lookup("loss_aggregation", self.aggregation)(per_token, mask, num_valid_tokens, self.num_sequences)
        with torch.no_grad():
            stats = PolicyLossStats(
                loss=float(loss),
                pg_loss_sum=float((pg * mask).sum()),
                kl_sum=float((kl * mask).sum()),
                clipped_tokens=float((is_clipped.to(mask.dtype) * mask).sum()),
                ratio_sum=float((ratio * mask).sum()),
                tokens=float(mask.sum()),
                sampler_abs_diff_sum=float((gap.abs() * mask).sum()),
                # as NeMo-RL's token_mult_prob_error: mean exp(|trainer - generator logprob|)
                sampler_mult_err_sum=float((torch.exp(gap.abs()) * mask).sum()),
                **(
                    {}
                    if weights is None
                    else dict(
                        corrected_tokens=float(mask.sum()),
                        correction_weight_sum=float((weights * mask).sum()),
                        correction_dropped=float(((weights == 0).to(mask.dtype) * mask).sum()),
                    )
                ),
            )
        return loss, stats
