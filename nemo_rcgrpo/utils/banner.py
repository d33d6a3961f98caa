"""What a run is about to do, said before it does it; and a log line per step when progress bars are off."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def loggers(logging: Any) -> str:
    """Where the ``logging`` section sends a run's metrics."""
    out = ["metrics.jsonl"]
    if logging.tensorboard:
        out.append("tensorboard/")
    if logging.wandb.enabled and logging.wandb.mode != "disabled":
        out.append(f"W&B ({logging.wandb.mode}, project {logging.wandb.project})")
    out.append("a progress bar" if logging.progress else "a log line per step")
    return ", ".join(out)


def start_banner(
    run: Any,
    *,
    recipe: str | None,
    parameters: int,
    data: str,
    steps: str,
    checkpoint: Path | None,
    start_step: int,
    extra: list[str] = (),
) -> str:
    """Lines naming the recipe, model, data, run folder, fresh start or resume, and where the metrics go (``run``:
    the run's `recipes/run_loop.py: RunSettings`). ``steps`` says the run's length in the unit ``trainer.max_steps``
    counts in the stage: optimizer steps in stage 1, RL steps in stage 2 (with the optimizer steps they make:
    rl.ppo_epochs x rl.mini_batches each)."""
    if hasattr(run, "to_dict"):  # a whole config is not what it takes
        raise TypeError(f"start_banner takes the run's RunSettings.of(cfg), not {type(run).__name__}")
    name = recipe or "(a config given in code)"
    start = f"resumes from {checkpoint} (step {start_step})" if checkpoint is not None else "fresh start"
    lines = [
        f"recipe  {name}: stage {run.stage}, policy backend {run.policy_backend}"
        + (f", generation {run.generation_backend}" if run.generation_backend else ""),
        f"model   {run.model.path}: {parameters / 1e6:.1f}M parameters, {run.model.dtype}, "
        f"chat format {run.chat.format}, reward tokens {run.model.reward_tokens}",
        f"data    {data}",
        f"steps   {steps}",
        *extra,
        f"run     {run.run_dir}: {start}",
        f"logs    {loggers(run.logging)}",
    ]
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def step_line(stage: str, step: int, total: int, metrics: dict[str, float], keys: tuple[str, ...]) -> str:
    """``rcgrpo step 3/10: reward_mean=0.400 loss=-0.0012 ... step_seconds=12.3`` (progress bars off)."""
    shown = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
    return f"{stage} step {step}/{total}: " + " ".join(shown)
