"""Stage 1: SFT on expert trajectories, or RCTP-FT on reward-conditioned mixed trajectories.

Both minimise the NLL of the assistant tokens (`losses.sft_loss`); RCTP-FT
differs only in its data (`rctp.jsonl`: the reward-goal token in the first
user message, 50/50 experts and failures) and needs the reward tokens in the
vocabulary. The loop: deterministic length-bucketed batches, gradient
accumulation over micro-batches, global valid-token normalisation, AdamW with
warmup + decay, metrics every step, atomic checkpoints that resume exactly,
and an HF export (``run_dir/hf``) that transformers and vLLM load directly.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_rcgrpo.algorithms.losses import NLLStats, sft_loss
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.consistency import reward_goal_of
from nemo_rcgrpo.data.packing import budget_batches, forward_cost, positions
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.sft_data import Example, build_examples, collate, epoch_batches, load_records
from nemo_rcgrpo.data.stage1_datasets import Prepared, stage1_dataset
from nemo_rcgrpo.models.factory import make_policy
from nemo_rcgrpo.models.setup import load_tokenizer_and_model, make_renderer, model_fingerprint, seed_everything
from nemo_rcgrpo.prepare_data import DataNeed, ensure_data
from nemo_rcgrpo.recipes.run_loop import RunLoop, RunSettings, open_run
from nemo_rcgrpo.utils.banner import say, start_banner, step_line
from nemo_rcgrpo.utils.dist import DistInfo, init_distributed, shutdown
from nemo_rcgrpo.utils.provenance import training_record
from nemo_rcgrpo.utils.run_lock import writing


def micro_batches_for_rank(
    examples: list[Example],
    batch: list[int],
    micro: int,
    dist: DistInfo,
    pad_id: int,
    budget: int | None = None,
    share: bool = False,
    pack: str | None = None,
):
    """Split a global batch (sorted by length) into micro-batches of ``micro`` examples, or filled to ``budget``
    forward positions as the policy runs them (its prefix tree with ``share``, packed rows with ``pack``); rank r
    takes every world_size-th. Under a budget the count is made a multiple of the world size (the largest
    micro-batches split in two), so every replica runs as many forward and backward passes."""
    ordered = sorted(batch, key=lambda i: len(examples[i]))
    if budget is None:
        groups = [ordered[s : s + micro] for s in range(0, len(ordered), micro)]
    else:

        def cost(lo: int, hi: int) -> int:
            return forward_cost([examples[i].ids for i in ordered[lo:hi]], share, pack)

        groups = [ordered[lo:hi] for lo, hi in budget_batches(len(ordered), 1, budget, cost)]
        while len(groups) % dist.world_size:  # split the costliest micro-batch of two rows or more in two, in place
            splittable = [j for j, g in enumerate(groups) if len(g) > 1]
            if not splittable:
                raise ValueError(
                    f"{len(batch)} examples cannot give each of {dist.world_size} data-parallel "
                    "replicas as many micro-batches"
                )
            k = max(splittable, key=lambda j: positions(None, [len(examples[i]) for i in groups[j]]))  # B x T
            g = groups.pop(k)
            groups[k:k] = [g[: len(g) // 2], g[len(g) // 2 :]]
    mine = groups[dist.rank :: dist.world_size]
    return [collate([examples[i] for i in g], pad_id) for g in mine], groups


@dataclass
class Stage1Data:
    """The stage's training examples, read from ``path`` and rendered, and how many optimizer steps they give."""

    path: Path
    examples: list[Example]
    stats: dict[str, Any]  # records read, examples kept, dropped as too long, ...
    steps_per_epoch: int
    total_steps: int  # trainer.max_steps (optimizer steps) or every epoch's


