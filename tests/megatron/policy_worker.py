"""torchrun worker: one GRPO optimizer step with MegatronPolicy vs TorchPolicy (rank 0).

    torchrun --nproc-per-node N tests/megatron/policy_worker.py OUT.json TP:PP:MODEL[,MODEL ...] [...]

(data-parallel size N / (TP x PP): each replica trains on its share of the micro-batches; each layout's parallel
groups are made anew in the same processes.)

Both backends start from the same HF weights (reward tokens added, so the
vocabulary is padded), compute old / reference logprobs, take one step of the
same pure ``GRPOLoss`` on the same micro-batches, and then: rank 0's HF copy
receives ``export_weights()`` (the generator's weight sync) and is compared with
the torch policy's weights; logprobs of both backends are compared before and
after the step; a sharded checkpoint is loaded into a fresh policy.
"""

import contextlib
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from nemo_rcgrpo.algorithms.losses import GRPOLoss, PolicyLossStats
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.batch import MicroBatch, RLMicroBatch
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.models.megatron.policy import MegatronPolicy
from nemo_rcgrpo.models.torch_policy import TorchPolicy
from nemo_rcgrpo.utils.dist import DistInfo, init_distributed


class Recorder:
    """A generator that keeps what a weight sync streams to it."""

    def __init__(self):
        self.tensors = {}

    def update_weights(self, weights, version):
        self.tensors = {n: t.clone() for n, t in weights}


def _counted_sync(policy, dist):
    """One ``sync_generator`` with a recording generator on rank 0; every rank's torch.distributed calls counted
    (the outermost: an object broadcast is one call). Returns (everyone's counts and grid place, the recorder)."""
    import torch.distributed as tdist

    from nemo_rcgrpo.models import factory

    names = (
        "all_gather",
        "gather",
        "broadcast",
        "broadcast_object_list",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "all_reduce",
    )
    calls, depth, saved = {}, [0], {n: getattr(tdist, n) for n in names}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            if depth[0] == 0:
                calls[name] = calls.get(name, 0) + 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapped

    for n in names:
        setattr(tdist, n, counting(n, saved[n]))
    recorder = Recorder() if dist.rank == 0 else None
    try:
        factory.sync_generator(policy, recorder, False, 1)
    finally:
        for n in names:
            setattr(tdist, n, saved[n])
    everyone = [None] * dist.world_size
    par = policy.parallel
    tdist.all_gather_object(
        everyone, {"calls": calls, "tp_rank": par.tp_rank, "dp_rank": par.dp_rank, "pp_rank": par.pp_rank}
    )
    return everyone, recorder


def stream_counts(policy, dist) -> dict:
    """The weight stream at the default bucket size (a tiny model's stage is one bucket), and again at 4 KB buckets
    (many buckets: offsets across bucket boundaries, buckets of norms only, the pipeline's bucket plan), checked
    against the HF copy that ``sync_hf_model`` filled and against each other."""
    everyone, recorder = _counted_sync(policy, dist)
    default = policy.export_bucket_bytes
    policy.export_bucket_bytes = 4096
    try:
        small, small_recorder = _counted_sync(policy, dist)
    finally:
        policy.export_bucket_bytes = default
    out = {"ranks": everyone, "small_ranks": small}
    if recorder is not None:
        sd = policy.module.state_dict()  # rank 0's HF copy, synced by sync_hf_model above
        expected = {n: t for n, t in sd.items() if n != "lm_head.weight" or not policy.shape.tied_embeddings}
        out["names_equal"] = list(recorder.tensors) == [m[0] for m in policy.export_meta()] and sorted(
            recorder.tensors
        ) == sorted(expected)
        out["max_diff"] = max(float((recorder.tensors[n] - expected[n]).abs().max()) for n in expected)
        out["small_equal"] = list(small_recorder.tensors) == list(recorder.tensors) and all(
            torch.equal(small_recorder.tensors[n], t) for n, t in recorder.tensors.items()
        )
    return out


