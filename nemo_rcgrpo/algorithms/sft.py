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
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nemo_rcgrpo.algorithms.losses import NLLStats, sft_loss
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.consistency import reward_goal_of
from nemo_rcgrpo.prepare_data import ensure_data
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.sft_data import Example, build_examples, collate, epoch_batches, load_records
from nemo_rcgrpo.data.stage1_datasets import Prepared, stage1_dataset
from nemo_rcgrpo.models.setup import export_hf, load_tokenizer_and_model, make_renderer, model_fingerprint, seed_everything
from nemo_rcgrpo.models.factory import make_policy, save_policy_checkpoint
from nemo_rcgrpo.utils.run_dir import check_run_dir, save_run_config
from nemo_rcgrpo.utils.signals import StopFlag, StopRequested
from nemo_rcgrpo.utils.banner import say, start_banner, step_line
from nemo_rcgrpo.utils.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, set_rng_state
from nemo_rcgrpo.utils.dist import DistInfo, barrier, init_distributed, shutdown
from nemo_rcgrpo.utils.logging import MetricsLogger
from nemo_rcgrpo.utils.provenance import training_record


def micro_batches_for_rank(examples: list[Example], batch: list[int], micro: int, dist: DistInfo, pad_id: int):
    """Split a global batch (sorted by length) into micro-batches; rank r takes every world_size-th."""
    ordered = sorted(batch, key=lambda i: len(examples[i]))
    groups = [ordered[s:s + micro] for s in range(0, len(ordered), micro)]
    mine = groups[dist.rank::dist.world_size]
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
    goal = (reward_goal_of(cfg.data.dir, cfg.reward_tokens.high, cfg.reward_tokens.low) if conditioned else
            RewardGoal(high_token=cfg.reward_tokens.high, low_token=cfg.reward_tokens.low))
    records = Prepared(records, stage1_dataset(cfg.stage1_dataset_name), goal)  # e.g. RCTP-FT's goal templating
    examples, data_stats = build_examples(records, renderer, cfg.chat.max_length, cfg.seed, cfg.data.max_examples)
    t = cfg.trainer
    steps_per_epoch = len(examples) // t.global_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(examples)} usable examples (of {data_stats['records']}; {data_stats['dropped_too_long']} "
                         f"longer than chat.max_length={cfg.chat.max_length}) cannot fill one batch of "
                         f"trainer.global_batch_size={t.global_batch_size}")
    total_steps = steps_per_epoch * t.epochs if t.max_steps is None else min(t.max_steps, steps_per_epoch * t.epochs)
    fingerprint = model_fingerprint(model, cfg.model.path)
    record = training_record(cfg.stage, cfg.model.path, cfg.reward_tokens.high, cfg.reward_tokens.low,
                             conditioned=cfg.stage_spec.conditioned)
    if conditioned:  # the data's reward goal, whose tokens must be the ones the model gets
        record["reward_goal"] = dataclasses.asdict(goal)
    policy = make_policy(cfg, model, dist, total_steps)
    data_dist, dp_sum = policy.data_parallel()  # megatron: the TP x PP ranks of a replica share micro-batches
    if t.global_batch_size % (t.micro_batch_size * data_dist.world_size):
        raise ValueError(f"trainer.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size x "
                         f"data-parallel size = {t.micro_batch_size * data_dist.world_size}")

    start_step, tokens_seen = 0, 0
    # every rank refuses another run's folder; then rank 0 keeps this invocation's config (config.N.yaml)
    check_run_dir(run_dir, cfg.to_dict(), resume=t.resume, overwrite=cfg.overwrite, may_change=t.resume_may_change)
    barrier(dist)
    if dist.is_main:
        save_run_config(run_dir, cfg.to_dict(), resume=t.resume, overwrite=cfg.overwrite)
    barrier(dist)
    ckpt = latest_checkpoint(run_dir) if t.resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        ts = state["trainer_state"]
        if ts.get("fingerprint") != fingerprint:
            raise CheckpointError(f"checkpoint {ckpt} was written for another model ({ts.get('model_path')}); "
                                  f"use a new run_dir, or start over with trainer.resume=false overwrite=true")
        policy.load_state_dict(state["model"], state["optimizer"], state["scheduler"])
        set_rng_state(state["rng"])
        start_step, tokens_seen = ts["step"], ts.get("tokens_seen", 0)
    if dist.is_main:
        (run_dir / "data_stats.json").write_text(json.dumps(data_stats, indent=1))
        say(start_banner(
            cfg, recipe=recipe, parameters=sum(p.numel() for p in model.parameters()), checkpoint=ckpt,
            start_step=start_step,
            data=f"{data_path} ({cfg.data.split}): {len(examples)} examples of {data_stats['records']} "
                 f"({data_stats['dropped_too_long']} longer than chat.max_length={cfg.chat.max_length})",
            steps=f"{total_steps} optimizer steps of {t.global_batch_size} sequences ({steps_per_epoch} per epoch), "
                  f"lr {t.lr:g} {t.schedule}"))
    logger = MetricsLogger(run_dir, rank=dist.rank, tensorboard=cfg.logging.tensorboard,
                           wandb_cfg=cfg.logging.wandb, config=cfg.to_dict(), resume_step=start_step)
    pad_id = tokenizer.pad_token_id
    bar = tqdm(total=total_steps, initial=start_step, desc=f"{cfg.stage}", unit="step",
               disable=not (cfg.logging.progress and dist.is_main), file=sys.stderr)
    batches_epoch, batches = -1, []
    last: dict[str, float] = {}
    end_step = total_steps if t.stop_after is None else min(total_steps, start_step + t.stop_after)
    stop, stopped = StopFlag().install(), None
    try:
        for step in range(start_step, end_step):
            epoch, index = divmod(step, steps_per_epoch)
            if epoch != batches_epoch:
                batches = epoch_batches([len(e) for e in examples], t.global_batch_size, cfg.seed, epoch, t.bucket_by_length)
                batches_epoch = epoch
            mine, groups = micro_batches_for_rank(examples, batches[index], t.micro_batch_size, data_dist, pad_id)
            num_valid = float(sum(sum(examples[i].mask) for g in groups for i in g))
            started = time.perf_counter()
            result = policy.train_step(mine, sft_loss, num_valid)
            elapsed = time.perf_counter() - started
            step_tokens = dp_sum(float(sum(int(mb.attention_mask.sum()) for mb in mine)))
            nll = NLLStats.total(result.stats, dp_sum).nll_sum
            tokens_seen += int(step_tokens)
            last = {"loss": nll / num_valid, "lr": result.lr, "grad_norm": result.grad_norm,
                    "tokens": num_valid, "tokens_total": step_tokens, "tokens_per_s": step_tokens / elapsed,
                    "step_seconds": elapsed, "epoch": epoch + index / steps_per_epoch, "tokens_seen": tokens_seen}
            signum = stop.requested(dist)  # a signal arrived: this step is the last of the invocation
            if (step + 1) % t.log_every == 0 or step + 1 == end_step or signum:
                logger.log(step + 1, last)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4f}")
            if not cfg.logging.progress and dist.is_main:
                say(step_line(cfg.stage, step + 1, total_steps, last, ("loss", "grad_norm", "lr", "step_seconds")))
            if (step + 1) % t.save_every == 0 or step + 1 == end_step or signum:
                save_policy_checkpoint(policy, dist, run_dir, step + 1, keep_last=t.keep_last, tokenizer=tokenizer,
                                       record=record,
                                       trainer_state={"fingerprint": fingerprint, "model_path": cfg.model.path,
                                                      "tokens_seen": tokens_seen, "epoch": epoch, "stage": cfg.stage})
            if signum and step + 1 < end_step:
                stopped = StopRequested(signum, step + 1, latest_checkpoint(run_dir))
                break
    finally:
        stop.restore()
    bar.close()
    logger.close()
    if stopped is not None:
        barrier(dist)
        raise stopped
    if t.export_hf and end_step == total_steps:
        hf = policy.sync_hf_model()  # a collective with the megatron backend
        if dist.is_main:
            export_hf(hf, tokenizer, run_dir / "hf", record, chat=cfg.chat)
    barrier(dist)
    return {"steps": end_step, "total_steps": total_steps, "start_step": start_step, **last, **data_stats}
