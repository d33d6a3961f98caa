"""Weights out of a Megatron-Core model: HF-named full tensors streamed to global rank 0, for the generator's weight
sync, checkpoints' HF copy and exports (`MegatronPolicy.export_weights`).

Each pipeline stage gathers its TP-split weights to its first TP rank in flat buckets (one gather per bucket; the
norms, whole on every TP rank, are not gathered); with PP > 1 each later stage's first TP rank sends its HF tensors
to rank 0 in flat buckets (one send per bucket), while rank 0 yields its own stage's. No rank but 0 holds more than
a bucket beyond its own weights.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as tdist

from nemo_rcgrpo.models.megatron.convert import (
    ConversionError,
    global_layer_name,
    hf_meta,
    is_weight,
    megatron_param_to_hf,
    replicated_over_tp,
    stage_layers,
)
from nemo_rcgrpo.utils.dist import DistInfo
from nemo_rcgrpo.utils.weight_stream import nbytes, plan_buckets

EXPORT_BUCKET_BYTES = 256 << 20  # per TP gather and per pipeline transfer of export_weights


class WeightExporter:
    """The export of one rank's model shard (``model``: its megatron GPTModel stage; ``parallel``: its TP / PP / DP
    place; the groups: megatron's TP and PP process groups)."""

    def __init__(
        self,
        model: torch.nn.Module,
        shape,
        parallel,
        spec: str,
        tp_group,
        pp_group,
        dist: DistInfo,
        device: torch.device,
    ):
        self.model, self.shape, self.parallel, self.spec = model, shape, parallel, spec
        self.tp_group, self.pp_group, self.dist, self.device = tp_group, pp_group, dist, device
        self._export_meta_cache: dict[int, list] | None = None  # each stage's HF meta (export_meta)

    def _stage_params(self) -> list[tuple[str, torch.Tensor]]:
        """This stage's weights in export order: (global Megatron name, this rank's shard). A tied model's
        ``output_layer.weight`` (the last stage's copy of the embedding at PP > 1) is left out."""
        offset = stage_layers(self.shape.num_layers, self.parallel.pp, self.parallel.pp_rank).start
        return [
            (global_layer_name(name, offset), param.detach())
            for name, param in self.model.state_dict().items()
            if is_weight(name) and not (name == "output_layer.weight" and self.shape.tied_embeddings)
        ]

    def _stage_meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [
            m
            for name, local in self._stage_params()
            for m in hf_meta(name, local, self.parallel.tp, self.shape, self.spec)
        ]

    def export_meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
        """What ``export_weights`` yields on global rank 0 (HF names, shapes, dtypes, in order); None on other
        ranks. A collective on the first call only: each later stage's first TP rank sends its part once."""
        stages = self._stage_metas()
        return [m for stage in range(self.parallel.pp) for m in stages[stage]] if self.dist.rank == 0 else None

    def _stage_metas(self) -> dict[int, list]:
        """``_gather_meta``, once per policy (a collective on the first call only)."""
        if self._export_meta_cache is None:
            self._export_meta_cache = self._gather_meta()
        return self._export_meta_cache

    def _gather_meta(self) -> dict[int, list]:
        """{stage: its HF meta} on rank 0, {own stage: meta} on a later stage's first TP rank, {} elsewhere."""
        par = self.parallel
        if par.dp_rank != 0 or par.tp_rank != 0:
            return {}
        mine = self._stage_meta()
        if par.pp == 1:
            return {0: mine}
        if par.pp_rank > 0:
            tdist.send_object_list([mine], dst=0)
            return {par.pp_rank: mine}
        stages = {0: mine}
        for stage in range(1, par.pp):
            box = [None]
            tdist.recv_object_list(box, src=tdist.get_global_rank(self.pp_group, stage))
            stages[stage] = box[0]
        return stages

    @torch.no_grad()
    def export_weights(self, bucket_bytes: int = EXPORT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, on global rank 0 only, on its device (a GPU's stay there), stage by stage.

        A collective over data-parallel replica 0 (the other replicas hold the same weights and return at once).
        Each stage gathers its TP-split weights to its first TP rank in flat buckets of up to ``bucket_bytes``
        (one gather per bucket; the norms, whole on every TP rank, are not gathered). With PP > 1 the first TP
        rank of each later stage sends its HF tensors to rank 0 in flat buckets (one send per bucket), while
        rank 0 yields its own stage's; no other rank holds more than a bucket beyond its own weights.
        """
        par = self.parallel
        if par.dp_rank != 0:
            return
        stages = self._stage_metas()
        mine = self._stage_hf(bucket_bytes)
        if self.dist.rank == 0:
            yield from mine
            for stage in range(1, par.pp):
                yield from self._receive_stage(stages[stage], tdist.get_global_rank(self.pp_group, stage), bucket_bytes)
        elif par.pp_rank > 0 and par.pp_rank in stages:  # this later stage's first TP rank
            self._send_stage(stages[par.pp_rank], mine, bucket_bytes)
        else:
            for _ in mine:  # the other TP ranks take part in the gathers
                pass

    def _stage_hf(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's HF tensors on its first TP rank (nothing on the others), gathered in flat buckets."""
        tp, params = self.parallel.tp, self._stage_params()
        split = [not replicated_over_tp(name, self.spec) and tp > 1 for name, _ in params]
        sizes = [(t.numel() * t.element_size() * tp, t.dtype) for _, t in params]
        first = self.parallel.tp_rank == 0
        dst = tdist.get_global_rank(self.tp_group, 0) if tp > 1 else 0
        for start, end in plan_buckets(sizes, bucket_bytes):
            gathered = shards = None  # the previous bucket's buffers go before this one's are made
            sharded = [params[i][1].reshape(-1) for i in range(start, end) if split[i]]
            if sharded:
                flat = torch.cat(sharded) if len(sharded) > 1 else sharded[0].contiguous()
                gathered = [torch.empty_like(flat) for _ in range(tp)] if first else None
                tdist.gather(flat, gathered, dst=dst, group=self.tp_group)
            if not first:
                continue
            offset = 0
            for i in range(start, end):
                name, local = params[i]
                shards = [local]
                if split[i]:
                    n = local.numel()
                    shards = [g[offset : offset + n].view(local.shape) for g in gathered]
                    offset += n
                yield from megatron_param_to_hf(name, shards, self.shape, self.spec)

    def _send_stage(self, meta, tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
        for start, end in plan_buckets([(nbytes(s, d), d) for _, s, d in meta], bucket_bytes):
            parts = [next(tensors)[1].reshape(-1) for _ in range(start, end)]
            tdist.send(torch.cat(parts) if len(parts) > 1 else parts[0].contiguous(), dst=0)
        for _ in tensors:  # nothing is left: the meta covers the stage
            raise ConversionError("a pipeline stage exported more tensors than it announced")

    def _receive_stage(self, meta, src: int, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        for start, end in plan_buckets([(nbytes(s, d), d) for _, s, d in meta], bucket_bytes):
            flat = torch.empty(
                sum(math.prod(s) for _, s, _ in meta[start:end]), dtype=meta[start][2], device=self.device
            )
            tdist.recv(flat, src=src)
            offset = 0
            for name, shape, _ in meta[start:end]:
                n = math.prod(shape)
                yield name, flat[offset : offset + n].view(shape)
                offset += n
