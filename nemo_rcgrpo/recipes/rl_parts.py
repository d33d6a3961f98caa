"""What an RL run is built from, in the order it is built: `build_rl(cfg, dist) -> RLParts`.

Each builder is handed only the sections it reads, so what decides a part is in its signature:

1. `build_tasks`: the data (prepared first where missing), the env section's task source and its opener, the reward
   goal stage 1 was prepared with: all checked before a model loads;
2. `build_model`: tokenizer, model (its reward tokens), chat renderer, fingerprint, the training record;
3. `build_policy`: the policy backend around the model, its frozen reference and data-parallel view;
4. `build_generator`: the generation backend (rank 0), and whether it samples from the policy's own module;
5. `build_engines`: the rollout engine (training sampling) and the greedy one of the held-out evaluation;

then the checks that need them all: the env opens a training task, and the RL prompt is a prefix of its stage-1
rendering (`data/consistency.py`). `recipes/rl.py: RLTrainer` runs the steps on the parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.config_schema import RLConfig
from nemo_rcgrpo.data.consistency import check_prompt_prefix, reward_goal_of
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.rl_tasks import load_rl_tasks
from nemo_rcgrpo.envs.interfaces import EnvOpener, Suite
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation import make_generator
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.models.factory import make_policy
from nemo_rcgrpo.models.setup import load_tokenizer_and_model, make_renderer, model_fingerprint, seed_everything
from nemo_rcgrpo.prepare_data import DataNeed, ensure_data
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine
from nemo_rcgrpo.utils.dist import DistInfo, all_reduce_sum
from nemo_rcgrpo.utils.provenance import training_record


@dataclass
class RLTasks:
    suite: Suite
    train: list[str]  # the training task ids, in the data's order
    held_out: list[str]  # the in-training evaluation's sample (stratified by category)
    goal: RewardGoal  # the reward goal stage 1 was prepared with
    opener: EnvOpener


@dataclass
class RLModel:
    tokenizer: Any
    model: Any  # the HF model, reward tokens added; None once the policy is built around it
    renderer: Any
    fingerprint: str
    parameters: int
    flop_shape: tuple[int, int, int]  # (parameters, layers, hidden size): the step's forward FLOPs are counted at it
    record: dict[str, Any]  # how this model is trained (in-training evaluation and `rcgrpo eval reward_token=auto`)


@dataclass
class RLPolicy:
    policy: Any
    reference: Any  # frozen initial weights: [B, T] reference logprobs
    data_dist: DistInfo
    dp_sum: Any
    updates: int  # optimizer steps per RL step (rl.ppo_epochs x rl.mini_batches)


@dataclass
class RLParts:
    tasks: RLTasks
    model: RLModel
    policy: RLPolicy
    generator: Any  # rank 0's; None on the others
    shares_weights: bool  # the generator samples from the policy's module (on every rank, as rank 0's says)
    engine: RolloutEngine
    eval_engine: RolloutEngine


def build_tasks(need: DataNeed, rl: RLConfig, env, reward_tokens, dist: DistInfo) -> RLTasks:
    """The data (``need``: prepared first where missing), the tasks of the env section's task source (``rl.split``'s,
    and ``rl.eval_tasks`` held out), the reward goal stage 1 was prepared with and the env opener."""
    ensure_data(need, dist)
    tasks = load_rl_tasks(need.dir, rl.split, env, rl.eval_tasks, need.seed)
    goal = reward_goal_of(need.dir, reward_tokens.high, reward_tokens.low)
    return RLTasks(tasks.suite, tasks.train, tasks.held_out, goal, make_opener(env, tasks.suite))


def build_model(setup, stage: str, conditioned: bool, goal: RewardGoal) -> RLModel:
    """Tokenizer, model and renderer from the policy setup (model, chat, reward tokens), and the training record."""
    tokenizer, model = load_tokenizer_and_model(setup)
    parameters = sum(p.numel() for p in model.parameters())
    shape = (parameters, getattr(model.config, "num_hidden_layers", 0), getattr(model.config, "hidden_size", 0))
    high, low = setup.reward_tokens.high, setup.reward_tokens.low
    record = training_record(stage, setup.model.path, high, low, conditioned=conditioned)
    record["reward_goal"] = dataclasses.asdict(goal)
    return RLModel(
        tokenizer,
        model,
        make_renderer(setup, tokenizer),
        model_fingerprint(model, setup.model.path),
        parameters,
        shape,
        record,
    )


def build_policy(build, model, dist: DistInfo, rl: RLConfig, max_steps: int) -> RLPolicy:
    """The policy backend (``build``: policy, trainer, precision, seed) around ``model``; several processes only for a
    backend that trains RL distributed."""
    updates = rl.ppo_epochs * rl.mini_batches
    policy = make_policy(build, model, dist, max_steps * updates)
    if dist.world_size > 1 and not policy.distributed_rl:
        raise ValueError(
            f"policy.backend={build.policy.backend} runs stage 2 in one process; for several "
            "processes use policy.backend=megatron"
        )
    reference = policy.frozen_reference()
    data_dist, dp_sum = policy.data_parallel()
    return RLPolicy(policy, reference, data_dist, dp_sum, updates)


def build_generator(setup, policy, tokenizer, max_staleness: int, dist: DistInfo) -> tuple[Any, bool]:
    """Rank 0's generator (``setup.generation``) and whether it samples from the policy's own module, as rank 0's
    says, on every rank. Generating ahead (rl.max_staleness >= 1) puts it behind a lock (generation/gated.py) and
    needs one that holds its own weights."""
    generator = make_generator(setup, policy.module, tokenizer, gated=max_staleness > 0) if dist.is_main else None
    shares = generator is not None and generator.shares_policy_weights
    if shares:  # it decodes where the policy computes (megatron keeps rank 0's HF copy on the CPU otherwise)
        policy.module.to(policy.device)
    shares_weights = bool(all_reduce_sum(float(shares), dist))
    if max_staleness and shares_weights:
        raise ValueError(
            f"rl.max_staleness={max_staleness} generates rollouts while the policy trains: the "
            "generator must hold its own weights (generation=vllm, or scripted), not sample from "
            "the policy's module; set rl.max_staleness=0 or generation=vllm"
        )
    return generator, shares_weights


def build_engines(
    generator, renderer, tasks: RLTasks, rl: RLConfig, env_name: str, rejected_message: str
) -> tuple[RolloutEngine, RolloutEngine]:
    """The rollout engine (rl.sampling, rl.max_turns, rl.max_total_tokens) and the held-out evaluation's (greedy)."""
    sampling = SamplingParams(
        max_new_tokens=rl.sampling.max_new_tokens, temperature=rl.sampling.temperature, top_p=rl.sampling.top_p
    )
    engine = RolloutEngine(
        generator,
        renderer,
        tasks.opener,
        sampling,
        max_turns=rl.max_turns,
        max_total_tokens=rl.max_total_tokens,
        reward_goal=tasks.goal,
        name=env_name,
        rejected_message=rejected_message,
    )
    return engine, engine.with_sampling(SamplingParams(max_new_tokens=rl.sampling.max_new_tokens, temperature=0.0))


