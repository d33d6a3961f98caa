"""Stage-2 settings refused at start with one line: sampling the trainer cannot score, scripted generator and
dynamic-sampling options."""

import pytest

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.utils.config import ConfigError, compose


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "rl.sampling.temperature=0.7",
            "rl.sampling.temperature=0.7, top_p=1.0: RL samples at temperature 1 and top_p 1",
        ),
        ("rl.sampling.top_p=0.9", "rl.sampling.temperature=1.0, top_p=0.9: RL samples at temperature 1"),
        ("rl.group_filter_shortfall=skip", "rl.group_filter_shortfall='skip': choose one of ['train', 'error']"),
        ("rl.max_failed_share=1.5", "rl.max_failed_share=1.5: must be in [0, 1]"),
        ("rl.max_failed_share=-0.1", "rl.max_failed_share=-0.1: must be in [0, 1]"),
    ],
)
def test_rl_settings_refused(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", [override]))


@pytest.mark.parametrize(
    "override, message",
    [
        ("generation.scripted.success_low=2", "generation.scripted.success_low=2.0: must be a probability in [0, 1]"),
        ("generation.scripted.success_rate=true", "generation.scripted.success_rate=True must be a number"),
        ("generation.scripted.failure_type=typo", "generation.scripted.failure_type='typo': no failure of that name"),
    ],
)
def test_scripted_settings_refused(override, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["generation=scripted", override]))
    assert str(err.value).startswith(message)


def test_max_failed_share_default():
    assert TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", [])).rl.max_failed_share == 0.25


def test_scripted_recipe_validates():
    cfg = TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["generation=scripted"]))
    assert cfg.generation.backend == "scripted" and cfg.generation.scripted.success_high == 1.0