def load_stage1_data(cfg: TrainConfig, path: Path, renderer, goal: RewardGoal, dist: DistInfo) -> Stage1Data:
    """``path``'s records of ``data.split`` made the stage's dataset (e.g. RCTP-FT's goal templating) and rendered;
    refused in one line where they cannot fill one batch."""
    records = load_records(path, cfg.data.split, progress=cfg.logging.progress and dist.is_main)
    records = Prepared(records, stage1_dataset(cfg.stage1_dataset_name), goal)
    examples, stats = build_examples(records, renderer, cfg.chat.max_length, cfg.seed, cfg.data.max_examples)
    t = cfg.trainer
    steps_per_epoch = len(examples) // t.global_batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(examples)} usable examples (of {stats['records']}; {stats['dropped_too_long']} "
            f"longer than chat.max_length={cfg.chat.max_length}) cannot fill one batch of "
            f"trainer.global_batch_size={t.global_batch_size}"
        )
    every_epoch = steps_per_epoch * t.epochs
    total = every_epoch if t.max_steps is None else min(t.max_steps, every_epoch)
    return Stage1Data(path, examples, stats, steps_per_epoch, total)


def stage1_goal(cfg: TrainConfig) -> RewardGoal:
    """The reward goal of a conditioned stage's data (its tokens must be the ones the model gets), else the
    tokens' default goal."""
    high, low = cfg.reward_tokens.high, cfg.reward_tokens.low
    if cfg.stage_spec.conditioned:
        return reward_goal_of(cfg.data.dir, high, low)
    return RewardGoal(high_token=high, low_token=low)


def check_batch_split(t, data_world: int) -> None:
    """``trainer.global_batch_size`` splits evenly over the data-parallel replicas (and micro-batches)."""
    per = t.micro_batch_size if t.micro_batch_tokens is None else 1  # a token budget: at least one example a replica
    if t.global_batch_size % (per * data_world):
        raise ValueError(
            f"trainer.global_batch_size={t.global_batch_size} must be a multiple of "
            + ("micro_batch_size x " if t.micro_batch_tokens is None else "")
            + f"data-parallel size = {per * data_world}"
        )


def run_stage1(cfg: TrainConfig, recipe: str | None = None) -> dict[str, Any]:
    dist = init_distributed()
    try:
        return _run(cfg, dist, recipe)
    finally:
        shutdown(dist)


def _run(cfg: TrainConfig, dist: DistInfo, recipe: str | None) -> dict[str, Any]:
    seed_everything(cfg.seed)
    run = RunSettings.of(cfg)
    data_path = ensure_data(DataNeed.of(cfg), dist)
    setup = cfg.policy_setup()
    tokenizer, model = load_tokenizer_and_model(setup)
    goal = stage1_goal(cfg)
    data = load_stage1_data(cfg, data_path, make_renderer(setup, tokenizer), goal, dist)
    fingerprint = model_fingerprint(model, cfg.model.path)
    high, low = cfg.reward_tokens.high, cfg.reward_tokens.low
    conditioned = cfg.stage_spec.conditioned
    record = training_record(cfg.stage, cfg.model.path, high, low, conditioned=conditioned)
    if conditioned:  # the data's reward goal, whose tokens must be the ones the model gets
        record["reward_goal"] = dataclasses.asdict(goal)
    parameters = sum(p.numel() for p in model.parameters())
    policy = make_policy(cfg.policy_build(), model, dist, data.total_steps)
    data_dist, dp_sum = policy.data_parallel()  # megatron: the TP x PP ranks of a replica share micro-batches
    check_batch_split(cfg.trainer, data_dist.world_size)
    ckpt, ts = open_run(run, dist, policy, fingerprint)
    if dist.is_main:
        _start_notes(run, recipe, data, parameters, ckpt, ts.get("step", 0), cfg)
    loop = Stage1Loop(cfg, data, policy, data_dist, dp_sum)
    return loop.run(RunLoop(run, dist, policy, tokenizer, record, ts.get("step", 0), data.total_steps, fingerprint), ts)


def _start_notes(run: RunSettings, recipe, data: Stage1Data, parameters: int, ckpt, start_step: int, cfg) -> None:
    """The data statistics kept in the run folder, and the banner."""
    with writing("the data statistics", run.run_dir / "data_stats.json"):
        (run.run_dir / "data_stats.json").write_text(json.dumps(data.stats, indent=1))
    t, stats = cfg.trainer, data.stats
    say(
        start_banner(
            run,
            recipe=recipe,
            parameters=parameters,
            checkpoint=ckpt,
            start_step=start_step,
            data=f"{data.path} ({cfg.data.split}): {len(data.examples)} examples of {stats['records']} "
            f"({stats['dropped_too_long']} longer than chat.max_length={cfg.chat.max_length})",
            steps=f"{data.total_steps} optimizer steps of {t.global_batch_size} sequences "
            f"({data.steps_per_epoch} per epoch), lr {t.lr:g} {t.schedule}",
        )
    )


