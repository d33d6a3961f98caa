"""recipes/rl.py: each step's draws, the held-out episodes' token, and the generator's first weights."""

import random

import pytest

from nemo_rcgrpo.recipes.rl import RLTrainer
from nemo_rcgrpo.utils.dist import DistInfo
from tests.unit.recipes.test_rl_update import _step_trainer


def test_each_step_draws_its_own_reward_tokens_and_a_resumed_run_the_same():
    from nemo_rcgrpo.recipes.rl import step_rng

    def draws(seed, step):
        return [step_rng(seed, step).random() for _ in range(4)]

    runs = {(seed, step): tuple(draws(seed, step)) for seed in (0, 1, 1234, 1_000_003) for step in range(6)}
    assert len(set(runs.values())) == len(runs)  # no two (seed, step) alike, (0, 1) and (1, 0) included
    # the documented stream: a recorded run (tests/data/golden) and a resumed one draw from exactly this
    assert draws(1234, 5) == [random.Random(1234 * 1_000_003 + 5).random() for _ in range(4)]
    assert all(draws(seed, step) == list(v) for (seed, step), v in runs.items())  # and each one repeats
    # what the loop's stratified sampler draws from it: the tokens of a step differ across steps
    from nemo_rcgrpo.algorithms.reward_tokens import iid

    tokens = [iid(4, 4, 0.5, step_rng(7, step)) for step in range(4)]
    assert len({tuple(map(tuple, t)) for t in tokens}) > 1


@pytest.mark.parametrize(
    "setting, conditioned, token",
    [
        ("high", True, True),
        ("low", True, False),
        ("none", True, None),
        ("high", False, None),
        ("low", False, None),
        ("none", False, None),  # unconditioned: never a token
    ],
)
def test_held_out_episodes_are_conditioned_only_where_the_model_was_trained_so(setting, conditioned, token):
    from nemo_rcgrpo.recipes.rl import eval_reward_token

    assert eval_reward_token(setting, conditioned) is token


@pytest.mark.parametrize("resumed", [0, 7])
def test_a_run_starts_its_generator_on_the_version_of_the_steps_done(resumed):
    """Fresh or resumed, the generator's first weights are the version of the steps already done (a resume from
    step 7 samples step 8 from version 7), and the banner is rank 0's."""
    update, events = _step_trainer()
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.policy, trainer.generator, trainer.shares_weights, trainer.step = update.policy, update.generator, True, 0
    trainer.dist = DistInfo(rank=0, world_size=1)
    banners = []
    trainer.resume = lambda: setattr(trainer, "step", resumed) or ("ckpt" if resumed else None)
    trainer._banner = banners.append
    trainer._start()
    assert trainer.generator.versions == [resumed] and events == ["sync", "versioned"]
    assert banners == ["ckpt" if resumed else None]
    trainer.dist, banners[:] = DistInfo(rank=1, world_size=2), []
    trainer._start()
    assert banners == [] and trainer.generator.versions == [resumed, resumed]


def test_step_k_hands_the_generator_the_weights_of_k_plus_1_steps():
    """After step k's update (the trainer holds k steps done) the generator samples from version k + 1."""
    import torch

    from tests.unit.recipes.test_rl_update import _groups

    update, events = _step_trainer()
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.updater, trainer.step = update, 3
    adv = torch.tensor([[-1.0, 1.0], [-1.0, 1.0]])
    trainer.update(_groups(), torch.tensor([[0.0, 1.0], [0.0, 1.0]]), adv, {})
    assert update.generator.versions == [4] and events[-2:] == ["sync", "versioned"]
