import importlib.util
from pathlib import Path

import pytest

from nemo_rcgrpo.envs.bfcl.config import BFCLEnvConfig, ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"


def _env_cfg(*overrides):
    """The env section of the stage-2 defaults, with ``key=value`` overrides of it (``+key=...`` adds one)."""
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    given = [f"+env.{o[1:]}" if o.startswith("+") else f"env.{o}" for o in overrides]
    return BFCLEnvConfig.from_mapping(compose_recipe("rl_defaults", given)["env"])


def test_shipped_env_config_composes_and_builds_an_env(suite):
    cfg = _env_cfg()
    assert cfg == BFCLEnvConfig()  # the recipe's env section restates no default differently
    env = _env_cfg("mode=per_turn", "arg_types=strict").make_env()
    assert (env.mode, env.arg_types) == ("per_turn", "strict")
    env.reset(suite["multi_turn_base_0"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("mode=turnwise", "env.mode='turnwise': choose one of"),
        ("max_steps=0", "env.max_steps=0: must be a positive integer"),
        ("categories=[base,web_search]", "use a non-empty subset"),
        ("+temperature=1.0", "unknown setting env.temperature"),
        ("arg_types=loose", "env.arg_types='loose'"),
    ],
)
def test_bad_settings_are_explained(override, message):
    with pytest.raises(ConfigError) as e:
        _env_cfg(override)
    assert message in str(e.value)


@pytest.mark.parametrize("command, overrides, message", [
    ("train", ["trainer.max_steps=abc"], "trainer.max_steps='abc' must be an integer or null"),
    ("train", ["trainer.lr=fast"], "trainer.lr='fast' must be a number"),
    ("train", ["rl.group_size=five"], "rl.group_size='five' must be an integer"),
    ("train", ["rl.p_high=high"], "rl.p_high='high' must be a number"),
    ("train", ["rl.group_size=true"], "rl.group_size=True must be an integer"),  # a boolean is not an integer
    ("train", ["logging.wandb.enabled=no"], "logging.wandb.enabled='no' must be a boolean"),
    ("train", ["logging.wandb.enabled=yes"], "logging.wandb.enabled='yes' must be a boolean"),
    ("train", ["env.max_steps=many"], "env.max_steps='many' must be an integer"),
    ("train", ["trainer.stpes=3"], "unknown setting trainer.stpes; did you mean trainer.max_steps?"),
    ("train", ["+rl.grop_size=3"], "unknown setting rl.grop_size; did you mean rl.group_size?"),
    ("train", ["policy.megatron.spec=fast"], "policy.megatron.spec='fast'"),
    ("train", ["policy.megatron.sequence_parallel=true", "policy.megatron.spec=local"],
     "policy.megatron.sequence_parallel=true needs the Transformer Engine spec"),
    ("train", ["policy.megatron.fp8=hybrid", "policy.megatron.spec=local"], "needs the Transformer Engine spec"),
    ("eval", ["limit=abc"], "limit='abc' must be an integer or null"),
    ("prepare-data", ["test_fraction=abc"], "test_fraction='abc' must be a number"),
    ("prepare-data", ["seed=abc"], "seed='abc' must be an integer"),
    ("prepare-data", ["categories=base"], "categories='base' must be a list"),
])
def test_every_command_checks_types_and_names_at_start(command, overrides, message, capfd, monkeypatch):
    """One line, exit 2, no traceback, nothing written, for a wrong type or a misspelled key."""
    from nemo_rcgrpo.cli import main

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # prepare-data re-executes itself without it
    name = {"train": ["--config-name", "rcgrpo_smollm_cpu"], "eval": ["policy=oracle", "out_dir=/nonexistent/x"],
            "prepare-data": ["out_dir=/nonexistent/y"]}[command]
    assert main([command, *name, *overrides]) == 2
    err = capfd.readouterr().err.strip()
    assert err == f"error: {err[7:]}" and message in err and "\n" not in err, err
    assert not Path("/nonexistent").exists()


def test_valid_types_still_pass():
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    cfg = TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["trainer.lr=1", "rl.p_high=0.5", "trainer.max_steps=3",
                                                              "generation=vllm", "generation.vllm.devices=4",
                                                              "logging.wandb.name=7"]))
    assert cfg.trainer.lr == 1.0 and isinstance(cfg.trainer.lr, float) and cfg.trainer.max_steps == 3
    assert cfg.generation.vllm.devices == "4" and cfg.logging.wandb.name == "7"  # numbers given for text settings


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine is installed")
def test_the_te_spec_is_refused_without_transformer_engine(capfd):
    from nemo_rcgrpo.cli import main

    assert main(["train", "--config-name", "rcgrpo_smollm_cpu", "policy.backend=megatron", "policy.megatron.spec=te"]) == 2
    assert "policy.megatron.spec=te needs Transformer Engine" in capfd.readouterr().err
