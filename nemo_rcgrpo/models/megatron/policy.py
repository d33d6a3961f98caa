"""MegatronPolicy: the Megatron-Core training backend behind the trainers' policy interface.

Same interface as ``TorchPolicy`` (``logprobs``, ``train_step``,
``export_weights``, ``state_dict``/``load_state_dict``), so the stage-1 and
stage-2 loops and the pure losses do not know which backend runs:

- the model is megatron-core's GPTModel (``builder.build_gpt``), loaded from
  the HF model by ``convert.hf_to_megatron``, wrapped in megatron's DDP, and
  trained by megatron's optimizer (distributed optimizer optional; bf16 with
  fp32 master weights when ``model.dtype=bfloat16``);
- per-token logprobs are computed vocab-parallel (``vocab_parallel_cross_entropy``
  for training, ``logprobs.vocab_parallel_logprobs`` for evaluation and
  entropies): the full vocabulary never sits on one rank. The loss function
  receives the gathered [B, T] values, exactly as with the torch backend;
- TP ranks of one data-parallel replica see the same micro-batches
  (``data_parallel`` gives the trainer the DP rank and size to split by);
- ``export_weights()`` streams HF-named full tensors (all-gathered over TP,
  one parameter at a time) for the generator's weight sync and for exports;
- checkpoints hold the model in HF names (the same ``model.pt`` as the torch
  backend) and each rank's optimizer state; resuming needs the same TP x DP
  layout (the model alone can be resumed at any layout).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as tdist

from nemo_rcgrpo.models.megatron.builder import MegatronSetupError, build_gpt, init_parallel, layer_spec, load_hf_state
from nemo_rcgrpo.models.megatron.convert import (ConversionError, ModelShape, check_tp, hf_to_megatron,
                                                 megatron_param_to_hf)
from nemo_rcgrpo.models.megatron.logprobs import mask_padded_vocab, vocab_parallel_logprobs
from nemo_rcgrpo.models.torch_policy import lr_lambda
from nemo_rcgrpo.utils.dist import DistInfo

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], float], "tuple[torch.Tensor, dict[str, float]]"]


class MegatronPolicy:
    def __init__(self, hf_model: torch.nn.Module, cfg, dist: DistInfo, total_steps: int):
        """hf_model: the HF model (reward tokens already added) that gives the shape and initial weights."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        m, t = cfg.policy.megatron, cfg.trainer
        self.dist, self.mcfg = dist, m
        hf_model.config.vocab_size = hf_model.get_input_embeddings().weight.shape[0]  # reward tokens included
        try:  # refuse a TP size that does not divide the heads before any process group exists
            check_tp(ModelShape.from_hf_config(hf_model.config), m.tp)
        except ConversionError as e:
            raise MegatronSetupError(f"policy.megatron.tp={m.tp}: {e}") from None
        self.spec = layer_spec(m)
        self.parallel = init_parallel(m.tp, m.pp, m.cp, cfg.seed)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
        self.hf_config, self.params_dtype = hf_model.config, dtype
        self.model, self.shape, self.config = build_gpt(hf_model.config, m, params_dtype=dtype)
        load_hf_state(self.model, hf_model.state_dict(), self.shape, m.tp, self.parallel.tp_rank, self.spec)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=m.grad_reduce_in_fp32, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=m.distributed_optimizer,
                                                   check_for_nan_in_grad=False)
        self.ddp = DistributedDataParallel(self.config, ddp_config, self.model)
        # clip_grad=0 would skip the norm; a huge threshold reports it without clipping (as the torch backend)
        opt = OptimizerConfig(optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0],
                              adam_beta2=t.betas[1], adam_eps=1e-8, clip_grad=t.grad_clip if t.grad_clip > 0 else 1e30,
                              bf16=dtype == torch.bfloat16, params_dtype=dtype,
                              use_distributed_optimizer=m.distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt, [self.ddp])
        self.base_lr = t.lr
        self.lr_at = lr_lambda(t.schedule, t.warmup_steps, total_steps, t.min_lr_ratio)
        self.optimizer_step = 0
        self.hf_model = hf_model if dist.is_main else None  # rank 0 keeps an HF copy for exports and rollouts
        if not dist.is_main:
            del hf_model

    # ------------------------------------------------------------------ parallel layout
    def data_parallel(self) -> tuple[DistInfo, Callable[[float], float]]:
        """(this rank's place among data-parallel replicas, a sum over them): TP ranks share micro-batches."""
        info = DistInfo(self.parallel.dp_rank, self.parallel.dp, self.dist.local_rank, self.dist.device)

        def reduce_sum(value: float) -> float:
            if self.parallel.dp == 1:
                return value
            x = torch.tensor([value], dtype=torch.float64, device=self.device)
            tdist.all_reduce(x, group=self.dp_group)
            return float(x.item())

        return info, reduce_sum

    # ------------------------------------------------------------------ forward
    def _forward_logits(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T, V_pad/tp] fp32 logits with the padded vocabulary at -inf."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        logits = model(input_ids, pos, None)  # causal; right padding never affects earlier positions
        return mask_padded_vocab(logits, self.shape.vocab_size, self.parallel.tp_rank)

    def _token_logprobs(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] log p(ids[:, t] | ids[:, <t]) with gradient (position 0 is 0), vocab-parallel."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        ids = batch["input_ids"]
        logits = self._forward_logits(model, ids)[:, :-1]  # [B, T-1, V/tp]
        lp = -vocab_parallel_cross_entropy(logits.contiguous(), ids[:, 1:].contiguous())  # [B, T-1]
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # [B, T]

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], with_entropy: bool = False):
        """[B, T] logprobs (and entropies with ``with_entropy``) of the current weights, no gradient."""
        self.model.eval()
        try:
            ids = batch["input_ids"].to(self.device)
            logits = self._forward_logits(self.model, ids)[:, :-1]
            out = vocab_parallel_logprobs(logits, ids[:, 1:], self.parallel.tp_rank, self.tp_group, with_entropy)
            pad = lambda x: torch.cat([torch.zeros_like(x[:, :1]), x], dim=1).float().cpu()  # noqa: E731
            return (pad(out[0]), pad(out[1])) if with_entropy else pad(out)
        finally:
            self.model.train()

    # ------------------------------------------------------------------ training
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], loss_fn: LossFn,
                   num_valid_tokens: float) -> dict[str, float]:
        """One optimizer step over this replica's micro-batches; the loss is normalised globally by the caller."""
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.base_lr * self.lr_at(self.optimizer_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for mb in micro_batches:
            b = {k: v.to(self.device) for k, v in mb.items()}
            lp = self._token_logprobs(self.ddp, b)
            loss, metrics = loss_fn(lp, b, num_valid_tokens)
            # megatron DDP averages gradients over DP replicas; the loss is already normalised over all of them
            (loss * self.parallel.dp).backward()
            loss_sum += loss.item()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
        self.ddp.finish_grad_sync()
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("the optimizer step was skipped (non-finite gradients)")
        self.optimizer_step += 1
        return {"loss_local": loss_sum, "grad_norm": float(grad_norm or 0.0), "lr": lr, **totals}

    @property
    def module(self) -> torch.nn.Module | None:
        """Rank 0's HF model (the in-process generator's model; current after ``sync_hf_model``), None elsewhere."""
        return self.hf_model

    def frozen_reference(self) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        """Logprobs of a frozen copy of the current weights: a second GPTModel sharded like the policy."""
        reference, _, _ = build_gpt(self.hf_config, self.mcfg, params_dtype=self.params_dtype)
        with torch.no_grad():
            target = reference.state_dict(keep_vars=True)
            for name, value in self.model.state_dict().items():
                if target[name] is not None and torch.is_tensor(value):
                    target[name].copy_(value)
        reference.eval().requires_grad_(False)

        @torch.no_grad()
        def logprobs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            ids = batch["input_ids"].to(self.device)
            logits = self._forward_logits(reference, ids)[:, :-1]
            lp = vocab_parallel_logprobs(logits, ids[:, 1:], self.parallel.tp_rank, self.tp_group)
            return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1).float().cpu()

        return logprobs

    # ------------------------------------------------------------------ weights out
    @torch.no_grad()
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one Megatron parameter at a time (a collective: every rank iterates)."""
        tp = self.parallel.tp
        for name, param in self.model.state_dict().items():
            if name.endswith("_extra_state") or name.endswith("inv_freq"):
                continue
            shard = param.detach().contiguous()
            shards = [torch.empty_like(shard) for _ in range(tp)]
            if tp > 1:
                tdist.all_gather(shards, shard, group=self.tp_group)
            else:
                shards = [shard]
            for hf_name, tensor in megatron_param_to_hf(name, [s.cpu() for s in shards], self.shape, self.spec):
                yield hf_name, tensor

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
        """A collective. model: HF names, full tensors (as the torch backend); optimizer: every rank's state."""
        model = {k: v.clone() for k, v in self.export_weights()}
        mine = {"layout": [self.parallel.tp, self.parallel.dp], "state": self._optimizer_state()}
        world = tdist.get_world_size()
        gathered = [None] * world if self.dist.is_main else None
        tdist.gather_object(mine, gathered, dst=0)
        return {"model": model, "optimizer": {"backend": "megatron", "ranks": gathered},
                "scheduler": {"optimizer_step": self.optimizer_step}}

    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _optimizer_state(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.mcfg.distributed_optimizer:  # this rank's shard of main params and Adam moments (not in state_dict())
            state["shards"] = [[{k: v.detach().clone().cpu() for k, v in o._get_main_param_and_optimizer_states(p).items()}
                                for p in o.model_param_group_index_map] for o in self._optimizers()]
        return state

    def load_state_dict(self, model: dict, optimizer: dict, scheduler: dict) -> None:
        mine = hf_to_megatron(model, self.shape, self.parallel.tp, self.spec)[self.parallel.tp_rank]
        with torch.no_grad():
            params = dict(self.model.state_dict(keep_vars=True))
            for name, value in mine.items():
                params[name].copy_(value)
        if optimizer.get("backend") != "megatron":
            raise MegatronSetupError("this checkpoint's optimizer state comes from the torch backend; resume with "
                                     "policy.backend=torch, or start a new run_dir (trainer.resume=false)")
        ranks = optimizer["ranks"]
        rank = tdist.get_rank()
        layout = [self.parallel.tp, self.parallel.dp]
        if len(ranks) != tdist.get_world_size() or ranks[rank]["layout"] != layout:
            raise MegatronSetupError(f"checkpoint written with tp x dp = {ranks[0]['layout']} on {len(ranks)} ranks; "
                                     f"resume with the same layout (now {layout})")
        state = ranks[rank]["state"]
        self.optimizer.load_state_dict(state["optimizer"])
        if "shards" in state:
            with torch.no_grad():  # fp32 main params are views of the model's own (leaf) parameters
                for o, shards in zip(self._optimizers(), state["shards"]):
                    for p, tensors in zip(o.model_param_group_index_map, shards):
                        o._set_main_param_and_optimizer_states(p, tensors)
                    # megatron's placeholder states share one 'step' tensor between parameters; Adam increments it
                    # per parameter, so each needs its own
                    for st in o.optimizer.state.values():
                        if torch.is_tensor(st.get("step")):
                            st["step"] = st["step"].clone()
        self.optimizer_step = scheduler["optimizer_step"]
        if self.hf_model is not None:
            self.hf_model.load_state_dict(model, strict=False)
