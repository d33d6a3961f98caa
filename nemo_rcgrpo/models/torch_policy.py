"""Torch policy backend: one process, or torchrun DDP (gloo on CPU, NCCL on GPU).

Interface shared with the Megatron backend: ``token_logprobs(batch)``,
``train_step(micro_batches, loss_fn, num_valid_tokens) -> TrainStepResult``,
``export_weights()`` (HF names, full tensors), ``state_dict()/load_state_dict()``.

A model in bf16 / fp16 trains with fp32 master weights, as Megatron does: the
model computes in its own dtype, its gradients are accumulated in fp32
(per micro-batch in one process; after DDP's reduction under torchrun), and
AdamW updates fp32 copies that are rounded into the model after each step.
Without them an update smaller than half a bf16 step (lr 1e-6 against a
weight of 1.0) rounds away and the weight never moves.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nemo_rcgrpo.config_schema import TrainerConfig
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.data.packing import Layout, Packed
from nemo_rcgrpo.models.interfaces import LossFn, TrainStepResult
from nemo_rcgrpo.models.packed import packed_position_logits, packs
from nemo_rcgrpo.models.shared_prefix import share_layout, shared_position_logits, supports
from nemo_rcgrpo.utils.dist import DistInfo, all_reduce_sum

ENTROPY_CHUNK = 256  # positions per chunk of the training pass's entropy
LOW_PRECISION = (torch.bfloat16, torch.float16)


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step s: linear warmup, then cosine/linear decay or constant."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_ratio + (1 - min_ratio) * decay

    return f


# model types whose causal-LM forward is exactly lm_head(decoder(...)) (no logit scaling or soft-capping), so the
# output layer can be applied to the trained positions only (`position_logits`)
GATHERED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def gathers(model: torch.nn.Module) -> bool:
    """Whether ``model``'s output layer may be applied to chosen positions only (`position_logits`)."""
    config = getattr(model, "config", None)
    return (
        getattr(config, "model_type", None) in GATHERED_MODEL_TYPES
        and hasattr(model, "get_decoder")
        and hasattr(model, "get_output_embeddings")
    )


def position_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    layout: Layout = None,
) -> torch.Tensor:
    """[N, V] logits at the N positions (rows[i], cols[i]) of a [B, T] batch: the decoder runs on every token (or,
    with ``layout``, the prefix tree's passes or the packed rows), the output layer (over a 50k-150k vocabulary,
    most of a small model's cost) only on the positions asked for."""
    if isinstance(layout, Packed):
        return packed_position_logits(model, input_ids, layout, rows, cols)
    if layout is not None:
        return shared_position_logits(model, input_ids, layout, rows, cols)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
    return model.get_output_embeddings()(hidden[rows, cols])  # [N, V]


