"""recipes/rl_update.py: the updates of one RL step's batch (epochs x mini-batches, data-parallel replicas) over a
recording policy, and what a step hands the generator."""

import types

import pytest
import torch

from nemo_rcgrpo.algorithms.losses import GRPOLoss, PolicyLossStats
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.models.interfaces import TrainStepResult
from nemo_rcgrpo.recipes.rl_parts import RLPolicy
from nemo_rcgrpo.recipes.rl_update import StepUpdate, UpdateSettings
from nemo_rcgrpo.utils.dist import DistInfo
from tests.conftest import rl_batch


def _updater(policy, rl, data_dist=None, dp_sum=lambda v: v, updates=1, generator=None, budget=None, reference=None):
    """A StepUpdate on ``policy`` with the rl settings ``rl``: micro-batches of 2 rollouts (or filled to ``budget``
    positions), a generator sharing the policy's weights where one is given."""
    parts = RLPolicy(policy, reference, data_dist or DistInfo(), dp_sum, updates)
    return StepUpdate(parts, generator, generator is not None, 0, (1000, 2, 8), UpdateSettings(rl, 2, budget))


class _RecordingPolicy:
    """Records what each optimizer step is given."""

    def __init__(self):
        self.calls = []

    def train_step(self, micro_batches, loss_fn, num_valid_tokens, with_entropy=False):
        self.calls.append(([b.first for b in micro_batches], num_valid_tokens, loss_fn.num_sequences, loss_fn.ratio))
        # one record per micro-batch, as a backend returns them (a replica without micro-batches returns none)
        stats = [
            PolicyLossStats(
                loss=float(len(self.calls)) / len(micro_batches),
                kl_sum=0.5,
                clipped_tokens=1.0,
                tokens=float(b.loss_mask.sum()),
            )
            for b in micro_batches
        ]
        return TrainStepResult(stats, grad_norm=1.0, lr=0.5)


@pytest.mark.parametrize("epochs, minis, replicas", [(1, 1, 1), (2, 3, 1), (1, 2, 2), (1, 5, 2)])
def test_updates_of_a_batch(epochs, minis, replicas):
    # 5 micro-batches of 2 sequences; micro-batch i has i + 1 trained tokens per sequence
    masks = [[[1] * (i + 1) + [0] * (5 - i)] * 2 for i in range(5)]
    tokens = [
        MicroBatch(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), torch.tensor(m))
        for m in masks
    ]
    results = []
    for rank in range(replicas):
        rl = types.SimpleNamespace(ppo_epochs=epochs, mini_batches=minis)  # the loss is handed to _update
        reduced = []
        dp_sum = lambda v, reduced=reduced: reduced.append(v) or v  # noqa: E731 - records every collective
        trainer = _updater(_RecordingPolicy(), rl, DistInfo(rank=rank, world_size=replicas), dp_sum, epochs * minis)
        mine = {
            i: rl_batch(masks[i], [0.0, 0.0], torch.zeros(2, 6), old_logprobs=torch.zeros(2, 6), first=2 * i)
            for i in range(5)
            if i % replicas == rank
        }
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
        local = [
            [i for i in range(bounds[u % minis], bounds[u % minis + 1]) if i % replicas == rank]
            for u in range(epochs * minis)
        ]
        assert out.stats.loss == pytest.approx(sum(u + 1 for u, m in enumerate(local) if m))
        assert out.stats.kl_sum == pytest.approx(0.5 * sum(len(m) for m in local))
        assert out.stats.tokens == sum(2 * (i + 1) for m in local for i in m)
        assert out.grad_norm == 1.0 and out.lr == 0.5  # the means over the updates
    if (epochs, minis) == (2, 3):  # 5 micro-batches in 3 slices: [0, 2), [2, 3), [3, 5)
        assert [c[0] for c in results[0][0][:3]] == [[0, 2], [4], [6, 8]]


