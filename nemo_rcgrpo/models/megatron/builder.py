"""Megatron-Core GPTModel for the Llama and Qwen2 families, and its parallel groups.

``build_gpt(hf_config, mcfg, ...)`` maps an HF config onto a TransformerConfig
(RMSNorm, SwiGLU, RoPE with the model's theta and Llama-3 scaling, GQA,
Qwen2's QKV bias, tied or untied embeddings) and builds the model with the
Transformer Engine layer spec wherever TE imports on a GPU (flash / fused
attention; FP8 when ``fp8`` is set), else the local (pure megatron-core)
spec. Every device-dependent flag comes from ``flags.decide`` (a pure,
CPU-tested function). On CPU the compatibility layer (``cpu_compat``) is
enabled first.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_rcgrpo.models.megatron.convert import ModelShape, check_tp, padded_vocab_size, stage_layers
from nemo_rcgrpo.models.megatron.flags import FlagError, Flags, Platform, decide
from nemo_rcgrpo.utils.dist import collective_timeout


class MegatronSetupError(ValueError):
    """The Megatron backend cannot start with these settings; the message says what to change."""


@dataclass(frozen=True)
class Parallel:
    """This process's place in the (TP, PP, CP, DP) grid."""

    tp: int
    pp: int
    cp: int
    dp: int
    tp_rank: int
    dp_rank: int
    pp_rank: int = 0


def platform_flags(
    mcfg, params_dtype: torch.dtype = torch.float32, dp: int = 1, platform: Platform | None = None
) -> Flags:
    """``flags.decide`` for this machine (``Platform.detect()``), its refusals as MegatronSetupError."""
    try:
        return decide(platform or Platform.detect(), mcfg, dp)
    except FlagError as e:
        raise MegatronSetupError(str(e)) from None


def init_parallel(tp: int, pp: int, cp: int, seed: int) -> Parallel:
    """Create megatron's parallel groups (joining torchrun's group, or a one-process gloo group).

    No gloo side groups (``flags``: the default groups serve the optimizer and checkpoints on CPU and GPU alike).
    """
    from megatron.core import parallel_state, tensor_parallel

    from nemo_rcgrpo.models.megatron import cpu_compat

    on_cpu = cpu_compat.enable()
    if not torch.distributed.is_initialized():
        backend = "gloo" if on_cpu else "nccl"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
            torch.distributed.init_process_group(backend, timeout=collective_timeout())
        else:
            store = tempfile.NamedTemporaryFile(prefix="rcgrpo-pg-", delete=False).name
            torch.distributed.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    world = torch.distributed.get_world_size()
    if world % (tp * pp * cp):
        raise MegatronSetupError(
            f"world size {world} is not a multiple of tp x pp x cp = {tp}x{pp}x{cp}; "
            f"change policy.megatron.tp/pp/cp or the number of processes"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=int(collective_timeout().total_seconds() // 60),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Parallel(
        tp,
        pp,
        cp,
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )


def rope_settings(hf_config) -> dict:
    """RoPE theta and Llama-3 scaling from an HF config; other scaling types are refused."""
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    src = scaling or params
    if kind in (None, "default"):
        return {"theta": float(theta), "llama3": None}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"theta": float(theta), "llama3": {k: src[k] for k in keys}}
    raise MegatronSetupError(f"rope scaling {kind!r} is not supported by the Megatron backend (default, llama3)")


def apply_rope_scaling(rotary, rope: dict) -> None:
    """Llama-3 scaling on megatron's RotaryEmbedding with the model's factors (megatron's own flag fixes
    low/high frequency factors and the original length)."""
    if rope["llama3"] is not None:
        rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **rope["llama3"])


def transformer_config(shape: ModelShape, hf_config, mcfg, params_dtype: torch.dtype, flags: Flags):
    """megatron's TransformerConfig for ``shape``; every device-dependent flag comes from ``flags``."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=mcfg.tp,
        pipeline_model_parallel_size=mcfg.pp,
        context_parallel_size=mcfg.cp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        # initialisation also marks the tensor-parallel parameters (megatron skips that without it), which the
        # gradient norm needs; the HF weights are loaded over it
        perform_initialization=True,
        **flags.transformer,
    )


def build_gpt(hf_config, mcfg, params_dtype: torch.dtype = torch.float32, flags: Flags | None = None):
    """A GPTModel matching ``hf_config`` (randomly initialised: load weights with ``convert.hf_to_megatron``).

    ``flags``: the device-dependent settings (default ``platform_flags(mcfg, params_dtype)``); ``flags.spec``
    is the layer spec ('te' or 'local'). With pipeline parallelism (groups from ``init_parallel``) the model is
    this rank's stage.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    shape = ModelShape.from_hf_config(hf_config)
    check_tp(shape, mcfg.tp)
    stage_layers(shape.num_layers, mcfg.pp, 0)
    flags = flags or platform_flags(mcfg, params_dtype)
    config = transformer_config(shape, hf_config, mcfg, params_dtype, flags)
    spec = (
        get_gpt_layer_with_transformer_engine_spec()
        if flags.spec == "te"
        else get_gpt_layer_local_spec(normalization="RMSNorm")
    )
    rope = rope_settings(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(shape.vocab_size, mcfg.tp),
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        rotary_base=int(rope["theta"]) if float(rope["theta"]).is_integer() else rope["theta"],
    )
    apply_rope_scaling(model.rotary_pos_emb, rope)
    if params_dtype != torch.float32:
        model = model.to(params_dtype)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model, shape, config


def load_hf_state(
    model, hf_state: dict[str, torch.Tensor], shape: ModelShape, parallel: Parallel, spec: str = "local"
) -> None:
    """Copy HF weights into this rank's model (conversion: ``convert.hf_to_megatron``, ``convert.pipeline_stage``)."""
    from nemo_rcgrpo.models.megatron.convert import hf_to_megatron, is_weight, pipeline_stage

    mine = pipeline_stage(
        hf_to_megatron(hf_state, shape, parallel.tp, spec)[parallel.tp_rank], shape, parallel.pp, parallel.pp_rank
    )
    own = {k for k in model.state_dict() if is_weight(k)}
    if own != set(mine):
        raise MegatronSetupError(
            f"Megatron model and converted weights differ: missing {sorted(own - set(mine))[:4]}, "
            f"unexpected {sorted(set(mine) - own)[:4]}"
        )
    with torch.no_grad():
        params = dict(model.state_dict(keep_vars=True))
        for name, value in mine.items():
            params[name].copy_(value)
