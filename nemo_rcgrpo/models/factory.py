"""Pick the policy backend from ``policy.backend`` (torch | megatron) with one call for both trainers."""

from __future__ import annotations

from typing import Callable

import torch

from nemo_rcgrpo.utils.checkpoint import checkpoint_tmp_dir, prepare_checkpoint, save_checkpoint
from nemo_rcgrpo.utils.dist import DistInfo, all_reduce_sum, barrier
from nemo_rcgrpo.utils.weight_stream import WeightStream


def make_policy(cfg, model: torch.nn.Module, dist: DistInfo, total_steps: int):
    """TorchPolicy or MegatronPolicy around ``model`` (an HF model with the reward tokens already added)."""
    if cfg.policy.backend == "megatron":
        from nemo_rcgrpo.models.megatron.policy import MegatronPolicy

        return MegatronPolicy(model, cfg, dist, total_steps)
    from nemo_rcgrpo.models.torch_policy import TorchPolicy

    return TorchPolicy(model, cfg.trainer, dist, total_steps, cfg.model.gradient_checkpointing)


def data_parallel(policy, dist: DistInfo) -> tuple[DistInfo, Callable]:
    """The data-parallel view the trainer splits batches by, and a sum over data-parallel replicas.

    Torch backend: every rank is a replica. Megatron: the TP x PP ranks of one replica share micro-batches.
    """
    if hasattr(policy, "data_parallel"):
        return policy.data_parallel()
    return dist, lambda value: all_reduce_sum(value, dist)


def hf_module(policy) -> torch.nn.Module | None:
    """The HF model holding the current weights (Megatron: synced onto rank 0; a collective; None elsewhere)."""
    if hasattr(policy, "sync_hf_model"):
        return policy.sync_hf_model()
    return policy.module


def make_reference(policy, model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """Reference logprobs [B, T] of the frozen initial weights (call before the first optimizer step).

    Torch: a frozen copy of the HF model, on the policy's device (batches come from CPU and go back). Megatron: a
    frozen second GPTModel sharded like the policy, so the reference costs 1/tp of a model per rank and its
    logprobs are vocab-parallel too.
    """
    if hasattr(policy, "frozen_reference"):
        return policy.frozen_reference()
    import copy

    from nemo_rcgrpo.models.torch_policy import token_logprobs

    reference = copy.deepcopy(policy.module).eval().requires_grad_(False)  # on the policy's device, in its dtype
    device = next(reference.parameters()).device

    @torch.no_grad()
    def logprobs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, attn, mask = (batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
        return token_logprobs(reference, ids, attn, mask).cpu()  # batches live on CPU between passes

    return logprobs


def sync_generator(policy, generator, backend: str, version: int) -> None:
    """Push the policy's weights to the generator (a collective with the megatron backend: every rank calls it).

    backend 'hf' with the torch policy shares the weights (nothing to do); with megatron, rank 0's HF copy
    receives ``export_weights()``. Other backends get a ``WeightStream`` on rank 0: the tensors are produced
    while the generator reads them (bucket by bucket, on the policy's device), and a generator that reads them
    again (a failed transfer redone through a folder) gets a fresh export, the other ranks taking part in each
    pass. Whatever the generator does, the export is finished before this returns, so no rank is left waiting.
    """
    if backend == "hf":
        if hasattr(policy, "sync_hf_model"):
            policy.sync_hf_model()
        return
    collective = getattr(policy, "export_is_collective", False)
    if not hasattr(policy, "export_meta"):  # a policy that cannot announce its tensors: list them first
        if generator is not None:
            generator.update_weights(WeightStream.of(policy.export_weights()), version)
        return
    meta = policy.export_meta()  # a collective on its first call with megatron
    if generator is None:  # the other ranks: each pass of rank 0's export, until rank 0 says it is over
        while collective:
            for _ in policy.export_weights():
                pass
            if not _next_pass(policy, None):
                return
        return
    stream = WeightStream(meta, policy.export_weights,
                          on_pass=(lambda k: _next_pass(policy, k > 0)) if collective else None)
    try:
        generator.update_weights(stream, version)
    finally:
        stream.close()


def _next_pass(policy, again: bool | None) -> bool:
    """Rank 0 tells every rank whether another export pass follows (``again``); the others learn it."""
    import torch.distributed as tdist

    flag = torch.tensor([int(bool(again))], device=getattr(policy, "device", None) or "cpu")
    tdist.broadcast(flag, src=0)
    return bool(flag.item())


def save_policy_checkpoint(policy, dist: DistInfo, run_dir, step: int, **kwargs) -> None:
    """Checkpoint ``step`` (every rank calls it). A backend with ``save_sharded`` (Megatron) first writes its
    shards from every rank into the checkpoint's temporary folder; rank 0 then adds the rest (``kwargs``: see
    ``save_checkpoint``) and moves the folder into place."""
    sd = policy.state_dict()  # a collective with the megatron backend
    sharded = hasattr(policy, "save_sharded")
    if sharded:
        if dist.is_main:
            prepare_checkpoint(run_dir, step)
        barrier(dist)
        policy.save_sharded(checkpoint_tmp_dir(run_dir, step) / sd["optimizer"]["dir"])
        barrier(dist)
    if dist.is_main:
        save_checkpoint(run_dir, step, model_state=sd["model"], optimizer_state=sd["optimizer"],
                        scheduler_state=sd["scheduler"], prepared=sharded, **kwargs)
    barrier(dist)