class PositionHead(torch.nn.Module):
    """``position_logits`` as a module, so DDP wraps it and its gradients are synchronised as the model's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.lm = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        layout: Layout = None,
    ) -> torch.Tensor:
        return position_logits(self.lm, input_ids, attention_mask, rows, cols, layout)


def _trained_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    layout: Layout = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    """[N, V] fp32 logits at the positions t whose token t+1 is trained (through ``layout``'s passes where given),
    and those (rows, cols) in the shifted [B, T-1] grid; None where the model cannot gather (a DDP model gathers
    only as a `PositionHead`, which runs the layout inside DDP's forward, so the gradients synchronise)."""
    inner = model.module if isinstance(model, DDP) else model
    if not (isinstance(inner, PositionHead) or (inner is model and gathers(model))):
        return None
    rows, cols = loss_mask[:, 1:].nonzero(as_tuple=True)  # [N], [N]
    if isinstance(inner, PositionHead):
        logits = model(input_ids, attention_mask, rows, cols, layout)
    else:
        logits = position_logits(model, input_ids, attention_mask, rows, cols, layout)
    return fp32_at_least(logits), (rows, cols)


def fp32_at_least(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the log-softmax: a low-precision model's in fp32, a float64 model's as they are."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _entropies(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] entropies, in chunks along the first dimension, without gradient (a whole
    [N, V] softmax beside the graph would double the peak)."""
    with torch.no_grad():
        out = torch.empty(logits.shape[:-1], dtype=logits.dtype, device=logits.device)
        for c in range(0, logits.shape[0], ENTROPY_CHUNK):
            logp_all = logits[c : c + ENTROPY_CHUNK].detach().log_softmax(-1)
            out[c : c + ENTROPY_CHUNK] = -(logp_all.exp() * logp_all).sum(-1)
        return out


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    entropy_out: list | None = None,
    layout: Layout = None,
) -> torch.Tensor:
    """[B, T] log p(ids[:, t] | ids[:, <t]); position 0 is 0 (nothing predicts the first token).

    With ``loss_mask`` [B, T], logits are computed only where they are needed (the output layer over a
    50k-150k vocabulary is a large share of the cost): at each row's own trained positions where the model
    gathers (`gathers`, `PositionHead`), else at the positions that predict a masked token in some row
    (``logits_to_keep``); positions not computed are 0.
    ``entropy_out`` (with ``loss_mask``): a list that receives the [B, T] entropies of the same forward pass
    (no gradient), so a training step needs no separate pass for them.
    ``layout`` (with ``loss_mask``, a model that gathers, or its DDP-wrapped `PositionHead`): the rows' prefix
    tree, whose shared prefixes are computed once (`models/shared_prefix.py`), or ``Packed`` rows run as one
    sequence without padding (`models/packed.py`); the result is the same grid.
    """
    targets = input_ids[:, 1:]  # [B, T-1]
    if loss_mask is None and isinstance(model.module if isinstance(model, DDP) else model, PositionHead):
        loss_mask = torch.ones_like(input_ids)  # every position, through the head DDP wraps
    if loss_mask is None:
        logits = fp32_at_least(model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1])  # [B, T-1, V]
        lp = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        lp = lp.view(targets.shape)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # [B, T]
    gathered = _trained_logits(model, input_ids, attention_mask, loss_mask, layout)
    if gathered is not None:
        logits, (rows, cols) = gathered  # [N, V]
        kept = -F.cross_entropy(logits, targets[rows, cols], reduction="none")  # [N]
        lp = torch.zeros(targets.shape, dtype=kept.dtype, device=kept.device)
        lp = lp.index_put((rows, cols), kept)  # out of place: the [N] values keep their graph
        if entropy_out is not None:
            ent = torch.zeros(targets.shape, dtype=kept.dtype, device=kept.device)
            ent[rows, cols] = _entropies(logits)
            entropy_out.append(torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1))  # [B, T]
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # [B, T]
    keep = loss_mask[:, 1:].any(dim=0).nonzero().squeeze(-1)  # [K] positions t whose t+1 is trained
    logits = fp32_at_least(
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
    )  # [B, K, V]
    picked = targets[:, keep]  # [B, K]
    kept = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), picked.reshape(-1), reduction="none")
    lp = torch.zeros(targets.shape, dtype=kept.dtype, device=kept.device)
    lp[:, keep] = kept.view(picked.shape)
    if entropy_out is not None:
        ent = torch.zeros_like(lp)
        ent[:, keep] = _entropies(logits.transpose(0, 1)).transpose(0, 1)  # chunks of positions
        entropy_out.append(torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1))  # [B, T]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # [B, T]


@torch.no_grad()
def logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    layout: Layout = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] token logprobs and [B, T] entropies of the predictive distribution, at masked positions."""
    out: list[torch.Tensor] = []
    lp = token_logprobs(model, input_ids, attention_mask, loss_mask, out, layout)
    return lp, out[0]


class TorchPolicy:
    """The ``torch`` policy backend (`models/interfaces.py: Policy`): the HF model itself, DDP-wrapped under
    torchrun; every rank is a data-parallel replica and holds the whole model."""

    export_is_collective = False
    sharded_checkpoints = False
    skips_nonfinite_updates = True  # train_step applies no update from NaN / inf gradients (trainer.on_nonfinite)
    fuses_old_logprobs = True  # `train_step(with_entropy=True)` returns the training pass's entropies
    distributed_rl = False  # the stage-2 loop runs it in one process (several: the megatron backend)

    def __init__(
        self,
        model: torch.nn.Module,
        trainer: TrainerConfig,
        dist: DistInfo,
        total_steps: int,
        gradient_checkpointing: bool = False,
    ):
        self.dist, self.device = dist, dist.device
        self.model = model.to(dist.device)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.module = self.model
        if dist.world_size > 1:
            ids = [dist.device.index] if dist.device.type == "cuda" else None
            # DDP wraps what the training forward calls: the position-gathering head where the model allows it
            self.model = DDP(PositionHead(self.model) if gathers(self.model) else self.model, device_ids=ids)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.mixed = any(p.dtype in LOW_PRECISION for p in self.params)
        # fp32 master weights for a low-precision model (the module docstring); the optimizer updates these
        self.master = (
            [torch.nn.Parameter(p.detach().float().clone()) for p in self.params] if self.mixed else self.params
        )
        self.optimizer = torch.optim.AdamW(
            self.master, lr=trainer.lr, betas=tuple(trainer.betas), weight_decay=trainer.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(trainer.schedule, trainer.warmup_steps, total_steps, trainer.min_lr_ratio)
        )
        self.grad_clip = trainer.grad_clip
        self.base_lr = trainer.lr
        # prefix-once passes (trainer.share_prefix): a model whose decoder and output layer are called apart (under
        # DDP inside its PositionHead) and whose cache keeps every key and value; with gradient checkpointing the
        # passes checkpoint their layers themselves (`shared_prefix._own_checkpointing`)
        self.share_prefix = trainer.share_prefix and gathers(self.module) and supports(self.module)
        # packed rows (trainer.pack_sequences): a model that gathers, and an attention that takes packed rows on this
        # device (`models/packed.py: packs`: a varlen kernel, or a dense block mask on CPU)
        attention = getattr(getattr(self.module, "config", None), "_attn_implementation", None)
        self.packs = (
            packs(dist.device.type, attention)
            if trainer.pack_sequences and gathers(self.module) and supports(self.module)
            else None
        )

    def layout(self, batch: MicroBatch) -> Layout:
        """How the micro-batch's forward runs: its prefix tree, its rows packed, or None (every row padded), the
        one of those this policy can run that runs the fewest positions (`data/packing.py: choose_layout`)."""
        return share_layout(batch.input_ids, batch.attention_mask, self.share_prefix, self.packs)

    @torch.no_grad()
    def logprobs(self, batch: MicroBatch, with_entropy: bool = False):
        """[B, T] logprobs at the masked positions (and entropies with ``with_entropy``), no gradient."""
        was_training = self.module.training
        self.module.eval()
        try:
            b = batch.to(self.dist.device)
            layout = self.layout(b)
            if with_entropy:
                lp, ent = logprobs_and_entropy(self.module, b.input_ids, b.attention_mask, b.loss_mask, layout)
                return lp.cpu(), ent.cpu()
            return token_logprobs(self.module, b.input_ids, b.attention_mask, b.loss_mask, layout=layout).cpu()
        finally:
            self.module.train(was_training)

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, num_valid_tokens: float, with_entropy: bool = False
    ) -> TrainStepResult:
        """One optimizer step over this rank's micro-batches (gradients synchronised once, at the last).

        ``with_entropy``: also return "entropy_sums", per micro-batch the [B] sums of the token entropies over
        its loss mask, from the training forward pass."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed:
            self.module.zero_grad(set_to_none=True)
        stats = []
        entropy_sums: list[torch.Tensor] = []
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if (last or not isinstance(self.model, DDP)) else self.model.no_sync()
            with sync:
                b = mb.to(self.dist.device)
                ent: list[torch.Tensor] | None = [] if with_entropy else None
                lp = token_logprobs(self.model, b.input_ids, b.attention_mask, b.loss_mask, ent, self.layout(b))
                if ent is not None:
                    entropy_sums.append((ent[0] * b.loss_mask).sum(1).double().cpu())
                loss, record = loss_fn(lp, b, num_valid_tokens)
                # DDP averages gradients over ranks; the loss is already normalised globally
                (loss * self.dist.world_size).backward()
            if self.mixed and not isinstance(self.model, DDP):
                self._gradients_to_master()  # fp32 accumulation over micro-batches
            stats.append(record)
        if self.mixed:
            self._gradients_to_master()  # under DDP: once, after the last micro-batch's reduction
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip if self.grad_clip > 0 else float("inf"))
        lr = self.scheduler.get_last_lr()[0]
        if not torch.isfinite(grad_norm):  # never an update from NaN / inf gradients (the loop stops or goes on)
            self.optimizer.zero_grad(set_to_none=True)
            return TrainStepResult(stats, float(grad_norm), lr, entropy_sums if with_entropy else None, skipped=True)
        self.optimizer.step()
        self.scheduler.step()
        if self.mixed:
            self._master_to_model()
        return TrainStepResult(stats, float(grad_norm), lr, entropy_sums if with_entropy else None)

    @torch.no_grad()
    def _gradients_to_master(self) -> None:
        """Add the model's gradients to the fp32 masters' and free them (foreach ops: a few kernels, not one
        per parameter)."""
        pairs = [(p, m) for p, m in zip(self.params, self.master) if p.grad is not None]
        fresh = [(p, m) for p, m in pairs if m.grad is None]
        more = [(p, m) for p, m in pairs if m.grad is not None]
        if fresh:
            grads = [torch.empty_like(m) for _, m in fresh]
            torch._foreach_copy_(grads, [p.grad for p, _ in fresh])  # bf16 -> fp32
            for (_, m), g in zip(fresh, grads):
                m.grad = g
        if more:
            torch._foreach_add_([m.grad for _, m in more], [p.grad for p, _ in more])  # fp32 += bf16
        for p, _ in pairs:
            p.grad = None

    @torch.no_grad()
    def _master_to_model(self) -> None:
        torch._foreach_copy_(self.params, self.master)  # fp32 -> bf16, rounded as copy_ rounds

    def master_weights(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates: fp32 masters for a low-precision model, else the parameters."""
        return list(self.master)

    def state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict()
        if self.mixed:  # the fp32 masters too, so that a resume continues from them rather than from rounded weights
            optimizer = {**optimizer, "master_weights": [m.detach().cpu().clone() for m in self.master]}
        return {"model": self.module.state_dict(), "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, model: dict, optimizer: dict, scheduler: dict) -> None:
        self.module.load_state_dict(model)
        optimizer = dict(optimizer)
        masters = optimizer.pop("master_weights", None)
        with torch.no_grad():
            if self.mixed:  # from the checkpoint's fp32 masters, or (older checkpoints) from the loaded weights
                for p, m, saved in zip(self.params, self.master, masters or [None] * len(self.master)):
                    m.copy_(saved if saved is not None else p.float())
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)
        # this run's schedule and learning rate from the restored step on: a resume that extends
        # trainer.max_steps (or changes trainer.lr) continues on the new schedule, not at the old one's
        # final (often zero) rate that the optimizer state carries
        self.scheduler.base_lrs = [self.base_lr for _ in self.optimizer.param_groups]
        for group, fn in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = self.base_lr * fn(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def data_parallel(self) -> tuple[DistInfo, Callable]:
        """Every rank is a replica: its own place, and a sum over all ranks."""
        return self.dist, lambda value: all_reduce_sum(value, self.dist)

    def sync_hf_model(self) -> torch.nn.Module:
        """The HF model itself (it holds the current weights; nothing to copy)."""
        return self.module

    @torch.no_grad()
    def frozen_reference(self) -> Callable[[MicroBatch], torch.Tensor]:
        """Logprobs of a frozen copy of the current weights, on the policy's device and in its dtype (batches
        come from CPU and go back)."""
        import copy

        reference = copy.deepcopy(self.module).eval().requires_grad_(False)
        device = next(reference.parameters()).device

        @torch.no_grad()
        def logprobs(batch: MicroBatch) -> torch.Tensor:
            b = batch.to(device)
            return token_logprobs(reference, b.input_ids, b.attention_mask, b.loss_mask, layout=self.layout(b)).cpu()

        return logprobs

    def save_sharded(self, directory) -> None:
        raise NotImplementedError("the torch backend's checkpoints are whole (sharded_checkpoints is False)")

    def export_meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What ``export_weights`` yields: names, shapes, dtypes, in order."""
        return [(name, tuple(t.shape), t.dtype) for name, t in self.module.state_dict().items()]

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (for the generator's weight sync), on the model's device."""
        for name, tensor in self.module.state_dict().items():
            yield name, tensor.detach()