def _right_padded(rows: list[list[int]], loss_from: int) -> MicroBatch:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    loss_mask = mask.clone()
    loss_mask[:, :loss_from] = 0
    return MicroBatch(ids, mask, loss_mask)


def _gradients(policy) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for p in policy.ddp.module.parameters()]


@contextlib.contextmanager
def _rows_padded(policy, padded: bool = True):
    """While inside, ``policy`` runs every micro-batch padded (with ``padded``)."""
    saved = policy.share_prefix, policy.packs
    if padded:
        policy.share_prefix, policy.packs = False, None
    try:
        yield
    finally:
        policy.share_prefix, policy.packs = saved


def _run(policy, batches, olds, padded: bool):
    """(logprobs and entropies, the loss, every parameter's gradient on this rank) of ``batches`` (the loss's old and
    reference logprobs from ``olds``), run as flat rows (the policy's setting) or padded."""
    with _rows_padded(policy, padded):
        evaluated = [policy.logprobs(b, with_entropy=True) for b in batches]
        rl = [
            RLMicroBatch(
                b.input_ids,
                b.attention_mask,
                b.loss_mask,
                advantages=torch.linspace(-1, 1, b.rows),
                ref_logprobs=(old - 0.05) * b.loss_mask,
                sampler_logprobs=torch.zeros(b.input_ids.shape),
                old_logprobs=old * b.loss_mask,
            )
            for b, old in zip(batches, olds)
        ]
        n = float(sum(b.loss_mask.sum() for b in batches))
        stats = policy.backward(rl, GRPOLoss(kl_beta=0.1, num_sequences=8.0), n)
        return evaluated, PolicyLossStats.total(stats).loss, _gradients(policy)


def layout_parity(policy, vocab: int, dist) -> dict:
    """A stratified RC-GRPO group (its prefix tree) and loose rows of very different lengths (packed rows), each as
    one flat row, against the same micro-batches padded: logprobs, entropies, the loss and every parameter's
    gradient (max over ranks). Then a suffix that sees another suffix, and a suffix whose positions restart at 0,
    planted in the flat row: the logprobs must show each."""
    from nemo_rcgrpo.data.packing import FlatRow
    from nemo_rcgrpo.data.prefix_tree import GroupLayout
    from nemo_rcgrpo.models.megatron import policy as policy_module

    g = torch.Generator().manual_seed(7)

    def rand(k):
        return torch.randint(3, vocab - 2, (k,), generator=g).tolist()

    hi, lo = vocab - 2, vocab - 1  # the reward tokens, added last
    prompt, common = rand(14), rand(3)
    group = [prompt + [tok] + common + rand(k) for tok, k in ((hi, 5), (lo, 2), (hi, 9), (lo, 7))]
    batches = [_right_padded(group, len(prompt) + 1), _right_padded([rand(20), rand(4), rand(3), rand(4)], 1)]
    kinds = [type(policy.layout(b)).__name__ for b in batches]
    with _rows_padded(policy):
        olds = [policy.logprobs(b) for b in batches]
    padded, flat = _run(policy, batches, olds, padded=True), _run(policy, batches, olds, padded=False)

    def on_loss(a, b, mb):
        return float(((a - b) * mb.loss_mask).abs().max())

    lp = max(on_loss(f[0], p[0], b) for f, p, b in zip(flat[0], padded[0], batches))
    ent = max(on_loss(f[1], p[1], b) for f, p, b in zip(flat[0], padded[0], batches))
    scale = max(float(p.abs().max()) for p in padded[2])
    grad = max(float((f - p).abs().max()) for f, p in zip(flat[2], padded[2])) / scale
    tree = policy.layout(batches[0])
    original = policy_module.flat_row

    def planted(kind):
        def build(layout, ids):
            row = original(layout, ids)
            if not isinstance(layout, GroupLayout):
                return row
            blocked, positions = row.blocked.clone(), row.positions.clone()
            end = tree.lengths[0]
            if kind == "leak":  # row 0's last trained position sees row 2's first suffix token
                blocked[row.index[0, end - 2], row.index[2, tree.suffix_start(2)]] = False
            else:  # row 0's suffix restarts at position 0
                start = tree.suffix_start(0)
                positions[row.index[0, start:end]] = torch.arange(end - start)
            return FlatRow(row.ids, positions, blocked, row.index)

        return build

    shown = {}
    for kind in ("leak", "restart"):
        policy_module.flat_row = planted(kind)
        try:
            wrong = policy.logprobs(batches[0])
        finally:
            policy_module.flat_row = original
        shown[kind] = on_loss(wrong, padded[0][0][0], batches[0])
    values = torch.tensor([lp, ent, abs(flat[1] - padded[1]), grad, shown["leak"], shown["restart"]])
    tops = values.clone()
    torch.distributed.all_reduce(tops, op=torch.distributed.ReduceOp.MAX)
    lows = values.clone()
    torch.distributed.all_reduce(lows, op=torch.distributed.ReduceOp.MIN)
    return {
        "kinds": kinds,
        "logprob_diff": float(tops[0]),
        "entropy_diff": float(tops[1]),
        "loss_diff": float(tops[2]),
        "loss": padded[1],
        "grad_rel_diff": float(tops[3]),
        "leak_shown": float(lows[4]),
        "restart_shown": float(lows[5]),
    }


