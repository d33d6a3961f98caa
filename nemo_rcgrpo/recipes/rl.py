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
     for up to rl.dapo_max_rounds more rounds, then train on the groups found (rl.dapo_shortfall=train) or stop
     (error) (1-4: `algorithms/rl_collect.py`);
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

import dataclasses
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nemo_rcgrpo.algorithms.advantages import group_advantages
from nemo_rcgrpo.algorithms.losses import GRPOLoss, PolicyLossStats
from nemo_rcgrpo.algorithms.rl_ahead import AheadCollector, staleness_metrics
from nemo_rcgrpo.algorithms.rl_batch import (
    RolloutGroup,
    UpdateTotals,
    rl_micro_batch,
    step_metrics,
    token_batches,
    write_rollouts,
)
from nemo_rcgrpo.algorithms.rl_collect import RolloutsFailed, StepRollouts, collect_groups
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.batch import MicroBatch, RLMicroBatch
from nemo_rcgrpo.data.packing import budget_batches, forward_cost, positions_saved
from nemo_rcgrpo.data.prefix_tree import step_savings
from nemo_rcgrpo.envs.sources import category_key
from nemo_rcgrpo.generation.vllm_client import GeneratorError
from nemo_rcgrpo.models.factory import sync_generator
from nemo_rcgrpo.recipes.rl_parts import build_rl
from nemo_rcgrpo.recipes.run_loop import RunLoop, open_run
from nemo_rcgrpo.rollout.multi_turn import RolloutSpec
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


