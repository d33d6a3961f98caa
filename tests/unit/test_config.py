import functools
import importlib.util
from pathlib import Path

import pytest

from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.utils.config import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"


def _env_cfg(*overrides):
    """The env section of the stage-2 defaults, with ``key=value`` overrides of it (``+key=...`` adds one)."""
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    given = [f"+env.{o[1:]}" if o.startswith("+") else f"env.{o}" for o in overrides]
    return EnvConfig.from_mapping(compose_recipe("rl_defaults", given)["env"])


def test_shipped_env_config_composes_and_builds_an_env(suite):
    cfg = _env_cfg()
    assert cfg == EnvConfig()  # the recipe's env section restates no default differently
    env = _env_cfg("settings.mode=per_turn", "settings.arg_types=strict").settings.make_env()
    assert (env.mode, env.arg_types) == ("per_turn", "strict")
    env.reset(suite["multi_turn_base_0"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("settings.mode=turnwise", "env.settings.mode='turnwise': choose one of"),
        ("settings.max_steps=0", "env.settings.max_steps=0: must be a positive integer"),
        ("categories=[base,web_search]", "use a non-empty subset"),
        ("+temperature=1.0", "unknown setting env.temperature"),
        ("+settings.temperature=1.0", "unknown setting env.settings.temperature"),
        ("+max_steps=3", "unknown setting env.max_steps: it moved to env.settings.max_steps"),
        ("settings.arg_types=loose", "env.settings.arg_types='loose'"),
        ("settings=3", "env.settings must be a section (mapping), got 3"),
    ],
)
def test_bad_settings_are_explained(override, message):
    with pytest.raises(ConfigError) as e:
        _env_cfg(override)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "command, overrides, message",
    [
        ("train", ["trainer.max_steps=abc"], "trainer.max_steps='abc' must be an integer or null"),
        ("train", ["trainer.lr=fast"], "trainer.lr='fast' must be a number"),
        ("train", ["rl.group_size=five"], "rl.group_size='five' must be an integer"),
        ("train", ["rl.p_high=high"], "rl.p_high='high' must be a number"),
        ("train", ["rl.group_size=true"], "rl.group_size=True must be an integer"),  # a boolean is not an integer
        ("train", ["logging.wandb.enabled=no"], "logging.wandb.enabled='no' must be a boolean"),
        ("train", ["logging.wandb.enabled=yes"], "logging.wandb.enabled='yes' must be a boolean"),
        ("train", ["env.settings.max_steps=many"], "env.settings.max_steps='many' must be an integer"),
        (
            "train",
            ["env.mode=per_turn"],
            "unknown setting env.mode: it moved to env.settings.mode (each env has a "
            "settings section of its own; in a recipe: env: {settings: {mode: ...}})",
        ),
        ("train", ["+env.max_steps=5"], "unknown setting env.max_steps: it moved to env.settings.max_steps"),
        (
            "train",
            ["rl.loss.tis_cap=2"],
            "unknown setting rl.loss.tis_cap: it is now rl.loss.correction=token_tis rl.loss.correction_cap=<the cap>",
        ),
        (
            "train",
            ["rl.dapo_max_rounds=3"],
            "unknown setting rl.dapo_max_rounds: it was renamed rl.group_filter_refills",
        ),
        (
            "train",
            ["+rl.dapo_shortfall=error"],
            "unknown setting rl.dapo_shortfall: it was renamed rl.group_filter_shortfall",
        ),
        ("train", ["env.settings.mdoe=per_turn"], "unknown setting env.settings.mdoe; did you mean env.settings.mode?"),
        ("train", ["trainer.stpes=3"], "unknown setting trainer.stpes; did you mean trainer.max_steps?"),
        ("train", ["+rl.grop_size=3"], "unknown setting rl.grop_size; did you mean rl.group_size?"),
        ("train", ["policy.megatron.spec=fast"], "policy.megatron.spec='fast'"),
        (
            "train",
            ["policy.megatron.sequence_parallel=true", "policy.megatron.spec=local"],
            "policy.megatron.sequence_parallel=true needs the Transformer Engine spec",
        ),
        ("train", ["policy.megatron.fp8=hybrid", "policy.megatron.spec=local"], "needs the Transformer Engine spec"),
        ("eval", ["limit=abc"], "limit='abc' must be an integer or null"),
        ("prepare-data", ["test_fraction=abc"], "test_fraction='abc' must be a number"),
        ("prepare-data", ["seed=abc"], "seed='abc' must be an integer"),
        ("prepare-data", ["categories=base"], "categories='base' must be a list"),
    ],
)
def test_every_command_checks_types_and_names_at_start(command, overrides, message, capfd, monkeypatch):
    """One line, exit 2, no traceback, nothing written, for a wrong type or a misspelled key."""
    from nemo_rcgrpo.cli import main

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # prepare-data re-executes itself without it
    name = {
        "train": ["--config-name", "rcgrpo_smollm_cpu"],
        "eval": ["policy=oracle", "out_dir=/nonexistent/x"],
        "prepare-data": ["out_dir=/nonexistent/y"],
    }[command]
    assert main([command, *name, *overrides]) == 2
    err = capfd.readouterr().err.strip()
    assert err == f"error: {err[7:]}" and message in err and "\n" not in err, err
    assert not Path("/nonexistent").exists()


