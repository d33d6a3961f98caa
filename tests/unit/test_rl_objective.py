"""The RL objective beyond one on-policy step: the ratio without an old-logprob pass, the train/inference gap
metrics, truncated importance sampling, and the updates of one batch (epochs x mini-batches)."""

import math
import types

import pytest
import torch

from nemo_rcgrpo.algorithms.losses import GRPOLoss, PolicyLossStats
from nemo_rcgrpo.recipes.rl import RLTrainer
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.models.interfaces import TrainStepResult
from nemo_rcgrpo.utils.dist import DistInfo

from ..conftest import rl_batch

MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]  # two sequences: 3 and 2 generated tokens, advantages +1 and -0.5


def _batch(old_logprobs=None, sampler_logprobs=None):
    return rl_batch(MASK, [1.0, -0.5], torch.full((2, 4), -1.0), old_logprobs=old_logprobs,
                    sampler_logprobs=sampler_logprobs)


def test_without_old_logprobs_the_ratio_is_one_with_the_on_policy_gradient():
    lp = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.3, -0.7, 0.0]], requires_grad=True)
    fused, _ = GRPOLoss(kl_beta=0.0, ratio="current")(lp, _batch(), 5.0)
    fused.backward()
    grad_fused = lp.grad.clone()
    lp.grad = None
    explicit, _ = GRPOLoss(kl_beta=0.0)(lp, _batch(old_logprobs=lp.detach().clone()), 5.0)
    explicit.backward()
    # ratio 1: loss = -(1 * 3 + (-0.5) * 2) / 5 = -0.4; d loss / d lp_t = -A_b / 5 on masked tokens
    assert fused.item() == pytest.approx(-0.4) and explicit.item() == pytest.approx(-0.4)
    expected = torch.tensor([[0, -0.2, -0.2, -0.2], [0, 0.1, 0.1, 0]])
    assert torch.allclose(grad_fused, expected) and torch.allclose(lp.grad, expected)


def test_sampler_gap_metrics_and_truncated_importance_sampling():
    lp = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.3, -0.7, 0.0]])
    sampler = torch.tensor([[0.0, -0.5, -1.5, -1.0], [0.0, -0.3, -0.2, 5.0]])  # the last column is not generated
    batch = _batch(old_logprobs=lp, sampler_logprobs=sampler)
    _, m = GRPOLoss(kl_beta=0.0)(lp, batch, 5.0)
    # trainer - sampler on the 5 masked tokens: 0, 0.5, -1.0 | 0, -0.5
    assert m.sampler_abs_diff_sum == pytest.approx(2.0)
    assert m.sampler_mult_err_sum == pytest.approx(2 * 1 + 2 * math.exp(0.5) + math.exp(1.0))
    loss, _ = GRPOLoss(kl_beta=0.0, tis_cap=1.2)(lp, batch, 5.0)
    # weights min(exp(gap), 1.2): 1, 1.2 (e^0.5 = 1.65 capped), e^-1 | 1, e^-0.5; pg = -A * w at ratio 1
    w = [1.0, 1.2, math.exp(-1.0), 1.0, math.exp(-0.5)]
    expected = -(1.0 * (w[0] + w[1] + w[2]) - 0.5 * (w[3] + w[4])) / 5
    assert loss.item() == pytest.approx(expected)


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


def test_entropies_of_the_training_pass_equal_the_no_grad_pass(monkeypatch):
    """token_logprobs(..., entropy_out) (chunked over positions) gives the entropies logprobs_and_entropy gives."""
    from nemo_rcgrpo.models import torch_policy
    from nemo_rcgrpo.models.hf import load_model

    monkeypatch.setattr(torch_policy, "ENTROPY_CHUNK", 3)  # several chunks, the last one short
    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    ids = torch.randint(0, 1000, (2, 12))
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[0, 4:12], mask[1, 2:9] = 1, 1
    out = []
    lp = torch_policy.token_logprobs(model, ids, attn, mask, out)
    ref_lp, ref_ent = torch_policy.logprobs_and_entropy(model, ids, attn, mask)
    assert torch.allclose(lp.detach(), ref_lp, atol=1e-5) and torch.allclose(out[0], ref_ent, atol=1e-5)
    assert (out[0] * mask).sum() > 0


@pytest.mark.parametrize("path", ["gathered", "head", "union"])
def test_trained_position_logprobs_equal_the_full_forward(monkeypatch, path):
    """Logprobs, entropies and gradients at the trained positions are the full forward pass's, whether the
    output layer runs on each row's own positions (`position_logits`, bare or as the `PositionHead` DDP
    wraps) or on the union of positions (`logits_to_keep`); positions nobody trains are 0."""
    from nemo_rcgrpo.models import torch_policy
    from nemo_rcgrpo.models.hf import load_model

    monkeypatch.setattr(torch_policy, "ENTROPY_CHUNK", 4)
    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    ids = torch.randint(0, 1000, (3, 14))
    attn = torch.ones_like(ids)
    attn[2, 10:] = 0  # a right-padded row
    mask = torch.zeros_like(ids)
    mask[0, 5:14], mask[1, 2:6], mask[2, 7:10] = 1, 1, 1
    full = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float().log_softmax(-1)  # [B, T-1, V]
    want_lp = torch.cat([torch.zeros(3, 1), full.gather(-1, ids[:, 1:, None]).squeeze(-1)], 1) * mask
    want_ent = torch.cat([torch.zeros(3, 1), -(full.exp() * full).sum(-1)], 1) * mask
    (want_lp.sum()).backward()
    want_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    if path == "union":
        monkeypatch.setattr(torch_policy, "GATHERED_MODEL_TYPES", frozenset())
    assert torch_policy.gathers(model) == (path != "union")
    runner = torch_policy.PositionHead(model) if path == "head" else model
    out: list = []
    lp = torch_policy.token_logprobs(runner, ids, attn, mask, out)
    assert torch.allclose(lp * mask, want_lp, atol=1e-5) and torch.allclose(out[0] * mask, want_ent, atol=1e-5)
    if path != "union":  # each row's own positions only: the rest are exactly 0 (the union fills other rows' too)
        assert (lp[mask == 0] == 0).all() and (out[0][mask == 0] == 0).all()
    (lp * mask).sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), want_grad):
        assert torch.allclose(got, want, atol=1e-5)


def test_position_head_without_a_mask_and_a_micro_batch_with_nothing_trained():
    """Through the PositionHead with loss_mask=None every position is computed (the full forward's logprobs); a
    micro-batch whose mask trains nothing gives all-zero logprobs and a zero loss whose backward runs."""
    from nemo_rcgrpo.algorithms.losses import sft_loss
    from nemo_rcgrpo.models import torch_policy
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    ids = torch.randint(0, 1000, (2, 9))
    attn = torch.ones_like(ids)
    full = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float().log_softmax(-1)
    want = torch.cat([torch.zeros(2, 1), full.gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)
    got = torch_policy.token_logprobs(torch_policy.PositionHead(model), ids, attn, None)
    assert torch.allclose(got, want, atol=1e-5)
    for runner in (model, torch_policy.PositionHead(model)):
        nothing = torch.zeros_like(ids)
        lp = torch_policy.token_logprobs(runner, ids, attn, nothing)
        assert lp.shape == ids.shape and (lp == 0).all()
        loss, m = sft_loss(lp, MicroBatch(ids, attn, nothing), 0.0)
        assert loss.item() == 0.0 and m.tokens == 0.0
        loss.backward()  # no position in the graph: nothing to propagate, and no error
