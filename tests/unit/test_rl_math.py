"""Reward-token sampling, group advantages, KL estimators and the clipped loss, against hand-computed values."""

import dataclasses
import math
import random

import pytest
import torch

from nemo_rcgrpo.algorithms.advantages import group_advantages, zero_variance_fraction
from nemo_rcgrpo.algorithms.kl import kl_k1, kl_k2, kl_k3
from nemo_rcgrpo.algorithms.losses import GRPOLoss
from nemo_rcgrpo.algorithms.reward_tokens import stratified_count
from nemo_rcgrpo.registry import lookup

from ..conftest import rl_batch


def test_iid_frequencies():
    groups = lookup("reward_token_sampler", "iid")(20_000, 5, 0.3, random.Random(0))
    flat = [t for g in groups for t in g]
    assert abs(sum(flat) / len(flat) - 0.3) < 4 * math.sqrt(0.3 * 0.7 / len(flat))
    one_type = sum(all(g) or not any(g) for g in groups) / len(groups)
    expected = 0.3**5 + 0.7**5  # 0.1705
    assert abs(one_type - expected) < 4 * math.sqrt(expected * (1 - expected) / len(groups))


@pytest.mark.parametrize("g, p, counts", [(5, 0.5, {2, 3}), (4, 0.5, {2}), (5, 0.1, {1}), (5, 0.9, {4}),
                                          (8, 0.25, {2}), (2, 0.0, {1}), (5, 0.3, {1, 2})])
def test_stratified_counts_and_mean_share(g, p, counts):
    groups = lookup("reward_token_sampler", "stratified")(4000, g, p, random.Random(1))
    assert {sum(grp) for grp in groups} == counts  # both tokens in every group
    assert len({tuple(grp) for grp in groups}) > 1  # positions are shuffled
    share = sum(map(sum, groups)) / (len(groups) * g)
    # randomised rounding: the expected high share is p, except where [1, G - 1] clamps it
    # (G=5, p=0.1: p*G = 0.5 -> 1, share 0.2; G=5, p=0.9: 4.5 -> 4, share 0.8; G=2, p=0: 1, share 0.5)
    expected = {(5, 0.1): 0.2, (5, 0.9): 0.8, (2, 0.0): 0.5}.get((g, p), p)
    assert abs(share - expected) < 4 * math.sqrt(0.25 / len(groups) / g) + 1e-12, share


def test_stratified_count_rounds_at_random():
    rng = random.Random(0)
    draws = [stratified_count(5, 0.5, rng) for _ in range(10_000)]
    assert set(draws) == {2, 3} and abs(draws.count(3) / len(draws) - 0.5) < 0.02  # 2.5 rounded up half the time
    assert [stratified_count(4, 0.5, rng) for _ in range(100)] == [2] * 100  # p * G whole: no rounding


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]])
    # mean 0.4; unbiased std = sqrt((2 * 0.6^2 + 3 * 0.4^2) / 4) = sqrt(0.3) = 0.5477
    a = group_advantages(r, eps=0.0)
    assert torch.allclose(a, torch.tensor([[0.6, -0.4, -0.4, 0.6, -0.4]]) / math.sqrt(0.3))
    loo = group_advantages(torch.tensor([[1.0, 0.0, 0.0]]), baseline="leave_one_out", scale="none")
    assert torch.allclose(loo, torch.tensor([[1.0, -0.5, -0.5]]))  # 1 - mean(0, 0); 0 - mean(1, 0)
    flat = group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(flat, torch.zeros(2, 3)) and not torch.isnan(flat).any()
    assert zero_variance_fraction(torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])) == pytest.approx(2 / 3)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)  # exp(-ln2) + ln2 - 1
    assert kl_k3(ref, ref).item() == 0.0
    # k3 is clamped at 10 (verl's low_var_kl): exp(20) - 20 - 1 = 4.85e8 otherwise; below the clamp it is exact
    assert kl_k3(torch.tensor([0.0]), torch.tensor([20.0])).item() == 10.0
    assert kl_k3(torch.tensor([0.0]), torch.tensor([2.0])).item() == pytest.approx(math.exp(2) - 3)  # 4.389