def test_a_recipe_with_the_group_filters_former_names_is_one_line_naming_the_new_ones(tmp_path, capfd, monkeypatch):
    """rl.dapo_max_rounds and rl.dapo_shortfall govern any group filter and were renamed rl.group_filter_refills and
    rl.group_filter_shortfall: a user's recipe that still gives them is refused in one line naming the new setting
    (the others renamed with it listed), and the new names compose and reach the config."""
    from nemo_rcgrpo.cli import main
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils import config as config_utils

    (tmp_path / "old_names.yaml").write_text(
        "defaults:\n  - rcgrpo_smollm_cpu\n  - _self_\nrl:\n  dapo_max_rounds: 3\n  dapo_shortfall: error\n"
    )
    monkeypatch.setattr(config_utils, "_USER_DIRS", [])  # --config-dir is remembered for the process
    assert main(["train", "--config-dir", str(tmp_path), "--config-name", "old_names"]) == 2
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        "error: unknown setting rl.dapo_max_rounds: it was renamed rl.group_filter_refills"
    ), err
    assert err.endswith("(moved too: ['rl.dapo_shortfall'])"), err
    from nemo_rcgrpo.utils.config import compose

    rl = TrainConfig.from_dict(
        compose("rcgrpo_smollm_cpu", ["rl.group_filter_refills=3", "rl.group_filter_shortfall=error"])
    ).rl
    assert (rl.group_filter_refills, rl.group_filter_shortfall) == (3, "error")


