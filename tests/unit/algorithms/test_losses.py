"""algorithms/losses.py: GRPOLoss through every KL estimator and both aggregations, against values worked out by
hand; the clipped loss on small cases and against a slow loop; the ratio against the pass's own logprobs, the
train / inference gap and truncated importance sampling; sft_loss; the LossStats records.

The first tests' batch: one batch of 3 sequences of different lengths (3, 2 and 4 tokens), advantages of both signs,
ratios away from 1 (some clipped), and a reference that differs from the policy by d = ref - logp
in {ln 2, -ln 2, 0}. clip_low = 0.2, clip_high = 0.3 (the window is [0.8, 1.3]), beta = 0.1.
"""

import dataclasses
import math

import pytest
import torch

from nemo_rcgrpo.algorithms.losses import GRPOLoss, NLLStats, PolicyLossStats, sft_loss
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.registry import names
from tests.conftest import rl_batch

L = math.log(2)
CLIP_LOW, CLIP_HIGH, BETA = 0.2, 0.3, 0.1
X = None  # a padded position (mask 0)

# per token: ratio r = exp(logp - old) and d = ref - logp
RATIOS = [[1.5, 0.5, 1.1, X], [X, 0.5, 1.5, X], [0.9, 2.0, 0.7, 1.0]]
DS = [[L, -L, -L, X], [X, L, L, X], [0.0, -L, 0.0, L]]
ADV = [2.0, -1.0, 0.5]
LENGTHS = [3, 2, 4]  # sum 9 tokens


def _batch():
    logp = torch.tensor(
        [[-0.5, -1.2, -0.8, -0.3], [-2.0, -0.1, -0.7, -1.1], [-0.4, -0.9, -1.6, -0.2]], dtype=torch.float64
    )
    old, ref, mask = logp.clone(), logp.clone(), torch.zeros(3, 4, dtype=torch.long)
    for b in range(3):
        for t in range(4):
            if RATIOS[b][t] is None:  # padding: values that would matter a lot were they not masked
                old[b, t], ref[b, t] = logp[b, t] - 1.7, logp[b, t] + 3.0
            else:
                old[b, t] = logp[b, t] - math.log(RATIOS[b][t])
                ref[b, t] = logp[b, t] + DS[b][t]
                mask[b, t] = 1
    return logp, rl_batch(mask, torch.tensor(ADV, dtype=torch.float64), ref, old_logprobs=old)


def _kl(est, d):
    x = -d  # logp - ref
    return {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(d) - d - 1}[est]


def _pg(r, a):
    return -min(r * a, min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH) * a)


def _by_hand(est, aggregation, num_valid_tokens=9.0, num_sequences=3):
    """Plain loops over the tokens: (loss, metrics)."""
    seq_terms, tok_total = [], 0.0
    m = {"pg_loss_sum": 0.0, "kl_sum": 0.0, "clipped_tokens": 0.0, "ratio_sum": 0.0, "tokens": 0.0}
    for b in range(3):
        seq_sum, n = 0.0, 0
        for r, d in zip(RATIOS[b], DS[b]):
            if r is None:
                continue
            pg, kl = _pg(r, ADV[b]), _kl(est, d)
            seq_sum += pg + BETA * kl
            n += 1
            m["pg_loss_sum"] += pg
            m["kl_sum"] += kl
            m["clipped_tokens"] += (r < 1 - CLIP_LOW and ADV[b] < 0) or (r > 1 + CLIP_HIGH and ADV[b] > 0)
            m["ratio_sum"] += r
            m["tokens"] += 1
        tok_total += seq_sum
        seq_terms.append(seq_sum / n)
    loss = tok_total / num_valid_tokens if aggregation == "token" else sum(seq_terms) / num_sequences
    return loss, m