def _batch(logp_shift, adv):
    old = torch.tensor([[0.0, -1.0, -1.0]])
    logp = old + torch.tensor([[0.0, math.log(1.5), math.log(0.5)]]) * logp_shift
    return logp, rl_batch([[0, 1, 1]], [adv], logp.clone(), old_logprobs=old)


def test_clipped_loss_by_hand():
    logp, batch = _batch(1.0, 2.0)  # ratios 1.5 and 0.5, A = 2
    loss, m = GRPOLoss(kl_beta=0.0)(logp, batch, 2.0)
    # min(3.0, 1.2*2) = 2.4 ; min(1.0, 0.8*2) = 1.0  ->  -(2.4 + 1.0) / 2
    assert loss.item() == pytest.approx(-1.7) and m.clipped_tokens == 1.0
    logp, batch = _batch(1.0, -1.0)
    loss, m = GRPOLoss(kl_beta=0.0)(logp, batch, 2.0)
    # min(-1.5, -1.2) = -1.5 ; min(-0.5, -0.8) = -0.8  ->  (1.5 + 0.8) / 2
    assert loss.item() == pytest.approx(1.15) and m.clipped_tokens == 1.0
    loss, _ = GRPOLoss(kl_beta=0.0, clip_low=0.6, clip_high=0.2)(logp, batch, 2.0)  # 0.5 -> 0.4 floor: unclipped
    assert loss.item() == pytest.approx((1.5 + 0.5) / 2)
    # KL term: ref differs by ln 2 on both tokens, k3 = 0.5 + ln2 - 1 each, beta 0.1
    batch = dataclasses.replace(batch, ref_logprobs=logp - math.log(2))
    loss_kl, m = GRPOLoss(kl_beta=0.1)(logp, batch, 2.0)
    # d = ref - logp = -ln 2: k3 = exp(-ln 2) + ln 2 - 1 = 0.1931 per token, averaged over the 2 tokens
    assert loss_kl.item() == pytest.approx(1.15 + 0.1 * (0.5 + math.log(2) - 1))
    seq, _ = GRPOLoss(kl_beta=0.0, aggregation="sequence", num_sequences=1)(logp, batch, 999.0)
    assert seq.item() == pytest.approx(1.15)  # one sequence of 2 tokens: mean over its tokens


def _slow_loss(logp, old, ref, adv, mask, n_tokens, eps_l, eps_h, beta):
    total = 0.0
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if mask[b][t]:
                ratio = math.exp(logp[b][t] - old[b][t])
                pg = -min(ratio * adv[b], min(max(ratio, 1 - eps_l), 1 + eps_h) * adv[b])
                d = ref[b][t] - logp[b][t]
                total += pg + beta * (math.exp(d) - d - 1)
    return total / n_tokens


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_loss_equals_slow_loop_and_is_microbatch_invariant(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + torch.randn(B, T, generator=g) * 0.3
    ref = logp + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 0
    n = float(mask.sum())
    batch = rl_batch(mask, adv, ref, old_logprobs=old)
    loss, _ = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_beta=0.1)(logp, batch, n)
    slow = _slow_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), n, 0.2, 0.28, 0.1)
    assert loss.item() == pytest.approx(slow, rel=1e-5, abs=1e-6)
    # two micro-batches with the global token count: same loss and same gradient
    x = logp.clone().requires_grad_(True)
    GRPOLoss(clip_high=0.28)(x, batch, n)[0].backward()
    y = logp.clone().requires_grad_(True)
    total = 0.0
    for part in (slice(0, 2), slice(2, B)):
        sub = rl_batch(mask[part], adv[part], ref[part], old_logprobs=old[part])
        l, _ = GRPOLoss(clip_high=0.28)(y[part], sub, n)
        l.backward()
        total += l.item()
    assert total == pytest.approx(loss.item(), rel=1e-5) and torch.allclose(x.grad, y.grad, atol=1e-7)