class Stage1Loop:
    """The optimizer steps of stage 1 on ``data``: each step's global batch (length-bucketed, the same for a seed
    and epoch), this replica's micro-batches of it, one `Policy.train_step`, the step's metrics."""

    def __init__(self, cfg: TrainConfig, data: Stage1Data, policy, data_dist: DistInfo, dp_sum):
        self.t, self.seed, self.stage = cfg.trainer, cfg.seed, cfg.stage
        self.progress = cfg.logging.progress
        self.data, self.policy, self.data_dist, self.dp_sum = data, policy, data_dist, dp_sum
        self.pad_id = None
        self._epoch, self._batches = -1, []

    def run(self, loop: RunLoop, resumed: dict[str, Any]) -> dict[str, Any]:
        """Every step of ``loop``, from the steps done and tokens seen of the checkpoint resumed (``resumed``)."""
        start_step, tokens_seen = resumed.get("step", 0), resumed.get("tokens_seen", 0)
        self.pad_id = loop.tokenizer.pad_token_id
        last: dict[str, float] = {}
        with loop:
            for step in loop.steps():
                last = self.step(step, tokens_seen)
                tokens_seen = last["tokens_seen"]
                state = {"tokens_seen": tokens_seen, "epoch": (step - 1) // self.data.steps_per_epoch}
                loop.end_step(step, last, log=step % self.t.log_every == 0, trainer_state=state)
                loop.bar.set_postfix(loss=f"{last['loss']:.4f}")
                if not self.progress and loop.dist.is_main:
                    keys = ("loss", "grad_norm", "lr", "step_seconds")
                    say(step_line(self.stage, step, self.data.total_steps, last, keys))
        loop.finish()
        d = self.data
        return {"steps": loop.end, "total_steps": d.total_steps, "start_step": start_step, **last, **d.stats}

    def _batch(self, step: int) -> tuple[int, int, list[int]]:
        """(epoch, index in it, the global batch's example indices) of step ``step`` (from 1)."""
        epoch, index = divmod(step - 1, self.data.steps_per_epoch)
        if epoch != self._epoch:
            lengths = [len(e) for e in self.data.examples]
            self._batches = epoch_batches(lengths, self.t.global_batch_size, self.seed, epoch, self.t.bucket_by_length)
            self._epoch = epoch
        return epoch, index, self._batches[index]

    def step(self, step: int, tokens_seen: int) -> dict[str, float]:
        """One optimizer step on step ``step``'s batch; its metrics (``tokens_seen`` after it among them)."""
        examples, policy, dp_sum = self.data.examples, self.policy, self.dp_sum
        epoch, index, batch = self._batch(step)
        t = self.t
        mine, groups = micro_batches_for_rank(
            examples,
            batch,
            t.micro_batch_size,
            self.data_dist,
            self.pad_id,
            t.micro_batch_tokens,
            policy.share_prefix,
            policy.packs,
        )
        num_valid = float(sum(sum(examples[i].mask) for g in groups for i in g))
        # the positions the forward runs (prefix tree, packed or padded rows) against the padded B x T
        run_positions = dp_sum(
            float(sum(positions(policy.layout(mb), mb.attention_mask.sum(1).tolist()) for mb in mine))
        )
        padded_positions = dp_sum(float(sum(mb.input_ids.numel() for mb in mine)))
        started = time.perf_counter()
        result = policy.train_step(mine, sft_loss, num_valid)
        elapsed = time.perf_counter() - started
        step_tokens = dp_sum(float(sum(int(mb.attention_mask.sum()) for mb in mine)))
        return {
            "loss": NLLStats.total(result.stats, dp_sum).nll_sum / num_valid,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": num_valid,
            "tokens_total": step_tokens,
            "tokens_per_s": step_tokens / elapsed,
            "step_seconds": elapsed,
            "epoch": epoch + index / self.data.steps_per_epoch,
            "tokens_seen": tokens_seen + int(step_tokens),
            "micro_batches": float(len(groups)),
            "skipped_updates": float(result.skipped),
            "forward_positions_saved": 1.0 - run_positions / padded_positions if padded_positions else 0.0,
        }