def test_hand_values_of_the_batch():
    # policy term per token, -min(r*A, clip(r, 0.8, 1.3)*A):
    # seq 0, A=2:    r=1.5: -min(3.0, 2.6) = -2.6 (clipped); r=0.5: -min(1.0, 1.6) = -1.0; r=1.1: -2.2
    # seq 1, A=-1:   r=0.5: -min(-0.5, -0.8) = 0.8 (clipped); r=1.5: -min(-1.5, -1.3) = 1.5
    # seq 2, A=0.5:  r=0.9: -0.45; r=2.0: -min(1.0, 0.65) = -0.65 (clipped); r=0.7: -min(0.35, 0.4) = -0.35; r=1: -0.5
    per_seq_pg = [-2.6 - 1.0 - 2.2, 0.8 + 1.5, -0.45 - 0.65 - 0.35 - 0.5]  # -5.8, 2.3, -1.95
    _, m = _by_hand("k3", "token")
    assert m["pg_loss_sum"] == pytest.approx(sum(per_seq_pg)) == pytest.approx(-5.45)
    assert m["clipped_tokens"] == 3 and m["tokens"] == 9
    assert m["ratio_sum"] == pytest.approx(9.7)  # 3.1 + 2.0 + 4.6
    # KL per token, d = ln2: k1 = -ln2, k2 = ln2^2/2, k3 = 2 - ln2 - 1 = 1 - ln2
    #               d = -ln2: k1 = ln2, k2 = ln2^2/2, k3 = 1/2 + ln2 - 1 = ln2 - 1/2;  d = 0: all 0
    # k1: seq0 -L + L + L = L, seq1 -2L, seq2 L - L = 0            -> -L
    # k2: 7 tokens with d != 0                                     -> 7 L^2 / 2
    # k3: seq0 (1 - L) + 2 (L - 1/2) = L, seq1 2 (1 - L), seq2 1/2 -> 2.5 - L
    assert _by_hand("k1", "token")[1]["kl_sum"] == pytest.approx(-L)
    assert _by_hand("k2", "token")[1]["kl_sum"] == pytest.approx(3.5 * L * L)
    assert _by_hand("k3", "token")[1]["kl_sum"] == pytest.approx(2.5 - L)


# loss for each estimator and aggregation, written out:
#   token:    (-5.45 + 0.1 * kl_sum) / 9
#   sequence: [(-5.8 + 0.1 kl_0) / 3 + (2.3 + 0.1 kl_1) / 2 + (-1.95 + 0.1 kl_2) / 4] / 3
HAND_LOSS = {
    ("k1", "token"): (-5.45 - 0.1 * L) / 9,  # -0.6133
    ("k2", "token"): (-5.45 + 0.1 * 3.5 * L * L) / 9,  # -0.5869
    ("k3", "token"): (-5.45 + 0.1 * (2.5 - L)) / 9,  # -0.5855
    ("k1", "sequence"): ((-5.8 + 0.1 * L) / 3 + (2.3 - 0.2 * L) / 2 + -1.95 / 4) / 3,
    ("k2", "sequence"): ((-5.8 + 0.15 * L * L) / 3 + (2.3 + 0.1 * L * L) / 2 + (-1.95 + 0.1 * L * L) / 4) / 3,
    ("k3", "sequence"): ((-5.8 + 0.1 * L) / 3 + (2.3 + 0.2 * (1 - L)) / 2 + (-1.95 + 0.05) / 4) / 3,
}


