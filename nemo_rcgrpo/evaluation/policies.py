"""What `rcgrpo eval` evaluates (``policy=``): oracle and null (reference points), an OpenAI-compatible endpoint,
and a trained checkpoint through the training stack's generator, each an `EvalPolicy`: ``description``, ``run(suite,
task_ids, sample, seed, on_done, only) -> [episode record]`` and ``close()`` (checked where it is built, one line
when a plugin's misses one); `run.py` runs them and writes the results.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Protocol

from nemo_rcgrpo.envs.interfaces import Suite
from nemo_rcgrpo.evaluation.agents import NullAgent, OracleAgent, play_episode
from nemo_rcgrpo.evaluation.config import EvalConfig
from nemo_rcgrpo.evaluation.records import episode_record, failure_reason, run_episodes  # noqa: F401 - failure_reason: public
from nemo_rcgrpo.registry import check_part, lookup, register
from nemo_rcgrpo.utils.provenance import reward_token_value


class EvalPolicy(Protocol):
    """What `run.py: evaluate` uses of the policy an ``eval_policy`` factory returns: what results.json and the
    first line say of it, its episodes, and its end (called once, also after a failure)."""

    description: dict[str, Any]  # the model, the reward token (`auto` resolved), ...: results.json's ``policy``

    def run(
        self,
        suite: Suite,
        task_ids: list[str],
        sample: int,
        seed: int,
        on_done: Callable[[dict], None],
        only: set[str] | None = None,
    ) -> list[dict]:
        """The episode records of ``task_ids`` (those in ``only``), each also handed to ``on_done`` when it ends."""
        ...

    def close(self) -> None: ...


def conditioning(cfg: EvalConfig, model_path: Path | None, source: str, has_tokens: bool | None):
    """(reward_token setting resolved: high | low | none, the RewardGoal) for the model at ``model_path``, as it was
    trained: ``auto`` reads its training record, and the goal's template, position and separator are the record's
    (the tokens are the run's ``reward_tokens``). ``has_tokens``: whether its vocabulary has the reward tokens (None:
    unknown, an endpoint)."""
    from nemo_rcgrpo.data.reward_goal import RewardGoal
    from nemo_rcgrpo.utils.provenance import RECORD_FILE, auto_reward_token, read_record

    record = read_record(model_path) if model_path is not None else None
    token = cfg.reward_token
    if token == "auto":  # as the model was trained (its training record), as in-training evaluation does
        token = auto_reward_token(record)
        if record is None and (has_tokens or (has_tokens is None and model_path is not None)):
            print(
                f"warning: {source} {'has reward tokens but ' if has_tokens else ''}no training record "
                f"({RECORD_FILE}); reward_token=auto evaluates it without a token: set reward_token=high for an "
                "RCTP-FT / RC-GRPO model",
                file=sys.stderr,
            )
    if token != "none" and has_tokens is False and cfg.model.reward_tokens == "special":
        print(
            f"warning: {source} was not trained with reward tokens; reward_token={token} adds untrained "
            f"tokens (use reward_token=none for SFT/GRPO models)",
            file=sys.stderr,
        )
    saved = (record or {}).get("reward_goal") or {}
    fields = {"template", "position", "separator"}  # the tokens are the run's (checked against the vocabulary)
    goal = RewardGoal(
        high_token=cfg.reward_tokens.high,
        low_token=cfg.reward_tokens.low,
        **{k: v for k, v in saved.items() if k in fields},
    )
    return token, goal


class MessagePolicy:
    """oracle, null and endpoint: whole messages in and out, episodes run in a thread pool. ``reward_token`` (True:
    high, False: low, None: no goal) goes into the first user message as ``goal`` writes it, as the checkpoint
    policy and training do."""

    def __init__(
        self,
        cfg: EvalConfig,
        make_agent: Callable[[], Any],
        concurrency: int,
        description: dict,
        reward_token: bool | None = None,
        goal=None,
    ):
        self.cfg, self.make_agent, self.concurrency, self.description = cfg, make_agent, concurrency, description
        self.reward_token, self.goal = reward_token, goal

    def run(
        self, suite: Suite, task_ids: list[str], sample: int, seed: int, on_done: Callable, only: set[str] | None = None
    ) -> list[dict]:
        """Episodes of ``task_ids`` (those in ``only``); episode seeds follow the position in ``task_ids``."""
        from nemo_rcgrpo.envs.sources import make_opener

        opener = make_opener(self.cfg.env_config(), suite)
        if callable(getattr(suite, "gold", None)):
            for t in task_ids:
                suite.gold(suite[t])  # memoised before the threads start

        def one(index: int, task_id: str) -> dict:
            task = suite[task_id]
            env, opening = opener.open(task)
            if self.reward_token is not None:
                opening = self.goal.apply(opening, self.reward_token)
            agent = self.make_agent()
            episode_seed = seed + index
            agent.start(task, self.cfg.mode, episode_seed)
            ep = play_episode(agent, env, opening, max_turns=self.cfg.max_turns)
            reward = env.reward()
            verdict = env.official_verdict()
            token = None if self.reward_token is None else ("high" if self.reward_token else "low")
            rec = episode_record(
                self.cfg,
                task,
                sample,
                episode_seed,
                token,
                reward=reward.value,
                official_valid=None if verdict is None else verdict.valid,
                official_error=None
                if verdict is None or verdict.valid
                else f"{verdict.error_type}: {verdict.error_message}",
                truncated=env.truncated,
                details=reward.details,
                num_turns=ep.num_turns,
                tool_errors=ep.tool_errors,
                generated_tokens=ep.generated_tokens,
                calls=ep.calls,
                observations=ep.observations,
                extra={"messages": ep.messages},
            )
            on_done(rec)
            return rec

        return run_episodes(one, task_ids, only, self.concurrency)

    def close(self) -> None:
        pass


class CheckpointPolicy:
    """A trained model through the generator named by ``generation.backend`` (hf or vllm), token in / token out."""

    def __init__(self, cfg: EvalConfig, suite: Suite):
        import torch

        from nemo_rcgrpo.envs.sources import make_opener
        from nemo_rcgrpo.generation import make_generator
        from nemo_rcgrpo.generation.base import SamplingParams
        from nemo_rcgrpo.models.hf import load_tokenizer
        from nemo_rcgrpo.models.setup import load_tokenizer_and_model, make_renderer, seed_everything
        from nemo_rcgrpo.rollout.multi_turn import RolloutEngine

        self.cfg = cfg
        model_path, state, source = resolve_checkpoint(cfg.checkpoint.path, cfg.checkpoint.step)
        has_tokens = cfg.reward_tokens.high in load_tokenizer(model_path).get_vocab()
        # the reward token and goal as the model was trained (template, position, separator: its training record)
        token, goal = conditioning(cfg, model_path, source, has_tokens)
        self.reward_token = reward_token_value(token)
        setup = cfg.policy_setup(str(model_path))
        seed_everything(cfg.seed)
        self.tokenizer, model = load_tokenizer_and_model(setup)
        if state is not None:
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if "lm_head" not in k]:
                raise ValueError(
                    f"checkpoint weights do not fit {model_path}: missing {missing[:3]}, unexpected {unexpected[:3]}"
                )
        model.eval().requires_grad_(False)
        if torch.cuda.is_available():
            model = model.cuda()
        self.generator = make_generator(setup, model, self.tokenizer)
        if (
            not self.generator.shares_policy_weights
        ):  # a started server serves these weights; an attached one receives them
            self.generator.update_weights(model.state_dict().items(), 0)
        self.engine = RolloutEngine(
            self.generator,
            make_renderer(setup, self.tokenizer),
            make_opener(setup.env, suite),
            SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p),
            max_turns=cfg.max_turns,
            max_total_tokens=cfg.max_total_tokens,
            reward_goal=goal,
            name=setup.env.name,
            rejected_message=cfg.chat.rejected_message,
        )
        self.goal, self.model_path = goal, model_path
        self.description = {
            "policy": "checkpoint",
            "source": source,
            "model_path": str(model_path),
            "generator": cfg.generation.backend,
            "reward_token": token,
            "chat_format": cfg.chat.format,
        }

    def run(
        self, suite: Suite, task_ids: list[str], sample: int, seed: int, on_done: Callable, only: set[str] | None = None
    ) -> list[dict]:
        from nemo_rcgrpo.rollout.multi_turn import RolloutSpec

        task_ids = [t for t in task_ids if only is None or t in only]
        out = []
        chunk = self.cfg.generation.max_batch_size
        for start in range(0, len(task_ids), chunk):
            part = task_ids[start : start + chunk]
            specs = [RolloutSpec(suite[t], start + i, self.reward_token) for i, t in enumerate(part)]
            for t in self.engine.rollout(specs, seed=seed + start):
                rec = episode_record(
                    self.cfg,
                    suite[t.task_id],
                    sample,
                    seed + start,
                    t.reward_token,
                    reward=t.reward,
                    official_valid=t.official_valid,
                    official_error=t.official_error,
                    truncated=t.truncated,
                    details=t.reward_details,
                    num_turns=t.num_turns,
                    tool_errors=t.tool_errors,
                    generated_tokens=t.generated_tokens,
                    calls=t.calls,
                    observations=t.observations,
                    extra={
                        "text": t.texts,
                        "reward_details": t.reward_details,
                        "messages": t.messages(),
                        "rejected_messages": t.rejected_messages,
                        "prompt": self.engine.tokenizer.decode(t.token_ids[: t.prompt_length]),
                    },
                )
                on_done(rec)
                out.append(rec)
        return out

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()


def resolve_checkpoint(path: str, step: int | None = None):
    """(HF folder of the architecture, weights to load on top or None, description) for checkpoint.path."""
    from nemo_rcgrpo.models.hf import resolve_model_path
    from nemo_rcgrpo.utils.checkpoint import (
        CheckpointError,
        checkpoint_dir,
        latest_checkpoint,
        load_checkpoint,
        verify_checkpoint,
    )

    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p, None, str(p)
    if (p / "hf" / "config.json").is_file() and step is None:
        return p / "hf", None, str(p / "hf")
    if (p / "checkpoints").is_dir() or (p / "trainer_state.json").is_file():
        run_dir = p if (p / "checkpoints").is_dir() else p.parent.parent
        ckpt = (
            (checkpoint_dir(run_dir) / f"step_{step}")
            if step is not None
            else (p if (p / "trainer_state.json").is_file() else latest_checkpoint(run_dir))
        )
        if ckpt is None or not ckpt.is_dir():
            raise FileNotFoundError(f"no checkpoint {'step_' + str(step) if step else ''} in {run_dir}/checkpoints")
        # never evaluate weights that are not what was written (the optimizer's bytes, most of them, are not used)
        reason = verify_checkpoint(ckpt, hashed=lambda name: name not in ("optimizer.pt", "extra.pt"))
        if reason is not None:
            raise CheckpointError(
                f"checkpoint {ckpt} fails verification ({reason}); choose another step "
                f"(checkpoint.step=N) or resume the run, which falls back to one that verifies"
            )
        state = load_checkpoint(ckpt)
        base = state["trainer_state"].get("model_path")
        tokenizer_dir = ckpt / "tokenizer"
        if not base:
            raise FileNotFoundError(f"{ckpt} does not say which model it was trained from")
        base_path = resolve_model_path(base)
        if tokenizer_dir.is_dir():  # the checkpoint's tokenizer (with reward tokens) over the base model's files
            import atexit
            import shutil
            import tempfile

            merged = Path(tempfile.mkdtemp(prefix="rcgrpo-eval-model-"))
            atexit.register(shutil.rmtree, merged, ignore_errors=True)
            for f in base_path.iterdir():
                if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                    (merged / f.name).symlink_to(f.resolve())
            for f in tokenizer_dir.iterdir():
                target = merged / f.name
                if target.is_symlink():  # never write through a link into the base model's folder
                    target.unlink()
                shutil.copy(f, target)
            base_path = merged
        return base_path, state["model"], str(ckpt)
    return resolve_model_path(path), None, path


class OfficialPipeline(Protocol):
    """What an ``official_pipeline`` factory returns (kind ``official_pipeline``, named as the env): the env's own
    evaluation pipeline under ``protocol=bfcl`` (BFCL's: `envs/bfcl/leaderboard.py`), where it plays the policy."""

    def policy(self, name: str, cfg: EvalConfig, suite: Suite, context: dict[str, Any]) -> EvalPolicy | None:
        """The pipeline's policy for the shipped policy ``name`` (oracle, null, endpoint, checkpoint), or None: the
        project's episodes play it. ``context``: what the generic factory resolved (endpoint: ``folder``,
        ``description``, ``reward_token``, ``goal``; checkpoint: ``build()`` -> the project's CheckpointPolicy)."""
        ...

    def finish(self, records: list[dict], cfg: EvalConfig, out_dir: Path) -> tuple[str, dict, str] | None:
        """After the episodes: (results.json key, its scores, a Markdown table), or None when it played none."""
        ...


def official_pipeline(cfg: EvalConfig) -> OfficialPipeline | None:
    """The env's own pipeline under protocol=bfcl (kind ``official_pipeline``, the name of ``env``), or None."""
    from nemo_rcgrpo.registry import table

    factory = table("official_pipeline").get(cfg.env)
    return None if cfg.protocol != "bfcl" or factory is None else factory(cfg)


def _pipeline_policy(name: str, cfg: EvalConfig, suite: Suite, **context) -> EvalPolicy | None:
    pipeline = official_pipeline(cfg)
    return None if pipeline is None else pipeline.policy(name, cfg, suite, context)


@register("eval_policy", "oracle")
def oracle_policy(cfg: EvalConfig, suite: Suite):
    """The suite's ``oracle_calls`` (BFCL's: the gold calls, the reward's and the checker's ceiling)."""
    from nemo_rcgrpo.utils.config import ConfigError

    plan_of = getattr(suite, "oracle_calls", None)
    if not callable(plan_of):
        raise ConfigError(
            f"policy=oracle plays the suite's oracle_calls(task); task_source={cfg.task_source}'s "
            f"suite ({type(suite).__name__}) has none (envs/interfaces.py: Suite)"
        )
    return _pipeline_policy("oracle", cfg, suite) or MessagePolicy(
        cfg, lambda: OracleAgent(plan_of), 1, {"policy": "oracle"}
    )


@register("eval_policy", "null")
def null_policy(cfg: EvalConfig, suite: Suite):
    """No call at all (the floor)."""
    return _pipeline_policy("null", cfg, suite) or MessagePolicy(cfg, NullAgent, 1, {"policy": "null"})


@register("eval_policy", "endpoint")
def endpoint_policy(cfg: EvalConfig, suite: Suite) -> EvalPolicy:
    """Any OpenAI-compatible chat server with tool calling, conditioned as the served model was trained."""
    from nemo_rcgrpo.evaluation.endpoint import EndpointAgent

    EndpointAgent(cfg.endpoint, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)
    folder = cfg.endpoint.model_path or cfg.endpoint.model
    folder = Path(folder).expanduser() if folder and Path(folder).expanduser().is_dir() else None
    if cfg.endpoint.model_path and folder is None:
        raise FileNotFoundError(f"endpoint.model_path={cfg.endpoint.model_path}: no such folder")
    # conditioned as the checkpoint policy is: the served model's training record, the goal in the first message
    has_tokens = None
    if folder is not None:  # the served folder's vocabulary says whether it has the reward tokens
        from nemo_rcgrpo.models.hf import load_tokenizer

        try:
            has_tokens = cfg.reward_tokens.high in load_tokenizer(str(folder)).get_vocab()
        except Exception:  # noqa: BLE001 - a folder without a tokenizer: unknown
            has_tokens = None
    token, goal = conditioning(cfg, folder, f"endpoint model {cfg.endpoint.model}", has_tokens)
    description = {"policy": "endpoint", "url": cfg.endpoint.url, "model": cfg.endpoint.model, "reward_token": token}
    pipelined = _pipeline_policy(
        "endpoint",
        cfg,
        suite,
        folder=folder,
        description=description,
        reward_token=reward_token_value(token),
        goal=goal,
    )
    if pipelined is not None:
        return pipelined
    return MessagePolicy(
        cfg,
        lambda: EndpointAgent(
            cfg.endpoint, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens
        ),
        cfg.endpoint.concurrency,
        {"policy": "endpoint", "url": cfg.endpoint.url, "model": cfg.endpoint.model, "reward_token": token},
        reward_token=reward_token_value(token),
        goal=goal,
    )


@register("eval_policy", "checkpoint")
def checkpoint_policy(cfg: EvalConfig, suite: Suite):
    """A trained model (an HF folder, a model name or a run dir) through ``generation.backend``, token in / out;
    with protocol=bfcl, through the env's official pipeline where it has one (BFCL's local handlers)."""
    return _pipeline_policy("checkpoint", cfg, suite, build=lambda: CheckpointPolicy(cfg, suite)) or CheckpointPolicy(
        cfg, suite
    )


def make_policy(cfg: EvalConfig, suite: Suite) -> EvalPolicy:
    """The ``policy`` entry (kind ``eval_policy``: oracle, null, endpoint, checkpoint or a plugin's), checked for
    what `evaluate` uses of it before any episode runs."""
    factory = lookup("eval_policy", cfg.policy)
    return check_part(
        "eval_policy",
        cfg.policy,
        factory,
        factory(cfg, suite),
        EvalPolicy,
        "an eval policy has description, and run() and close() (the EvalPolicy Protocol, "
        "nemo_rcgrpo/evaluation/policies.py)",
    )
