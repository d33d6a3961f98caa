"""The training record every export and checkpoint carries: how the model was trained, so evaluation conditions it
the way it was trained (``reward_token=auto``).

``nemo_rcgrpo_training.json`` sits beside the tokenizer files (``run_dir/hf/`` and ``checkpoints/step_N/tokenizer/``):

    {"stage": "rcgrpo", "reward_conditioned": true, "reward_tokens": {"high": ..., "low": ...},
     "init": "runs/rctp_qwen7b/hf", "init_stage": "rctp"}

``reward_conditioned`` is true for a conditioned stage (RCTP-FT, RC-GRPO: `nemo_rcgrpo/stages.py`) and for any
model trained from one (an RC-GRPO init's
GRPO run keeps the conditioning it learnt); stage 1 adds the reward tokens to every model, so their presence in
the vocabulary says nothing about it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORD_FILE = "nemo_rcgrpo_training.json"


def read_record(folder: str | Path) -> dict[str, Any] | None:
    """The training record of a model folder, or None (a model not trained here, or a built-in name)."""
    path = Path(folder) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def training_record(stage: str, init: str, high: str, low: str, *, conditioned: bool) -> dict[str, Any]:
    """The record of a model trained by ``stage`` from the model at ``init``; ``conditioned``: the stage trains on
    reward tokens (its registered ``Stage.conditioned``)."""
    parent = read_record(init)
    derived = bool(parent and parent.get("reward_conditioned"))
    return {
        "stage": stage,
        "reward_conditioned": conditioned or derived,
        "reward_tokens": {"high": high, "low": low},
        "init": init,
        "init_stage": parent.get("stage") if parent else None,
    }


def write_record(folder: str | Path, record: dict[str, Any]) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")


def reward_token_value(setting: str) -> bool | None:
    """A reward-token setting (``reward_token`` of ``rcgrpo eval``, ``rl.eval_token``: high | low | none) as the
    goal an episode is conditioned on: True (high), False (low) or None (no token)."""
    return {"high": True, "low": False, "none": None}[setting]


def auto_reward_token(record: dict[str, Any] | None) -> str:
    """``reward_token=auto``: high for a reward-conditioned model, none otherwise (and for a model without a record)."""
    return "high" if record and record.get("reward_conditioned") else "none"