@pytest.mark.parametrize("est, aggregation", sorted(HAND_LOSS))
def test_loss_and_metrics_by_hand(est, aggregation):
    logp, batch = _batch()
    loss, stats = GRPOLoss(
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_beta=BETA, kl_estimator=est, aggregation=aggregation, num_sequences=3
    )(logp, batch, 9.0)
    m = stats.as_dict()
    want_loss, want_m = _by_hand(est, aggregation)
    assert want_loss == pytest.approx(HAND_LOSS[est, aggregation], rel=1e-12)  # the loops agree with the comments
    assert loss.item() == pytest.approx(want_loss, rel=1e-9), f"{est}/{aggregation} loss"
    assert m["loss"] == pytest.approx(want_loss, rel=1e-9)
    for key, value in want_m.items():
        assert m[key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{est}/{aggregation} {key}"


def test_the_estimators_give_different_losses():
    logp, batch = _batch()
    losses = {
        est: GRPOLoss(kl_beta=BETA, kl_estimator=est)(logp, batch, 9.0)[0].item() for est in names("kl_estimator")
    }
    assert len({round(v, 9) for v in losses.values()}) == 3, losses


def test_normalisers_are_the_global_counts():
    logp, batch = _batch()  # this micro-batch is half of a 6-sequence step on 18 tokens
    loss = GRPOLoss(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_beta=BETA, kl_estimator="k2", num_sequences=6)
    tok, _ = loss(logp, batch, 18.0)
    assert tok.item() == pytest.approx(HAND_LOSS["k2", "token"] * 9 / 18)
    seq, _ = GRPOLoss(**{**vars(loss), "aggregation": "sequence"})(logp, batch, 18.0)
    assert seq.item() == pytest.approx(HAND_LOSS["k2", "sequence"] * 3 / 6)


def _hand_grad(est, aggregation):
    """d loss / d logp per token. Policy term: -A r while r*A is the minimum (unclipped), 0 when the
    clipped value is the minimum (r outside [0.8, 1.3] on the side the advantage favours);
    KL term: dk1/dlogp = 1, dk2/dlogp = logp - ref = -d, dk3/dlogp = 1 - e^d."""
    grad = [[0.0] * 4 for _ in range(3)]
    for b in range(3):
        for t, (r, d) in enumerate(zip(RATIOS[b], DS[b])):
            if r is None:
                continue
            clipped = (r < 1 - CLIP_LOW and ADV[b] < 0) or (r > 1 + CLIP_HIGH and ADV[b] > 0)
            dpg = 0.0 if clipped else -ADV[b] * r
            dkl = {"k1": 1.0, "k2": -d, "k3": 1 - math.exp(d)}[est]
            norm = 9.0 if aggregation == "token" else LENGTHS[b] * 3
            grad[b][t] = (dpg + BETA * dkl) / norm
    return torch.tensor(grad, dtype=torch.float64)


def test_gradient_by_hand_k3_token():
    logp, batch = _batch()
    x = logp.clone().requires_grad_(True)
    GRPOLoss(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_beta=BETA, kl_estimator="k3")(x, batch, 9.0)[0].backward()
    # seq 0: r=1.5 clipped: 0 + 0.1 (1 - 2) = -0.1;  r=0.5: -2 * 0.5 + 0.1 (1 - 0.5) = -0.95;
    #        r=1.1: -2.2 + 0.05 = -2.15;  padding 0                         (all / 9 tokens)
    # seq 1: padding 0; r=0.5 clipped: -0.1; r=1.5: 1.5 - 0.1 = 1.4; padding 0
    # seq 2: r=0.9: -0.45; r=2 clipped: +0.05; r=0.7: -0.35; r=1: -0.5 - 0.1 = -0.6
    want = (
        torch.tensor(
            [[-0.1, -0.95, -2.15, 0.0], [0.0, -0.1, 1.4, 0.0], [-0.45, 0.05, -0.35, -0.6]], dtype=torch.float64
        )
        / 9
    )
    assert torch.allclose(_hand_grad("k3", "token"), want, atol=1e-12)
    assert torch.allclose(x.grad, want, atol=1e-10), x.grad


@pytest.mark.parametrize("est, aggregation", [("k1", "sequence"), ("k2", "token"), ("k2", "sequence")])
def test_gradient_by_hand_other_cases(est, aggregation):
    logp, batch = _batch()
    x = logp.clone().requires_grad_(True)
    GRPOLoss(
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_beta=BETA, kl_estimator=est, aggregation=aggregation, num_sequences=3
    )(x, batch, 9.0)[0].backward()
    # e.g. k1/sequence, seq 1 (2 tokens of 3 sequences): r=1.5 -> (1.5 + 0.1) / (2 * 3) = 0.2667
    assert torch.allclose(x.grad, _hand_grad(est, aggregation), atol=1e-10), x.grad


@pytest.mark.parametrize("est", ["k1", "k3"])
def test_sequence_aggregation_is_microbatch_invariant(est):
    logp, batch = _batch()
    loss = GRPOLoss(
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_beta=BETA, kl_estimator=est, aggregation="sequence", num_sequences=3
    )
    x = logp.clone().requires_grad_(True)
    whole, _ = loss(x, batch, 9.0)
    whole.backward()
    y = logp.clone().requires_grad_(True)
    total = 0.0
    # halves of 1 and 2 sequences (3 and 6 tokens); num_sequences stays the global 3, and the
    # token count passed is each half's own (it must not matter for "sequence")
    for rows, n_tok in ((slice(0, 1), 3.0), (slice(1, 3), 6.0)):
        sub = rl_batch(
            batch.loss_mask[rows],
            batch.advantages[rows],
            batch.ref_logprobs[rows],
            old_logprobs=batch.old_logprobs[rows],
        )
        part, _ = loss(y[rows], sub, n_tok)
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-12) == pytest.approx(HAND_LOSS[est, "sequence"])
    assert torch.allclose(x.grad, y.grad, atol=1e-12)


