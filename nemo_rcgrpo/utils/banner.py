"""What a run is about to do, said before it does it; and a log line per step when progress bars are off."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def loggers(cfg: Any) -> str:
    out = ["metrics.jsonl"]
    if cfg.logging.tensorboard:
        out.append("tensorboard/")
    if cfg.logging.wandb.enabled and cfg.logging.wandb.mode != "disabled":
        out.append(f"W&B ({cfg.logging.wandb.mode}, project {cfg.logging.wandb.project})")
    out.append("a progress bar" if cfg.logging.progress else "a log line per step")
    return ", ".join(out)


def start_banner(
    cfg: Any,
    *,
    recipe: str | None,
    parameters: int,
    data: str,
    steps: str,
    checkpoint: Path | None,
    start_step: int,
    extra: list[str] = (),
) -> str:
    """Lines naming the recipe, model, data, run folder, fresh start or resume, and where the metrics go."""
    name = recipe or "(a config given in code)"
    start = f"resumes from {checkpoint} (step {start_step})" if checkpoint is not None else "fresh start"
    lines = [
        f"recipe  {name}: stage {cfg.stage}, policy backend {cfg.policy.backend}"
        + (f", generation {cfg.generation.backend}" if cfg.is_rl else ""),
        f"model   {cfg.model.path}: {parameters / 1e6:.1f}M parameters, {cfg.model.dtype}, "
        f"chat format {cfg.chat.format}, reward tokens {cfg.model.reward_tokens}",
        f"data    {data}",
        f"steps   {steps}",
        *extra,
        f"run     {cfg.run_dir}: {start}",
        f"logs    {loggers(cfg)}",
    ]
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def step_line(stage: str, step: int, total: int, metrics: dict[str, float], keys: tuple[str, ...]) -> str:
    """``rcgrpo step 3/10: reward_mean=0.400 loss=-0.0012 ... step_seconds=12.3`` (progress bars off)."""
    shown = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
    return f"{stage} step {step}/{total}: " + " ".join(shown)
