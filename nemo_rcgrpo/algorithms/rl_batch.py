"""The data of one RL step, typed and built in one place: the rollout groups, the training batches the policy
backend gets (`models/interfaces.py: Policy`), the step's metrics and its rollout dump.

Shapes: N groups of G rollouts; B rows of a micro-batch, T its padded length (right padding).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from nemo_rcgrpo.algorithms.advantages import zero_variance_fraction
from nemo_rcgrpo.algorithms.losses import PolicyLossStats
from nemo_rcgrpo.data.batch import MicroBatch, RLMicroBatch
from nemo_rcgrpo.data.sft_data import Example, collate
from nemo_rcgrpo.rollout.multi_turn import Trajectory
from nemo_rcgrpo.utils.bounded import bounded_line

RolloutGroup = list[Trajectory]  # the G rollouts of one task (one group); advantages are taken within it


def token_batches(
    trajs: Sequence[Trajectory], pad_id: int, micro: int, ranges: Sequence[tuple[int, int]] | None = None
) -> list[MicroBatch]:
    """The rollouts' tokens as right-padded micro-batches, in trajectory order: ``micro`` rollouts each (batch i
    holds rollouts i * micro ...), or ``ranges``' [lo, hi) runs of rollouts (a token budget's,
    `data/packing.py: budget_batches`): what the reference and the policy score before the update."""
    if ranges is None:
        ranges = [(s, min(s + micro, len(trajs))) for s in range(0, len(trajs), micro)]
    return [collate([Example(t.token_ids, t.loss_mask, t.task_id) for t in trajs[lo:hi]], pad_id) for lo, hi in ranges]


def rl_micro_batch(
    tokens: MicroBatch,
    trajs: Sequence[Trajectory],
    first: int,
    flat_adv: torch.Tensor,
    ref_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
) -> RLMicroBatch:
    """The complete micro-batch of rollouts ``trajs[first : first + tokens.rows]``: their tokens, advantages
    (``flat_adv``: [len(trajs)]), the generator's logprobs, the reference's and (None where the loss takes its
    ratio against its own pass) the policy's old logprobs, [B, T] each."""
    part = trajs[first : first + tokens.rows]
    sampler = torch.zeros(tuple(tokens.input_ids.shape), dtype=torch.float32)  # [B, T]
    for row, t in enumerate(part):
        sampler[row, : len(t.sampler_logprobs)] = torch.tensor(t.sampler_logprobs, dtype=torch.float32)
    return RLMicroBatch(
        tokens.input_ids,
        tokens.attention_mask,
        tokens.loss_mask,
        advantages=flat_adv[first : first + tokens.rows].float(),
        ref_logprobs=ref_logprobs,
        sampler_logprobs=sampler,
        old_logprobs=old_logprobs,
        first=first,
    )


@dataclass(frozen=True)
class UpdateTotals:
    """The updates of one RL step (``rl.ppo_epochs`` x mini-batches optimizer steps), summed."""

    stats: PolicyLossStats  # over micro-batches, replicas and updates (stats.loss: the updates' losses added)
    updates: int
    grad_norm: float  # the mean over the updates
    lr: float  # the mean over the updates
    skipped: int = 0  # updates not applied: their gradients were not finite


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's correlation, None where either side is constant or there are fewer than 2 points."""
    if len(xs) < 2 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / len(xs)
    return cov / (statistics.pstdev(xs) * statistics.pstdev(ys))


