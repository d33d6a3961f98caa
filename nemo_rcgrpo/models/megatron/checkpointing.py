"""Sharded checkpoints of the Megatron backend: megatron-core ``dist_checkpointing``, torch_dist format.

``save_sharded`` (a collective) writes one directory: every rank stores its
part of the GPTModel's ``sharded_state_dict()`` and of the optimizer's, each
tensor as a piece of its global (unsharded) tensor, keyed by megatron's global
parameter names (``decoder.layers.<global layer>...``); what DP ranks hold
alike is written once, the writing spread over them:

- model weights under their names;
- Adam moments under ``optimizer.state.{exp_avg,exp_avg_sq}.<name>``, and with
  the distributed optimizer also its fp32 main weights
  (``optimizer.state.param.<name>``; bf16 runs without it store them as
  ``optimizer.state.fp32_param.<name>``);
- in ``common.pt``: param-group hyper-parameters and the Adam step, the layout
  the checkpoint was written at, and the caller's ``metadata``.

Resharding: weights and optimizer state load at another TP, PP and DP size.
The distributed optimizer uses megatron's ``fully_reshardable`` format: on
save each DP group all-gathers its shards into whole tensors of its TP/PP
part, and on load every rank reads those and keeps its own slice, so during
both every DP rank holds its TP/PP part's optimizer state in CPU memory. (The
other formats of megatron-core 0.16.1: ``dp_reshardable`` writes the DP shards
as they are but reloads only at the same TP and PP; ``fully_sharded_model_space``
fails, as ShardedTensor no longer accepts a flattened range.) A checkpoint
restores only the kind of optimizer it was written with (distributed or not):
the two keep different state, and ``load_sharded`` raises
``CheckpointLayoutError`` otherwise.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

_FORMAT = "fully_reshardable"  # the distributed optimizer's model-space format (any TP/PP/DP on load)
_META = "rcgrpo"  # the key of this module's entry in the checkpoint's content metadata


class CheckpointLayoutError(ValueError):
    """The checkpoint cannot be loaded into this model/optimizer; the message says how it was saved."""


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel: megatron's DDP wrapper has no ``sharded_state_dict`` of its own (its keys would gain
    'module.')."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    while isinstance(model, _BaseDataParallel):
        model = model.module
    return model


def _layout(optimizer) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "distributed_optimizer": bool(_distributed(optimizer)),
    }


def _words(layout: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in layout.items())


def _sharded(model, optimizer, is_loading: bool) -> dict[str, Any]:
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    # chained_optim_avoid_prefix: keys do not depend on how many optimizers megatron chains
    meta = ensure_metadata_has_dp_cp_group({"distrib_optim_sharding_type": _FORMAT, "chained_optim_avoid_prefix": True})
    model_sd = _gpt(model).sharded_state_dict(metadata=meta)
    optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta)
    return {"model": model_sd, "optimizer": optimizer_sd}


def save_sharded(model, optimizer, directory: Path, metadata: dict | None = None) -> None:
    """A collective: every rank writes its shards of the model and optimizer state into ``directory``.

    ``metadata`` (the same on every rank; plain Python values) comes back from ``load_sharded``. The first
    save starts megatron's writer-results process with ``spawn``, which imports ``__main__`` again: the
    calling script needs an ``if __name__ == "__main__":`` guard.
    """
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    content = {_META: {"layout": _layout(optimizer), "metadata": dict(metadata or {})}}
    dist_checkpointing.save(
        _sharded(model, optimizer, is_loading=False), str(directory), _save_strategy(), content_metadata=content
    )


def _save_strategy():
    """torch_dist, with the tensors that DP ranks hold alike written by all of them, a part each (metadata is
    exchanged, no data)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), ps.get_data_parallel_group(with_context_parallel=True)
    )


def saved_metadata(directory: Path) -> dict[str, Any]:
    """The layout a checkpoint was written at and the caller's metadata (no collective)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    common = TorchCommonLoadStrategy().load_common(Path(directory))
    return common["content_metadata"][_META]


def load_sharded(model, optimizer, directory: Path) -> dict:
    """A collective: load weights and optimizer state (fp32 main weights, Adam moments, step) in place.

    Returns the ``metadata`` given to ``save_sharded``.
    """
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    saved = saved_metadata(directory)
    was, now = saved["layout"], _layout(optimizer)
    if was["distributed_optimizer"] != now["distributed_optimizer"]:
        raise CheckpointLayoutError(
            f"{directory} was saved at {_words(was)}; its optimizer state loads only with "
            f"distributed_optimizer={was['distributed_optimizer']} (now {_words(now)})"
        )
    _init_empty_states(optimizer)
    state = dist_checkpointing.load(_sharded(model, optimizer, is_loading=True), str(directory))
    _gpt(model).load_state_dict(state["model"])
    with _keep_torch_adam_steps(optimizer), torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])
    _unshare_steps(optimizer)
    return saved["metadata"]


def _distributed(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]


def _init_empty_states(optimizer) -> None:
    """With torch's Adam (no Apex/TE) the distributed optimizer reads the step from the Adam state, which does
    not exist before the first step: create it with megatron's zero-gradient step (overwritten by the load)."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    for o in _distributed(optimizer):
        if not HAVE_APEX_OR_TE and len(o.optimizer.state) == 0:
            o._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _keep_torch_adam_steps(optimizer) -> Iterator[None]:
    """The fully_reshardable loader passes no 'step' (it comes from the param groups) but then copies every key
    of the Adam state, which for torch's Adam includes 'step': hand it the current one."""
    patched = []
    for o in _distributed(optimizer):

        def set_states(model_param, tensors, o=o, original=o._set_main_param_and_optimizer_states):
            current = o._get_main_param_and_optimizer_states(model_param)
            original(model_param, {**{k: v for k, v in current.items() if k == "step"}, **tensors})

        o._set_main_param_and_optimizer_states = set_states
        patched.append(o)
    try:
        yield
    finally:
        for o in patched:
            del o._set_main_param_and_optimizer_states  # back to the class's method


def _unshare_steps(optimizer) -> None:
    """Without Apex/TE the distributed optimizer restores one 'step' tensor shared by all parameters, and
    torch's Adam increments it once per parameter: give each its own."""
    for o in _distributed(optimizer):
        for state in o.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