def test_unknown_aggregation_and_estimator():
    logp, batch = _batch()
    with pytest.raises(ValueError, match="aggregation='mean'"):
        GRPOLoss(aggregation="mean")(logp, batch, 9.0)
    with pytest.raises(
        ValueError, match="kl_estimator='k4': no kl_estimator of that name; registered: \\['k1', 'k2', 'k3'"
    ):
        GRPOLoss(kl_estimator="k4")(logp, batch, 9.0)
    with pytest.raises(ValueError, match="'sequence' needs the update's sequence count"):
        GRPOLoss(aggregation="sequence")(logp, batch, 9.0)


def test_policy_losses_by_hand():
    """rl.loss.policy_loss: the registered per-token surrogate. ratio [0.5, 1.0, 1.5], clip 0.2 -> clip(r) =
    [0.8, 1.0, 1.2]:
    A = +2: clipped -min(2r, 2 clip(r)) = -min([1, 2, 3], [1.6, 2, 2.4]) = [-1, -2, -2.4], cut where r > 1.2;
    A = -0.5: clipped -min(-0.5 r, -0.5 clip(r)) = -min([-0.25, -0.5, -0.75], [-0.4, -0.5, -0.6])
              = [0.4, 0.5, 0.75], cut where r < 0.8;
    unclipped -r * A: [-1, -2, -3] and [0.25, 0.5, 0.75], nothing cut."""
    from nemo_rcgrpo.registry import lookup

    ratio = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    adv = torch.tensor([[2.0], [-0.5]])
    pg, cut = lookup("policy_loss", "clipped")(ratio, adv, 0.2, 0.2)
    assert torch.allclose(pg, torch.tensor([[-1.0, -2.0, -2.4], [0.4, 0.5, 0.75]]))
    assert cut.tolist() == [[False, False, True], [True, False, False]]
    pg, cut = lookup("policy_loss", "unclipped")(ratio, adv, 0.2, 0.2)
    assert torch.allclose(pg, torch.tensor([[-1.0, -2.0, -3.0], [0.25, 0.5, 0.75]])) and not cut.any()


def test_grpo_loss_uses_the_named_policy_loss():
    """With old logprobs making ratio [1.5] on a positive advantage, clipped pays -1.2 per token and unclipped -1.5
    (kl_beta 0: the policy term alone); the clipped-token count follows the loss."""
    lp = torch.log(torch.tensor([[0.3, 0.3]]))
    batch = rl_batch([[1, 1]], [1.0], lp.clone(), old_logprobs=torch.log(torch.tensor([[0.2, 0.2]])))
    loss, m = GRPOLoss(kl_beta=0.0)(lp, batch, 2.0)
    assert loss.item() == pytest.approx(-1.2) and m.clipped_tokens == 2.0
    loss, m = GRPOLoss(kl_beta=0.0, policy_loss="unclipped")(lp, batch, 2.0)
    assert loss.item() == pytest.approx(-1.5) and m.clipped_tokens == 0.0
    with pytest.raises(ValueError, match="registered: \\['clipped', 'unclipped'"):
        GRPOLoss(policy_loss="nope")(lp, batch, 2.0)


def test_the_ratio_is_chosen_by_the_setting_not_by_the_batch():
    """ratio="old" takes it against batch.old_logprobs; "current" against the detached logprobs of the pass (ratio 1,
    so clipped pays -A per token); each refuses the other's batch, so that a loop that forgot (or kept) the old
    logprobs stops instead of training on another formula."""
    lp = torch.log(torch.tensor([[0.3, 0.3]]))
    with_old = rl_batch([[1, 1]], [1.0], lp.clone(), old_logprobs=torch.log(torch.tensor([[0.2, 0.2]])))
    without = rl_batch([[1, 1]], [1.0], lp.clone())
    loss, m = GRPOLoss(kl_beta=0.0, ratio="current")(lp, without, 2.0)
    assert loss.item() == pytest.approx(-1.0) and m.ratio_sum == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ratio='old'.*without old_logprobs"):
        GRPOLoss(ratio="old")(lp, without, 2.0)
    with pytest.raises(ValueError, match="ratio='current'.*with old_logprobs"):
        GRPOLoss(ratio="current")(lp, with_old, 2.0)
    with pytest.raises(ValueError, match="ratio='both'"):
        GRPOLoss(ratio="both")