class _FusedPolicy(_RecordingPolicy):
    """Returns each micro-batch's per-rollout entropy sums from the training pass (the fused old-logprob pass)."""

    def train_step(self, micro_batches, loss_fn, num_valid_tokens, with_entropy=False):
        self.with_entropy = with_entropy
        result = super().train_step(micro_batches, loss_fn, num_valid_tokens)
        sums = (
            [torch.tensor([100.0 * b.first + r for r in range(b.rows)], dtype=torch.float64) for b in micro_batches]
            if with_entropy
            else None
        )
        return TrainStepResult(result.stats, result.grad_norm, result.lr, entropy_sums=sums)


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_fused_pass_gives_each_rollout_its_entropy_where_it_was_trained(replicas):
    """With one fused update the entropies come from the training pass: rollout first + r of a micro-batch gets
    that micro-batch's r-th sum, in place, and the rollouts another replica trained on stay 0 here."""
    rows = [2, 3, 1, 2]  # micro-batches of different sizes: rollouts 0-1, 2-4, 5, 6-7
    firsts = [0, 2, 5, 6]
    tokens = [
        MicroBatch(
            torch.zeros(n, 4, dtype=torch.long), torch.ones(n, 4, dtype=torch.long), torch.ones(n, 4, dtype=torch.long)
        )
        for n in rows
    ]
    for rank in range(replicas):
        rl = types.SimpleNamespace(ppo_epochs=1, mini_batches=1)
        trainer = _updater(_FusedPolicy(), rl, DistInfo(rank=rank, world_size=replicas))
        mine = {
            i: rl_batch([[1] * 4] * n, [0.0] * n, torch.zeros(n, 4), first=firsts[i])
            for i, n in enumerate(rows)
            if i % replicas == rank
        }
        _, entropy = trainer._update(tokens, mine, GRPOLoss(), with_entropy=True)
        expected = [0.0] * 8
        for i in mine:
            for r in range(rows[i]):
                expected[firsts[i] + r] = 100.0 * firsts[i] + r
        assert entropy.tolist() == expected and trainer.policy.with_entropy is True
    _, none = trainer._update(tokens, mine, GRPOLoss(), with_entropy=False)
    assert none.tolist() == [0.0] * 8 and trainer.policy.with_entropy is False


class _StepPolicy(_RecordingPolicy):
    """A policy whose passes are recorded in ``events`` (shared with the generator): its old-logprob pass returns
    -0.1 x the micro-batch's first rollout per token (entropy 1 per token), its training pass per-rollout entropy
    sums of 100 x the rollout's index."""

    def __init__(self, events, fuses):
        super().__init__()
        self.events, self.fuses_old_logprobs, self.given = events, fuses, []

    def logprobs(self, batch, with_entropy=False):
        self.events.append("logprobs")
        shape = tuple(batch.input_ids.shape)
        return torch.full(shape, -0.1 * len(self.events)), torch.ones(shape)

    def train_step(self, micro_batches, loss_fn, num_valid_tokens, with_entropy=False):
        self.events.append("train")
        self.given.append([(b.first, b.old_logprobs) for b in micro_batches])
        result = super().train_step(micro_batches, loss_fn, num_valid_tokens)
        sums = (
            [torch.tensor([100.0 * (b.first + r) for r in range(b.rows)], dtype=torch.float64) for b in micro_batches]
            if with_entropy
            else None
        )
        return TrainStepResult(result.stats, result.grad_norm, result.lr, entropy_sums=sums)

    def sync_hf_model(self):
        self.events.append("sync")

    share_prefix, packs = True, None

    def layout(self, batch):  # shares what the rows of a micro-batch start with, as the torch backend does
        from nemo_rcgrpo.models.shared_prefix import share_layout

        return share_layout(batch.input_ids, batch.attention_mask)


class _VersionedGenerator:
    """Records the version each weight update says the generator samples from."""

    def __init__(self, events):
        self.events, self.versions = events, []

    def update_weights(self, weights, version):
        self.events.append("versioned")
        self.versions.append(version)


def _step_trainer(updates=1, old_logprobs="auto", fuses=True, budget=None):
    """A step's updates on a recording policy, with a generator that shares its weights; groups of 2, micro-batches
    of 2 rollouts or filled to ``budget`` positions (trainer.micro_batch_tokens)."""
    loss = types.SimpleNamespace(
        clip_low=0.2,
        clip_high=0.2,
        kl_beta=0.1,
        kl_estimator="k3",
        aggregation="token",
        correction="none",
        correction_cap=2.0,
        policy_loss="clipped",
    )
    rl = types.SimpleNamespace(ppo_epochs=updates, mini_batches=1, old_logprobs=old_logprobs, loss=loss, group_size=2)
    events = []
    reference = lambda b: torch.zeros(tuple(b.input_ids.shape))  # noqa: E731
    generator = _VersionedGenerator(events)
    update = _updater(
        _StepPolicy(events, fuses), rl, None, updates=updates, generator=generator, budget=budget, reference=reference
    )
    return update, events


