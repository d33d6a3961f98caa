"""What every command that runs a model sets up the same way: seeds, the tokenizer and model with the chat format's
control tokens and the reward tokens, the chat renderer, the model's fingerprint and the HF export.

Stage 1 (`recipes/stage1.py`), stage 2 (`recipes/rl.py`), evaluation (`evaluation/run.py`) and the scripted
generator take them from here; each gets only the sections it reads (`config.PolicySetup`).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch

from nemo_rcgrpo.config import PolicySetup
from nemo_rcgrpo.data.tokenize import ChatRenderer, ensure_format_tokens
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer, resize_with_mean, resolve_model_path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_tokenizer_and_model(cfg: PolicySetup):
    """Tokenizer + model with the format's control tokens and the reward tokens (if special)."""
    resolve_model_path(cfg.model.path)  # a missing model is reported as such, not as a missing tokenizer
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_model(cfg.model.path, cfg.model.dtype)
    n_old = len(tokenizer)
    added = ensure_format_tokens(tokenizer, cfg.chat.format)
    if added:
        resize_with_mean(tokenizer, model, added, n_old)
    if cfg.model.reward_tokens == "special":
        add_reward_tokens(tokenizer, model, (cfg.reward_tokens.high, cfg.reward_tokens.low))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


def make_renderer(cfg: PolicySetup, tokenizer) -> ChatRenderer:
    return ChatRenderer(
        tokenizer,
        cfg.chat.format,
        tool_description=cfg.chat.tool_description,
        renderer=cfg.chat.renderer,
        reward_tokens=(cfg.reward_tokens.high, cfg.reward_tokens.low),
        literal_reward_tokens=cfg.model.reward_tokens != "special",
    )


def model_fingerprint(model: torch.nn.Module, path: str) -> str:
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    return hashlib.sha256(json.dumps([type(model).__name__, shapes], sort_keys=True).encode()).hexdigest()[:16]


def export_hf(model: torch.nn.Module, tokenizer, target: Path, record: dict | None = None, chat=None) -> Path:
    """An HF folder (weights + tokenizer with the reward tokens + the training record), written beside and moved
    into place. With ``chat`` (the run's chat section) it is served as trained: the chat template of its format and
    tool description, its bos / eos and the format's stop ids in generation_config.json
    (`data/served_template.py`); the run's own tokenizer and model are left as they are."""
    import copy

    from nemo_rcgrpo.utils.atomic import staged_folder
    from nemo_rcgrpo.utils.provenance import write_record

    generation = copy.deepcopy(getattr(model, "generation_config", None))
    if chat is not None:
        from nemo_rcgrpo.data.served_template import OFFICIAL, prepare_export

        if chat.format in OFFICIAL:  # a plugin format keeps its tokenizer's own template
            tokenizer = copy.deepcopy(tokenizer)
            prepare_export(tokenizer, generation, chat.format, chat.tool_description)
    with staged_folder(target) as tmp:
        model.save_pretrained(tmp)
        if generation is not None:
            generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if record is not None:
            write_record(tmp, record)
    return target