def test_the_loss_is_built_from_its_settings():
    """GRPOLoss.from_config takes every field of the rl.loss section, and the ratio the loop chose."""
    from nemo_rcgrpo.config_schema import LossConfig

    section = LossConfig(
        policy_loss="unclipped",
        clip_low=0.1,
        clip_high=0.3,
        kl_beta=0.05,
        kl_estimator="k1",
        aggregation="sequence",
        correction="geometric_mask",
        correction_cap=2.5,
    )
    loss = GRPOLoss.from_config(section, ratio="current")
    assert loss == GRPOLoss(
        clip_low=0.1,
        clip_high=0.3,
        kl_beta=0.05,
        kl_estimator="k1",
        aggregation="sequence",
        correction="geometric_mask",
        correction_cap=2.5,
        policy_loss="unclipped",
        ratio="current",
    )
    assert {f for f in dataclasses.asdict(section)} <= set(dataclasses.asdict(loss))  # no setting left behind
    # the loss's defaults are the section's
    assert GRPOLoss.from_config(LossConfig(), ratio="old") == GRPOLoss()


def test_loss_stats_add_and_total():
    """LossStats records add field by field, and total sums a replica's records and then reduces them once."""
    from nemo_rcgrpo.algorithms.losses import NLLStats

    a, b = PolicyLossStats(loss=1.0, kl_sum=2.0, tokens=3.0), PolicyLossStats(loss=0.5, kl_sum=-1.0, tokens=4.0)
    assert a + b == PolicyLossStats(loss=1.5, kl_sum=1.0, tokens=7.0)
    calls = []

    def reduce(vector):
        calls.append(vector.clone())
        return vector * 2  # two replicas with the same records

    assert PolicyLossStats.total([a, b], reduce) == PolicyLossStats(loss=3.0, kl_sum=2.0, tokens=14.0)
    assert len(calls) == 1 and calls[0].dtype == torch.float64
    assert PolicyLossStats.total([], reduce) == PolicyLossStats()  # a replica without micro-batches adds zeros
    # a record starts from zeros: a replica's total of one record is that record
    assert NLLStats().values() == (0.0, 0.0, 0.0) and PolicyLossStats().values() == (0.0,) * 11
    one = NLLStats(loss=0.5, nll_sum=4.0, tokens=8.0)
    assert NLLStats.total([one]) == one and NLLStats.total([one], lambda v: v * 3) == NLLStats(1.5, 12.0, 24.0)
    with pytest.raises(TypeError, match="PolicyLossStats.total got a NLLStats"):
        PolicyLossStats.total([NLLStats(loss=1.0)])


# -------------------- the clipped loss on small cases, and against a slow loop


def _shifted_batch(logp_shift, adv):
    old = torch.tensor([[0.0, -1.0, -1.0]])
    logp = old + torch.tensor([[0.0, math.log(1.5), math.log(0.5)]]) * logp_shift
    return logp, rl_batch([[0, 1, 1]], [adv], logp.clone(), old_logprobs=old)


def test_clipped_loss_by_hand():
    logp, batch = _shifted_batch(1.0, 2.0)  # ratios 1.5 and 0.5, A = 2
    loss, m = GRPOLoss(kl_beta=0.0)(logp, batch, 2.0)
    # min(3.0, 1.2*2) = 2.4 ; min(1.0, 0.8*2) = 1.0  ->  -(2.4 + 1.0) / 2
    assert loss.item() == pytest.approx(-1.7) and m.clipped_tokens == 1.0
    logp, batch = _shifted_batch(1.0, -1.0)
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


# -------------------- the ratio against the pass's own logprobs, the train / inference gap and truncated importance
# sampling


TWO_ROWS_MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]  # two sequences: 3 and 2 generated tokens, advantages +1 and -0.5


