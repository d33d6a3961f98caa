"""Reward-token sampling for RC-GRPO rollouts (the RC-GRPO paper, "Stage 2").

Every rollout j of a group is conditioned on r_j in {high, low}. The paper
samples i.i.d. with P(high) = p (p = 0.5, the success share of the stage-1
data); with G = 5 about 6% of groups then get one token type only (2 * 0.5^5).
`stratified` gives every group both tokens in proportion p (3 or 2 high of 5 at
p = 0.5, with equal odds, so the high share is p on average), so the token always
injects within-group variance (Prop. 4.3).
Each sampler is a registered function: ``(num_groups, group_size, p_high, rng) -> [[bool]]``
(True = high).
"""

from __future__ import annotations

import math
import random
from typing import Callable

from nemo_rcgrpo.registry import register

RewardTokenSampler = Callable[[int, int, float, random.Random], list[list[bool]]]


def register_sampler(name: str):
    """``@register("reward_token_sampler", name)``."""
    return register("reward_token_sampler", name)


def _check(group_size: int, p_high: float) -> None:
    if group_size < 1 or not 0.0 <= p_high <= 1.0:
        raise ValueError(f"group_size={group_size} must be >= 1 and p_high={p_high} in [0, 1]")


@register_sampler("iid")
def iid(num_groups: int, group_size: int, p_high: float, rng: random.Random) -> list[list[bool]]:
    """r_j ~ Bernoulli(p) independently for every rollout (the paper)."""
    _check(group_size, p_high)
    return [[rng.random() < p_high for _ in range(group_size)] for _ in range(num_groups)]


def stratified_count(group_size: int, p_high: float, rng: random.Random) -> int:
    """High tokens in one group: p * G rounded up with probability frac(p * G), down otherwise (so the expected
    count is p * G, e.g. 2 or 3 with equal odds at G = 5, p = 0.5), then kept within [1, G - 1] so both tokens
    appear (which moves the mean only where p * G < 1 or > G - 1)."""
    exact = p_high * group_size
    n = math.floor(exact)
    if rng.random() < exact - n:
        n += 1
    return min(max(n, 1), group_size - 1) if group_size >= 2 else n


@register_sampler("stratified")
def stratified(num_groups: int, group_size: int, p_high: float, rng: random.Random) -> list[list[bool]]:
    """`stratified_count` high tokens per group (randomised rounding of p * G), at shuffled positions."""
    _check(group_size, p_high)
    groups = []
    for _ in range(num_groups):
        n_high = stratified_count(group_size, p_high, rng)
        tokens = [True] * n_high + [False] * (group_size - n_high)
        rng.shuffle(tokens)
        groups.append(tokens)
    return groups
