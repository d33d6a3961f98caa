"""Generators: token ids in, token ids and sampling logprobs out, chosen by ``generation.backend``."""

from __future__ import annotations

from typing import Any, Callable

from nemo_rcgrpo.registry import _TABLES, register


@register("generator", "hf")
def _hf(cfg: Any, model: Any, tokenizer: Any):
    from nemo_rcgrpo.generation.hf_local import HFGenerator

    return HFGenerator(model, tokenizer.pad_token_id, max_batch_size=cfg.generation.max_batch_size,
                       share_prefixes=cfg.generation.share_prefixes)


@register("generator", "vllm")
def _vllm(cfg: Any, model: Any, tokenizer: Any):
    from nemo_rcgrpo.generation.vllm_server import make_vllm_generator

    return make_vllm_generator(cfg, model, tokenizer)


@register("generator", "scripted")
def _scripted(cfg: Any, model: Any, tokenizer: Any):
    from nemo_rcgrpo.generation.scripted import make_scripted_generator

    return make_scripted_generator(cfg, model, tokenizer)


# name -> factory(train config, policy model, tokenizer) -> Generator: the registry's table
GENERATORS: dict[str, Callable[[Any, Any, Any], Any]] = _TABLES["generator"]


def make_generator(cfg: Any, model: Any, tokenizer: Any):
    return GENERATORS[cfg.generation.backend](cfg, model, tokenizer)