def _two_rows(old_logprobs=None, sampler_logprobs=None):
    return rl_batch(
        TWO_ROWS_MASK,
        [1.0, -0.5],
        torch.full((2, 4), -1.0),
        old_logprobs=old_logprobs,
        sampler_logprobs=sampler_logprobs,
    )


def test_without_old_logprobs_the_ratio_is_one_with_the_on_policy_gradient():
    lp = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.3, -0.7, 0.0]], requires_grad=True)
    fused, _ = GRPOLoss(kl_beta=0.0, ratio="current")(lp, _two_rows(), 5.0)
    fused.backward()
    grad_fused = lp.grad.clone()
    lp.grad = None
    explicit, _ = GRPOLoss(kl_beta=0.0)(lp, _two_rows(old_logprobs=lp.detach().clone()), 5.0)
    explicit.backward()
    # ratio 1: loss = -(1 * 3 + (-0.5) * 2) / 5 = -0.4; d loss / d lp_t = -A_b / 5 on masked tokens
    assert fused.item() == pytest.approx(-0.4) and explicit.item() == pytest.approx(-0.4)
    expected = torch.tensor([[0, -0.2, -0.2, -0.2], [0, 0.1, 0.1, 0]])
    assert torch.allclose(grad_fused, expected) and torch.allclose(lp.grad, expected)


def test_sampler_gap_metrics_and_truncated_importance_sampling():
    lp = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.3, -0.7, 0.0]])
    sampler = torch.tensor([[0.0, -0.5, -1.5, -1.0], [0.0, -0.3, -0.2, 5.0]])  # the last column is not generated
    batch = _two_rows(old_logprobs=lp, sampler_logprobs=sampler)
    _, m = GRPOLoss(kl_beta=0.0)(lp, batch, 5.0)
    # trainer - sampler on the 5 masked tokens: 0, 0.5, -1.0 | 0, -0.5
    assert m.sampler_abs_diff_sum == pytest.approx(2.0)
    assert m.sampler_mult_err_sum == pytest.approx(2 * 1 + 2 * math.exp(0.5) + math.exp(1.0))
    loss, _ = GRPOLoss(kl_beta=0.0, correction="token_tis", correction_cap=1.2)(lp, batch, 5.0)
    # weights min(exp(gap), 1.2): 1, 1.2 (e^0.5 = 1.65 capped), e^-1 | 1, e^-0.5; pg = -A * w at ratio 1
    w = [1.0, 1.2, math.exp(-1.0), 1.0, math.exp(-0.5)]
    expected = -(1.0 * (w[0] + w[1] + w[2]) - 0.5 * (w[3] + w[4])) / 5
    assert loss.item() == pytest.approx(expected)


# the gaps old - sampler on the 5 generated tokens: row 0 (A = 1) 0.1, 0.5, -1.0; row 1 (A = -0.5) 0.5, 0.4; C = 1.5
# (log C = 0.405): weights by hand, one row per correction
GAP_ROWS = [[0.0, 0.1, 0.5, -1.0], [0.0, 0.5, 0.4, 0.0]]
GAPS = torch.tensor(GAP_ROWS)
HAND_WEIGHTS = {
    "none": [1.0, 1.0, 1.0, 1.0, 1.0],
    "token_tis": [math.exp(0.1), 1.5, math.exp(-1.0), 1.5, math.exp(0.4)],  # e^0.5 = 1.65 capped
    "sequence_tis": [math.exp(-0.4)] * 3 + [1.5] * 2,  # row sums -0.4 and 0.9 (e^0.9 = 2.46 capped)
    "token_mask": [1.0, 0.0, 0.0, 0.0, 1.0],  # |0.5| and |-1.0| > log 1.5; 0.4 is within
    "geometric_mask": [1.0] * 3 + [0.0] * 2,  # row means -0.133 and 0.45 (> log 1.5: the row is dropped)
}


