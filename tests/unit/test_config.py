from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from nemo_rcgrpo.envs.bfcl.config import BFCLEnvConfig, ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"


def _env_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF / "env"), version_base=None):
        cfg = compose(config_name="bfcl", overrides=list(overrides))
    return BFCLEnvConfig.from_mapping(OmegaConf.to_container(cfg, resolve=True))


def test_shipped_env_config_composes_and_builds_an_env(suite):
    cfg = _env_cfg()
    assert cfg == BFCLEnvConfig()  # the YAML and the dataclass defaults agree
    env = _env_cfg("mode=per_turn", "arg_types=strict").make_env()
    assert (env.mode, env.arg_types) == ("per_turn", "strict")
    env.reset(suite["multi_turn_base_0"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("mode=turnwise", "env.mode='turnwise': choose one of"),
        ("max_steps=0", "env.max_steps=0: must be a positive integer"),
        ("categories=[base,web_search]", "use a non-empty subset"),
        ("+temperature=1.0", "unknown env setting(s) ['temperature']"),
        ("arg_types=loose", "env.arg_types='loose'"),
    ],
)
def test_bad_settings_are_explained(override, message):
    with pytest.raises(ConfigError) as e:
        _env_cfg(override)
    assert message in str(e.value)
