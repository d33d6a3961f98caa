"""The typed schema of a training run (`conf/*.yaml` recipes), validated at start.

One dataclass per config section; `TrainConfig.from_dict` refuses unknown keys
and impossible values with a message that says what to change. Recipes are
Hydra configs (`conf/sft_smollm_cpu.yaml`, ...); overrides use Hydra's grammar
(`trainer.max_steps=3 run_dir=runs/x`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from nemo_rcgrpo.config_schema import (
    ChatConfig,
    DataConfig,
    GenerationConfig,
    LayoutConfig,
    LoggingConfig,
    ModelConfig,
    PolicyConfig,
    RewardTokensConfig,
    RLConfig,
    TrainerConfig,
)
from nemo_rcgrpo.data.stage1_datasets import stage1_dataset
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.layout import ParallelPlan, parallel_plan
from nemo_rcgrpo.registry import load_plugins, lookup
from nemo_rcgrpo.stages import Loop, Stage, group_filter, loop_of, stage_of
from nemo_rcgrpo.utils.config import ConfigError, check_fields, plain, reject_unknown


@dataclass(frozen=True)
class PolicyBuild:
    """What a policy backend's factory (``@register("policy_backend", ...)``) is given of a training run's config,
    and nothing else: its own section (``policy``: the backend and ``policy.megatron``), the optimizer's
    (``trainer``), the precision and memory settings of the model, and the seed (``TrainConfig.policy_build()``)."""

    policy: PolicyConfig = PolicyConfig()
    trainer: TrainerConfig = TrainerConfig()
    dtype: str = "float32"  # model.dtype
    gradient_checkpointing: bool = False  # model.gradient_checkpointing
    seed: int = 1234


@dataclass(frozen=True)
class PolicySetup:
    """Everything the policy factories read, and nothing else: `load_tokenizer_and_model`, `make_renderer` and the
    generator factories (`make_generator`, a plugin's ``@register("generator", ...)``) take this, the same for a
    training run (``TrainConfig.policy_setup()``) and an evaluation (``EvalConfig.policy_setup(model_path)``)."""

    model: ModelConfig = ModelConfig()
    chat: ChatConfig = ChatConfig()
    reward_tokens: RewardTokensConfig = RewardTokensConfig()
    generation: GenerationConfig = GenerationConfig()
    env: EnvConfig = EnvConfig()  # the tasks played (the scripted generator plays their ground truth)
    run_dir: str = "runs/default"  # a started vLLM server keeps its weight folder under it
    generation_gpus: int = 0  # layout.generation_gpus of a training job (the server's GPUs); 0 elsewhere

    def validate(self) -> None:
        lookup("chat_format", self.chat.format, setting="chat.format")
        factory = lookup("generator", self.generation.backend, setting="generation.backend")
        if self.generation.max_batch_size <= 0:
            raise ConfigError(f"generation.max_batch_size={self.generation.max_batch_size}: must be > 0")
        check = getattr(factory, "check", None)  # the generator's own settings (generation.<backend>), one line
        if check is not None:
            check(self)
        if not self.reward_tokens.high or self.reward_tokens.high == self.reward_tokens.low:
            raise ConfigError("reward_tokens.high and reward_tokens.low must be non-empty and different")


@dataclass(frozen=True)
class TrainConfig:
    # a registered stage: sft (expert data) | rctp (reward-conditioned mixed data) | grpo (no tokens) | rcgrpo |
    # dapo_filter (GRPO + zero-variance filtering) | a plugin's (nemo_rcgrpo/stages.py)
    stage: str = "sft"
    seed: int = 1234  # data order, sampling, model initialisation of added rows
    run_dir: str = (
        "runs/default"  # checkpoints, metrics.jsonl, tensorboard/, rollouts/, hf/ (the recipes: runs/<stage>)
    )
    overwrite: bool = False  # with trainer.resume=false: remove the run already in run_dir and start over
    plugins: tuple[str, ...] = ()  # modules imported before validation: their @register entries (nemo_rcgrpo.registry)
    model: ModelConfig = ModelConfig()
    chat: ChatConfig = ChatConfig()
    data: DataConfig = DataConfig()
    trainer: TrainerConfig = TrainerConfig()
    logging: LoggingConfig = LoggingConfig()
    policy: PolicyConfig = PolicyConfig()
    reward_tokens: RewardTokensConfig = RewardTokensConfig()
    rl: RLConfig = RLConfig()
    env: EnvConfig = EnvConfig()  # the environment, its tasks and its settings (nemo_rcgrpo/envs/config.py)
    generation: GenerationConfig = GenerationConfig()
    layout: LayoutConfig = LayoutConfig()  # GPU jobs: where processes go (read by `rcgrpo layout` and scripts/slurm/)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "TrainConfig":
        load_plugins(cfg.get("plugins") or ())  # before validation: a plugin's names are valid choices
        config = _build(cls, cfg, "")
        config.validate()
        return config

    @property
    def stage_spec(self) -> Stage:
        """The registered stage ``stage`` names (`nemo_rcgrpo/stages.py`): its loop, conditioning, data, filter."""
        return stage_of(self.stage)

    def policy_build(self) -> PolicyBuild:
        """The sections a policy backend's factory reads (`models/factory.py`)."""
        return PolicyBuild(
            policy=self.policy,
            trainer=self.trainer,
            dtype=self.model.dtype,
            gradient_checkpointing=self.model.gradient_checkpointing,
            seed=self.seed,
        )

    def policy_setup(self) -> PolicySetup:
        """The sections the policy factories read (model, chat, reward tokens, generator, tasks, run folder)."""
        return PolicySetup(
            model=self.model,
            chat=self.chat,
            reward_tokens=self.reward_tokens,
            generation=self.generation,
            env=self.env,
            run_dir=self.run_dir,
            generation_gpus=self.layout.generation_gpus,
        )

    @property
    def stage1_dataset_name(self) -> str:
        """``data.dataset``, else the stage's dataset, else rctp for a conditioned stage and sft otherwise."""
        spec = self.stage_spec
        return self.data.dataset or spec.dataset or ("rctp" if spec.conditioned else "sft")

    @property
    def keep_group(self):
        """The group filter of this run (``rl.group_filter``, else the stage's ``keep_group``); None: every group."""
        return group_filter(self.stage_spec, self.rl.group_filter)

    @property
    def is_rl(self) -> bool:
        return loop_of(self.stage_spec).rl

    @property
    def data_file(self) -> str:
        return self.data.file or self.stage_spec.data_file or "sft.jsonl"

    def _validate_stage1_dataset(self) -> None:
        name = self.stage1_dataset_name
        label = "data.dataset" if self.data.dataset else f"stage {self.stage}'s dataset"
        lookup("stage1_dataset", name, setting=label)
        if stage1_dataset(name).conditioned != self.stage_spec.conditioned:
            want = "a reward-conditioned" if self.stage_spec.conditioned else "an unconditioned"
            raise ConfigError(
                f"{label}={name}: stage={self.stage} trains on {want} dataset; pick one (e.g. "
                f"data.dataset={'rctp' if self.stage_spec.conditioned else 'sft'}) or another stage"
            )

    def validate(self) -> None:
        from nemo_rcgrpo.envs.sources import check_categories

        # env.categories: [] (the default) is every category the task source declares, written out here so the
        # run's saved config says which it played
        categories = check_categories(self.env.task_source, self.env.categories, "env.categories")
        if categories != self.env.categories:
            object.__setattr__(self, "env", dataclasses.replace(self.env, categories=categories))
        lookup("stage", self.stage, setting="stage")
        lookup("loop", self.stage_spec.loop, of=Loop, setting=f"stage {self.stage}'s loop")
        self.policy_setup().validate()  # model, chat, reward tokens, generation
        backend = lookup("policy_backend", self.policy.backend, setting="policy.backend")
        self._validate_megatron_section()
        check = getattr(backend, "check", None)  # what the chosen backend needs of the run, one line
        if check is not None:
            check(self)
        self.parallel_plan(model_parallel=False)  # the GPU layout adds up (TP x PP x CP: checked by the launchers)
        t = self.trainer  # sizes first: the RL checks divide by them
        positive = {
            "trainer.lr": t.lr,
            "trainer.global_batch_size": t.global_batch_size,
            "trainer.micro_batch_size": t.micro_batch_size,
            "trainer.epochs": t.epochs,
            "trainer.save_every": t.save_every,
            "trainer.log_every": t.log_every,
            "trainer.keep_last": t.keep_last,
            "chat.max_length": self.chat.max_length,
        }
        for key, value in positive.items():
            if value is None or value <= 0:
                raise ConfigError(f"{key}={value}: must be > 0")
        budget = t.micro_batch_tokens
        if budget == "auto" and not self.is_rl:  # stage 1: micro_batch_size examples each (written out, as saved)
            budget = None
            object.__setattr__(self, "trainer", dataclasses.replace(t, micro_batch_tokens=None))
        if budget not in (None, "auto") and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ConfigError(f"trainer.micro_batch_tokens={budget!r}: must be an integer > 0, auto or null")
        if self.is_rl:
            self._validate_rl()
        else:
            self._validate_stage1_dataset()
        if self.stage_spec.conditioned and self.model.reward_tokens == "none":
            raise ConfigError(
                f"stage={self.stage} conditions on reward tokens: set model.reward_tokens=special (or literal)"
            )
        if t.stop_after is not None and t.stop_after <= 0:
            raise ConfigError(f"trainer.stop_after={t.stop_after}: must be > 0 or null")
        if t.max_steps is not None and t.max_steps <= 0:
            raise ConfigError(f"trainer.max_steps={t.max_steps}: must be > 0 or null")
        if budget is not None and not self.is_rl and budget < self.chat.max_length:
            raise ConfigError(
                f"trainer.micro_batch_tokens={budget}: must be >= chat.max_length={self.chat.max_length} "
                "(an example is never split across micro-batches), or null"
            )
        if budget in (None, "auto") and t.global_batch_size % t.micro_batch_size:
            raise ConfigError(
                f"trainer.global_batch_size={t.global_batch_size} must be a multiple of "
                f"trainer.micro_batch_size={t.micro_batch_size}"
            )
        if t.warmup_steps < 0 or not 0.0 <= t.min_lr_ratio <= 1.0 or t.grad_clip < 0:
            raise ConfigError("trainer.warmup_steps >= 0, 0 <= trainer.min_lr_ratio <= 1 and trainer.grad_clip >= 0")
        if self.data.max_examples is not None and self.data.max_examples <= 0:
            raise ConfigError(f"data.max_examples={self.data.max_examples}: must be > 0 or null")

    def micro_batch_budget(self, device_type: str) -> int | None:
        """``trainer.micro_batch_tokens`` as a stage-2 run on ``device_type`` ("cpu" | "cuda") fills its
        micro-batches: ``auto`` resolved (`auto_micro_batch_tokens`), else as set."""
        budget = self.trainer.micro_batch_tokens
        if budget != "auto":
            return budget
        backend = lookup("policy_backend", self.policy.backend, setting="policy.backend")
        pp = getattr(backend, "model_parallel", lambda policy: (1, 1, 1))(self.policy)[1]
        return auto_micro_batch_tokens(
            self.rl.group_size, self.rl.max_total_tokens, self.rl.mini_batches, pp, device_type
        )

    def _validate_megatron_section(self) -> None:
        """``policy.megatron``'s own bounds, whichever backend runs (what Megatron needs installed: its factory's
        ``check``, `models/factory.py`)."""
        m = self.policy.megatron
        for key, value in {"policy.megatron.tp": m.tp, "policy.megatron.pp": m.pp, "policy.megatron.cp": m.cp}.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r}: must be an integer >= 1")
        if m.cp != 1:
            raise ConfigError(
                f"policy.megatron.cp={m.cp}: context parallelism is not implemented in this backend; "
                "use cp=1 (tensor, pipeline and data parallel)"
            )
        if m.fp8 is not None and m.spec == "local":
            raise ConfigError(
                f"policy.megatron.fp8={m.fp8} needs the Transformer Engine spec: set policy.megatron.spec=auto"
            )
        if m.sequence_parallel and m.spec == "local":
            raise ConfigError(
                "policy.megatron.sequence_parallel=true needs the Transformer Engine spec: set "
                "policy.megatron.spec=auto, or sequence_parallel=null"
            )

    def _validate_rl(self) -> None:
        rl = self.rl  # the choices of pluggable parts are the registry's names (a plugin's included)
        lookup("reward_token_sampler", rl.reward_token_sampling, setting="rl.reward_token_sampling")
        lookup("advantage_baseline", rl.advantage.baseline, setting="rl.advantage.baseline")
        lookup("advantage_scale", rl.advantage.scale, setting="rl.advantage.scale")
        lookup("policy_loss", rl.loss.policy_loss, setting="rl.loss.policy_loss")
        lookup("kl_estimator", rl.loss.kl_estimator, setting="rl.loss.kl_estimator")
        lookup("loss_aggregation", rl.loss.aggregation, setting="rl.loss.aggregation")
        if rl.group_filter is not None:
            lookup("group_filter", rl.group_filter, setting="rl.group_filter")
        if isinstance(self.stage_spec.keep_group, str):
            lookup("group_filter", self.stage_spec.keep_group, setting=f"stage {self.stage}'s keep_group")
        for key, value in {"rl.ppo_epochs": rl.ppo_epochs, "rl.mini_batches": rl.mini_batches}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r}: must be an integer >= 1")
        if rl.group_size < 2:
            raise ConfigError(f"rl.group_size={rl.group_size}: group advantages need at least 2 rollouts per task")
        for key, value in {
            "rl.tasks_per_step": rl.tasks_per_step,
            "rl.max_turns": rl.max_turns,
            "rl.max_total_tokens": rl.max_total_tokens,
            "rl.sampling.max_new_tokens": rl.sampling.max_new_tokens,
        }.items():
            if value <= 0:
                raise ConfigError(f"{key}={value}: must be > 0")
        budget = self.trainer.micro_batch_tokens
        budget = None if budget == "auto" else budget  # auto: a budget only where it can hold (micro_batch_budget)
        if budget is not None and rl.mini_batches > 1:
            raise ConfigError(
                f"trainer.micro_batch_tokens={budget} with rl.mini_batches={rl.mini_batches}: a budget "
                "decides the micro-batches at each step, so the updates' slices (and their count) "
                "would vary; use trainer.micro_batch_size, or rl.mini_batches=1"
            )
        if budget is not None and budget < rl.max_total_tokens:
            raise ConfigError(
                f"trainer.micro_batch_tokens={budget}: must be >= rl.max_total_tokens="
                f"{rl.max_total_tokens} (a rollout is never split across micro-batches), or null"
            )
        micro = -(-rl.tasks_per_step * rl.group_size // self.trainer.micro_batch_size)
        if rl.mini_batches > micro:
            raise ConfigError(
                f"rl.mini_batches={rl.mini_batches} exceeds the {micro} micro-batches of a step "
                f"(rl.tasks_per_step x rl.group_size / trainer.micro_batch_size)"
            )
        correction = lookup("sampler_correction", rl.loss.correction, setting="rl.loss.correction")
        if not rl.loss.correction_cap > 0.0:
            raise ConfigError(f"rl.loss.correction_cap={rl.loss.correction_cap}: must be > 0")
        if getattr(correction, "keeps_within_cap", False) and not rl.loss.correction_cap > 1.0:
            raise ConfigError(
                f"rl.loss.correction_cap={rl.loss.correction_cap}: must be > 1 with "
                f"rl.loss.correction={rl.loss.correction} (it keeps the ratios in [1/C, C])"
            )
        if rl.max_staleness < 0:
            raise ConfigError(f"rl.max_staleness={rl.max_staleness}: must be >= 0 (0: generate, then train)")
        if not 0.0 <= rl.max_failed_share <= 1.0:
            raise ConfigError(
                f"rl.max_failed_share={rl.max_failed_share}: must be in [0, 1] (the share of a step's "
                "rollouts that may fail before the step warns)"
            )
        if rl.eval_every < 0 or rl.eval_tasks <= 0:
            raise ConfigError("rl.eval_every must be >= 0 and rl.eval_tasks > 0")
        if not 0.0 <= rl.p_high <= 1.0:
            raise ConfigError(f"rl.p_high={rl.p_high}: must be in [0, 1]")
        if rl.sampling.temperature != 1.0 or rl.sampling.top_p != 1.0:
            # the trainer's logprobs (ratio, KL, entropy) are those of the model's own distribution (temperature 1,
            # no top-p): rollouts drawn from another distribution would make the ratio and the KL wrong
            raise ConfigError(
                f"rl.sampling.temperature={rl.sampling.temperature}, top_p={rl.sampling.top_p}: RL "
                "samples at temperature 1 and top_p 1, the distribution the trainer's logprobs are of; "
                "set both to 1.0"
            )
        if rl.loss.clip_low < 0 or rl.loss.clip_high < 0 or rl.loss.kl_beta < 0:
            raise ConfigError("rl.loss.clip_low, clip_high and kl_beta must be >= 0")
        if self.trainer.max_steps is None:
            raise ConfigError(f"stage={self.stage} needs trainer.max_steps (RL steps)")

    def parallel_plan(self, model_parallel: bool = True) -> ParallelPlan:
        """The job's GPU layout (`nemo_rcgrpo/layout.py`): the policy's model-parallel sizes (its backend's
        ``model_parallel(policy section)``; 1 for a backend without) and the GPUs a generation server needs of its own
        (its generator's ``server_gpus(generation section)``; none without). ``model_parallel``: also require
        TP x PP x CP to divide the training GPUs (what the launchers use)."""
        backend = lookup("policy_backend", self.policy.backend, setting="policy.backend")
        sizes = getattr(backend, "model_parallel", lambda policy: (1, 1, 1))(self.policy)
        gen_factory = lookup("generator", self.generation.backend, setting="generation.backend")
        server_tp = getattr(gen_factory, "server_gpus", lambda generation: None)(self.generation)
        return parallel_plan(self.layout, sizes, server_tp, check_model_parallel=model_parallel)

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))


