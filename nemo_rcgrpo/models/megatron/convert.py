"""HF <-> Megatron-Core weight conversion for the Llama and Qwen2 families, as pure functions.

Megatron's GPTModel stores (per tensor-parallel rank r of ``tp``):

    embedding.word_embeddings.weight          [V_pad / tp, H]   rows r*V_pad/tp ... (vocab padded with zeros)
    decoder.layers.i.input_layernorm.weight   [H]               (TE spec: self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.i.self_attention.linear_qkv.weight [(q + 2) * d * g / tp, H]
        one block per KV group (GQA): the group's q heads, then its k head, then its v head;
        rank r holds groups r*g/tp ...;  same layout for .bias (Qwen2)
    decoder.layers.i.self_attention.linear_proj.weight [H, nq * d / tp]   (column split)
    decoder.layers.i.pre_mlp_layernorm.weight [H]               (TE spec: mlp.linear_fc1.layer_norm_weight)
    decoder.layers.i.mlp.linear_fc1.weight    [2 * F / tp, H]   the rank's gate rows, then its up rows
    decoder.layers.i.mlp.linear_fc2.weight    [H, F / tp]       (column split)
    decoder.final_layernorm.weight            [H]
    output_layer.weight                       [V_pad / tp, H]   (untied models only)

with g KV groups, q = nq / g query heads per group, d the head size. The
vocabulary is padded to a multiple of ``128 x tp`` with zero rows beyond the
real vocabulary (the reward tokens are real entries: they are added to the HF
model before conversion); logits of padded rows are masked out by the policy.

``megatron_param_to_hf(name, shards)`` converts one Megatron parameter given
its shards from every TP rank; it is used both for whole checkpoints and to
stream HF-named tensors out of a running TP model (``export_weights``).

Pipeline parallelism splits the layers evenly over ``pp`` stages; a stage's
state dict numbers its layers from 0 (megatron's local numbering). The first
stage holds the embedding, the last the final norm and the output layer; with
tied embeddings and ``pp > 1`` the last stage holds a copy of the embedding as
its output layer (megatron keeps the two in sync by summing their gradients).
``pipeline_stage`` cuts a full-model state dict into a stage's part and
``global_layer_name`` maps a stage's names back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

VOCAB_MULTIPLE = 128
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class ConversionError(ValueError):
    """A state dict or config that cannot be converted; the message says why."""


@dataclass(frozen=True)
class ModelShape:
    family: str  # llama | qwen2
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int  # real vocabulary (embedding rows of the HF model)
    tied_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        family = getattr(config, "model_type", None)
        if family not in ("llama", "qwen2"):
            raise ConversionError(f"model_type={family!r}: the Megatron backend supports llama and qwen2")
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if family == "llama" and getattr(config, "attention_bias", False):
            raise ConversionError("llama with attention_bias=true is not supported")
        if getattr(config, "mlp_bias", False):
            raise ConversionError("mlp_bias=true is not supported")
        return cls(
            family,
            config.num_hidden_layers,
            config.hidden_size,
            heads,
            kv,
            head_dim,
            config.intermediate_size,
            config.vocab_size,
            bool(config.tie_word_embeddings),
            family == "qwen2",
        )


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    step = multiple * tp
    return -(-vocab_size // step) * step


def check_tp(shape: ModelShape, tp: int) -> None:
    """Refuse a tensor-parallel size that does not divide the heads, KV heads and FFN width."""
    if tp < 1:
        raise ConversionError(f"tensor-parallel size {tp}: must be >= 1")
    bad = {
        k: v
        for k, v in {
            "attention heads": shape.num_heads,
            "KV heads": shape.num_kv_heads,
            "FFN width": shape.ffn_hidden_size,
        }.items()
        if v % tp
    }
    if bad:
        sizes = [
            t
            for t in range(1, shape.num_kv_heads + 1)
            if shape.num_heads % t == 0 and shape.num_kv_heads % t == 0 and shape.ffn_hidden_size % t == 0
        ]
        what = ", ".join(f"{k} ({v})" for k, v in bad.items())
        raise ConversionError(
            f"tensor-parallel size {tp} does not divide the model's {what}; possible sizes for this model: {sizes}"
        )


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the layers of pipeline stage ``pp_rank`` (megatron's even split)."""
    if pp < 1 or num_layers % pp:
        raise ConversionError(
            f"pipeline-parallel size {pp} does not divide the model's {num_layers} layers; "
            f"possible sizes: {[p for p in range(1, num_layers + 1) if num_layers % p == 0]}"
        )
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def pipeline_stage(state: dict[str, torch.Tensor], shape: ModelShape, pp: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """Stage ``pp_rank``'s part of one TP rank's full-model state dict, layers renumbered from 0."""
    layers = stage_layers(shape.num_layers, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        m = _LAYER.match(name)
        if m is not None:
            if int(m.group(1)) in layers:
                out[f"decoder.layers.{int(m.group(1)) - layers.start}.{m.group(2)}"] = value
        elif name.startswith("embedding."):
            if first:
                out[name] = value
        elif last:  # final norm, output layer
            out[name] = value
    if last and not first and shape.tied_embeddings:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    return out


def global_layer_name(name: str, layer_offset: int) -> str:
    """A stage-local Megatron name with its layer index made global."""
    m = _LAYER.match(name)
    return name if m is None or layer_offset == 0 else f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}"


def _layer_names(spec: str) -> dict[str, str]:
    fused = spec == "te"
    return {
        "input_layernorm": "self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight",
        "post_attention_layernorm": "mlp.linear_fc1.layer_norm_weight" if fused else "pre_mlp_layernorm.weight",
    }


# ---------------------------------------------------------------------- HF -> Megatron
def _qkv_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape, tp: int) -> list[torch.Tensor]:
    """q [nq*d, ...], k/v [g*d, ...] -> per rank [(q+2)*d*g/tp, ...], grouped by KV head."""
    g, d = shape.num_kv_heads, shape.head_dim
    per = shape.num_heads // g
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return [c.reshape(-1, *rest).clone() for c in fused.chunk(tp, dim=0)]


