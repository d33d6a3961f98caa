"""algorithms/advantages.py: group advantages (baselines, scales) against hand-computed values."""

import math

import pytest
import torch

from nemo_rcgrpo.algorithms.advantages import group_advantages, zero_variance_fraction


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


# -------------------- `make mutation`'s survivors killed (docs/testing.md); each test names its mutants


def test_default_eps_and_groups_of_two():
    # kills: eps default 1e-6 -> 1.000001; `g > 1` -> `g > 2` (a group of 2 got std 0)
    # G = 2, R = (1, 0): mean 0.5, unbiased std = sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    a = group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)  # 0.7071058
    assert a[0].tolist() == pytest.approx([expected, -expected], abs=1e-12)


def test_eps_is_added_to_the_std():
    # kills: `std + eps` -> `std - eps`; R = (1, 0), eps = 0.5: 0.5 / (0.70711 + 0.5) = 0.41421 (not 0.5 / 0.20711)
    a = group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64), eps=0.5)
    assert a[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 0.5), abs=1e-12)


def test_leave_one_out_with_two_members_and_several_groups():
    # kills: `g < 2` -> `g <= 2` / `g < 3` (G = 2 refused); keepdim=True -> False in the LOO sum
    # G = 2: A_j = R_j - R_other: (1 - 0, 0 - 1)
    loo2 = group_advantages(torch.tensor([[1.0, 0.0]]), baseline="leave_one_out", scale="none")
    assert loo2.tolist() == [[1.0, -1.0]]
    # two groups of 3: (1, 0, 0) -> (1 - 0, 0 - 0.5, 0 - 0.5); (0, 1, 1) -> (0 - 1, 1 - 0.5, 1 - 0.5)
    loo = group_advantages(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]), baseline="leave_one_out", scale="none")
    assert loo.tolist() == [[1.0, -0.5, -0.5], [-1.0, 0.5, 0.5]]


def test_groups_of_one_get_zero_advantage():
    # kills: `g > 1` -> `g >= 1` (std of one sample is NaN); r[:, :1] -> r[:, :0] (shape [N, 0])
    a = group_advantages(torch.tensor([[3.0], [5.0]]))
    assert a.shape == (2, 1) and a.tolist() == [[0.0], [0.0]]