class RLTrainer:
    def __init__(self, cfg: TrainConfig, dist: DistInfo, recipe: str | None = None):
        self.cfg, self.dist, self.recipe = cfg, dist, recipe
        self.run_dir = Path(cfg.run_dir)
        parts = build_rl(cfg, dist)  # tasks, model, policy, generator, engines: recipes/rl_parts.py
        self.parts = parts
        self.suite, self.task_ids, self.eval_ids = parts.tasks.suite, parts.tasks.train, parts.tasks.held_out
        m, p = parts.model, parts.policy
        self.tokenizer, self.renderer, self.fingerprint = m.tokenizer, m.renderer, m.fingerprint
        self.parameters, self.flop_shape, self.record = m.parameters, m.flop_shape, m.record
        self.policy, self.reference, self.updates = p.policy, p.reference, p.updates
        self.data_dist, self.dp_sum = p.data_dist, p.dp_sum
        self.generator, self.shares_weights = parts.generator, parts.shares_weights
        self.engine, self.eval_engine = parts.engine, parts.eval_engine
        self.step, self.task_cursor = 0, 0

    # ------------------------------------------------------------------ one step
    def collect(self, step: int, cursor: int) -> StepRollouts:
        """Step ``step``'s (from 1) rollout groups from task ``cursor`` on, their timing / filter stats and the task
        cursor after them (`algorithms/rl_collect.py`), with the step's seeded rng."""
        cfg = self.cfg
        try:
            return collect_groups(
                cfg.rl,
                cfg.stage_spec,
                self.engine,
                self.suite,
                self.task_ids,
                cursor,
                step - 1,
                step_rng(cfg.seed, step - 1),
                cfg.seed,
                stage=cfg.stage,
            )
        except RolloutsFailed as e:  # the run stops; the dump says why each rollout failed
            g = self.cfg.rl.group_size
            trajs = e.trajectories
            groups = [trajs[i : i + g] for i in range(0, len(trajs), g)]
            write_rollouts(
                self.run_dir / "rollouts" / f"step_{step}.jsonl",
                step,
                groups,
                torch.zeros(len(groups), g),
                self.tokenizer.decode,
            )
            raise

    def advantages(self, groups: list[RolloutGroup]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards [N, G], advantages [N, G]) over each whole group, regardless of token."""
        adv_cfg = self.cfg.rl.advantage
        rewards = torch.tensor([[t.reward for t in g] for g in groups])  # [N, G]
        return rewards, group_advantages(rewards, baseline=adv_cfg.baseline, scale=adv_cfg.scale, eps=adv_cfg.eps)

    def train_step(
        self, groups: list[RolloutGroup], rewards: torch.Tensor, adv: torch.Tensor, stats: dict[str, float]
    ) -> dict[str, float]:
        """The updates of one batch (``rl.ppo_epochs`` x ``rl.mini_batches`` optimizer steps, one by default) on
        ``groups`` with their rewards and advantages [N, G]; returns the step's metrics."""
        rl = self.cfg.rl
        trajs = [t for g in groups for t in g]
        t0 = time.perf_counter()
        tokens = token_batches(
            trajs, self.tokenizer.pad_token_id, self.cfg.trainer.micro_batch_size, self._budget_ranges(trajs)
        )
        # how the policy runs each micro-batch: a group's prompt shared by its rows computed once, rows packed
        layouts = [(self.policy.layout(b), b.attention_mask.sum(1).tolist()) for b in tokens]
        savings = step_savings(layouts, *self.flop_shape)
        savings.update(forward_positions_saved=positions_saved(layouts), micro_batches=float(len(tokens)))
        # one update: the ratio is taken against the detached logprobs of the training forward pass (the old ones)
        # and the entropies come from that pass too (torch backend): no separate old-logprob pass
        fused = self.updates == 1 and rl.old_logprobs == "auto" and self.policy.fuses_old_logprobs
        batches, entropy = self._score(tokens, trajs, adv.reshape(-1), recompute_old=not fused)
        logprob_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        loss = GRPOLoss.from_config(rl.loss, ratio="current" if fused else "old")
        out, fused_entropy = self._update(tokens, batches, loss, with_entropy=fused)
        if fused:
            entropy = fused_entropy
        entropy_sums = self.dp_sum(entropy).tolist()  # every trajectory's entropy sum, from the replica that scored it
        train_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync_generator(self.policy, self.generator, self.shares_weights, self.step + 1)
        sync_seconds = time.perf_counter() - t0
        num_valid = float(sum(int(b.loss_mask.sum()) for b in tokens))
        metrics = step_metrics(groups, rewards, adv, entropy_sums, out, num_valid)
        metrics.update(
            stats,
            logprob_seconds=logprob_seconds,
            train_seconds=train_seconds,
            weight_sync_seconds=sync_seconds,
            **savings,
        )
        return metrics

    def _budget_ranges(self, trajs: list) -> list[tuple[int, int]] | None:
        """With ``trainer.micro_batch_tokens``: the step's micro-batches as runs of rollouts filled to that many forward
        positions, counted as the policy runs them (prefix tree, packed or padded rows); None without it."""
        budget = self.cfg.trainer.micro_batch_tokens
        if budget is None:
            return None
        seqs = [t.token_ids for t in trajs]
        share, pack = self.policy.share_prefix, self.policy.packs
        return budget_batches(
            len(trajs), self.cfg.rl.group_size, budget, lambda lo, hi: forward_cost(seqs[lo:hi], share, pack)
        )

    def _mine(self, indices) -> list[int]:
        """This data-parallel replica's micro-batches among ``indices`` (another replica scores and trains on the
        rest)."""
        return [i for i in indices if i % self.data_dist.world_size == self.data_dist.rank]

    def _score(
        self, tokens: list[MicroBatch], trajs: list, flat_adv: torch.Tensor, recompute_old: bool
    ) -> tuple[dict[int, RLMicroBatch], torch.Tensor]:
        """This replica's complete micro-batches (by index among ``tokens``), scored before any update: reference
        logprobs and, where the loss takes its ratio against them, old logprobs and entropies; with the [N * G]
        entropy sums (zeros where not computed here)."""
        entropy = torch.zeros(len(trajs), dtype=torch.float64)
        firsts = list(itertools.accumulate((b.rows for b in tokens), initial=0))  # each batch's first rollout
        batches = {}
        for i in self._mine(range(len(tokens))):
            b, first, old = tokens[i], firsts[i], None
            if recompute_old:
                old, ent = self.policy.logprobs(b, with_entropy=True)
                entropy[first : first + b.rows] = (ent * b.loss_mask.float()).sum(1)
            batches[i] = rl_micro_batch(b, trajs, first, flat_adv, self.reference(b), old)
        return batches, entropy

    def _update(
        self, tokens: list[MicroBatch], batches: dict[int, RLMicroBatch], loss: GRPOLoss, with_entropy: bool
    ) -> tuple[UpdateTotals, torch.Tensor]:
        """``rl.ppo_epochs`` passes over ``rl.mini_batches`` consecutive slices of the micro-batches, one optimizer step
        each (normalised by the slice's global token and sequence counts, from every replica's ``tokens``; this
        replica trains on its ``batches``). Returns the updates' totals and the fused pass's entropy sums."""
        rl = self.cfg.rl
        n = len(tokens)
        slices = min(rl.mini_batches, n)  # dapo_filter may train on fewer groups than a full step: no empty slice
        bounds = [round(k * n / slices) for k in range(slices + 1)]
        stats, grad_norm, lr, skipped = PolicyLossStats(), 0.0, 0.0, 0
        entropy = torch.zeros(sum(b.rows for b in tokens), dtype=torch.float64)
        for _epoch in range(rl.ppo_epochs):
            for lo, hi in zip(bounds, bounds[1:]):
                num_valid = float(sum(int(b.loss_mask.sum()) for b in tokens[lo:hi]))
                sequences = float(sum(b.rows for b in tokens[lo:hi]))
                mine = [batches[i] for i in self._mine(range(lo, hi))]
                kwargs = {"with_entropy": True} if with_entropy else {}
                result = self.policy.train_step(
                    mine, dataclasses.replace(loss, num_sequences=sequences), num_valid, **kwargs
                )
                for b, sums in zip(mine, result.entropy_sums or []):
                    entropy[b.first : b.first + len(sums)] = sums
                # one collective per update, on every replica alike (one without micro-batches adds zeros)
                stats = stats + PolicyLossStats.total(result.stats, self.dp_sum)
                grad_norm, lr, skipped = grad_norm + result.grad_norm, lr + result.lr, skipped + result.skipped
        updates = rl.ppo_epochs * slices
        return UpdateTotals(stats, updates, grad_norm / updates, lr / updates, skipped), entropy

    def evaluate(self) -> dict[str, float]:
        """Greedy rollouts on held-out tasks (the paper protocol's episodes), conditioned on ``rl.eval_token``
        where the model is reward-conditioned (its training record: rctp / rcgrpo, or trained from one); accuracy in percent overall and per category, episodes in eval/step_N.jsonl."""
        from nemo_rcgrpo.evaluation.run import summarize

        token = eval_reward_token(self.cfg.rl.eval_token, self.record["reward_conditioned"])
        specs = [RolloutSpec(self.suite[t], g, token) for g, t in enumerate(self.eval_ids)]
        trajs = self.eval_engine.rollout(specs, seed=self.cfg.seed)
        records = [{"task_id": t.task_id, "category": t.category, "success": t.reward == 1.0} for t in trajs]
        summary = summarize(records, order=category_key(self.suite))
        out = {"eval_reward": statistics.fmean(t.reward for t in trajs), "eval_accuracy": summary["overall"]}
        out.update({f"eval_accuracy_{c}": v["accuracy"] for c, v in summary["categories"].items()})
        folder = self.run_dir / "eval"
        folder.mkdir(parents=True, exist_ok=True)
        dump = folder / f"step_{self.step}.jsonl"
        with writing("the evaluation dump", dump), dump.open("w") as f:
            for t in trajs:  # the paper protocol's success: reward 1
                record = t.record(
                    step=self.step,
                    success=t.reward == 1.0,
                    prompt=self.tokenizer.decode(t.token_ids[: t.prompt_length]),
                )
                f.write(bounded_line(record) + "\n")  # tool results clipped past the dump cap (utils/bounded.py)
        return out

    # ------------------------------------------------------------------ loop
    def resume(self) -> Path | None:
        """The run folder checked, and where resuming the newest checkpoint loaded (`recipes/run_loop.py`); the
        step and task cursor continue from it."""
        ckpt, ts = open_run(self.cfg, self.dist, self.policy, self.fingerprint)
        if ckpt is not None:
            self.step, self.task_cursor = ts["step"], ts["task_cursor"]
        return ckpt

    def _categories(self) -> list[str]:
        """The categories of the run's training tasks (in the suite's ``category_order``, else by name)."""
        return sorted({self.suite[t].category for t in self.task_ids}, key=category_key(self.suite))

    def _banner(self, ckpt: Path | None) -> None:
        cfg, rl = self.cfg, self.cfg.rl
        start = int(ckpt.name.split("_")[-1]) if ckpt is not None else 0
        tokens = (
            f", reward tokens {rl.reward_token_sampling} (p_high {rl.p_high:g})" if cfg.stage_spec.conditioned else ""
        )
        say(
            start_banner(
                cfg,
                recipe=self.recipe,
                parameters=self.parameters,
                checkpoint=ckpt,
                start_step=start,
                data=f"{cfg.data.dir}: {len(self.task_ids)} {rl.split} tasks of categories {self._categories()}, "
                f"{len(self.eval_ids)} held-out for evaluation"
                + (f" every {rl.eval_every} steps" if rl.eval_every else " (rl.eval_every=0: not evaluated)"),
                steps=f"{cfg.trainer.max_steps} RL steps of {rl.tasks_per_step} tasks x G={rl.group_size}{tokens}, "
                f"lr {cfg.trainer.lr:g}, beta {rl.loss.kl_beta:g}, {rl.max_turns} turns x "
                f"{rl.sampling.max_new_tokens} new tokens at most",
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
        cfg = self.cfg
        self._start()
        main = self.dist.is_main
        total = cfg.trainer.max_steps
        metrics: dict[str, float] = {}
        with RunLoop(
            cfg, self.dist, self.policy, self.tokenizer, self.record, self.step, total, self.fingerprint
        ) as loop:
            k = cfg.rl.max_staleness
            # k >= 1: rank 0's thread collects the next steps while this one trains (algorithms/rl_ahead.py)
            ahead = AheadCollector(self.collect, self.step + 1, loop.end, self.task_cursor, k) if k and main else None
            try:
                for step in loop.steps():
                    started = time.perf_counter()
                    if ahead is not None:
                        mine, waited = ahead.get(step)
                    else:
                        mine, waited = (self.collect(step, self.task_cursor), 0.0) if main else (None, 0.0)
                    rollouts = self._share(mine)  # rank 0 rolls out, every rank trains
                    self.task_cursor = rollouts.cursor
                    rewards, adv = self.advantages(rollouts.groups)
                    groups = rollouts.groups
                    metrics = self.train_step(groups, rewards, adv, rollouts.stats)
                    self.step = step
                    if ahead is not None:
                        ahead.trained(step)  # the generator holds step's weights: the next collections may start
                        metrics.update(
                            staleness_metrics(groups, step), rollout_wait_seconds=waited, **self.generator.take_waits()
                        )
                    self._after_step(loop, step, groups, adv, metrics, started)
            finally:
                if ahead is not None:
                    ahead.close()  # what was collected ahead is dropped: a resume draws the same tasks again
        loop.finish()
        return {"steps": self.step, **metrics}

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
        cfg, main = self.cfg, self.dist.is_main
        total = cfg.trainer.max_steps
        if main:
            dump = self.run_dir / "rollouts" / f"step_{step}.jsonl"
            with writing("the rollout dump", dump):
                write_rollouts(dump, step, groups, adv, self.tokenizer.decode)
        if cfg.rl.eval_every and step % cfg.rl.eval_every == 0 and self.eval_ids and main:
            t0 = time.perf_counter()
            metrics.update(self.evaluate(), eval_seconds=time.perf_counter() - t0)
        metrics["step_seconds"] = time.perf_counter() - started
        metrics["tokens_per_s"] = metrics["tokens"] / metrics["step_seconds"]
        loop.end_step(step, metrics, log=True, trainer_state={"task_cursor": self.task_cursor})
        loop.bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}")
        if main and not cfg.logging.progress:
            say(
                step_line(
                    cfg.stage,
                    step,
                    total,
                    metrics,
                    ("reward_mean", "zero_variance_fraction", "loss", "kl", "entropy", "eval_accuracy", "step_seconds"),
                )
            )

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
        return RLTrainer(cfg, dist, recipe).run()
    finally:
        shutdown(dist)