def _vocab_shards(weight: torch.Tensor, tp: int) -> list[torch.Tensor]:
    rows = padded_vocab_size(weight.shape[0], tp)
    padded = torch.zeros(rows, *weight.shape[1:], dtype=weight.dtype)
    padded[: weight.shape[0]] = weight
    return [c.clone() for c in padded.chunk(tp, dim=0)]


def hf_to_megatron(
    hf: dict[str, torch.Tensor], shape: ModelShape, tp: int, spec: str = "local"
) -> list[dict[str, torch.Tensor]]:
    """One Megatron state dict per TP rank from an HF state dict (``model.*`` and ``lm_head.weight`` names)."""
    check_tp(shape, tp)
    names = _layer_names(spec)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]

    def put(name: str, shards: list[torch.Tensor]) -> None:
        for r in range(tp):
            out[r][name] = shards[r]

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"HF state dict has no {name!r}")
        return hf[name]

    def same(t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone() for _ in range(tp)]

    emb = get("model.embed_tokens.weight")
    if emb.shape[0] != shape.vocab_size:
        raise ConversionError(f"embedding has {emb.shape[0]} rows but the config says vocab_size={shape.vocab_size}")
    put("embedding.word_embeddings.weight", _vocab_shards(emb, tp))
    for i in range(shape.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        put(dst + names["input_layernorm"], same(get(src + "input_layernorm.weight")))
        put(dst + names["post_attention_layernorm"], same(get(src + "post_attention_layernorm.weight")))
        att = src + "self_attn."
        put(
            dst + "self_attention.linear_qkv.weight",
            _qkv_shards(get(att + "q_proj.weight"), get(att + "k_proj.weight"), get(att + "v_proj.weight"), shape, tp),
        )
        if shape.qkv_bias:
            put(
                dst + "self_attention.linear_qkv.bias",
                _qkv_shards(get(att + "q_proj.bias"), get(att + "k_proj.bias"), get(att + "v_proj.bias"), shape, tp),
            )
        put(dst + "self_attention.linear_proj.weight", [c.clone() for c in get(att + "o_proj.weight").chunk(tp, dim=1)])
        gate, up = get(src + "mlp.gate_proj.weight").chunk(tp, dim=0), get(src + "mlp.up_proj.weight").chunk(tp, dim=0)
        put(dst + "mlp.linear_fc1.weight", [torch.cat([gate[r], up[r]], dim=0) for r in range(tp)])
        put(dst + "mlp.linear_fc2.weight", [c.clone() for c in get(src + "mlp.down_proj.weight").chunk(tp, dim=1)])
    put("decoder.final_layernorm.weight", same(get("model.norm.weight")))
    if not shape.tied_embeddings:
        put("output_layer.weight", _vocab_shards(get("lm_head.weight"), tp))
    return out


# ---------------------------------------------------------------------- Megatron -> HF


def _cat(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim)  # one shard: no copy


def megatron_param_to_hf(
    name: str, shards: list[torch.Tensor], shape: ModelShape, spec: str = "local"
) -> list[tuple[str, torch.Tensor]]:
    """HF-named full tensors for one Megatron parameter, given its shard from every TP rank (in rank order).
    With one shard, tensors that need no reordering are views of it, not copies."""
    tp = len(shards)
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", _cat(shards, 0)[: shape.vocab_size])]
    if name == "output_layer.weight":
        return [("lm_head.weight", _cat(shards, 0)[: shape.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    m = _LAYER.match(name)
    if m is None:
        raise ConversionError(f"unknown Megatron parameter {name!r}")
    i, rest = int(m.group(1)), m.group(2)
    hf = f"model.layers.{i}."
    names = _layer_names(spec)
    if rest == names["input_layernorm"]:
        return [(hf + "input_layernorm.weight", shards[0])]
    if rest == names["post_attention_layernorm"]:
        return [(hf + "post_attention_layernorm.weight", shards[0])]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        g, d = shape.num_kv_heads, shape.head_dim
        per = shape.num_heads // g
        full = _cat(shards, 0)
        rest_dims = full.shape[1:]
        grouped = full.reshape(g, (per + 2) * d, *rest_dims)
        q, k, v = grouped.split([per * d, d, d], dim=1)
        return [
            (hf + f"self_attn.q_proj.{kind}", q.reshape(-1, *rest_dims).contiguous()),
            (hf + f"self_attn.k_proj.{kind}", k.reshape(-1, *rest_dims).contiguous()),
            (hf + f"self_attn.v_proj.{kind}", v.reshape(-1, *rest_dims).contiguous()),
        ]
    if rest == "self_attention.linear_proj.weight":
        return [(hf + "self_attn.o_proj.weight", _cat(shards, 1))]
    if rest == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [
            (hf + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves], 0)),
            (hf + "mlp.up_proj.weight", torch.cat([h[1] for h in halves], 0)),
        ]
    if rest == "mlp.linear_fc2.weight":
        return [(hf + "mlp.down_proj.weight", _cat(shards, 1))]
    raise ConversionError(f"unknown Megatron parameter {name!r} (tp={tp})")


def replicated_over_tp(name: str, spec: str = "local") -> bool:
    """Megatron weights that every TP rank holds whole (the norms); the others are split over TP."""
    names = _layer_names(spec)
    return name.endswith(("final_layernorm.weight", names["input_layernorm"], names["post_attention_layernorm"]))


def hf_meta(
    name: str, local: torch.Tensor, tp: int, shape: ModelShape, spec: str = "local"
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The HF names, shapes and dtypes ``megatron_param_to_hf`` gives for a parameter whose TP-local shard looks
    like ``local``; computed on meta tensors, nothing is allocated."""
    shard = torch.empty(local.shape, dtype=local.dtype, device="meta")
    shards = [shard] * (1 if replicated_over_tp(name, spec) else tp)
    return [(n, tuple(t.shape), t.dtype) for n, t in megatron_param_to_hf(name, shards, shape, spec)]


def is_weight(name: str) -> bool:
    """Megatron state-dict entries that are weights (not TE's ``_extra_state`` or buffers)."""
    return not name.endswith("_extra_state") and not name.endswith("inv_freq")


def megatron_to_hf(
    ranks: list[dict[str, torch.Tensor]], shape: ModelShape, spec: str = "local"
) -> dict[str, torch.Tensor]:
    """An HF state dict from the Megatron state dicts of all TP ranks (rank order)."""
    if not ranks:
        raise ConversionError("no Megatron state dicts given")
    keys = [k for k in ranks[0] if is_weight(k)]
    for r, sd in enumerate(ranks[1:], 1):
        if [k for k in sd if is_weight(k)] != keys:
            raise ConversionError(f"TP rank {r} has other parameters than rank 0")
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        out.update(megatron_param_to_hf(k, [sd[k] for sd in ranks], shape, spec))
    return out
