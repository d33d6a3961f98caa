"""The updates of one RL step (step 5 of `recipes/rl.py`): ``StepUpdate.apply(groups, rewards, advantages, stats,
version)`` turns a step's rollout groups into micro-batches, scores them before any update (reference logprobs and,
where the loss takes its ratio against them, old logprobs and entropies), runs ``rl.ppo_epochs`` x
``rl.mini_batches`` optimizer steps (each one `Policy.train_step`), hands the generator the new weights as
``version`` and returns the step's metrics.

With one update (the default) and ``rl.old_logprobs=auto`` on a policy that fuses them, the ratio is taken against
the detached logprobs of the training pass itself, which also gives the entropies: no separate old-logprob pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rcgrpo.algorithms.losses import GRPOLoss, PolicyLossStats
from nemo_rcgrpo.algorithms.rl_batch import RolloutGroup, UpdateTotals, rl_micro_batch, step_metrics, token_batches
from nemo_rcgrpo.config_schema import RLConfig
from nemo_rcgrpo.data.batch import MicroBatch, RLMicroBatch
from nemo_rcgrpo.data.packing import budget_batches, forward_cost, positions_saved
from nemo_rcgrpo.data.prefix_tree import step_savings
from nemo_rcgrpo.models.factory import sync_generator
from nemo_rcgrpo.recipes.rl_parts import RLPolicy


@dataclass(frozen=True)
class UpdateSettings:
    """What the updates read of the config: the rl section (ppo_epochs, mini_batches, old_logprobs, loss,
    group_size) and the trainer's micro-batching."""

    rl: RLConfig
    micro_batch_size: int  # trainer.micro_batch_size: rollouts per micro-batch
    micro_batch_tokens: int | None  # trainer.micro_batch_tokens: micro-batches filled to this many forward positions


