"""recipes/rl.py: the updates of one batch (epochs x mini-batches, data-parallel replicas) over a recording policy."""

import types

import pytest
import torch

from nemo_rcgrpo.algorithms.losses import GRPOLoss, PolicyLossStats
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.models.interfaces import TrainStepResult
from nemo_rcgrpo.recipes.rl import RLTrainer
from nemo_rcgrpo.utils.dist import DistInfo

from tests.conftest import rl_batch


class _RecordingPolicy:
    """Records what each optimizer step is given."""

    def __init__(self):
        self.calls = []

    def train_step(self, micro_batches, loss_fn, num_valid_tokens, with_entropy=False):
        self.calls.append(([b.first for b in micro_batches], num_valid_tokens, loss_fn.num_sequences, loss_fn.ratio))
        # one record per micro-batch, as a backend returns them (a replica without micro-batches returns none)
        stats = [PolicyLossStats(loss=float(len(self.calls)) / len(micro_batches), kl_sum=0.5, clipped_tokens=1.0,
                                 tokens=float(b.loss_mask.sum())) for b in micro_batches]
        return TrainStepResult(stats, grad_norm=1.0, lr=0.5)


@pytest.mark.parametrize("epochs, minis, replicas", [(1, 1, 1), (2, 3, 1), (1, 2, 2), (1, 5, 2)])
def test_updates_of_a_batch(epochs, minis, replicas):
    # 5 micro-batches of 2 sequences; micro-batch i has i + 1 trained tokens per sequence
    masks = [[[1] * (i + 1) + [0] * (5 - i)] * 2 for i in range(5)]
    tokens = [MicroBatch(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), torch.tensor(m))
              for m in masks]
    results = []
    for rank in range(replicas):
        trainer = RLTrainer.__new__(RLTrainer)
        trainer.cfg = types.SimpleNamespace(rl=types.SimpleNamespace(
            ppo_epochs=epochs, mini_batches=minis, loss=types.SimpleNamespace(
                clip_low=0.2, clip_high=0.2, kl_beta=0.1, kl_estimator="k3", aggregation="token", tis_cap=None)))
        trainer.updates = epochs * minis
        trainer.policy = _RecordingPolicy()
        trainer.data_dist = DistInfo(rank=rank, world_size=replicas)
        reduced = []
        trainer.dp_sum = lambda v, reduced=reduced: reduced.append(v) or v  # records every collective
        mine = {i: rl_batch(masks[i], [0.0, 0.0], torch.zeros(2, 6), old_logprobs=torch.zeros(2, 6), first=2 * i)
                for i in range(5) if i % replicas == rank}
        out, _ = trainer._update(tokens, mine, GRPOLoss(), with_entropy=False)
        results.append((trainer.policy.calls, out, len(reduced)))
    bounds = [round(k * 5 / minis) for k in range(minis + 1)]  # slices of consecutive micro-batches
    assert {r[2] for r in results} == {epochs * minis}  # every replica joins one reduction per update, the same
    for rank, (calls, out, _) in enumerate(results):
        assert len(calls) == epochs * minis and out.updates == epochs * minis
        for u, (firsts, num_valid, seqs, ratio) in enumerate(calls):
            lo, hi = bounds[u % minis], bounds[u % minis + 1]
            mine = [i for i in range(lo, hi) if i % replicas == rank]
            assert firsts == [2 * i for i in mine]
            assert num_valid == sum(2 * (i + 1) for i in range(lo, hi))  # the whole slice's tokens, every replica's
            assert seqs == 2.0 * (hi - lo) and ratio == "old"  # the slice's sequences, bound into the loss
        # this replica's records, summed over its micro-batches and the updates (dp_sum here adds no replica):
        # the loss of update u (u + 1 here) where it had micro-batches, 0.5 KL per micro-batch, its tokens
        local = [[i for i in range(bounds[u % minis], bounds[u % minis + 1]) if i % replicas == rank]
                 for u in range(epochs * minis)]
        assert out.stats.loss == pytest.approx(sum(u + 1 for u, m in enumerate(local) if m))
        assert out.stats.kl_sum == pytest.approx(0.5 * sum(len(m) for m in local))
        assert out.stats.tokens == sum(2 * (i + 1) for m in local for i in m)
        assert out.grad_norm == 1.0 and out.lr == 0.5  # the means over the updates
    if (epochs, minis) == (2, 3):  # 5 micro-batches in 3 slices: [0, 2), [2, 3), [3, 5)
        assert [c[0] for c in results[0][0][:3]] == [[0, 2], [4], [6, 8]]
