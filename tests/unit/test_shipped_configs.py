"""Every shipped recipe composes with Hydra and passes validation."""

from pathlib import Path

import pytest

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.prepare_data import PrepareDataConfig
from nemo_rcgrpo.utils.config import ConfigError, compose, conf_dir

TRAIN_RECIPES = sorted(p.stem for p in conf_dir().glob("*.yaml") if p.stem.startswith(("sft_", "rctp_")))


def test_recipes_are_found():
    assert {"sft_smollm_cpu", "rctp_smollm_cpu", "sft_qwen7b", "sft_llama8b", "rctp_qwen7b", "rctp_llama8b"} <= set(TRAIN_RECIPES)


@pytest.mark.parametrize("name", TRAIN_RECIPES)
def test_train_recipe_validates(name, monkeypatch):
    monkeypatch.setenv("RCGRPO_QWEN7B_PATH", "/models/qwen")
    cfg = TrainConfig.from_dict(compose(name))
    assert cfg.stage == name.split("_")[0]
    if name.endswith(("qwen7b", "llama8b")):  # Appendix E
        assert (cfg.trainer.lr, cfg.trainer.global_batch_size, cfg.model.dtype) == (1e-5, 16, "bfloat16")
        assert cfg.trainer.epochs == (2 if cfg.stage == "sft" else 5)
        assert cfg.chat.format == ("llama3_json" if "llama" in name else "hermes")
    if name == "sft_qwen7b":
        assert cfg.model.path == "/models/qwen"  # from the environment variable


def test_prepare_data_config_validates():
    assert PrepareDataConfig.from_dict(compose("prepare_data")) == PrepareDataConfig()


def test_unknown_config_name():
    with pytest.raises(ConfigError, match="no config named 'sft_gpt5'"):
        compose("sft_gpt5")