def check(name: str, tp: int, pp: int, dist) -> dict:
    cfg = TrainConfig.from_dict(
        {
            "trainer": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
            "policy": {"backend": "megatron", "megatron": {"tp": tp, "pp": pp}},
        }
    )
    tok, hf = load_tokenizer(name), load_model(name)
    add_reward_tokens(tok, hf, ("<|high_reward|>", "<|low_reward|>"))
    torch_model = copy.deepcopy(hf)
    policy = MegatronPolicy(hf, cfg.policy_build(), dist, total_steps=4)
    flat = layout_parity(policy, len(tok), dist)  # gradients only: the weights stay as loaded
    reference = policy.frozen_reference()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, len(tok), (4, 24), generator=g)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 12:] = 1
    loss_mask[1, 20:] = 0
    batches, ents = [], []
    for s in (0, 2):
        t = MicroBatch(ids[s : s + 2], torch.ones_like(ids[s : s + 2]), loss_mask[s : s + 2])
        old, ent = policy.logprobs(t, with_entropy=True)
        batches.append(
            RLMicroBatch(
                t.input_ids,
                t.attention_mask,
                t.loss_mask,
                advantages=torch.tensor([1.0, -0.5] if s == 0 else [0.25, -1.0]),
                ref_logprobs=reference(t),
                sampler_logprobs=torch.zeros(t.input_ids.shape),
                old_logprobs=old,
                first=s,
            )
        )
        ents.append(ent)
    one = MicroBatch(ids[:1], torch.ones_like(ids[:1]), loss_mask[:1])
    policy_one = policy.logprobs(one, with_entropy=True)
    n = float(loss_mask.sum())
    loss_fn = GRPOLoss(kl_beta=0.1, num_sequences=4.0)
    replica, dp_sum = policy.data_parallel()
    mine = batches[replica.rank :: replica.world_size]
    out = policy.train_step(mine, loss_fn, n)
    stats = PolicyLossStats.total(out.stats, dp_sum)
    policy.sync_hf_model()  # the generator's weight sync: rank 0's HF copy receives export_weights()
    streamed = stream_counts(policy, dist)
    after = [policy.logprobs(b) for b in batches]
    result = {}
    if dist.rank == 0:
        tpol = TorchPolicy(torch_model, cfg.trainer, DistInfo(), total_steps=4)
        t_old = [tpol.logprobs(b, with_entropy=True) for b in batches]
        # one row: the logits slice is contiguous (megatron's cross entropy works in place on it)
        result["one_row_entropy_diff"] = float(
            ((policy_one[1] - tpol.logprobs(one, with_entropy=True)[1]) * one.loss_mask).abs().max()
        )
        t_out = tpol.train_step(batches, loss_fn, n)
        t_stats = PolicyLossStats.total(t_out.stats)
        t_after = [tpol.logprobs(b) for b in batches]
        synced = policy.module.state_dict()
        moved = max(float((synced[k] - torch_model.state_dict()[k]).abs().max()) for k in synced)
        start = load_model(name).state_dict()
        result.update(
            {
                "model": name,
                "flat": flat,
                "tp": tp,
                "pp": pp,
                "dp": replica.world_size,
                "stream": streamed,
                "old_logprob_diff": max(
                    float(((b.old_logprobs - o[0]) * b.loss_mask).abs().max()) for b, o in zip(batches, t_old)
                ),
                "entropy_diff": max(
                    float(((e - o[1]) * b.loss_mask).abs().max()) for b, e, o in zip(batches, ents, t_old)
                ),
                "loss": stats.loss,
                "torch_loss": t_stats.loss,
                "grad_norm": out.grad_norm,
                "torch_grad_norm": t_out.grad_norm,
                "kl_sum": stats.kl_sum,
                "torch_kl_sum": t_stats.kl_sum,
                "weights_vs_torch": moved,
                "weights_changed": max(float((synced[k][: start[k].shape[0]] - start[k]).abs().max()) for k in start),
                "new_logprob_diff": max(
                    float(((a - t) * b.loss_mask).abs().max()) for a, t, b in zip(after, t_after, batches)
                ),
            }
        )
    # checkpoint round trip: a fresh policy loaded from the sharded checkpoint gives the same logprobs
    box = [tempfile.mkdtemp(prefix="rcgrpo-ckpt-") if dist.rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    sd = policy.state_dict()
    policy.save_sharded(Path(box[0]) / sd["optimizer"]["dir"])
    fresh_hf = load_model(name)
    add_reward_tokens(tok, fresh_hf, ("<|high_reward|>", "<|low_reward|>"))
    fresh = MegatronPolicy(fresh_hf, cfg.policy_build(), dist, total_steps=4)
    fresh.load_state_dict({}, {**sd["optimizer"], "path": str(Path(box[0]) / sd["optimizer"]["dir"])}, sd["scheduler"])
    if dist.rank == 0:  # rank 0's HF copy (the generator's model) follows the loaded weights
        result["reloaded_hf_diff"] = max(
            float((fresh.module.state_dict()[k] - v).abs().max()) for k, v in policy.module.state_dict().items()
        )
    torch.distributed.barrier()
    if dist.rank == 0:
        shutil.rmtree(box[0])
    reloaded = max(float((fresh.logprobs(b) - a).abs().max()) for b, a in zip(batches, after))
    # the next step from the reloaded optimizer state equals the next step of the original
    o1 = policy.train_step(mine, loss_fn, n)
    o2 = fresh.train_step(mine, loss_fn, n)
    result.update(
        reloaded_logprob_diff=reloaded,
        resumed_step_loss_diff=abs(PolicyLossStats.total(o1.stats).loss - PolicyLossStats.total(o2.stats).loss),
        resumed_logprob_diff=max(float((policy.logprobs(b) - fresh.logprobs(b)).abs().max()) for b in batches),
    )
    # a step in which only replica 0 has a micro-batch (RL groups can be dropped): the others still take part
    lonely = policy.train_step(mine[:1] if replica.rank == 0 else [], loss_fn, n)
    result["lonely_step_grad_norm"] = lonely.grad_norm
    return result


def main() -> None:
    dist = init_distributed()
    out, results = sys.argv[1], []
    for spec in sys.argv[2:]:
        tp, pp, names = spec.split(":")
        results += [check(name, int(tp), int(pp), dist) for name in names.split(",")]
    if dist.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