@pytest.mark.parametrize("correction", list(HAND_WEIGHTS))
def test_each_sampler_correction_weighs_the_loss_and_its_gradient_by_hand(correction):
    """pg_t = -A_b * w_t at ratio 1 (old = this pass), token mean over the 5 tokens: the loss is
    -(sum_row0 w - 0.5 sum_row1 w) / 5 and d loss / d logp_t = -A_b w_t / 5; the weights carry no gradient."""
    lp = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.3, -0.7, 0.0]], requires_grad=True)
    batch = _two_rows(old_logprobs=lp.detach().clone(), sampler_logprobs=lp.detach() - GAPS)
    loss, stats = GRPOLoss(kl_beta=0.0, correction=correction, correction_cap=1.5)(lp, batch, 5.0)
    loss.backward()
    w = HAND_WEIGHTS[correction]
    assert loss.item() == pytest.approx(-(sum(w[:3]) - 0.5 * sum(w[3:])) / 5, abs=1e-7)
    expected = torch.tensor([[0.0, -w[0], -w[1], -w[2]], [0.0, 0.5 * w[3], 0.5 * w[4], 0.0]]) / 5
    assert torch.allclose(lp.grad, expected, atol=1e-7), (lp.grad, expected)
    if correction == "none":  # measured only: no correction statistics
        assert (stats.corrected_tokens, stats.correction_weight_sum, stats.correction_dropped) == (0.0, 0.0, 0.0)
    else:
        assert stats.corrected_tokens == 5.0 and stats.correction_weight_sum == pytest.approx(sum(w))
        assert stats.correction_dropped == sum(x == 0.0 for x in w)


def test_the_corrections_by_themselves_and_at_their_edges():
    """Each registered function on the hand-made gaps (float64): the hand weights on the generated tokens; a gap of
    exactly log C is kept by the masks (|gap| <= log C), one just beyond is dropped; a one-token rollout's mean is
    its one gap (0.6 > log 1.5: dropped) and a rollout without generated tokens divides by 1, not 0."""
    from nemo_rcgrpo.registry import lookup

    mask = torch.tensor(TWO_ROWS_MASK, dtype=torch.float64)
    on = mask.bool()
    for name, w in HAND_WEIGHTS.items():
        got = lookup("sampler_correction", name)(torch.tensor(GAP_ROWS, dtype=torch.float64), mask, 1.5)
        assert got.shape == GAPS.shape and got[on].tolist() == pytest.approx(w, abs=1e-12), name
    edge = math.log(1.5)
    beyond = math.nextafter(edge, 1.0)
    gaps = torch.tensor([[edge, -edge, beyond, -beyond]], dtype=torch.float64)
    assert lookup("sampler_correction", "token_mask")(gaps, torch.ones_like(gaps), 1.5).tolist() == [[1, 1, 0, 0]]
    for g, kept in ((edge, 1.0), (-edge, 1.0), (beyond, 0.0)):
        rows = torch.tensor([[g, g, 0.0]], dtype=torch.float64)
        assert lookup("sampler_correction", "geometric_mask")(
            rows, torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64), 1.5
        ).tolist() == [[kept] * 3], g
    # the masks declare that their cap must exceed 1 (the config refuses C <= 1 for them); the truncations do not
    assert {n for n in HAND_WEIGHTS if getattr(lookup("sampler_correction", n), "keeps_within_cap", False)} == {
        "token_mask",
        "geometric_mask",
    }
    one = torch.tensor([[0.6, 0.0], [0.0, 0.0]], dtype=torch.float64)
    one_mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    assert lookup("sampler_correction", "geometric_mask")(one, one_mask, 1.5).tolist() == [[0, 0], [1, 1]]


def test_without_a_correction_the_loss_is_the_uncorrected_one_whatever_the_sampler_says():
    """correction none: the loss and gradient do not depend on the sampler's logprobs (only its metrics do)."""
    lp = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.3, -0.7, 0.0]], requires_grad=True)
    grads, losses = [], []
    for sampler in (lp.detach().clone(), lp.detach() - GAPS):
        loss, _ = GRPOLoss()(lp, _two_rows(old_logprobs=(lp.detach() - 0.1), sampler_logprobs=sampler), 5.0)
        loss.backward()
        losses.append(loss.item())
        grads.append(lp.grad.clone())
        lp.grad = None
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])


