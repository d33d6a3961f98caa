"""Per-token logprobs and entropies from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary,
``[B, T, V_pad / tp]``. With m = max over all ranks, Z = sum over all ranks of
exp(logit - m), and the target's logit found on the rank that owns it:

    logp(target) = logit_target - m - log Z
    entropy      = log Z + m - sum_v p_v * logit_v

Only [B, T] tensors cross ranks (three all-reduces). Vocabulary rows beyond the
real vocabulary (padding to 128 x tp) are masked to -inf first, so the
distribution is exactly the HF model's. The training path uses megatron's
``vocab_parallel_cross_entropy`` (same formula, with its own backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """fp32 copy of this rank's logits [.., V/tp] with rows of the padded vocabulary at -inf."""
    part = logits.shape[-1]
    start = tp_rank * part
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if start + part > vocab_size:
        keep = max(0, vocab_size - start)
        logits = torch.cat([logits[..., :keep], torch.full_like(logits[..., keep:], float("-inf"))], dim=-1)
    return logits


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, tp_rank: int, group, with_entropy: bool = False
):
    """logits [B, T, V/tp] (padded rows already masked), targets [B, T] -> logprobs [B, T] (and entropy [B, T]).

    No autograd through the all-reduces: for evaluation (old / reference logprobs, entropies).
    """
    part = logits.shape[-1]
    start = tp_rank * part
    m = logits.max(dim=-1).values  # [B, T]
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)  # [B, T, V/tp]
    exp = shifted.exp()
    z = exp.sum(-1)  # [B, T]
    local = targets - start
    mine = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine  # [B, T]
    if with_entropy:
        # sum_v exp(shifted_v) * shifted_v, with 0 * -inf taken as 0
        weighted = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(-1)  # [B, T]
        stacked = torch.stack([z, picked, weighted])
        dist.all_reduce(stacked, group=group)
        z, picked, weighted = stacked
        logz = z.log()
        return picked - logz, logz - weighted / z
    stacked = torch.stack([z, picked])
    dist.all_reduce(stacked, group=group)
    z, picked = stacked
    return picked - z.log()