def test_the_scripted_generator_takes_any_env():
    """generation=scripted plays any env's tasks (the suite's oracle_calls, played through the run's env): another
    env validates; a suite without oracle_calls is refused when the generator is built
    (tests/unit/generation/test_scripted.py)."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.registry import register, table
    from nemo_rcgrpo.utils.config import compose

    try:
        register("env", "not_bfcl_example")(lambda settings, suite: None)
        cfg = TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["generation=scripted", "env.name=not_bfcl_example"]))
        assert cfg.generation.backend == "scripted" and cfg.env.name == "not_bfcl_example"
    finally:
        table("env").pop("not_bfcl_example", None)


def test_valid_types_still_pass():
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    cfg = TrainConfig.from_dict(
        compose(
            "rcgrpo_smollm_cpu",
            [
                "trainer.lr=1",
                "rl.p_high=0.5",
                "trainer.max_steps=3",
                "generation=vllm",
                "generation.vllm.devices=4",
                "logging.wandb.name=7",
            ],
        )
    )
    assert cfg.trainer.lr == 1.0 and isinstance(cfg.trainer.lr, float) and cfg.trainer.max_steps == 3
    assert cfg.generation.vllm.devices == "4" and cfg.logging.wandb.name == "7"  # numbers given for text settings


def _sections(instance):
    """``instance`` and every dataclass section under it (the defaults of a schema)."""
    import dataclasses

    yield instance
    for f in dataclasses.fields(instance):
        if dataclasses.is_dataclass(getattr(instance, f.name)):
            yield from _sections(getattr(instance, f.name))


def test_the_choices_of_a_setting_are_its_literal_annotation_and_its_default_is_one():
    """A setting of a fixed set of values is annotated Literal[...] (its choices, written once); the type check refuses
    another value in the one line a user sees, the constants the code compares against are the same values, and every
    default is one of its choices."""
    import typing

    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.config_schema import ChatConfig, DataConfig
    from nemo_rcgrpo.data.chat_format import TOOL_DESCRIPTIONS
    from nemo_rcgrpo.data.tokenize import RENDERERS
    from nemo_rcgrpo.data.tool_parsers import REJECTED_MESSAGE
    from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
    from nemo_rcgrpo.envs.bfcl.env import EPISODE_MODES, PARSE_FAILURE_MODES
    from nemo_rcgrpo.envs.bfcl.executor import ARG_TYPE_MODES
    from nemo_rcgrpo.evaluation.config import EvalConfig
    from nemo_rcgrpo.utils.config import check_choices, check_type

    for instance in (*_sections(TrainConfig()), *_sections(EvalConfig()), BFCLSettings()):
        check_choices(instance)
    chat, data, bfcl = (typing.get_type_hints(c) for c in (ChatConfig, DataConfig, BFCLSettings))
    for hint, constant in (
        (chat["renderer"], RENDERERS),
        (chat["tool_description"], TOOL_DESCRIPTIONS),
        (chat["rejected_message"], REJECTED_MESSAGE),
        (data["mode"], EPISODE_MODES),
        (bfcl["mode"], EPISODE_MODES),
        (bfcl["on_parse_failure"], PARSE_FAILURE_MODES),
        (bfcl["arg_types"], ARG_TYPE_MODES),
    ):
        assert typing.get_args(hint) == constant
    with pytest.raises(ConfigError) as e:
        check_type("policy.megatron.fp8", "e5m2", typing.get_type_hints(type(TrainConfig().policy.megatron))["fp8"])
    assert str(e.value) == "policy.megatron.fp8='e5m2': choose one of [None, 'hybrid', 'e4m3']"
    assert (
        check_type("policy.megatron.fp8", None, typing.get_type_hints(type(TrainConfig().policy.megatron))["fp8"])
        is None
    )


def test_settings_built_in_code_check_their_choices_too():
    """BFCLSettings built in code (tests, benchmarks) refuses a value outside its choices as a config does."""
    from nemo_rcgrpo.envs.bfcl.config import BFCLSettings

    for key, value in (
        ("mode", "turnwise"),
        ("arg_types", "loose"),
        ("on_parse_failure", "retry"),
        ("tool_response", "full"),
    ):
        with pytest.raises(ConfigError, match=rf"^env\.settings\.{key}='{value}': choose one of \["):
            BFCLSettings(**{key: value})


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine is installed"
)
def test_the_te_spec_is_refused_without_transformer_engine(capfd):
    from nemo_rcgrpo.cli import main

    assert (
        main(["train", "--config-name", "rcgrpo_smollm_cpu", "policy.backend=megatron", "policy.megatron.spec=te"]) == 2
    )
    assert "policy.megatron.spec=te needs Transformer Engine" in capfd.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine is installed"
)
def test_what_needs_transformer_engine_is_refused_only_for_the_megatron_backend():
    """FP8, the TE spec and sequence parallelism are the megatron backend's: refused there without Transformer
    Engine, each in one line; the torch backend ignores the megatron section and validates."""
    from nemo_rcgrpo.config import TrainConfig

    cases = {
        "policy.megatron.fp8=hybrid": "policy.megatron.fp8=hybrid needs Transformer Engine, which is not installed",
        "policy.megatron.spec=te": "policy.megatron.spec=te needs Transformer Engine, which is not installed",
        "policy.megatron.sequence_parallel=true": "policy.megatron.sequence_parallel=true needs Transformer Engine",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            TrainConfig.from_dict(_with(["policy.backend=megatron"], override))
        assert str(e.value).startswith(message), str(e.value)
        TrainConfig.from_dict(_with(["policy.backend=torch"], override))
    TrainConfig.from_dict(_with(["policy.backend=megatron"], "policy.megatron.fp8=null"))


# Every documented bound of the training config (config.py's validation): the value just outside it refused in one
# line that names the setting, the value at its edge accepted. Base: the CPU RC-GRPO recipe (10 micro-batches a step).
_RL = "rcgrpo_smollm_cpu"
_VLLM = ["generation=vllm"]
_SCRIPTED = ["generation=scripted"]
_BOUNDS = [  # (extra overrides, refused override, message start, accepted override at the edge or None)
    ([], "model.dtype=float16", "model.dtype='float16': choose one of ['float32', 'bfloat16']", "model.dtype=float32"),
    ([], "model.reward_tokens=plain", "model.reward_tokens='plain': choose one of", "model.reward_tokens=literal"),
    ([], "chat.renderer=jinja", "chat.renderer='jinja': choose one of", None),
    ([], "chat.tool_description=long", "chat.tool_description='long': choose one of", None),
    ([], "chat.rejected_message=drop", "chat.rejected_message='drop': choose one of", None),
    ([], "generation.max_batch_size=0", "generation.max_batch_size=0: must be > 0", "generation.max_batch_size=1"),
    ([], "reward_tokens.high=''", "reward_tokens.high and reward_tokens.low must be non-empty and different", None),
    ([], "reward_tokens.low='<|high_reward|>'", "reward_tokens.high and reward_tokens.low must be non-empty", None),
    (_VLLM, "generation.vllm.weight_sync=ray", "generation.vllm.weight_sync='ray': choose one of", None),
    (_VLLM, "generation.vllm.dtype=int8", "generation.vllm.dtype='int8': choose one of", None),
    (
        _VLLM,
        "generation.vllm.url=localhost:8000",
        "generation.vllm.url='localhost:8000': give http://HOST:PORT",
        "generation.vllm.url=https://host:8000",
    ),
    (_VLLM, "generation.vllm.tp=0", "generation.vllm.tp=0: must be > 0", "generation.vllm.tp=1"),
    (_VLLM, "generation.vllm.kv_cache_gib=0", "generation.vllm.kv_cache_gib=0: must be > 0", None),
    (
        _VLLM,
        "generation.vllm.max_concurrency=0",
        "generation.vllm.max_concurrency=0: must be > 0",
        "generation.vllm.max_concurrency=1",
    ),
    (_VLLM, "generation.vllm.startup_timeout=0", "generation.vllm.startup_timeout=0", None),
    (_VLLM, "generation.vllm.request_timeout=0", "generation.vllm.request_timeout=0", None),
    (_VLLM, "generation.vllm.max_retries=-1", "generation.vllm: max_retries >= 0", "generation.vllm.max_retries=0"),
    (
        _VLLM,
        "generation.vllm.port=-1",
        "generation.vllm: max_retries >= 0, 0 <= port < 65536",
        "generation.vllm.port=0",
    ),
    (_VLLM, "generation.vllm.port=65536", "generation.vllm: max_retries >= 0, 0 <= port", "generation.vllm.port=65535"),
    (
        _VLLM,
        "generation.vllm.gpu_memory_utilization=0",
        "generation.vllm: max_retries >= 0",
        "generation.vllm.gpu_memory_utilization=1.0",
    ),
    (_VLLM, "generation.vllm.gpu_memory_utilization=1.01", "generation.vllm: max_retries >= 0", None),
    (
        _VLLM,
        "generation.vllm.max_model_len=0",
        "generation.vllm.max_model_len=0: must be > 0 or null",
        "generation.vllm.max_model_len=1",
    ),
    (
        _SCRIPTED,
        "generation.scripted.success_rate=-0.1",
        "generation.scripted.success_rate=-0.1: must be a probability",
        "generation.scripted.success_rate=0",
    ),
    (
        _SCRIPTED,
        "generation.scripted.success_high=1.01",
        "generation.scripted.success_high=1.01: must be a probability",
        "generation.scripted.success_high=1",
    ),
    ([], "data.mode=whole", "data.mode='whole': choose one of", None),
    ([], "data.split=dev", "data.split='dev': choose one of ['train', 'test', 'all']", "data.split=all"),
    ([], "trainer.schedule=step", "trainer.schedule='step': choose one of", "trainer.schedule=constant"),
    ([], "logging.wandb.mode=cloud", "logging.wandb.mode='cloud': choose one of", "logging.wandb.mode=disabled"),
    ([], "model.reward_tokens=none", "stage=rcgrpo conditions on reward tokens: set model.reward_tokens=special", None),
    ([], "trainer.lr=0", "trainer.lr=0.0: must be > 0", None),
    ([], "trainer.global_batch_size=0", "trainer.global_batch_size=0: must be > 0", None),
    ([], "trainer.micro_batch_size=0", "trainer.micro_batch_size=0: must be > 0", None),
    ([], "trainer.epochs=0", "trainer.epochs=0: must be > 0", "trainer.epochs=1"),
    ([], "trainer.save_every=0", "trainer.save_every=0: must be > 0", "trainer.save_every=1"),
    ([], "trainer.log_every=0", "trainer.log_every=0: must be > 0", "trainer.log_every=1"),
    ([], "trainer.keep_last=0", "trainer.keep_last=0: must be > 0", "trainer.keep_last=1"),
    ([], "chat.max_length=0", "chat.max_length=0: must be > 0", None),
    ([], "trainer.stop_after=0", "trainer.stop_after=0: must be > 0 or null", "trainer.stop_after=1"),
    ([], "trainer.max_steps=0", "trainer.max_steps=0: must be > 0 or null", "trainer.max_steps=1"),
    (
        [],
        "trainer.global_batch_size=3",
        "trainer.global_batch_size=3 must be a multiple of trainer.micro_batch_size=2",
        None,
    ),
    (
        [],
        "trainer.warmup_steps=-1",
        "trainer.warmup_steps >= 0, 0 <= trainer.min_lr_ratio <= 1",
        "trainer.warmup_steps=0",
    ),
    ([], "trainer.min_lr_ratio=-0.1", "trainer.warmup_steps >= 0", "trainer.min_lr_ratio=0"),
    ([], "trainer.min_lr_ratio=1.1", "trainer.warmup_steps >= 0", "trainer.min_lr_ratio=1"),
    ([], "trainer.grad_clip=-1", "trainer.warmup_steps >= 0", "trainer.grad_clip=0"),
    ([], "data.max_examples=0", "data.max_examples=0: must be > 0 or null", "data.max_examples=1"),
    ([], "policy.megatron.recompute=some", "policy.megatron.recompute='some': choose one of", None),
    ([], "policy.megatron.fp8=e5m2", "policy.megatron.fp8='e5m2': choose one of", None),
    ([], "policy.megatron.tp=0", "policy.megatron.tp=0: must be an integer >= 1", "policy.megatron.tp=1"),
    ([], "policy.megatron.pp=0", "policy.megatron.pp=0: must be an integer >= 1", None),
    (
        [],
        "policy.megatron.cp=2",
        "policy.megatron.cp=2: context parallelism is not implemented",
        "policy.megatron.cp=1",
    ),
    ([], "policy.megatron.spec=fast", "policy.megatron.spec='fast': choose one of", "policy.megatron.spec=local"),
    (
        ["policy.megatron.spec=local"],
        "policy.megatron.fp8=hybrid",
        "policy.megatron.fp8=hybrid needs the Transformer Engine spec",
        None,
    ),
    (
        ["policy.megatron.spec=local"],
        "policy.megatron.sequence_parallel=true",
        "policy.megatron.sequence_parallel=true needs the Transformer Engine spec",
        "policy.megatron.sequence_parallel=false",
    ),
    ([], "rl.split=all", "rl.split='all': choose one of ['train', 'test']", "rl.split=test"),
    ([], "rl.eval_token=auto", "rl.eval_token='auto': choose one of", "rl.eval_token=none"),
    ([], "rl.old_logprobs=reuse", "rl.old_logprobs='reuse': choose one of", "rl.old_logprobs=recompute"),
    ([], "rl.ppo_epochs=0", "rl.ppo_epochs=0: must be an integer >= 1", "rl.ppo_epochs=1"),
    ([], "rl.mini_batches=0", "rl.mini_batches=0: must be an integer >= 1", None),
    ([], "rl.mini_batches=11", "rl.mini_batches=11 exceeds the 10 micro-batches of a step", "rl.mini_batches=10"),
    ([], "rl.loss.correction_cap=0", "rl.loss.correction_cap=0.0: must be > 0", "rl.loss.correction_cap=0.5"),
    (
        ["rl.loss.correction=token_mask"],
        "rl.loss.correction_cap=1",
        "rl.loss.correction_cap=1.0: must be > 1 with rl.loss.correction=token_mask",
        "rl.loss.correction_cap=1.001",
    ),
    (
        ["rl.loss.correction=geometric_mask"],
        "rl.loss.correction_cap=0.5",
        "rl.loss.correction_cap=0.5: must be > 1 with rl.loss.correction=geometric_mask",
        "rl.loss.correction_cap=1.001",
    ),
    (
        [],
        "rl.loss.correction=tis",
        "rl.loss.correction='tis': no sampler_correction of that name; registered: "
        "['none', 'token_tis', 'sequence_tis', 'token_mask', 'geometric_mask']",
        "rl.loss.correction=token_tis",
    ),
    ([], "rl.max_failed_share=1.01", "rl.max_failed_share=1.01: must be in [0, 1]", "rl.max_failed_share=1"),
    ([], "rl.max_failed_share=-0.01", "rl.max_failed_share=-0.01: must be in [0, 1]", "rl.max_failed_share=0"),
    ([], "rl.eval_every=-1", "rl.eval_every must be >= 0 and rl.eval_tasks > 0", "rl.eval_every=0"),
    ([], "rl.eval_tasks=0", "rl.eval_every must be >= 0 and rl.eval_tasks > 0", "rl.eval_tasks=1"),
    ([], "rl.group_size=1", "rl.group_size=1: group advantages need at least 2 rollouts", "rl.group_size=2"),
    ([], "rl.tasks_per_step=0", "rl.tasks_per_step=0: must be > 0", None),
    ([], "rl.max_turns=0", "rl.max_turns=0: must be > 0", "rl.max_turns=1"),
    ([], "rl.max_total_tokens=0", "rl.max_total_tokens=0: must be > 0", "rl.max_total_tokens=1"),
    ([], "rl.sampling.max_new_tokens=0", "rl.sampling.max_new_tokens=0: must be > 0", "rl.sampling.max_new_tokens=1"),
    ([], "rl.p_high=-0.1", "rl.p_high=-0.1: must be in [0, 1]", "rl.p_high=0"),
    ([], "rl.p_high=1.1", "rl.p_high=1.1: must be in [0, 1]", "rl.p_high=1"),
    ([], "rl.loss.clip_low=-0.1", "rl.loss.clip_low, clip_high and kl_beta must be >= 0", "rl.loss.clip_low=0"),
    ([], "rl.loss.clip_high=-0.1", "rl.loss.clip_low, clip_high and kl_beta must be >= 0", "rl.loss.clip_high=0"),
    ([], "rl.loss.kl_beta=-0.1", "rl.loss.clip_low, clip_high and kl_beta must be >= 0", "rl.loss.kl_beta=0"),
    ([], "trainer.max_steps=null", "stage=rcgrpo needs trainer.max_steps (RL steps)", None),
    (
        [],
        "trainer.micro_batch_tokens=autox",
        "trainer.micro_batch_tokens='autox' has the wrong type",
        "trainer.micro_batch_tokens=auto",
    ),
    ([], "trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens=0: must be an integer > 0, auto or null", None),
    (
        [],
        "trainer.micro_batch_tokens=2.5",
        "trainer.micro_batch_tokens=2.5 has the wrong type (expected int or auto or null)",
        None,
    ),
    (
        ["rl.max_total_tokens=4096"],
        "trainer.micro_batch_tokens=4095",
        "trainer.micro_batch_tokens=4095: must be >= rl.max_total_tokens=4096 (a rollout is never split",
        "trainer.micro_batch_tokens=4096",
    ),
    # a token budget decides the micro-batches at each step: one update per pass, every micro-batch in it
    (
        ["trainer.micro_batch_tokens=4096", "rl.max_total_tokens=4096"],
        "rl.mini_batches=2",
        "trainer.micro_batch_tokens=4096 with rl.mini_batches=2: a budget decides the micro-batches",
        "rl.mini_batches=1",
    ),
    (
        ["trainer.micro_batch_tokens=4096", "rl.max_total_tokens=4096", "policy.backend=megatron"],
        "policy.megatron.pp=2",
        "trainer.micro_batch_tokens=4096 with policy.megatron.pp=2: pipeline stages exchange",
        "policy.megatron.pp=1",
    ),
]


@functools.lru_cache(maxsize=None)
def _composed(extra: tuple[str, ...]):
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    return compose_recipe(_RL, list(extra))


def _with(extra, override):
    """The recipe composed with ``extra`` (once per set), then ``override`` (key=YAML value) set on it."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.create(_composed(tuple(extra))), OmegaConf.from_dotlist([override]))
    return OmegaConf.to_container(merged)


