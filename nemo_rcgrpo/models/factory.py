"""The policy backends, registered by name (kind ``policy_backend``, setting ``policy.backend``: torch | megatron |
a plugin's), and what the training loops do with any of them through the `Policy` seam (`models/interfaces.py`):
weight sync to a generator and checkpoints (the loops call the Policy's own methods for the rest)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nemo_rcgrpo.models.interfaces import Policy
from nemo_rcgrpo.registry import check_part, lookup, register
from nemo_rcgrpo.utils.checkpoint import checkpoint_tmp_dir, prepare_checkpoint, save_checkpoint
from nemo_rcgrpo.utils.dist import DistInfo, barrier
from nemo_rcgrpo.utils.weight_stream import WeightStream

if TYPE_CHECKING:
    from nemo_rcgrpo.config import PolicyBuild


@register("policy_backend", "torch")
def torch_backend(build: PolicyBuild, model: torch.nn.Module, dist: DistInfo, total_steps: int) -> Policy:
    """One process, or torchrun DDP (gloo on CPU, NCCL on GPU): `models/torch_policy.py`."""
    from nemo_rcgrpo.models.torch_policy import TorchPolicy

    return TorchPolicy(model, build.trainer, dist, total_steps, build.gradient_checkpointing)


@register("policy_backend", "megatron")
def megatron_backend(build: PolicyBuild, model: torch.nn.Module, dist: DistInfo, total_steps: int) -> Policy:
    """Megatron-Core TP x PP x DP (`models/megatron/policy.py`); ``policy.megatron`` says how."""
    from nemo_rcgrpo.models.megatron.policy import MegatronPolicy

    return MegatronPolicy(model, build, dist, total_steps)


def _check_megatron(cfg) -> None:
    """``policy.megatron``'s settings against the run (a TrainConfig), checked when the config is validated: one
    ConfigError line each (kind policy_backend: a factory's ``check``)."""
    import importlib.util

    from nemo_rcgrpo.utils.config import ConfigError

    m = cfg.policy.megatron  # its section's own bounds: TrainConfig._validate_megatron_section, for any backend
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if m.fp8 is not None and not has_te:
        raise ConfigError(
            f"policy.megatron.fp8={m.fp8} needs Transformer Engine, which is not installed here: "
            "run in the GPU container (containers/Dockerfile) or set policy.megatron.fp8=null"
        )
    if (m.spec == "te" or m.sequence_parallel) and not has_te:
        setting = "spec=te" if m.spec == "te" else "sequence_parallel=true"
        raise ConfigError(
            f"policy.megatron.{setting} needs Transformer Engine, which is not installed here: "
            "run in the GPU container (containers/Dockerfile) or leave it at its default (null/auto)"
        )
    budget = cfg.trainer.micro_batch_tokens
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 and m.pp > 1:
        raise ConfigError(
            f"trainer.micro_batch_tokens={budget} with policy.megatron.pp={m.pp}: pipeline stages "
            "exchange one activation shape, so every micro-batch would be padded to the largest rows x "
            "the longest row, past the budget; use trainer.micro_batch_size"
        )


megatron_backend.check = _check_megatron  # a backend's own settings, validated with the config
megatron_backend.model_parallel = lambda policy: (policy.megatron.tp, policy.megatron.pp, policy.megatron.cp)


def make_policy(build: PolicyBuild, model: torch.nn.Module, dist: DistInfo, total_steps: int) -> Policy:
    """The ``policy.backend`` entry around ``model`` (an HF model with the reward tokens already added), given
    only the sections it reads (``TrainConfig.policy_build()``)."""
    from nemo_rcgrpo.config import PolicyBuild

    if not isinstance(build, PolicyBuild):  # a whole TrainConfig is not a factory's input (cfg.policy_build())
        raise TypeError(f"make_policy takes a PolicyBuild, not {type(build).__name__}")
    factory = lookup("policy_backend", build.policy.backend)
    return check_part(
        "policy_backend",
        build.policy.backend,
        factory,
        factory(build, model, dist, total_steps),
        Policy,
        "a policy declares the capabilities the loops ask of it and has the methods they call "
        "(the Policy Protocol, nemo_rcgrpo/models/interfaces.py)",
    )


def sync_generator(policy: Policy, generator, shares_weights: bool, version: int) -> None:
    """The generator samples from the policy's current weights as ``version`` from now on (a collective with the
    megatron backend: every rank calls it; the generator is None on ranks without one).

    ``shares_weights``: the generator's ``shares_policy_weights``, the same on every rank (the loop asks rank 0's
    once). Such a generator reads ``policy.module``: ``sync_hf_model`` makes that current (nothing moves with the
    torch backend; megatron copies its shards into rank 0's HF model) and the generator is handed no tensor, only
    the version. Any other gets a ``WeightStream`` on rank 0: the tensors are produced while the generator reads
    them (bucket by bucket, on the policy's device), and a generator that reads them again (a failed transfer redone
    through a folder) gets a fresh export, the other ranks taking part in each pass. Whatever the generator does,
    the export is finished before this returns, so no rank is left waiting.
    """
    if shares_weights:
        policy.sync_hf_model()
        if generator is not None:
            generator.update_weights((), version)  # its module is current: nothing to load
        return
    collective = policy.export_is_collective
    meta = policy.export_meta()  # a collective on its first call with megatron
    if meta is None and not collective:  # a policy that cannot announce its tensors: list them first
        if generator is not None:
            generator.update_weights(WeightStream.of(policy.export_weights()), version)
        return
    if generator is None:  # the other ranks: each pass of rank 0's export, until rank 0 says it is over
        while collective:
            for _ in policy.export_weights():
                pass
            if not _next_pass(policy, None):
                return
        return
    stream = WeightStream(
        meta, policy.export_weights, on_pass=(lambda k: _next_pass(policy, k > 0)) if collective else None
    )
    try:
        generator.update_weights(stream, version)
    finally:
        stream.close()


def _next_pass(policy, again: bool | None) -> bool:
    """Rank 0 tells every rank whether another export pass follows (``again``); the others learn it."""
    import torch.distributed as tdist

    flag = torch.tensor([int(bool(again))], device=policy.device)
    tdist.broadcast(flag, src=0)
    return bool(flag.item())


def save_policy_checkpoint(policy, dist: DistInfo, run_dir, step: int, **kwargs) -> None:
    """Checkpoint ``step`` (every rank calls it). A backend with ``save_sharded`` (Megatron) first writes its
    shards from every rank into the checkpoint's temporary folder; rank 0 then adds the rest (``kwargs``: see
    ``save_checkpoint``) and moves the folder into place."""
    sd = policy.state_dict()  # a collective with the megatron backend
    sharded = policy.sharded_checkpoints
    if sharded:
        if dist.is_main:
            prepare_checkpoint(run_dir, step)
        barrier(dist)
        policy.save_sharded(checkpoint_tmp_dir(run_dir, step) / sd["optimizer"]["dir"])
        barrier(dist)
    if dist.is_main:
        save_checkpoint(
            run_dir,
            step,
            model_state=sd["model"],
            optimizer_state=sd["optimizer"],
            scheduler_state=sd["scheduler"],
            prepared=sharded,
            **kwargs,
        )
    barrier(dist)
