"""MegatronPolicy: the Megatron-Core training backend behind the trainers' policy interface.

Same interface as ``TorchPolicy`` (``logprobs``, ``train_step``,
``export_weights``, ``state_dict``/``load_state_dict``), so the stage-1 and
stage-2 loops and the pure losses do not know which backend runs:

- the model is megatron-core's GPTModel (``builder.build_gpt``), loaded from
  the HF model by ``convert.hf_to_megatron``, wrapped in megatron's DDP, and
  trained by megatron's optimizer (distributed optimizer optional; bf16 with
  fp32 master weights when ``model.dtype=bfloat16``);
- per-token logprobs are computed vocab-parallel (megatron's
  ``vocab_parallel_cross_entropy``, in training and for old / reference
  logprobs alike, so the first update's ratio is exactly 1;
  ``logprobs.vocab_parallel_logprobs`` for entropies): the full vocabulary
  never sits on one rank. The loss function
  receives the gathered [B, T] values, exactly as with the torch backend;
- TP ranks of one data-parallel replica see the same micro-batches
  (``data_parallel`` gives the trainer the DP rank and size to split by);
- ``export_weights()`` streams HF-named full tensors to global rank 0 (gathered
  over TP and sent between pipeline stages in flat buckets, on the device) for
  the generator's weight sync and for exports;
- pipeline parallelism runs megatron's 1F1B schedule (``_schedule``); stage
  outputs are exchanged point to point, the last stage computes the loss, and
  metrics and logprobs are broadcast back over the pipeline group;
- checkpoints hold the model in HF names (the same ``model.pt`` as the torch
  backend, for evaluation and exports) and a megatron ``dist_checkpointing``
  folder (``checkpointing.py``) with the model and optimizer state, which
  resumes at any TP x PP x DP layout (with the same optimizer kind:
  distributed or not).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as tdist

from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.data.packing import DENSE, FlatRow, Layout, Packed, flat_row
from nemo_rcgrpo.models.interfaces import LossFn, TrainStepResult
from nemo_rcgrpo.models.megatron.builder import (
    MegatronSetupError,
    build_gpt,
    init_parallel,
    load_hf_state,
    platform_flags,
)
from nemo_rcgrpo.models.megatron.checkpointing import CheckpointLayoutError, load_sharded, save_sharded, saved_metadata
from nemo_rcgrpo.models.megatron.convert import ConversionError, ModelShape, check_tp, stage_layers
from nemo_rcgrpo.models.megatron.export import EXPORT_BUCKET_BYTES, WeightExporter
from nemo_rcgrpo.models.megatron.flags import padded_length
from nemo_rcgrpo.models.megatron.layouts import rotary_at
from nemo_rcgrpo.models.megatron.logprobs import mask_padded_vocab, vocab_parallel_logprobs
from nemo_rcgrpo.models.shared_prefix import share_layout
from nemo_rcgrpo.models.torch_policy import lr_lambda
from nemo_rcgrpo.utils.dist import DistInfo, all_reduce_sum

log = logging.getLogger(__name__)
SHARDED_DIR = "megatron"  # the sharded checkpoint's folder inside a checkpoint step_N/


def pad_micro_batches(batches: list[MicroBatch], same_shape: bool = True, multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches padded at the right (`MicroBatch.padded`): to one [B, T] shape with ``same_shape`` (pipeline
    stages exchange fixed-shape activations), and each length to a multiple of ``multiple`` (FP8 GEMMs, sequence
    parallel)."""
    rows = max(b.rows for b in batches)
    length = padded_length(max(b.length for b in batches), multiple)
    return [
        b.padded(rows, length) if same_shape else b.padded(b.rows, padded_length(b.length, multiple)) for b in batches
    ]