def test_a_bound_set_on_the_composed_recipe_is_what_the_command_line_gives():
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    for override in ("rl.p_high=0.25", "reward_tokens.high=''", "trainer.max_steps=null", "rl.loss.correction_cap=1.5"):
        assert _with([], override) == compose_recipe(_RL, [override]), override


@pytest.mark.parametrize("extra, refused, message, accepted", _BOUNDS, ids=[b[1] for b in _BOUNDS])
def test_every_documented_bound_is_refused_in_one_line_and_its_edge_accepted(extra, refused, message, accepted):
    from nemo_rcgrpo.config import TrainConfig

    if refused.startswith("trainer.global"):
        extra = [*extra, "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(_with(extra, refused))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    if accepted is not None:
        TrainConfig.from_dict(_with(extra, accepted))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["stage=sft", "data.dataset=rctp"],
            "data.dataset=rctp: stage=sft trains on an unconditioned dataset; pick one",
        ),
        (["stage=rctp", "data.dataset=sft"], "data.dataset=sft: stage=rctp trains on a reward-conditioned dataset"),
        (["stage=rctp", "model.reward_tokens=none"], "stage=rctp conditions on reward tokens"),
    ],
)
def test_a_stage_1_dataset_must_match_the_stages_conditioning(overrides, message):
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(compose_recipe("sft_smollm_cpu", overrides))
    assert str(e.value).startswith(message), str(e.value)
    TrainConfig.from_dict(compose_recipe("sft_smollm_cpu", [overrides[0], "data.dataset=null"]))


