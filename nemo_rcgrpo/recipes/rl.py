"""Stage 2: GRPO, RC-GRPO and the dynamic-sampling baseline (``stage=grpo|rcgrpo|dapo_filter``, or a user's
registered RL stage: `nemo_rcgrpo/stages.py` says what each of them changes in this loop).

One step (the RC-GRPO paper, "The method"):
  1. take ``tasks_per_step`` training tasks; G rollouts each;
  2. a conditioned stage (rcgrpo): sample a reward token per rollout (iid with P(high) = p, or
     stratified) and put it into the rollout's first user message;
  3. roll out all of them together (`rollout/multi_turn.py`), the env's reward (BFCL's: env.settings.reward, by default
     the paper's R = R_state x R_action);
  4. group advantages over the whole group regardless of token;
     with a group filter (rl.group_filter, or the stage's keep_group; dapo_filter: DAPO's dynamic sampling,
     never train on a zero-variance group) train only on the groups it keeps; roll out replacement tasks
     for up to rl.group_filter_refills more rounds, then train on the groups found
     (rl.group_filter_shortfall=train) or stop (error) (1-4: `algorithms/rl_collect.py`);
  5. reference logprobs from the frozen initial model; rl.ppo_epochs x rl.mini_batches optimizer steps of
     the policy loss (rl.loss.policy_loss, by default PPO's clipped surrogate) + KL (old logprobs recomputed before the first; with one update, the default, the
     ratio is taken against the detached logprobs of the training pass itself, which also gives the
     entropies, so the torch backend runs no separate old-logprob pass);
  6. the in-process generator shares the policy's weights (nothing to copy);
     metrics, rollout dump, checkpoint.
GRPO is RC-GRPO without tokens; the 2x2 ablation is the init (SFT or RCTP-FT
export) x the stage name.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_rcgrpo.algorithms.advantages import group_advantages
from nemo_rcgrpo.algorithms.rl_ahead import AheadCollector, staleness_metrics
from nemo_rcgrpo.algorithms.rl_batch import RolloutGroup, write_rollouts
from nemo_rcgrpo.algorithms.rl_collect import RolloutsFailed, StepRollouts, collect_groups
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.config_schema import RLConfig
from nemo_rcgrpo.envs.sources import category_key
from nemo_rcgrpo.generation.vllm_client import GeneratorError
from nemo_rcgrpo.models.factory import sync_generator
from nemo_rcgrpo.recipes.rl_parts import RLParts, build_rl
from nemo_rcgrpo.recipes.rl_update import StepUpdate, UpdateSettings
from nemo_rcgrpo.recipes.run_loop import RunLoop, RunSettings, open_run
from nemo_rcgrpo.rollout.multi_turn import RolloutSpec
from nemo_rcgrpo.stages import Stage
from nemo_rcgrpo.utils.banner import say, start_banner, step_line
from nemo_rcgrpo.utils.bounded import bounded_line
from nemo_rcgrpo.utils.checkpoint import latest_checkpoint
from nemo_rcgrpo.utils.dist import DistInfo, init_distributed, shutdown
from nemo_rcgrpo.utils.provenance import reward_token_value
from nemo_rcgrpo.utils.run_lock import writing


def step_rng(seed: int, steps_done: int) -> random.Random:
    """The draws of the step after ``steps_done`` (the reward tokens of its rollouts): different across steps and
    seeds, and the same again for the same ones, so a resumed run draws what the uninterrupted one did."""
    return random.Random(seed * 1_000_003 + steps_done)


def eval_reward_token(setting: str, reward_conditioned: bool) -> bool | None:
    """The reward token of the held-out episodes: ``rl.eval_token`` (high | low | none) for a reward-conditioned model
    (its training record: rctp / rcgrpo, or trained from one), none for any other, as ``rcgrpo eval
    reward_token=auto`` does on its export."""
    return reward_token_value(setting) if reward_conditioned else None


@dataclass(frozen=True)
class RLSettings:
    """What the RL loop reads of its config beside its parts and the run's settings (``RLSettings.of(cfg, device_type)``)."""

    rl: RLConfig
    stage: str
    spec: Stage  # what the stage changes in the loop (`stages.py`)
    seed: int
    max_steps: int  # trainer.max_steps: RL steps, each of rl.ppo_epochs x rl.mini_batches optimizer steps
    update: UpdateSettings
    lr: float  # trainer.lr (the banner)
    data_dir: str  # data.dir (the banner)

    @classmethod
    def of(cls, cfg: TrainConfig, device_type: str = "cpu") -> "RLSettings":
        t = cfg.trainer  # the micro-batches' token budget as this device fills them (``auto`` resolved)
        update = UpdateSettings(cfg.rl, t.micro_batch_size, cfg.micro_batch_budget(device_type))
        return cls(cfg.rl, cfg.stage, cfg.stage_spec, cfg.seed, t.max_steps, update, t.lr, cfg.data.dir)


class RLTrainer:
    """The RL loop on its built parts (`recipes/rl_parts.py`) and settings: ``RLTrainer.from_config(cfg, dist)``
    builds both, ``run()`` runs the steps."""

    def __init__(self, parts: RLParts, settings: RLSettings, run: RunSettings, dist: DistInfo, recipe: str | None):
        self.parts, self.settings, self.run_settings, self.dist, self.recipe = parts, settings, run, dist, recipe
        self.run_dir = run.run_dir
        self.suite, self.task_ids, self.eval_ids = parts.tasks.suite, parts.tasks.train, parts.tasks.held_out
        m = parts.model
        self.tokenizer, self.fingerprint, self.record = m.tokenizer, m.fingerprint, m.record
        self.policy = parts.policy.policy
        self.generator, self.shares_weights = parts.generator, parts.shares_weights
        self.engine, self.eval_engine = parts.engine, parts.eval_engine
        pad_id = m.tokenizer.pad_token_id
        self.updater = StepUpdate(
            parts.policy, parts.generator, parts.shares_weights, pad_id, m.flop_shape, settings.update
        )
        self.step, self.task_cursor = 0, 0

    @classmethod
    def from_config(cls, cfg: TrainConfig, dist: DistInfo, recipe: str | None = None) -> "RLTrainer":
        """The trainer of ``cfg``: its parts built (`build_rl`), its settings and the run's taken from it."""
        return cls(build_rl(cfg, dist), RLSettings.of(cfg, dist.device.type), RunSettings.of(cfg), dist, recipe)

    # ------------------------------------------------------------------ one step
    def collect(self, step: int, cursor: int) -> StepRollouts:
        """Step ``step``'s (from 1) rollout groups from task ``cursor`` on, their timing / filter stats and the task
        cursor after them (`algorithms/rl_collect.py`), with the step's seeded rng."""
        s = self.settings
        rng = step_rng(s.seed, step - 1)
        try:
            return collect_groups(
                s.rl, s.spec, self.engine, self.suite, self.task_ids, cursor, step - 1, rng, s.seed, stage=s.stage
            )
        except RolloutsFailed as e:  # the run stops; the dump says why each rollout failed
            g = s.rl.group_size
            trajs = e.trajectories
            groups = [trajs[i : i + g] for i in range(0, len(trajs), g)]
            dump = self.run_dir / "rollouts" / f"step_{step}.jsonl"
            write_rollouts(dump, step, groups, torch.zeros(len(groups), g), self.tokenizer.decode)
            raise

    def advantages(self, groups: list[RolloutGroup]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards [N, G], advantages [N, G]) over each whole group, regardless of token."""
        adv_cfg = self.settings.rl.advantage
        rewards = torch.tensor([[t.reward for t in g] for g in groups])  # [N, G]
        return rewards, group_advantages(rewards, baseline=adv_cfg.baseline, scale=adv_cfg.scale, eps=adv_cfg.eps)

    def update(
        self, groups: list[RolloutGroup], rewards: torch.Tensor, adv: torch.Tensor, stats: dict[str, float]
    ) -> dict[str, float]:
        """The step's updates on ``groups`` (``rl.ppo_epochs`` x ``rl.mini_batches`` optimizer steps, one by default;
        `recipes/rl_update.py`), after which the generator samples from the weights of ``step + 1`` steps."""
        return self.updater.apply(groups, rewards, adv, stats, self.step + 1)

    def evaluate(self) -> dict[str, float]:
        """Greedy rollouts on held-out tasks (the paper protocol's episodes), conditioned on ``rl.eval_token``
        where the model is reward-conditioned (its training record: rctp / rcgrpo, or trained from one); accuracy in
        percent overall and per category, episodes in eval/step_N.jsonl."""
        from nemo_rcgrpo.evaluation.run import summarize

        token = eval_reward_token(self.settings.rl.eval_token, self.record["reward_conditioned"])
        specs = [RolloutSpec(self.suite[t], g, token) for g, t in enumerate(self.eval_ids)]
        trajs = self.eval_engine.rollout(specs, seed=self.settings.seed)
        records = [{"task_id": t.task_id, "category": t.category, "success": t.reward == 1.0} for t in trajs]
        summary = summarize(records, order=category_key(self.suite))
        out = {"eval_reward": statistics.fmean(t.reward for t in trajs), "eval_accuracy": summary["overall"]}
        out.update({f"eval_accuracy_{c}": v["accuracy"] for c, v in summary["categories"].items()})
        folder = self.run_dir / "eval"
        folder.mkdir(parents=True, exist_ok=True)
        dump = folder / f"step_{self.step}.jsonl"
        with writing("the evaluation dump", dump), dump.open("w") as f:
            for t in trajs:  # the paper protocol's success: reward 1
                prompt = self.tokenizer.decode(t.token_ids[: t.prompt_length])
                record = t.record(step=self.step, success=t.reward == 1.0, prompt=prompt)
                f.write(bounded_line(record) + "\n")  # tool results clipped past the dump cap (utils/bounded.py)
        return out

    # ------------------------------------------------------------------ loop
    def resume(self) -> Path | None:
        """The run folder checked, and where resuming the newest checkpoint loaded (`recipes/run_loop.py`); the
        step and task cursor continue from it."""
        ckpt, ts = open_run(self.run_settings, self.dist, self.policy, self.fingerprint)
        if ckpt is not None:
            self.step, self.task_cursor = ts["step"], ts["task_cursor"]
        return ckpt

    def _categories(self) -> list[str]:
        """The categories of the run's training tasks (in the suite's ``category_order``, else by name)."""
        return sorted({self.suite[t].category for t in self.task_ids}, key=category_key(self.suite))

    def _micro_batching(self) -> str:
        """How the updates split a step's rollouts (``trainer.micro_batch_tokens``, ``auto`` resolved)."""
        u = self.settings.update
        if u.micro_batch_tokens is None:
            return f"micro-batches of {u.micro_batch_size} rollout{'s' if u.micro_batch_size != 1 else ''}"
        return f"micro-batches filled to {u.micro_batch_tokens} forward positions (whole groups first)"

    def _banner(self, ckpt: Path | None) -> None:
        s, rl = self.settings, self.settings.rl
        start = int(ckpt.name.split("_")[-1]) if ckpt is not None else 0
        tokens = f", reward tokens {rl.reward_token_sampling} (p_high {rl.p_high:g})" if s.spec.conditioned else ""
        evaluated = f" every {rl.eval_every} steps" if rl.eval_every else " (rl.eval_every=0: not evaluated)"
        say(
            start_banner(
                self.run_settings,
                recipe=self.recipe,
                parameters=self.parts.model.parameters,
                checkpoint=ckpt,
                start_step=start,
                data=f"{s.data_dir}: {len(self.task_ids)} {rl.split} tasks of categories {self._categories()}, "
                f"{len(self.eval_ids)} held-out for evaluation{evaluated}",
                steps=f"{s.max_steps} RL steps (= {s.max_steps * rl.ppo_epochs * rl.mini_batches} optimizer steps) "
                f"of {rl.tasks_per_step} tasks x G={rl.group_size}{tokens}, "
                f"lr {s.lr:g}, beta {rl.loss.kl_beta:g}, {rl.max_turns} turns x "
                f"{rl.sampling.max_new_tokens} new tokens at most; {self._micro_batching()}",
            )
        )

    def run(self) -> dict[str, Any]:
        """The loop. The generator (a vLLM server) is closed however the run ends; a generator that fails is a
        one-line error that names the checkpoint to resume from."""
        try:
            return self._run()
        except GeneratorError as e:
            ckpt = latest_checkpoint(self.run_dir)
            where = f"the last checkpoint {ckpt} resumes" if ckpt else "no checkpoint yet"
            raise GeneratorError(f"{e} [in step {self.step + 1}; {where}: run the same command again]") from None
        finally:
            if self.generator is not None:  # rank 0 only
                self.generator.close()

    def _start(self) -> None:
        """Resumes where a checkpoint is, says what the run does and hands the generator the weights it starts from,
        as the version of the steps done: a server starts on (an attached one receives) them, a generator sharing
        them is told the version."""
        ckpt = self.resume()
        if self.dist.is_main:
            self._banner(ckpt)
        sync_generator(self.policy, self.generator, self.shares_weights, self.step)

    def _run(self) -> dict[str, Any]:
        self._start()
        total, metrics = self.settings.max_steps, {}
        with RunLoop(
            self.run_settings, self.dist, self.policy, self.tokenizer, self.record, self.step, total, self.fingerprint
        ) as loop:
            k = self.settings.rl.max_staleness
            # k >= 1: rank 0's thread collects the next steps while this one trains (algorithms/rl_ahead.py)
            main = self.dist.is_main
            ahead = AheadCollector(self.collect, self.step + 1, loop.end, self.task_cursor, k) if k and main else None
            try:
                for step in loop.steps():
                    metrics = self._one_step(loop, step, ahead)
            finally:
                if ahead is not None:
                    ahead.close()  # what was collected ahead is dropped: a resume draws the same tasks again
        loop.finish()
        return {"steps": self.step, **metrics}

    def _one_step(self, loop: RunLoop, step: int, ahead: AheadCollector | None) -> dict[str, float]:
        """Step ``step``: rank 0's rollouts (collected now, or ahead) on every rank, the update, what follows it."""
        started = time.perf_counter()
        if ahead is not None:
            mine, waited = ahead.get(step)
        else:
            mine, waited = (self.collect(step, self.task_cursor), 0.0) if self.dist.is_main else (None, 0.0)
        rollouts = self._share(mine)  # rank 0 rolls out, every rank trains
        self.task_cursor = rollouts.cursor
        groups = rollouts.groups
        rewards, adv = self.advantages(groups)
        metrics = self.update(groups, rewards, adv, rollouts.stats)
        self.step = step
        if ahead is not None:
            ahead.trained(step)  # the generator holds step's weights: the next collections may start
            waits = self.generator.take_waits()
            metrics.update(staleness_metrics(groups, step), rollout_wait_seconds=waited, **waits)
        self._after_step(loop, step, groups, adv, metrics, started)
        return metrics

    def _after_step(
        self,
        loop: RunLoop,
        step: int,
        groups: list[RolloutGroup],
        adv: torch.Tensor,
        metrics: dict[str, float],
        started: float,
    ) -> None:
        """The step's rollout dump, evaluation where due, timing, metrics line and checkpoint."""
        rl, main = self.settings.rl, self.dist.is_main
        if main:
            dump = self.run_dir / "rollouts" / f"step_{step}.jsonl"
            with writing("the rollout dump", dump):
                write_rollouts(dump, step, groups, adv, self.tokenizer.decode)
        if rl.eval_every and step % rl.eval_every == 0 and self.eval_ids and main:
            t0 = time.perf_counter()
            metrics.update(self.evaluate(), eval_seconds=time.perf_counter() - t0)
        metrics["step_seconds"] = time.perf_counter() - started
        metrics["tokens_per_s"] = metrics["tokens"] / metrics["step_seconds"]
        loop.end_step(step, metrics, log=True, trainer_state={"task_cursor": self.task_cursor})
        loop.bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}")
        if main and not self.run_settings.logging.progress:
            keys = ("reward_mean", "zero_variance_fraction", "loss", "kl", "entropy", "eval_accuracy", "step_seconds")
            say(step_line(self.settings.stage, step, self.settings.max_steps, metrics, keys))

    def _share(self, rollouts: StepRollouts | None) -> StepRollouts:
        """Rank 0's rollouts (groups, stats, task cursor) on every rank; a no-op in one process."""
        if self.dist.world_size == 1:
            return rollouts
        import torch.distributed as tdist

        box = [rollouts]
        tdist.broadcast_object_list(box, src=0)
        return box[0]


def run_rl(cfg: TrainConfig, recipe: str | None = None) -> dict[str, Any]:
    """Stage 2 on model.path, which exists (`loops.rl_loop` trains it first from rl.stage1_recipe where it does not)."""
    dist = init_distributed()
    try:
        return RLTrainer.from_config(cfg, dist, recipe).run()
    finally:
        shutdown(dist)