def step_metrics(
    groups: Sequence[RolloutGroup],
    rewards: torch.Tensor,
    adv: torch.Tensor,
    entropy_sums: Sequence[float],
    out: UpdateTotals,
    num_valid: float,
) -> dict[str, float]:
    """The step's metrics from its groups, rewards [N, G], advantages [N, G], per-rollout entropy sums, the
    updates' totals and the number of generated tokens."""
    stats = out.stats
    trajs = [t for g in groups for t in g]
    r = [t.reward for t in trajs]
    entropies = [e / max(1, t.generated_tokens) for e, t in zip(entropy_sums, trajs)]  # per-trajectory means
    m: dict[str, float] = {
        "loss": stats.loss / max(out.updates, 1),
        "grad_norm": out.grad_norm,
        "lr": out.lr,
        "reward_mean": statistics.fmean(r),
        "zero_variance_fraction": zero_variance_fraction(rewards),
        "advantage_mean": float(adv.mean()),
        "advantage_std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "advantage_abs_mean": float(adv.abs().mean()),
        "nonzero_advantage_share": float((adv != 0).float().mean()),
        # entropy: the token mean over every generated token of the step; entropy_seq_mean: mean of the
        # per-trajectory means (short trajectories weigh more)
        "entropy": sum(entropy_sums) / max(num_valid, 1.0),
        "entropy_seq_mean": statistics.fmean(entropies),
        # per token over every update (stats.tokens: the generated tokens of all updates, each epoch once)
        "kl": stats.kl_sum / max(stats.tokens, 1.0),
        "clip_fraction": stats.clipped_tokens / max(stats.tokens, 1.0),
        "updates": float(out.updates),
        "skipped_updates": float(out.skipped),
        "response_tokens": statistics.fmean(t.generated_tokens for t in trajs),
        "turns": statistics.fmean(t.num_turns for t in trajs),
        "tool_error_rate": sum(t.tool_errors for t in trajs) / max(1, sum(len(c) for t in trajs for c in t.calls)),
        # assistant messages the format's parser rejected whole (chat.rejected_message decides what they became)
        "rejected_message_rate": sum(t.rejected_messages for t in trajs) / max(1, sum(t.num_turns for t in trajs)),
        "truncated_share": statistics.fmean(t.truncated is not None for t in trajs),
        "groups": float(len(groups)),
        "rollouts": float(len(trajs)),
        "tokens": num_valid,
    }
    if stats.sampler_mult_err_sum > 0:  # the generator's logprobs against the trainer's, before the update
        m["sampler_logprob_abs_diff"] = stats.sampler_abs_diff_sum / max(stats.tokens, 1.0)
        m["token_mult_prob_error"] = stats.sampler_mult_err_sum / max(stats.tokens, 1.0)
    if stats.corrected_tokens > 0:  # rl.loss.correction's weights: their mean, and the share of tokens it dropped
        m["correction_weight_mean"] = stats.correction_weight_sum / stats.corrected_tokens
        m["correction_dropped_fraction"] = stats.correction_dropped / stats.corrected_tokens
    # Pearson correlation of a trajectory's mean token entropy with its reward (the paper's rho), overall and
    # among the rollouts of each reward token
    corr = pearson(entropies, r)
    if corr is not None:
        m["entropy_reward_corr"] = corr
    for token in ("high", "low"):
        sel = [i for i, t in enumerate(trajs) if t.reward_token == token]
        if sel:
            m[f"reward_mean_{token}"] = statistics.fmean(r[i] for i in sel)
            corr = pearson([entropies[i] for i in sel], [r[i] for i in sel])
            if corr is not None:
                m[f"entropy_reward_corr_{token}"] = corr
    by_cat = defaultdict(list)
    for t in trajs:
        by_cat[t.category].append(t.reward)
    for cat, vals in by_cat.items():
        m[f"success_{cat}"] = statistics.fmean(vals)
    return m


def write_rollouts(
    path: Path, step: int, groups: Sequence[RolloutGroup], adv: torch.Tensor, decode: Callable[[list[int]], str]
) -> None:
    """rollouts/step_N.jsonl (N counts from 1, as metrics.jsonl and checkpoints/ do): one record per rollout; the
    rendered prompt (reward goal included) is written once per group and token, on the first record that has
    it, and the others name that record's line (``prompt_line``, from 1). Each line is bounded (`utils/bounded.py`:
    tool results clipped past a cap that follows the rollout's generated text); the training batch is not."""
    path.parent.mkdir(parents=True, exist_ok=True)
    first_line: dict[tuple[int, str | None], int] = {}
    with path.open("w") as f:
        line = 0
        for g, group in enumerate(groups):
            for j, t in enumerate(group):
                line += 1
                episode = t.episode(step=step, advantage=float(adv[g, j]), success=t.reward == 1.0)
                episode.group = g
                if (g, t.reward_token) in first_line:
                    episode.prompt_line = first_line[(g, t.reward_token)]
                else:
                    first_line[(g, t.reward_token)] = line
                    episode.prompt = decode(t.token_ids[: t.prompt_length])
                f.write(bounded_line(episode.to_json()) + "\n")
