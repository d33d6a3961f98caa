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
from nemo_rcgrpo.prepare_data import ensure_data
from nemo_rcgrpo.recipes.run_loop import RunLoop, open_run
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


def run_stage1(cfg: TrainConfig, recipe: str | None = None) -> dict[str, Any]:
    dist = init_distributed()
    try:
        return _run(cfg, dist, recipe)
    finally:
        shutdown(dist)


def _run(cfg: TrainConfig, dist: DistInfo, recipe: str | None) -> dict[str, Any]:
    seed_everything(cfg.seed)
    run_dir = Path(cfg.run_dir)
    data_path = ensure_data(cfg, dist)
    setup = cfg.policy_setup()
    tokenizer, model = load_tokenizer_and_model(setup)
    renderer = make_renderer(setup, tokenizer)
    records = load_records(data_path, cfg.data.split, progress=cfg.logging.progress and dist.is_main)
    conditioned = cfg.stage_spec.conditioned
    goal = (
        reward_goal_of(cfg.data.dir, cfg.reward_tokens.high, cfg.reward_tokens.low)
        if conditioned
        else RewardGoal(high_token=cfg.reward_tokens.high, low_token=cfg.reward_tokens.low)
    )
    records = Prepared(records, stage1_dataset(cfg.stage1_dataset_name), goal)  # e.g. RCTP-FT's goal templating
    examples, data_stats = build_examples(records, renderer, cfg.chat.max_length, cfg.seed, cfg.data.max_examples)
    t = cfg.trainer
    steps_per_epoch = len(examples) // t.global_batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(examples)} usable examples (of {data_stats['records']}; {data_stats['dropped_too_long']} "
            f"longer than chat.max_length={cfg.chat.max_length}) cannot fill one batch of "
            f"trainer.global_batch_size={t.global_batch_size}"
        )
    total_steps = steps_per_epoch * t.epochs if t.max_steps is None else min(t.max_steps, steps_per_epoch * t.epochs)
    fingerprint = model_fingerprint(model, cfg.model.path)
    record = training_record(
        cfg.stage, cfg.model.path, cfg.reward_tokens.high, cfg.reward_tokens.low, conditioned=cfg.stage_spec.conditioned
    )
    if conditioned:  # the data's reward goal, whose tokens must be the ones the model gets
        record["reward_goal"] = dataclasses.asdict(goal)
    policy = make_policy(cfg.policy_build(), model, dist, total_steps)
    data_dist, dp_sum = policy.data_parallel()  # megatron: the TP x PP ranks of a replica share micro-batches
    per = t.micro_batch_size if t.micro_batch_tokens is None else 1  # a token budget: at least one example a replica
    if t.global_batch_size % (per * data_dist.world_size):
        raise ValueError(
            f"trainer.global_batch_size={t.global_batch_size} must be a multiple of "
            + ("micro_batch_size x " if t.micro_batch_tokens is None else "")
            + f"data-parallel size = {per * data_dist.world_size}"
        )

    ckpt, ts = open_run(cfg, dist, policy, fingerprint)
    start_step, tokens_seen = ts.get("step", 0), ts.get("tokens_seen", 0)
    if dist.is_main:
        with writing("the data statistics", run_dir / "data_stats.json"):
            (run_dir / "data_stats.json").write_text(json.dumps(data_stats, indent=1))
        say(
            start_banner(
                cfg,
                recipe=recipe,
                parameters=sum(p.numel() for p in model.parameters()),
                checkpoint=ckpt,
                start_step=start_step,
                data=f"{data_path} ({cfg.data.split}): {len(examples)} examples of {data_stats['records']} "
                f"({data_stats['dropped_too_long']} longer than chat.max_length={cfg.chat.max_length})",
                steps=f"{total_steps} optimizer steps of {t.global_batch_size} sequences ({steps_per_epoch} per epoch), "
                f"lr {t.lr:g} {t.schedule}",
            )
        )
    pad_id = tokenizer.pad_token_id
    batches_epoch, batches = -1, []
    last: dict[str, float] = {}
    with RunLoop(cfg, dist, policy, tokenizer, record, start_step, total_steps, fingerprint) as loop:
        for step in loop.steps():
            epoch, index = divmod(step - 1, steps_per_epoch)
            if epoch != batches_epoch:
                batches = epoch_batches(
                    [len(e) for e in examples], t.global_batch_size, cfg.seed, epoch, t.bucket_by_length
                )
                batches_epoch = epoch
            mine, groups = micro_batches_for_rank(
                examples,
                batches[index],
                t.micro_batch_size,
                data_dist,
                pad_id,
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
            nll = NLLStats.total(result.stats, dp_sum).nll_sum
            tokens_seen += int(step_tokens)
            last = {
                "loss": nll / num_valid,
                "lr": result.lr,
                "grad_norm": result.grad_norm,
                "tokens": num_valid,
                "tokens_total": step_tokens,
                "tokens_per_s": step_tokens / elapsed,
                "step_seconds": elapsed,
                "epoch": epoch + index / steps_per_epoch,
                "tokens_seen": tokens_seen,
                "micro_batches": float(len(groups)),
                "skipped_updates": float(result.skipped),
                "forward_positions_saved": 1.0 - run_positions / padded_positions if padded_positions else 0.0,
            }
            loop.end_step(
                step, last, log=step % t.log_every == 0, trainer_state={"tokens_seen": tokens_seen, "epoch": epoch}
            )
            loop.bar.set_postfix(loss=f"{last['loss']:.4f}")
            if not cfg.logging.progress and dist.is_main:
                say(step_line(cfg.stage, step, total_steps, last, ("loss", "grad_norm", "lr", "step_seconds")))
    loop.finish()
    end_step = loop.end
    return {"steps": end_step, "total_steps": total_steps, "start_step": start_step, **last, **data_stats}
