"""torchrun worker: sharded Megatron checkpoints (``checkpointing.save_sharded``/``load_sharded``), resume and reshard.

    torchrun --nproc-per-node 2 tests/megatron/ckpt_worker.py OUT.json TMP_DIR MODEL [MODEL ...]

For each model and with the distributed optimizer on and off, a MegatronPolicy
at TP = 2 takes one GRPO step and is saved, then:
(a) a fresh TP = 2 policy (initial HF weights, no optimizer state) loads it:
    logprobs, the next step's loss and the logprobs after it are compared with
    the original's;
(b) a TP = 1 policy (DP = 2) loads it and takes the same next step, each DP
    rank on one of the two micro-batches; before that it must refuse the
    checkpoint of the other kind of optimizer (``CheckpointLayoutError``);
(c) distributed optimizer only: (b)'s state, sharded over DP = 2, is saved and
    loaded back at TP = 2, which takes the original's third step;
(d) a TP = 1 x PP = 2 policy loads it and takes the same next step.
"""

import json
import sys
import time
from pathlib import Path

import torch

from nemo_rcgrpo.algorithms.losses import GRPOLoss, PolicyLossStats
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.batch import MicroBatch, RLMicroBatch
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.models.megatron.checkpointing import CheckpointLayoutError, load_sharded, save_sharded
from nemo_rcgrpo.models.megatron.policy import MegatronPolicy
from nemo_rcgrpo.utils.dist import init_distributed

REWARD_TOKENS = ("<|high_reward|>", "<|low_reward|>")


def make_policy(name: str, tp: int, distributed_optimizer: bool, dist, pp: int = 1) -> MegatronPolicy:
    megatron = {"tp": tp, "pp": pp, "distributed_optimizer": distributed_optimizer}
    cfg = TrainConfig.from_dict(
        {
            "trainer": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
            "policy": {"backend": "megatron", "megatron": megatron},
        }
    )
    tok, hf = load_tokenizer(name), load_model(name)
    add_reward_tokens(tok, hf, REWARD_TOKENS)
    return MegatronPolicy(hf, cfg.policy_build(), dist, total_steps=4)