class MegatronPolicy:
    sharded_checkpoints = True  # dist_checkpointing folders, written by every rank (save_sharded)
    # megatron-core applies non-finite gradients without a grad scaler (bf16 / fp32): it skips only under fp16's
    skips_nonfinite_updates = False
    fuses_old_logprobs = False  # old logprobs and entropies come from a pass of their own
    share_prefix, packs = False, None  # set per run: flat rows where `flags.flat_rows_off` allows
    distributed_rl = True  # TP x PP x DP under torchrun

    def __init__(self, hf_model: torch.nn.Module, build, dist: DistInfo, total_steps: int):
        """hf_model: the HF model (reward tokens already added) that gives the shape and initial weights; build: the
        sections it reads (`nemo_rcgrpo.config.PolicyBuild`: policy.megatron, trainer, dtype, seed)."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        m, t = build.policy.megatron, build.trainer
        self.dist, self.mcfg = dist, m
        hf_model.config.vocab_size = hf_model.get_input_embeddings().weight.shape[0]  # reward tokens included
        try:  # refuse TP / PP sizes that do not divide the heads / layers before any process group exists
            check_tp(ModelShape.from_hf_config(hf_model.config), m.tp)
        except ConversionError as e:
            raise MegatronSetupError(f"policy.megatron.tp={m.tp}: {e}") from None
        try:
            stage_layers(hf_model.config.num_hidden_layers, m.pp, 0)
        except ConversionError as e:
            raise MegatronSetupError(f"policy.megatron.pp={m.pp}: {e}") from None
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[build.dtype]
        replicas = max(1, dist.world_size // (m.tp * m.pp * m.cp))
        self.flags = platform_flags(m, dtype, replicas)  # every device-dependent choice (flags.py)
        self.spec = self.flags.spec
        # prefix trees and packed rows as one flat row (trainer.share_prefix / pack_sequences), where the platform
        # runs them (`flags.flat_rows_off`: the local spec on the CPU); a dense mask, as sdpa's on the CPU
        self.share_prefix = bool(t.share_prefix and self.flags.flat_rows)
        self.packs = DENSE if t.pack_sequences and self.flags.flat_rows else None
        if (t.share_prefix or t.pack_sequences) and not self.flags.flat_rows and dist.is_main:
            log.info(
                "every micro-batch runs padded (trainer.share_prefix / pack_sequences are not used here): %s",
                self.flags.flat_rows_off,
            )
        self.parallel = init_parallel(m.tp, m.pp, m.cp, build.seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank of this pipeline's last stage
        self.hf_config, self.params_dtype = hf_model.config, dtype
        self.model, self.shape, self.config = build_gpt(hf_model.config, m, params_dtype=dtype, flags=self.flags)
        load_hf_state(self.model, hf_model.state_dict(), self.shape, self.parallel, self.spec)
        self.ddp = DistributedDataParallel(self.config, DistributedDataParallelConfig(**self.flags.ddp), self.model)
        if self.flags.ddp[
            "overlap_grad_reduce"
        ]:  # the schedule holds gradient reduction back until the last micro-batch
            self.config.no_sync_func = self.ddp.no_sync
        # clip_grad=0 would skip the norm; a huge threshold reports it without clipping (as the torch backend)
        opt = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.betas[0],
            adam_beta2=t.betas[1],
            adam_eps=1e-8,
            clip_grad=t.grad_clip if t.grad_clip > 0 else 1e30,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=m.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt, [self.ddp], **self.flags.optimizer)
        self.base_lr = t.lr
        self.export_bucket_bytes = EXPORT_BUCKET_BYTES
        self.exporter = WeightExporter(
            self.model, self.shape, self.parallel, self.spec, self.tp_group, self.pp_group, dist, self.device
        )
        self.lr_at = lr_lambda(t.schedule, t.warmup_steps, total_steps, t.min_lr_ratio)
        self.optimizer_step = 0
        # rank 0 keeps an HF copy for exports and rollouts (an in-process generator moves it to its device)
        self.hf_model = hf_model if dist.is_main else None
        if not dist.is_main:
            del hf_model

    def layout(self, batch: MicroBatch) -> Layout:
        """How ``batch`` runs: its prefix tree or packed rows as one flat row where that runs the fewest positions
        (`data/packing.py: choose_layout`, as the torch backend), else padded. With pipeline stages (one activation
        shape for every micro-batch) a batch that would run padded runs as packed rows instead, so that a step's
        micro-batches are all flat rows or all padded."""
        layout = share_layout(batch.input_ids, batch.attention_mask, self.share_prefix, self.packs)
        if layout is None and self.parallel.pp > 1 and (self.share_prefix or self.packs):
            lengths = batch.attention_mask.sum(1)
            if torch.equal(
                batch.attention_mask.bool(), torch.arange(batch.length, device=lengths.device)[None] < lengths[:, None]
            ) and bool((lengths > 0).all()):
                layout = Packed(tuple(lengths.tolist()))
        return layout

    # ------------------------------------------------------------------ parallel layout
    def data_parallel(self) -> tuple[DistInfo, Callable]:
        """(this rank's place among data-parallel replicas, a sum over them of a float or, elementwise, of a
        tensor): the TP and PP ranks of a replica share micro-batches."""
        info = DistInfo(self.parallel.dp_rank, self.parallel.dp, self.dist.local_rank, self.dist.device)
        return info, lambda value: all_reduce_sum(value, info, group=self.dp_group)

    # ------------------------------------------------------------------ forward
    def _schedule(
        self,
        model,
        batches: list[MicroBatch],
        on_logits: Callable[[torch.Tensor, MicroBatch], torch.Tensor],
        forward_only: bool,
    ) -> None:
        """Run micro-batches through megatron's schedule (1F1B across pipeline stages; a plain loop at PP=1).

        ``on_logits(logits, batch)`` runs on the last stage with this rank's [B, T, V_pad/tp] fp32 logits (padded
        vocabulary at -inf) and returns the micro-batch's loss; megatron's schedule divides it by the number of
        micro-batches, so it is handed back multiplied by that number.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        flats = [self._flat(b) for b in batches]
        if self.parallel.pp > 1 and None in flats:  # stages exchange one shape: all flat rows or all padded
            flats = [None] * len(batches)
        batches = [b.to(self.device) for b in batches]
        n = len(batches)
        if flats[0] is not None:
            # one flat row per micro-batch (batch 1), padded to the longest with pipeline stages
            length = max(f.length for f in flats) if self.parallel.pp > 1 else None
            flats = [(f.padded(length) if length else f).to(self.device) for f in flats]
            rows, seq = 1, max(f.length for f in flats)
        else:
            if self.parallel.pp > 1 or self.flags.token_multiple > 1:  # fixed-shape stage exchange; FP8 / SP lengths
                batches = pad_micro_batches(
                    batches, same_shape=self.parallel.pp > 1, multiple=self.flags.token_multiple
                )
            rows, seq = batches[0].input_ids.shape

        def forward_step(data_iterator, module):
            b, flat = next(data_iterator)
            if flat is None:
                ids = b.input_ids
                pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
                output = module(ids, pos, None)  # causal; right padding never affects earlier positions
            else:  # every token sees its own path, at its own row's positions (`layouts.py`)
                with rotary_at(module, flat.positions):
                    output = module(flat.ids[None], flat.positions[None], flat.blocked[None, None])

            def loss_func(logits: torch.Tensor):
                if flat is not None:  # [1, N, V/tp] -> the padded micro-batch's [B, T, V/tp] grid
                    logits = logits[0][flat.index]
                masked = mask_padded_vocab(logits, self.shape.vocab_size, self.parallel.tp_rank)
                return on_logits(masked, b) * n, {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(list(zip(batches, flats))),
            model=model,
            num_microbatches=n,
            seq_length=seq,
            micro_batch_size=rows,
            forward_only=forward_only,
        )

    def _flat(self, batch: MicroBatch) -> FlatRow | None:
        """``batch``'s flat row (`data/packing.py: flat_row`), None where it runs padded."""
        layout = self.layout(batch)
        return None if layout is None else flat_row(layout, batch.input_ids.cpu())

    def _from_last_stage(self, value):
        """A picklable value computed on the last pipeline stage, on every stage."""
        if self.parallel.pp == 1:
            return value
        box = [value]
        tdist.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
        return box[0]

    @torch.no_grad()
    def _evaluate(self, model, batch: MicroBatch, with_entropy: bool):
        """[B, T] logprobs (and entropies) of ``model``, vocab-parallel, on every rank; position 0 is 0."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        ids = batch.input_ids
        found: list[torch.Tensor] = []

        def on_logits(logits: torch.Tensor, b: MicroBatch) -> torch.Tensor:
            rows, length = ids.shape  # pipeline padding may add rows and positions; they are dropped here
            logits, targets = logits[:rows, : length - 1], b.input_ids[:rows, 1:length]
            ent = (
                vocab_parallel_logprobs(logits, targets, self.parallel.tp_rank, self.tp_group, True)[1]
                if with_entropy
                else None
            )
            # the training path's function, so that old logprobs equal the first update's (ratio 1, KL 0; exactly
            # where the shapes match: at PP > 1 training pads micro-batches, which on a GPU may change rounding);
            # it works in place on the logits (a contiguous slice is the logits themselves), so it comes last
            lp = -vocab_parallel_cross_entropy(logits.contiguous(), targets.contiguous())
            found.append(torch.stack([lp, ent]) if with_entropy else lp.unsqueeze(0))
            return logits.new_zeros(())

        was_training = model.training
        model.eval()
        try:
            self._schedule(model, [batch], on_logits, forward_only=True)
        finally:
            model.train(was_training)
        values = found[0].float() if found else torch.empty(2 if with_entropy else 1, ids.shape[0], ids.shape[1] - 1)
        if self.parallel.pp > 1:
            values = values.to(self.device)
            tdist.broadcast(values, src=self.pp_last_rank, group=self.pp_group)
        values = torch.cat([torch.zeros_like(values[..., :1]), values], dim=-1).cpu()
        return (values[0], values[1]) if with_entropy else values[0]

    def logprobs(self, batch: MicroBatch, with_entropy: bool = False):
        """[B, T] logprobs (and entropies with ``with_entropy``) of the current weights, no gradient."""
        return self._evaluate(self.model, batch, with_entropy)

    # ------------------------------------------------------------------ training
    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, num_valid_tokens: float) -> TrainStepResult:
        """One optimizer step over this replica's micro-batches; the loss is normalised globally by the caller."""
        self.ddp.train()
        lr = self.base_lr * self.lr_at(self.optimizer_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stats = self.backward(micro_batches, loss_fn, num_valid_tokens)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # megatron-core found NaN / inf gradients and applied no update: the loop stops or goes on
            return TrainStepResult(stats, float("nan"), lr, skipped=True)
        self.optimizer_step += 1
        return TrainStepResult(stats, float(grad_norm or 0.0), lr)

    def backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn, num_valid_tokens: float) -> list:
        """The gradients of this replica's micro-batches, reduced over replicas into each parameter's ``main_grad``
        (no optimizer step); returns the loss function's records, from the last pipeline stage, on every rank."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = []

        def on_logits(logits: torch.Tensor, b: MicroBatch) -> torch.Tensor:
            ids = b.input_ids
            lp = -vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), ids[:, 1:].contiguous())  # [B, T-1]
            lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # [B, T]
            loss, record = loss_fn(lp, b, num_valid_tokens)
            stats.append(record)
            # megatron DDP averages gradients over DP replicas; the loss is already normalised over all of them
            return loss * self.parallel.dp

        if micro_batches:  # a replica left without micro-batches (e.g. groups dropped) still joins the reductions
            self._schedule(self.ddp, micro_batches, on_logits, forward_only=False)
        elif self.flags.ddp["overlap_grad_reduce"]:
            self.ddp.start_grad_sync()  # no backward ran to start it; the other replicas wait for this one's zeros
        # DP gradient reduction, and the sum of the tied embedding's gradients across first and last stages
        finalize_model_grads([self.ddp])
        return self._from_last_stage(stats)

    @property
    def module(self) -> torch.nn.Module | None:
        """Rank 0's HF model (the in-process generator's model; current after ``sync_hf_model``), None elsewhere."""
        return self.hf_model

    def frozen_reference(self) -> Callable[[MicroBatch], torch.Tensor]:
        """Logprobs of a frozen copy of the current weights: a second GPTModel sharded like the policy."""
        reference, _, _ = build_gpt(self.hf_config, self.mcfg, params_dtype=self.params_dtype, flags=self.flags)
        with torch.no_grad():
            target = reference.state_dict(keep_vars=True)
            for name, value in self.model.state_dict().items():
                if target[name] is not None and torch.is_tensor(value):
                    target[name].copy_(value)
        reference.eval().requires_grad_(False)

        def logprobs(batch: MicroBatch) -> torch.Tensor:
            return self._evaluate(reference, batch, with_entropy=False)

        return logprobs

    # ------------------------------------------------------------------ weights out
    @property
    def export_is_collective(self) -> bool:
        return self.dist.world_size > 1

    def export_meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
        """What ``export_weights`` yields on global rank 0 (HF names, shapes, dtypes, in order); None on other
        ranks (`export.WeightExporter.export_meta`)."""
        return self.exporter.export_meta()

    def export_weights(self, bucket_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, on global rank 0 only, in flat buckets of up to ``bucket_bytes`` (default
        ``export_bucket_bytes``): `export.WeightExporter.export_weights`."""
        return self.exporter.export_weights(bucket_bytes or self.export_bucket_bytes)

    def sync_hf_model(self) -> torch.nn.Module | None:
        """Copy the current weights into rank 0's HF model (a collective); returns it on rank 0, None elsewhere."""
        target = dict(self.hf_model.state_dict()) if self.hf_model is not None else None
        for name, tensor in self.export_weights():
            if target is not None:
                target[name].copy_(tensor.to(target[name].dtype))
        if self.hf_model is not None and self.shape.tied_embeddings:
            self.hf_model.tie_weights()
        return self.hf_model

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A collective. model: HF names, full tensors, on rank 0 only (as the torch backend: evaluation and
        exports read it at any layout); optimizer: a pointer to the folder inside the checkpoint that
        ``save_sharded`` writes."""
        model = {}
        for name, tensor in self.export_weights():  # every rank takes part; rank 0 gets the full model
            model[name] = tensor.to("cpu", copy=True)
        return {
            "model": model,
            "optimizer": {"backend": "megatron", "format": "dist_checkpointing", "dir": SHARDED_DIR},
            "scheduler": {"optimizer_step": self.optimizer_step},
        }

    def save_sharded(self, directory: Path) -> None:
        """A collective: megatron ``dist_checkpointing`` of the model and optimizer state (any layout on load)."""
        save_sharded(self.ddp, self.optimizer, directory, {"optimizer_step": self.optimizer_step, "spec": self.spec})

    def load_state_dict(self, model: dict, optimizer: dict, scheduler: dict) -> None:
        """A collective. Weights and optimizer state come from the sharded checkpoint (``optimizer['path']``),
        which reshards to this run's TP x PP x DP; ``model`` (the HF-named copy) is not needed."""
        if optimizer.get("backend") != "megatron":
            raise MegatronSetupError(
                "this checkpoint's optimizer state comes from the torch backend; resume with "
                "policy.backend=torch, or start over (a new run_dir, or trainer.resume=false overwrite=true)"
            )
        if optimizer.get("format") != "dist_checkpointing" or "path" not in optimizer:
            raise MegatronSetupError(
                "this checkpoint has no sharded Megatron state (written by an older version); "
                "start over from its model (a new run_dir, or trainer.resume=false overwrite=true)"
            )
        # the local and Transformer Engine specs name their tensors differently (TE fuses the norms into the linears)
        was = saved_metadata(Path(optimizer["path"]))["metadata"].get("spec", "local")
        if was != self.spec:
            raise MegatronSetupError(
                f"this checkpoint was saved with the {was!r} layer spec and this run builds "
                f"{self.spec!r}: resume with policy.megatron.spec={was}"
            )
        try:
            load_sharded(self.ddp, self.optimizer, Path(optimizer["path"]))
        except CheckpointLayoutError as e:
            raise MegatronSetupError(str(e)) from None
        self.optimizer_step = scheduler["optimizer_step"]
        self.sync_hf_model()  # rank 0's HF copy (the in-process generator's model) follows the loaded weights