def test_a_registered_correction_is_used_and_a_wrong_shape_refused():
    from nemo_rcgrpo.registry import register, table

    lp = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.3, -0.7, 0.0]])
    batch = _two_rows(old_logprobs=lp, sampler_logprobs=lp - GAPS)
    try:
        register("sampler_correction", "halve_example")(lambda gap, mask, cap: torch.full_like(gap, 0.5))
        register("sampler_correction", "row_example")(lambda gap, mask, cap: gap[:, :1])
        loss, _ = GRPOLoss(kl_beta=0.0, correction="halve_example")(lp, batch, 5.0)
        assert loss.item() == pytest.approx(0.5 * -(3 - 0.5 * 2) / 5)
        with pytest.raises(
            ValueError,
            match=r"sampler_correction row_example returned torch.Size\(\[2, 1\]\), not "
            r"weights of shape \(2, 4\)",
        ):
            GRPOLoss(correction="row_example")(lp, batch, 5.0)
    finally:
        table("sampler_correction").pop("halve_example", None)
        table("sampler_correction").pop("row_example", None)


# -------------------- `make mutation`'s survivors killed (docs/testing.md); each test names its mutants


def test_sft_loss_by_hand():
    # kills every sft_loss mutant (no other test calls it): sign, `*` -> `/`, `/` -> `*`, max -> min, return None
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ones = torch.ones(1, 3, dtype=torch.long)
    loss, metrics = sft_loss(logp, MicroBatch(ones, ones, torch.tensor([[0, 1, 1]])), num_valid_tokens=2)
    # NLL of the two trained tokens: 2 + 3 = 5, over 2 tokens: 2.5
    assert loss.item() == pytest.approx(2.5) and metrics == NLLStats(loss=2.5, nll_sum=5.0, tokens=2.0)
    # kills: max(num_valid_tokens, 1.0) -> max(.., 2.0); one token: 3 / 1 (not 3 / 2)
    loss, _ = sft_loss(logp, MicroBatch(ones, ones, torch.tensor([[0, 0, 1]])), num_valid_tokens=1)
    assert loss.item() == pytest.approx(3.0)


def _one_token_batch(adv=1.0):
    # logp = old = ref: ratio 1, KL 0, so per-token loss = -min(1 * A, 1 * A) = -A
    z = torch.tensor([[-0.5]])
    return z.clone(), rl_batch(torch.ones(1, 1), [adv], z.clone(), old_logprobs=z.clone())


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_grpo_loss_of_a_single_token(aggregation):
    # kills: max(num_valid_tokens, 1.0) -> 2.0 (token); lengths.clamp(min=1.0) -> 2.0 (sequence)
    logp, batch = _one_token_batch(adv=1.0)
    loss, _ = GRPOLoss(aggregation=aggregation, num_sequences=1)(logp, batch, 1)
    assert loss.item() == pytest.approx(-1.0)  # -1 / 1 token (or / 1 sequence of length 1), not -1 / 2


def _clip_batch(ratios, advs):
    logp = torch.tensor([[math.log(r)] for r in ratios])
    z = torch.zeros_like(logp)
    return logp, rl_batch(torch.ones_like(logp), torch.tensor(advs, dtype=torch.float32), logp.clone(), old_logprobs=z)


def test_clipped_token_count():
    # kills: `1.0 - clip_low` -> `1.0 + clip_low`, `adv < 0` -> `adv <= 0`, `adv > 0` -> `adv >= 0` in the metric
    # a token is clipped when the clamp takes the gradient away: ratio < 0.8 with A < 0, or ratio > 1.2 with A > 0
    ratios = [0.5, 1.5, 0.5, 1.5, 0.5, 1.5, 1.1]
    advs = [-1.0, 1.0, 1.0, -1.0, 0.0, 0.0, -1.0]
    #       yes   yes   no    no    no    no    no (1.1 is inside [0.8, 1.2])
    logp, batch = _clip_batch(ratios, advs)
    _, m = GRPOLoss(clip_low=0.2, clip_high=0.2)(logp, batch, 7)
    assert m.clipped_tokens == 2.0


def test_ratio_on_the_clip_bound_is_not_clipped():
    # kills: `ratio < 1.0 - clip_low` -> `<=`, `ratio > 1.0 + clip_high` -> `>=`
    # clip_low = clip_high = 0 and logp = old: ratio = exp(0) = 1.0 exactly, on both bounds; the clamp changes nothing
    logp, batch = _clip_batch([1.0, 1.0], [-1.0, 1.0])
    _, m = GRPOLoss(clip_low=0.0, clip_high=0.0)(logp, batch, 2)
    assert m.clipped_tokens == 0.0
