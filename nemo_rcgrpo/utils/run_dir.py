"""What a run folder holds, checked before a run writes into it.

- A folder that holds a run (a ``config.yaml`` or a checkpoint) is resumed only by the same run:
  its last saved config must equal this one, except for the settings that may change on resume
  (``RESUME_FREE``: how long this invocation runs, where it logs and shows progress, where the
  generation server is, how the same computation is laid out on devices) and the ones the user names in ``trainer.resume_may_change``. A
  difference is one line naming it and the ways out.
- ``trainer.resume=false`` on a folder that holds a run is refused unless ``overwrite=true``,
  which removes that run's checkpoints, metrics, TensorBoard files and rollout dumps first.
- Each invocation's resolved config is kept: ``config.yaml`` for the first, then ``config.1.yaml``,
  ``config.2.yaml``, ...; the original is never overwritten.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from nemo_rcgrpo.utils.config import ConfigError

RESUME_FREE = (
    "run_dir", "trainer.resume", "trainer.stop_after", "trainer.resume_may_change", "overwrite",
    "logging.progress", "logging.tensorboard", "logging.wandb",
    "generation.vllm.url", "generation.vllm.port", "generation.vllm.devices", "generation.vllm.startup_timeout_s",
    # how the same computation is laid out (checkpoints reshard to another TP x PP x DP)
    "policy.megatron.tp", "policy.megatron.pp", "policy.megatron.recompute", "layout", "trainer.micro_batch_size",
)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "rollouts", "wandb", "wandb_id", "hf", "nemo_rcgrpo_training.json")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out if value else {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): value}


def _free(key: str, allowed: tuple[str, ...]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allowed)


def config_files(run_dir: Path) -> list[Path]:
    """The saved configs in invocation order: config.yaml, config.1.yaml, config.2.yaml, ..."""
    numbered = sorted((int(m.group(1)), p) for p in run_dir.glob("config.*.yaml")
                      if (m := re.fullmatch(r"config\.(\d+)\.yaml", p.name)))
    first = [run_dir / "config.yaml"] if (run_dir / "config.yaml").is_file() else []
    return first + [p for _, p in numbered]


def holds_run(run_dir: Path) -> bool:
    return (run_dir / "config.yaml").is_file() or any((run_dir / "checkpoints").glob("step_*"))


def differences(saved: dict[str, Any], now: dict[str, Any], may_change: tuple[str, ...]) -> list[str]:
    a, b = _flat(saved), _flat(now)
    allowed = RESUME_FREE + tuple(may_change)
    out = []
    for key in sorted(set(a) | set(b)):
        if _free(key, allowed):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            out.append(f"{key} is {a.get(key, '<unset>')!r} there and {b.get(key, '<unset>')!r} now")
    return out


def prepare_run_dir(run_dir: str | Path, config: dict[str, Any], *, resume: bool, overwrite: bool,
                    may_change: tuple[str, ...] = (), write: bool = True) -> Path | None:
    """Check ``run_dir`` against this run (see the module docstring) and save this invocation's config.

    Every rank checks (so every rank stops with the same one line); only the one with ``write`` removes
    and writes. Returns the path of the saved config. Raises ConfigError when the folder holds another run."""
    run_dir = Path(run_dir)
    if holds_run(run_dir):
        if not resume:
            if not overwrite:
                raise ConfigError(f"run_dir {run_dir} holds a run; resume it (trainer.resume=true), start it over "
                                  f"(overwrite=true: its checkpoints and metrics are removed) or choose a new run_dir")
            for name in RUN_OUTPUTS if write else ():
                path = run_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        else:
            saved_files = config_files(run_dir)
            if saved_files:
                saved = yaml.safe_load(saved_files[-1].read_text()) or {}
                diff = differences(saved, config, may_change)
                if diff:
                    more = f" (and {len(diff) - 1} more: {'; '.join(diff[1:3])}{'; ...' if len(diff) > 3 else ''})" \
                        if len(diff) > 1 else ""
                    keys = [d.split(" is ", 1)[0] for d in diff]
                    raise ConfigError(
                        f"cannot resume run_dir {run_dir} ({saved_files[-1].name}): {diff[0]}{more}; use a new run_dir, "
                        f"or allow the change: trainer.resume_may_change=[{','.join(keys)}]")
    if not write:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    existing = config_files(run_dir)
    path = run_dir / "config.yaml" if not existing else run_dir / f"config.{len(existing)}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
