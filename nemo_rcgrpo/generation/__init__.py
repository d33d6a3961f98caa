"""Generators: token ids in, token ids and sampling logprobs out, chosen by ``generation.backend``.

A factory is registered by name and called as ``factory(setup, model, tokenizer)``: ``setup`` is the run's
`nemo_rcgrpo.config.PolicySetup` (model, chat, reward tokens, generation, env, run_dir), the same in training and
in `rcgrpo eval`; ``model`` the HF policy module the generator may share or copy; ``tokenizer`` its tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nemo_rcgrpo.registry import check_part, lookup, register

if TYPE_CHECKING:  # not at run time: the vLLM worker imports this package, and needs none of the config
    from nemo_rcgrpo.config import PolicySetup


@register("generator", "hf")
def _hf(cfg: PolicySetup, model: Any, tokenizer: Any):
    from nemo_rcgrpo.generation.hf_local import HFGenerator

    return HFGenerator(
        model,
        tokenizer.pad_token_id,
        max_batch_size=cfg.generation.max_batch_size,
        share_prefixes=cfg.generation.share_prefixes,
    )


@register("generator", "vllm")
def _vllm(cfg: PolicySetup, model: Any, tokenizer: Any):
    from nemo_rcgrpo.generation.vllm_generator import make_vllm_generator

    return make_vllm_generator(cfg, model, tokenizer)


def _check_vllm(setup: PolicySetup) -> None:
    """``generation.vllm``'s settings, checked when the config is validated (one ConfigError line)."""
    from nemo_rcgrpo.utils.config import ConfigError

    v = setup.generation.vllm  # weight_sync and dtype: Literal choices, checked where the config is read
    urls = [v.url] if isinstance(v.url, str) else list(v.url or ())
    for url in urls:
        if not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"generation.vllm.url={v.url!r}: give http://HOST:PORT of each running server, or null")
    if isinstance(v.url, (list, tuple)) and (not urls or len(set(urls)) != len(urls)):
        raise ConfigError(f"generation.vllm.url={list(v.url)}: a list of distinct server addresses (one per engine)")
    if v.engines != "auto" and (isinstance(v.engines, bool) or not isinstance(v.engines, int) or v.engines < 1):
        raise ConfigError(f"generation.vllm.engines={v.engines!r}: an integer >= 1, or auto")
    if urls and v.engines not in ("auto", len(urls)):
        raise ConfigError(
            f"generation.vllm.engines={v.engines} with {len(urls)} server address(es) in generation.vllm.url: "
            "attached, the engines are the servers listed (engines=auto)"
        )
    gpus = setup.generation_gpus  # a training job's layout.generation_gpus (0 elsewhere: CPU, eval)
    if not urls and isinstance(v.engines, int) and gpus and v.engines * v.tp > gpus:
        raise ConfigError(
            f"generation.vllm.engines={v.engines} x tp={v.tp} needs {v.engines * v.tp} GPUs; "
            f"layout.generation_gpus={gpus} (engines=auto fills them)"
        )
    for key in ("tp", "kv_cache_gib", "max_concurrency", "startup_timeout", "request_timeout"):
        if getattr(v, key) <= 0:
            raise ConfigError(f"generation.vllm.{key}={getattr(v, key)}: must be > 0")
    if v.max_retries < 0 or not 0 <= v.port < 65536 or not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError("generation.vllm: max_retries >= 0, 0 <= port < 65536, 0 < gpu_memory_utilization <= 1")
    if v.max_model_len is not None and v.max_model_len <= 0:
        raise ConfigError(f"generation.vllm.max_model_len={v.max_model_len}: must be > 0 or null")


_vllm.check = _check_vllm  # a generator's ``check(setup)``: its settings, validated with the config
_vllm.server_gpus = lambda generation: generation.vllm.tp  # engines of their own, on layout.generation_gpus


@register("generator", "scripted")
def _scripted(cfg: PolicySetup, model: Any, tokenizer: Any):
    """Scripted rollouts of the run's env (`generation/scripted.py`): the RL loop's tests and benchmarks."""
    from nemo_rcgrpo.generation.scripted import make_scripted_generator

    return make_scripted_generator(cfg, model, tokenizer)


def _check_scripted(setup: PolicySetup) -> None:
    """``generation.scripted``'s settings, checked when the config is validated (one ConfigError line). Any env
    may be scripted; a suite that offers no oracle_calls (nor scripted_messages) is refused when the generator is
    built, naming it."""
    from nemo_rcgrpo.utils.config import ConfigError

    s = setup.generation.scripted
    # a registered failure type (read by a suite that scripts its own failures: BFCL's)
    lookup("failure", s.failure_type, setting="generation.scripted.failure_type")
    for key in ("success_rate", "success_high", "success_low"):
        value = getattr(s, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ConfigError(f"generation.scripted.{key}={value!r}: must be a probability in [0, 1]")


_scripted.check = _check_scripted


def make_generator(setup: PolicySetup, model: Any, tokenizer: Any, gated: bool = False):
    """The ``generation.backend``'s generator. ``gated``: it is called from two threads (rollouts generated ahead),
    so it comes behind `GatedGenerator`'s lock, unless it samples from the policy's own module (shares its weights:
    the RL loop refuses that combination in one line)."""
    from nemo_rcgrpo.config import PolicySetup

    if not isinstance(setup, PolicySetup):  # a whole TrainConfig is not a factory's input (cfg.policy_setup())
        raise TypeError(f"make_generator takes a PolicySetup, not {type(setup).__name__}")
    from nemo_rcgrpo.generation.base import Generator

    backend = setup.generation.backend
    factory = lookup("generator", backend)
    generator = factory(setup, model, tokenizer)
    # the loops call these without probing for them: a missing one is one line now, not an AttributeError mid-step
    check_part(
        "generator",
        backend,
        factory,
        generator,
        Generator,
        "a generator has version and shares_policy_weights, and generate(), update_weights() and close() "
        "(the Generator Protocol, nemo_rcgrpo/generation/base.py)",
    )
    if gated and not generator.shares_policy_weights:
        from nemo_rcgrpo.generation.gated import GatedGenerator

        return GatedGenerator(generator)
    return generator