def build_rl(cfg: TrainConfig, dist: DistInfo) -> RLParts:
    """Every part of an RL run, built in order and checked together (module docstring)."""
    seed_everything(cfg.seed)  # first: whatever a task source, an env or the model draws is seeded
    # the two views the policy side is built from: model, chat, reward tokens, generation, env; policy, trainer
    setup, build = cfg.policy_setup(), cfg.policy_build()
    tasks = build_tasks(DataNeed.of(cfg), cfg.rl, cfg.env, cfg.reward_tokens, dist)
    model = build_model(setup, cfg.stage, cfg.stage_spec.conditioned, tasks.goal)
    policy = build_policy(build, model.model, dist, cfg.rl, cfg.trainer.max_steps)
    model.model = None  # the policy holds what it keeps of it (megatron drops it on the ranks that do not generate)
    generator, shares = build_generator(setup, policy.policy, model.tokenizer, cfg.rl.max_staleness, dist)
    engine, eval_engine = build_engines(
        generator, model.renderer, tasks, cfg.rl, cfg.env.name, cfg.chat.rejected_message
    )
    engine.opening(tasks.suite[tasks.train[0]], None)  # the env opens a training task, or one line here
    # stage 1 trained on the ids these prompts start with, or the run stops here with the setting to change
    check_prompt_prefix(
        engine, model.renderer, tasks.suite, cfg.data.dir, tasks.train, cfg.env, conditioned=cfg.stage_spec.conditioned
    )
    return RLParts(tasks, model, policy, generator, shares, engine, eval_engine)