def test_a_stage_1_token_budget_holds_the_longest_example():
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(
            compose_recipe("sft_smollm_cpu", ["chat.max_length=900", "trainer.micro_batch_tokens=899"])
        )
    assert str(e.value) == (
        "trainer.micro_batch_tokens=899: must be >= chat.max_length=900 (an example is never split "
        "across micro-batches), or null"
    )
    # the budget replaces the micro-batch count: global_batch_size need not be a multiple of micro_batch_size
    TrainConfig.from_dict(
        compose_recipe(
            "sft_smollm_cpu",
            [
                "chat.max_length=900",
                "trainer.micro_batch_tokens=900",
                "trainer.global_batch_size=3",
                "trainer.micro_batch_size=2",
            ],
        )
    )


def test_a_model_parallel_run_started_by_hand_is_not_held_to_the_layouts_gpus():
    """Validation checks that the layout adds up, not that TP x PP divides its GPUs: a run started by hand (TP=2
    under torchrun on a machine the layout does not describe) needs only its own world size to fit, which
    Megatron checks at start; the launchers ask for the full plan."""
    from nemo_rcgrpo.config import TrainConfig

    cfg = TrainConfig.from_dict(_with(["policy.backend=megatron", "layout.gpus_per_node=3"], "policy.megatron.tp=2"))
    assert cfg.parallel_plan(model_parallel=False).world_size == 3  # 3 GPUs in the layout, not a multiple of 2
    with pytest.raises(ConfigError, match=r"training GPUs are not a multiple of TP x PP x CP = 2 x 1 x 1"):
        cfg.parallel_plan()