def _groups():
    from tests.unit.algorithms.test_rl_batch import _traj

    # 2 groups of 2: rollout i has i + 1 generated tokens after a 2-token prompt
    trajs = [_traj([1, 2] + [3] * (i + 1), [0, 0] + [1] * (i + 1), float(i % 2), None, group=i // 2) for i in range(4)]
    return [trajs[:2], trajs[2:]]


@pytest.mark.parametrize(
    "updates, old_logprobs, fuses", [(1, "auto", True), (1, "recompute", True), (2, "auto", True), (1, "auto", False)]
)
def test_a_step_trains_then_hands_the_generator_the_next_version(updates, old_logprobs, fuses):
    """After step k's update the generator samples from version k + 1, never before the update; the old-logprob
    pass runs unless one update takes its ratio against its own pass (rl.old_logprobs=auto, a policy that fuses),
    and the entropies come from whichever pass ran."""
    trainer, events = _step_trainer(updates, old_logprobs, fuses)
    groups = _groups()
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    adv = torch.tensor([[-1.0, 1.0], [-1.0, 1.0]])
    metrics = trainer.apply(groups, rewards, adv, {"filter_rounds": 1.0}, version=4)  # after step 3
    fused = updates == 1 and old_logprobs == "auto" and fuses
    assert trainer.generator.versions == [4] and events[-2:] == ["sync", "versioned"]
    assert events[:-2] == ["train"] * updates if fused else ["logprobs", "logprobs"] + ["train"] * updates
    given = trainer.policy.given[0]
    assert [f for f, _ in given] == [0, 2]  # micro-batches of 2 rollouts, in trajectory order
    ratios = {c[3] for c in trainer.policy.calls}
    if fused:
        assert ratios == {"current"} and all(old is None for _, old in given)
        # the training pass's sums, rollout i's 100 i over its i + 1 tokens, 10 tokens in all
        assert metrics["entropy"] == pytest.approx((0 + 100 + 200 + 300) / 10)
    else:
        assert ratios == {"old"} and [old[0, 0].item() for _, old in given] == pytest.approx([-0.1, -0.2])
        assert metrics["entropy"] == pytest.approx(1.0)  # the old-logprob pass's: 1 per generated token
    assert metrics["tokens"] == 10.0 and metrics["updates"] == float(updates) and metrics["filter_rounds"] == 1.0
    # micro-batches of rows of 3 and 4, then 5 and 6 tokens, each row the one before plus a 3: a pair's shorter row
    # but its last token (its own) is computed once, 2 and then 4 tokens saved
    assert metrics["prefix_tokens_saved"] == 6.0 and 0.0 < metrics["forward_flops_saved"] < 6 / 18
    assert metrics["reward_mean"] == 0.5 and metrics["loss"] == pytest.approx(1.0 if updates == 1 else 1.5)
    for key in ("logprob_seconds", "train_seconds", "weight_sync_seconds"):
        assert 0.0 <= metrics[key] < 60.0


@pytest.mark.parametrize(
    "budget, firsts",
    [
        (18, [0]),  # both groups in one micro-batch: the tree's root 2 + 4 suffixes of 4 = 18 positions
        (10, [0, 2]),  # one group each (6 and 8 positions)
        (7, [0, 2, 3]),  # the second group (8) fits neither beside the first nor alone: one rollout each
    ],
)
def test_micro_batches_filled_to_a_token_budget_counted_as_the_policy_runs_them(budget, firsts):
    """trainer.micro_batch_tokens: the micro-batches are runs of rollouts filled to the budget, whole groups where they
    fit, counted through the policy's prefix tree; the tokens, the normaliser and the metrics see the same rows."""
    trainer, _ = _step_trainer(budget=budget)
    adv = torch.tensor([[-1.0, 1.0], [-1.0, 1.0]])
    metrics = trainer.apply(_groups(), torch.tensor([[0.0, 1.0], [0.0, 1.0]]), adv, {}, version=1)
    assert [f for f, _ in trainer.policy.given[0]] == firsts
    assert trainer.policy.calls[0][1] == 10.0 and trainer.policy.calls[0][2] == 4.0  # tokens and sequences
    assert metrics["tokens"] == 10.0 and metrics["micro_batches"] == float(len(firsts))
    # positions run against the padded micro-batches' B x T (one micro-batch: 18 of 24)
    if budget == 18:
        assert metrics["forward_positions_saved"] == pytest.approx(1 - 18 / 24)