def auto_micro_batch_tokens(
    group_size: int, max_total_tokens: int, mini_batches: int, pp: int, device: str
) -> int | None:
    """``trainer.micro_batch_tokens=auto`` in stage 2: the forward positions a micro-batch is filled to, so that a
    group's prompt is computed once and its rollouts share one pass wherever memory allows.

    - On CPU, a whole group of max-length rollouts (``group_size x max_total_tokens``): host memory holds it (the
      shipped CPU recipes' peaks are measured in docs/benchmarks.md), and every group then fits one micro-batch.
    - On GPU, ``max_total_tokens``: the positions of one max-length rollout, which a micro-batch of one rollout must
      hold anyway, so the peak memory is that of ``micro_batch_size=1``; a group fits where its prompt, computed
      once, and its responses add up to no more.
    - None (``micro_batch_size`` rollouts each) where a budget cannot hold: with ``mini_batches > 1`` (each update's
      slice is fixed in rollouts) or pipeline stages (``pp > 1``: one activation shape for every micro-batch)."""
    if mini_batches > 1 or pp > 1:
        return None
    return group_size * max_total_tokens if device == "cpu" else max_total_tokens


def _build(cls: type, cfg: dict[str, Any] | None, prefix: str):
    cfg = dict(cfg or {})
    reject_unknown(prefix.rstrip("."), cfg, {f.name for f in fields(cls)})
    values = {}
    for f in fields(cls):
        if f.name not in cfg:
            continue
        value = cfg[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{f.name} must be a section (mapping), got {value!r}")
            # a section that builds itself (env: env.settings is the class env.name registers); others field by field
            build = getattr(type(default), "from_mapping", None)
            value = build(value, f"{prefix}{f.name}") if build else _build(type(default), value, f"{prefix}{f.name}.")
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    values = check_fields(cls, values, prefix)
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None