def make_batches(policy: MegatronPolicy, vocab: int) -> tuple[list[RLMicroBatch], float]:
    """Two GRPO micro-batches of 2 sequences (old = reference logprobs: the step starts on-policy)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 24), generator=g)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 12:] = 1
    loss_mask[1, 20:] = 0
    batches = []
    for s, adv in ((0, [1.0, -0.5]), (2, [0.25, -1.0])):
        rows = slice(s, s + 2)
        t = MicroBatch(ids[rows], torch.ones_like(ids[rows]), loss_mask[rows])
        old = policy.logprobs(t)
        batches.append(
            RLMicroBatch(
                t.input_ids,
                t.attention_mask,
                t.loss_mask,
                advantages=torch.tensor(adv),
                ref_logprobs=old.clone(),
                sampler_logprobs=torch.zeros(old.shape),
                old_logprobs=old,
                first=s,
            )
        )
    return batches, float(loss_mask.sum())


loss_fn = GRPOLoss(kl_beta=0.1, num_sequences=4.0)


def step_loss(result) -> float:
    """This replica's share of a step's loss (its micro-batches' records added)."""
    return PolicyLossStats.total(result.stats).loss


def logprobs(policy: MegatronPolicy, batches: list[RLMicroBatch]) -> list[torch.Tensor]:
    return [policy.logprobs(b) for b in batches]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check(name: str, distributed_optimizer: bool, tmp: Path, dist, other_kind: Path | None) -> dict:
    vocab = len(load_tokenizer(name))
    world = dist.world_size
    policy = make_policy(name, world, distributed_optimizer, dist)
    batches, n = make_batches(policy, vocab)
    policy.train_step(batches, loss_fn, n)
    after = [logprobs(policy, batches)]
    ckpt = tmp / f"{name}-{'distopt' if distributed_optimizer else 'opt'}"
    t0 = time.perf_counter()
    save_sharded(policy.ddp, policy.optimizer, ckpt, {"optimizer_step": policy.optimizer_step})
    save_s = time.perf_counter() - t0
    steps = []  # the original continues: the reference for every reload
    for _ in range(2 if distributed_optimizer else 1):
        steps.append(policy.train_step(batches, loss_fn, n))
        after.append(logprobs(policy, batches))
    del policy

    # (a) same layout: a fresh policy (initial weights, no optimizer state) loads and takes the next step
    fresh = make_policy(name, world, distributed_optimizer, dist)
    initial_diff = max_diff(logprobs(fresh, batches), after[0])
    t0 = time.perf_counter()
    fresh.optimizer_step = load_sharded(fresh.ddp, fresh.optimizer, ckpt)["optimizer_step"]
    load_s = time.perf_counter() - t0
    reloaded = max_diff(logprobs(fresh, batches), after[0])
    resumed = fresh.train_step(batches, loss_fn, n)
    result = {
        "model": name,
        "distributed_optimizer": distributed_optimizer,
        "tp": world,
        "checkpoint_bytes": dir_size(ckpt),
        "save_s": save_s,
        "load_s": load_s,
        "fresh_logprob_diff": initial_diff,
        "reloaded_logprob_diff": reloaded,
        "resumed_step_loss_diff": abs(step_loss(resumed) - step_loss(steps[0])),
        "resumed_grad_norm_diff": abs(resumed.grad_norm - steps[0].grad_norm),
        "resumed_logprob_diff": max_diff(logprobs(fresh, batches), after[1]),
    }
    del fresh

    # (b) TP = 1 (DP = 2), each DP rank on one micro-batch
    tp1 = make_policy(name, 1, distributed_optimizer, dist)
    if other_kind is not None:  # the other kind of optimizer state cannot be restored (checked before any change)
        try:
            load_sharded(tp1.ddp, tp1.optimizer, other_kind)
            result["other_kind_error"] = None
        except CheckpointLayoutError as e:
            result["other_kind_error"] = str(e)
    tp1.optimizer_step = load_sharded(tp1.ddp, tp1.optimizer, ckpt)["optimizer_step"]
    result["tp1_logprob_diff"] = max_diff(logprobs(tp1, batches), after[0])
    info, reduce_sum = tp1.data_parallel()
    out = tp1.train_step([batches[info.rank]], loss_fn, n)
    result.update(
        tp1_dp=info.world_size,
        tp1_step_loss_diff=abs(reduce_sum(step_loss(out)) - step_loss(steps[0])),
        tp1_grad_norm_diff=abs(out.grad_norm - steps[0].grad_norm),
        tp1_resumed_logprob_diff=max_diff(logprobs(tp1, batches), after[1]),
    )
    if distributed_optimizer:  # (c) this state, sharded over DP = 2, goes back to TP = 2
        save_sharded(tp1.ddp, tp1.optimizer, tmp / f"{ckpt.name}-tp1", {"optimizer_step": tp1.optimizer_step})
        result.update(back_to_tp2(name, tmp / f"{ckpt.name}-tp1", batches, n, steps[1], after[1:], dist))
    del tp1

    # (d) PP = 2 (TP = 1, DP = 1): the checkpoint's layers are split between two pipeline stages
    pp2 = make_policy(name, 1, distributed_optimizer, dist, pp=2)
    pp2.optimizer_step = load_sharded(pp2.ddp, pp2.optimizer, ckpt)["optimizer_step"]
    result["pp2_logprob_diff"] = max_diff(logprobs(pp2, batches), after[0])
    out = pp2.train_step(batches, loss_fn, n)
    result.update(
        pp2_step_loss_diff=abs(step_loss(out) - step_loss(steps[0])),
        pp2_resumed_logprob_diff=max_diff(logprobs(pp2, batches), after[1]),
    )
    return result


def back_to_tp2(name: str, ckpt: Path, batches: list[RLMicroBatch], n: float, step, after: list, dist) -> dict:
    """A checkpoint of the distributed optimizer sharded over DP = 2 loads at TP = 2, DP = 1 and takes the
    original's next step."""
    back = make_policy(name, dist.world_size, True, dist)
    back.optimizer_step = load_sharded(back.ddp, back.optimizer, ckpt)["optimizer_step"]
    result = {"back_logprob_diff": max_diff(logprobs(back, batches), after[0])}
    out = back.train_step(batches, loss_fn, n)
    result.update(
        back_step_loss_diff=abs(step_loss(out) - step_loss(step)),
        back_resumed_logprob_diff=max_diff(logprobs(back, batches), after[1]),
    )
    return result


def main() -> None:
    dist = init_distributed()
    out, tmp, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    results = []
    for i, name in enumerate(names):
        # alternate which kind comes first, so that each direction of the wrong-kind load is tried
        first = i % 2 == 0
        results.append(check(name, first, tmp, dist, None))
        results.append(check(name, not first, tmp, dist, tmp / f"{name}-{'distopt' if first else 'opt'}"))
    if dist.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
