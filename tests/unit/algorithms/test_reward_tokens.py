"""algorithms/reward_tokens.py: the reward-token samplers (iid, stratified) against hand-computed values."""

import math
import random

import pytest

from nemo_rcgrpo.algorithms import reward_tokens
from nemo_rcgrpo.algorithms.reward_tokens import stratified_count
from nemo_rcgrpo.registry import lookup


def test_iid_frequencies():
    groups = lookup("reward_token_sampler", "iid")(20_000, 5, 0.3, random.Random(0))
    flat = [t for g in groups for t in g]
    assert abs(sum(flat) / len(flat) - 0.3) < 4 * math.sqrt(0.3 * 0.7 / len(flat))
    one_type = sum(all(g) or not any(g) for g in groups) / len(groups)
    expected = 0.3**5 + 0.7**5  # 0.1705
    assert abs(one_type - expected) < 4 * math.sqrt(expected * (1 - expected) / len(groups))


@pytest.mark.parametrize(
    "g, p, counts",
    [(5, 0.5, {2, 3}), (4, 0.5, {2}), (5, 0.1, {1}), (5, 0.9, {4}), (8, 0.25, {2}), (2, 0.0, {1}), (5, 0.3, {1, 2})],
)
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


# -------------------- `make mutation`'s survivors killed (docs/testing.md); each test names its mutants


class ZeroRandom(random.Random):
    """random() may return exactly 0.0 (probability 2^-53 per draw); this one always does."""

    def random(self):
        return 0.0


def test_samplers_stay_importable_by_name():
    # kills: register_sampler's wrap returning None (the module attribute `iid` would be None)
    assert reward_tokens.iid is lookup("reward_token_sampler", "iid")
    assert reward_tokens.stratified is lookup("reward_token_sampler", "stratified")


@pytest.mark.parametrize("sampler", ["iid", "stratified"])
def test_argument_checks_are_exact(sampler):
    # kills: `or` -> `and`, `group_size < 1` -> `<= 1` / `< 2`, `p <= 1.0` -> `p < 1.0`, 1.0 -> 2.0
    fn = lookup("reward_token_sampler", sampler)
    assert [len(g) for g in fn(3, 1, 0.5, random.Random(0))] == [1, 1, 1]  # G = 1 is allowed
    assert len(fn(2, 4, 1.0, random.Random(0))) == 2 and len(fn(2, 4, 0.0, random.Random(0))) == 2  # p at 0 and 1
    for group_size, p in [(0, 0.5), (-1, 0.5), (4, 1.5), (4, 1.0001), (4, -0.1)]:
        with pytest.raises(ValueError, match="group_size"):
            fn(1, group_size, p, random.Random(0))


def test_iid_with_p_zero_never_draws_high():
    # kills: `rng.random() < p_high` -> `<=`; random() returns values in [0, 1), 0.0 included
    assert lookup("reward_token_sampler", "iid")(2, 3, 0.0, ZeroRandom()) == [[False] * 3, [False] * 3]
    assert lookup("reward_token_sampler", "iid")(1, 3, 1.0, ZeroRandom()) == [[True] * 3]


def test_stratified_count_never_rounds_a_whole_number_up():
    # kills: `rng.random() < exact - n` -> `<=`; p * G = 0.5 * 4 = 2 exactly: frac 0, so never 3, even at random() = 0
    assert stratified_count(4, 0.5, ZeroRandom()) == 2
    # frac(0.5 * 5) = 0.5 > 0.0: a draw of 0.0 rounds 2.5 up to 3
    assert stratified_count(5, 0.5, ZeroRandom()) == 3


def test_stratified_groups_have_group_size_tokens():
    # kills: `group_size - n_high` -> `group_size + n_high` (extra low tokens)
    groups = lookup("reward_token_sampler", "stratified")(50, 5, 0.5, random.Random(3))
    assert {len(g) for g in groups} == {5}
    assert {sum(g) for g in groups} == {2, 3}