class StepUpdate:
    """One RL step's optimizer steps on its batch, on ``parts`` (the policy, its frozen reference and data-parallel
    view); the generator (rank 0's, or None) gets the weights after them."""

    def __init__(
        self,
        parts: RLPolicy,
        generator: Any,
        shares_weights: bool,
        pad_id: int,
        flop_shape: tuple[int, int, int],
        settings: UpdateSettings,
    ):
        self.policy, self.reference, self.updates = parts.policy, parts.reference, parts.updates
        self.data_dist, self.dp_sum = parts.data_dist, parts.dp_sum
        self.generator, self.shares_weights = generator, shares_weights
        self.pad_id, self.flop_shape, self.settings = pad_id, flop_shape, settings

    def apply(
        self,
        groups: list[RolloutGroup],
        rewards: torch.Tensor,
        adv: torch.Tensor,
        stats: dict[str, float],
        version: int,
    ) -> dict[str, float]:
        """The updates on ``groups`` with their rewards and advantages [N, G], then the generator on ``version``;
        returns the step's metrics (``stats``: the collection's, passed through)."""
        rl = self.settings.rl
        trajs = [t for g in groups for t in g]
        t0 = time.perf_counter()
        tokens = token_batches(trajs, self.pad_id, self.settings.micro_batch_size, self._budget_ranges(trajs))
        savings = self._savings(tokens)
        fused = self.updates == 1 and rl.old_logprobs == "auto" and self.policy.fuses_old_logprobs
        batches, entropy = self._score(tokens, trajs, adv.reshape(-1), recompute_old=not fused)
        logprob_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        loss = GRPOLoss.from_config(rl.loss, ratio="current" if fused else "old")
        out, fused_entropy = self._update(tokens, batches, loss, with_entropy=fused)
        entropy_sums = self.dp_sum(fused_entropy if fused else entropy).tolist()  # each from the replica that scored it
        train_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync_generator(self.policy, self.generator, self.shares_weights, version)
        sync_seconds = time.perf_counter() - t0
        num_valid = float(sum(int(b.loss_mask.sum()) for b in tokens))
        metrics = step_metrics(groups, rewards, adv, entropy_sums, out, num_valid)
        metrics.update(
            stats,
            logprob_seconds=logprob_seconds,
            train_seconds=train_seconds,
            weight_sync_seconds=sync_seconds,
            **savings,
        )
        return metrics

    def _savings(self, tokens: list[MicroBatch]) -> dict[str, float]:
        """How the policy runs each micro-batch (a group's prompt shared by its rows computed once, rows packed):
        the tokens, positions and FLOPs it saves."""
        layouts = [(self.policy.layout(b), b.attention_mask.sum(1).tolist()) for b in tokens]
        savings = step_savings(layouts, *self.flop_shape)
        savings.update(forward_positions_saved=positions_saved(layouts), micro_batches=float(len(tokens)))
        return savings

    def _budget_ranges(self, trajs: list) -> list[tuple[int, int]] | None:
        """With ``trainer.micro_batch_tokens``: the step's micro-batches as runs of rollouts filled to that many forward
        positions, counted as the policy runs them (prefix tree, packed or padded rows); None without it."""
        budget = self.settings.micro_batch_tokens
        if budget is None:
            return None
        seqs = [t.token_ids for t in trajs]
        share, pack = self.policy.share_prefix, self.policy.packs
        return budget_batches(
            len(trajs), self.settings.rl.group_size, budget, lambda lo, hi: forward_cost(seqs[lo:hi], share, pack)
        )

    def _mine(self, indices) -> list[int]:
        """This data-parallel replica's micro-batches among ``indices`` (another replica scores and trains on the
        rest)."""
        return [i for i in indices if i % self.data_dist.world_size == self.data_dist.rank]

    def _score(
        self, tokens: list[MicroBatch], trajs: list, flat_adv: torch.Tensor, recompute_old: bool
    ) -> tuple[dict[int, RLMicroBatch], torch.Tensor]:
        """This replica's complete micro-batches (by index among ``tokens``), scored before any update: reference
        logprobs and, where the loss takes its ratio against them, old logprobs and entropies; with the [N * G]
        entropy sums (zeros where not computed here)."""
        entropy = torch.zeros(len(trajs), dtype=torch.float64)
        firsts = list(itertools.accumulate((b.rows for b in tokens), initial=0))  # each batch's first rollout
        batches = {}
        for i in self._mine(range(len(tokens))):
            b, first, old = tokens[i], firsts[i], None
            if recompute_old:
                old, ent = self.policy.logprobs(b, with_entropy=True)
                entropy[first : first + b.rows] = (ent * b.loss_mask.float()).sum(1)
            batches[i] = rl_micro_batch(b, trajs, first, flat_adv, self.reference(b), old)
        return batches, entropy

    def _update(
        self, tokens: list[MicroBatch], batches: dict[int, RLMicroBatch], loss: GRPOLoss, with_entropy: bool
    ) -> tuple[UpdateTotals, torch.Tensor]:
        """``rl.ppo_epochs`` passes over ``rl.mini_batches`` consecutive slices of the micro-batches, one optimizer step
        each (normalised by the slice's global token and sequence counts, from every replica's ``tokens``; this
        replica trains on its ``batches``). Returns the updates' totals and the fused pass's entropy sums."""
        rl = self.settings.rl
        n = len(tokens)
        slices = min(rl.mini_batches, n)  # a group filter may train on fewer groups than a full step: no empty slice
        bounds = [round(k * n / slices) for k in range(slices + 1)]
        stats, grad_norm, lr, skipped = PolicyLossStats(), 0.0, 0.0, 0
        entropy = torch.zeros(sum(b.rows for b in tokens), dtype=torch.float64)
        for _epoch in range(rl.ppo_epochs):
            for lo, hi in zip(bounds, bounds[1:]):
                num_valid = float(sum(int(b.loss_mask.sum()) for b in tokens[lo:hi]))
                sequences = float(sum(b.rows for b in tokens[lo:hi]))
                mine = [batches[i] for i in self._mine(range(lo, hi))]
                kwargs = {"with_entropy": True} if with_entropy else {}
                result = self.policy.train_step(
                    mine, dataclasses.replace(loss, num_sequences=sequences), num_valid, **kwargs
                )
                for b, sums in zip(mine, result.entropy_sums or []):
                    entropy[b.first : b.first + len(sums)] = sums
                # one collective per update, on every replica alike (one without micro-batches adds zeros)
                stats = stats + PolicyLossStats.total(result.stats, self.dp_sum)
                grad_norm, lr, skipped = grad_norm + result.grad_norm, lr + result.lr, skipped + result.skipped
        updates = rl.ppo_epochs * slices
        return UpdateTotals(stats, updates, grad_norm / updates, lr / updates, skipped), entropy