def test_env_categories_default_to_what_the_task_source_declares():
    """env.categories: [] in every recipe's defaults, written out at validation as the task source's own categories
    (BFCL's four; a plugin source's), so the saved config says which were played; an undeclared name is refused."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.registry import register, table
    from nemo_rcgrpo.utils.config import compose, schema_defaults

    assert schema_defaults("nemo_rcgrpo.config:TrainConfig")["env"]["categories"] == []
    cfg = TrainConfig.from_dict(compose("rl_defaults", ["stage=grpo"]))
    assert cfg.env.categories == ("base", "miss_func", "miss_param", "long_context")
    assert cfg.to_dict()["env"]["categories"] == ["base", "miss_func", "miss_param", "long_context"]

    def two_kinds(categories, data_dir=None):  # never built here
        raise AssertionError

    two_kinds.categories = ("easy", "hard")
    register("task_source", "two_kinds")(two_kinds)
    try:
        cfg = TrainConfig.from_dict(compose("rl_defaults", ["stage=grpo", "env.task_source=two_kinds"]))
        assert cfg.env.categories == ("easy", "hard")
        with pytest.raises(ConfigError, match=r"env.categories=\['base'\]: unknown \['base'\]; use a non-empty subset"):
            TrainConfig.from_dict(
                compose("rl_defaults", ["stage=grpo", "env.task_source=two_kinds", "env.categories=[base]"])
            )
    finally:
        table("task_source").pop("two_kinds")


def test_auto_micro_batch_tokens_by_device_and_where_a_budget_cannot_hold():
    from nemo_rcgrpo.config import auto_micro_batch_tokens

    assert auto_micro_batch_tokens(5, 2048, 1, 1, "cpu") == 10240  # a whole group of max-length rollouts
    assert auto_micro_batch_tokens(5, 2048, 1, 1, "cuda") == 2048  # one max-length rollout's positions
    assert auto_micro_batch_tokens(5, 2048, 2, 1, "cpu") is None  # mini-batches: slices fixed in rollouts
    assert auto_micro_batch_tokens(5, 2048, 1, 2, "cuda") is None  # pipeline stages: one activation shape


def test_every_shipped_rl_recipe_fills_micro_batches_with_whole_groups_by_default():
    """The fast path is the default: every stage-2 recipe leaves trainer.micro_batch_tokens at auto, and a shipped
    CPU recipe's budget holds a whole group of max-length rollouts (one prompt computed once per group)."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    rl_recipes = [p.stem for p in CONF.glob("*.yaml") if "rl:" in p.read_text() or "grpo" in p.stem]
    assert {"rcgrpo_smollm_cpu", "smoke_rl", "micro_rcgrpo", "rcgrpo_llama8b"} <= set(rl_recipes)
    for name in rl_recipes:
        cfg = TrainConfig.from_dict(compose_recipe(name, []))
        if not cfg.is_rl:
            continue
        assert cfg.trainer.micro_batch_tokens == "auto", name
        rl = cfg.rl
        expected_cpu = None if rl.mini_batches > 1 else rl.group_size * rl.max_total_tokens
        assert cfg.micro_batch_budget("cpu") == expected_cpu, name
    gpu = TrainConfig.from_dict(compose_recipe("rcgrpo_llama8b", []))
    assert gpu.micro_batch_budget("cuda") == gpu.rl.max_total_tokens == 16384
    pipeline = TrainConfig.from_dict(compose_recipe("rcgrpo_llama8b", ["policy.megatron.pp=2"]))
    assert pipeline.micro_batch_budget("cuda") is None


@pytest.mark.parametrize("override", ["rl.mini_batches=2", "trainer.micro_batch_size=4"])
def test_auto_gives_way_to_a_users_micro_batch_settings(override):
    """auto never refuses what a user sets beside it: with mini-batches it falls back to micro_batch_size rows."""
    from nemo_rcgrpo.config import TrainConfig

    cfg = TrainConfig.from_dict(_with([], override))
    assert cfg.trainer.micro_batch_tokens == "auto"
    budget = cfg.micro_batch_budget("cpu")
    assert budget == (None if "mini_batches" in override else cfg.rl.group_size * cfg.rl.max_total_tokens)


def test_auto_in_stage_1_is_micro_batch_size_examples_written_out():
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose as compose_recipe

    cfg = TrainConfig.from_dict(compose_recipe("sft_smollm_cpu", ["trainer.micro_batch_tokens=auto"]))
    assert cfg.trainer.micro_batch_tokens is None
