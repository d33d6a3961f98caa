"""algorithms/kl.py: the KL estimators k1, k2, k3 against hand-computed values."""

import math

import pytest
import torch

from nemo_rcgrpo.algorithms.kl import kl_k1, kl_k2, kl_k3


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)  # exp(-ln2) + ln2 - 1
    assert kl_k3(ref, ref).item() == 0.0
    # k3 is clamped at 10 (verl's low_var_kl): exp(20) - 20 - 1 = 4.85e8 otherwise; below the clamp it is exact
    assert kl_k3(torch.tensor([0.0]), torch.tensor([20.0])).item() == 10.0
    assert kl_k3(torch.tensor([0.0]), torch.tensor([2.0])).item() == pytest.approx(math.exp(2) - 3)  # 4.389
