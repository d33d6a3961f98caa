"""Pick the policy backend from ``policy.backend`` (torch | megatron) with one call for both trainers."""

from __future__ import annotations

from typing import Callable

import torch

from nemo_rcgrpo.utils.checkpoint import checkpoint_tmp_dir, prepare_checkpoint, save_checkpoint
from nemo_rcgrpo.utils.dist import DistInfo, all_reduce_sum, barrier


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
    receives ``export_weights()``; other backends get the HF-named tensors through ``update_weights``.
    """
    if backend == "hf":
        if hasattr(policy, "sync_hf_model"):
            policy.sync_hf_model()
        return
    weights = policy.export_weights()
    if generator is None:  # ranks without a generator still take part in the all-gathers, keeping nothing
        for _ in weights:
            pass
        return
    # rank 0 finishes the export before the generator sees it (every consumer holds it all anyway), so a
    # generator that fails cannot leave the other ranks waiting inside the collective
    generator.update_weights(list(weights), version)


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
