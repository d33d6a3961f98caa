"""Every CUDA-dependent choice of the Megatron backend, as one pure function.

``decide(platform, mcfg, dp)`` maps what this machine has (a
``Platform``: CUDA, Transformer Engine, apex's fused kernels) and the
``policy.megatron`` settings to the keyword arguments of megatron-core's
``TransformerConfig``, ``DistributedDataParallelConfig``,
``initialize_model_parallel`` and ``get_megatron_optimizer``, the layer spec,
and the multiple that sequence lengths are padded to. Nothing here imports
megatron or touches a device, so every GPU case is a CPU unit test
(``tests/unit/models/megatron/test_flags.py``); ``Platform.detect()`` is the only
place that looks at the machine.

What each flag needs, read in megatron-core 0.16.1:

- ``persist_layer_norm``: only apex's ``FusedLayerNorm`` (LayerNorm) reads it. The local spec builds RMSNorm
  as ``WrappedTorchNorm``, which asserts it is off, and Transformer Engine's norm ignores it: always off
  (these models are RMSNorm).
- ``masked_softmax_fusion``: the local spec's ``FusedScaleMaskSoftmax`` imports apex's
  ``scaled_upper_triang_masked_softmax_cuda`` / ``scaled_masked_softmax_cuda`` for most half-precision
  shapes: on only where both import (NGC images). The TE spec's attention is TE's own (flash / fused).
- ``bias_activation_fusion`` (the SwiGLU of ``fused_bias_swiglu``) and ``bias_dropout_fusion``: megatron's
  ``jit_fuser``, which is ``torch.compile`` for torch >= 2.2 (Triton and a C compiler on a GPU): on with CUDA
  where those are there (``Platform.compiles``); off on CPU, where compiling in every test process costs
  more than it saves (a CPU test builds and trains with them on: tests/megatron/gpu_flags_worker.py).
- ``apply_rope_fusion``: Transformer Engine's fused RoPE: on with TE on a GPU.
- ``gradient_accumulation_fusion``: the output layer is megatron's own ``ColumnParallelLinear`` even with
  the TE spec, and it raises without apex's ``fused_weight_gradient_mlp_cuda``: on only where that imports.
- gloo process groups: megatron creates them only when asked, and ``get_megatron_optimizer`` uses them by
  default (``use_gloo_process_groups=True``: "Intra partial data parallel group is not initialized" on GPU).
  Neither is needed: the default groups (NCCL on GPU, gloo on CPU) serve the optimizer and checkpoints, so
  both are off everywhere and CPU runs use the GPU's setting.
- ``overlap_grad_reduce`` (bucketed, megatron's default bucket size): on with more than one data-parallel
  replica (with one there is nothing to overlap), on CPU (gloo) as on GPU; the schedule then needs
  ``no_sync_func``, and a replica without micro-batches starts its (zero) reduction itself.
- flat rows (a prefix tree or packed rows as one sequence, `data/packing.py: flat_row`, `layouts.py`): the local
  spec's ``FusedScaleMaskSoftmax`` falls back to ``forward_torch_softmax``, which uses a given mask in place of the
  causal default, wherever the fused kernels are off; with apex's causal kernel the mask would be ignored. So
  flat rows run with the local spec on the CPU, one context-parallel rank (``flat_rows_off`` says why not
  elsewhere; those micro-batches run padded, as before).
- FP8 (TE): GEMM dimensions must be multiples of 16, so token counts are padded to 16; sequence parallel
  splits the sequence over TP ranks, each of which must still hold a multiple of 16 with FP8: 16 x tp
  then, and a multiple of tp without FP8.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from dataclasses import dataclass, field
from typing import Any

SPECS = ("auto", "te", "local")
APEX_SOFTMAX = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")
APEX_GRAD_ACCUM = "fused_weight_gradient_mlp_cuda"
FP8_MULTIPLE = 16


def _imports(module: str) -> bool:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - present but unusable: treated as absent
        return False
    return True


class FlagError(ValueError):
    """These settings cannot run on this machine; the message says what to change."""


@dataclass(frozen=True)
class Platform:
    """What the Megatron backend can use here."""

    cuda: bool
    transformer_engine: bool = False  # transformer_engine.pytorch imports
    apex_softmax: bool = False  # apex's fused masked-softmax kernels import
    apex_grad_accum: bool = False  # apex's fused weight-gradient accumulation kernel imports
    compiles: bool = False  # torch.compile can build kernels here (Triton with CUDA, and a C compiler)

    @staticmethod
    def detect() -> "Platform":
        """What imports here (a package that is present but broken, e.g. built for another torch, counts as absent)."""
        import torch

        cuda = torch.cuda.is_available()
        compiler = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
        return Platform(
            cuda=cuda,
            transformer_engine=cuda and _imports("transformer_engine.pytorch"),
            apex_softmax=cuda and all(_imports(n) for n in APEX_SOFTMAX),
            apex_grad_accum=cuda and _imports(APEX_GRAD_ACCUM),
            compiles=compiler and (not cuda or _imports("triton")),
        )


@dataclass(frozen=True)
class Flags:
    spec: str  # 'te' | 'local'
    transformer: dict[str, Any] = field(default_factory=dict)  # TransformerConfig keyword arguments
    ddp: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallelConfig keyword arguments
    parallel: dict[str, Any] = field(default_factory=dict)  # initialize_model_parallel keyword arguments
    optimizer: dict[str, Any] = field(default_factory=dict)  # get_megatron_optimizer keyword arguments
    token_multiple: int = 1  # sequence lengths are padded to a multiple of this
    # prefix trees and packed rows run as one flat row behind an explicit [N, N] mask (`data/packing.py:
    # flat_row`); why not if not
    flat_rows: bool = False
    flat_rows_off: str = ""


def choose_spec(platform: Platform, spec: str, fp8: str | None) -> str:
    """'te' or 'local' for ``policy.megatron.spec`` (auto: TE wherever it imports on a GPU, as FP8 needs)."""
    if spec not in SPECS:
        raise FlagError(f"policy.megatron.spec={spec!r}: choose one of {list(SPECS)}")
    have_te = platform.cuda and platform.transformer_engine
    if spec == "te" and not have_te:
        raise FlagError(
            "policy.megatron.spec=te needs Transformer Engine on a GPU (the GPU container); use spec=auto or spec=local"
        )
    if fp8 is not None:
        if not have_te:
            raise FlagError(
                f"policy.megatron.fp8={fp8} needs Transformer Engine on a GPU; run in the GPU container "
                "(containers/Dockerfile) or set policy.megatron.fp8=null"
            )
        if spec == "local":
            raise FlagError(
                f"policy.megatron.fp8={fp8} needs the Transformer Engine spec: set policy.megatron.spec=auto"
            )
        return "te"
    if spec == "auto":
        return "te" if have_te else "local"
    return spec


def decide(platform: Platform, mcfg, dp: int = 1) -> Flags:
    """The megatron keyword arguments for ``mcfg`` (a MegatronConfig) on ``platform`` (see the module docstring).

    ``dp``: data-parallel replicas (world / (tp x pp x cp)).
    """
    spec = choose_spec(platform, getattr(mcfg, "spec", "auto"), mcfg.fp8)
    sp_setting = getattr(mcfg, "sequence_parallel", None)
    if sp_setting and spec != "te":
        raise FlagError(
            "policy.megatron.sequence_parallel=true needs the Transformer Engine spec (GPU container); "
            "set sequence_parallel=null (on where TE is) or false"
        )
    sequence_parallel = mcfg.tp > 1 and spec == "te" and sp_setting is not False
    cuda = platform.cuda
    recompute = (
        {}
        if mcfg.recompute == "none"
        else (
            {"recompute_granularity": "selective"}
            if mcfg.recompute == "selective"
            else {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        )
    )
    fp8 = {} if mcfg.fp8 is None else {"fp8": mcfg.fp8, "fp8_recipe": "delayed"}
    transformer = dict(
        use_cpu_initialization=not cuda,
        sequence_parallel=sequence_parallel,
        persist_layer_norm=False,
        masked_softmax_fusion=cuda and platform.apex_softmax,
        bias_activation_fusion=cuda and platform.compiles,
        bias_dropout_fusion=cuda and platform.compiles,
        apply_rope_fusion=cuda and spec == "te",
        gradient_accumulation_fusion=cuda and platform.apex_grad_accum,
        cross_entropy_loss_fusion=False,  # the losses here use megatron's vocab-parallel cross entropy directly
        **recompute,
        **fp8,
    )
    overlap = dp > 1
    ddp = dict(
        grad_reduce_in_fp32=mcfg.grad_reduce_in_fp32,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=mcfg.distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    multiple = FP8_MULTIPLE if mcfg.fp8 is not None else 1
    if sequence_parallel:
        multiple *= mcfg.tp  # every TP rank's slice of the sequence keeps the multiple
    flat_off = flat_rows_off(spec, cuda, getattr(mcfg, "cp", 1))
    return Flags(
        spec=spec,
        transformer=transformer,
        ddp=ddp,
        parallel={"create_gloo_process_groups": False},
        optimizer={"use_gloo_process_groups": False},
        token_multiple=multiple,
        flat_rows=not flat_off,
        flat_rows_off=flat_off,
    )


def flat_rows_off(spec: str, cuda: bool, cp: int) -> str:
    """Why a micro-batch's prefix tree or packed rows cannot run as one flat row here ('' where they can): the
    flat row needs the local spec's unfused softmax, which takes an explicit mask (the fused causal kernel ignores
    one), on the CPU (on a GPU a dense N x N mask per micro-batch is what Transformer Engine's packed-sequence path
    avoids, and that path is not wired), and the whole sequence on every rank (no context parallelism)."""
    if cp > 1:
        return "context parallelism splits the sequence, which a flat row's mask spans"
    if spec != "local":
        return "the Transformer Engine spec's packed-sequence path is not wired to prefix trees or packed rows yet"
    if cuda:
        return "on a GPU a flat row's dense N x N mask is not used (the Transformer Engine path is what avoids it)"
    return ""


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple
