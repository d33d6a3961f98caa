"""What a run folder holds, checked before a run writes into it.

- A folder that holds a run (a ``config.yaml`` or a checkpoint) is resumed only by the same run:
  its last saved config must equal this one, except for the settings that may change on resume
  (``RESUME_FREE``: how long this invocation runs, where it logs and shows progress, where the
  generation server is, how the same computation is laid out on devices) and the ones the user names in ``trainer.resume_may_change``. A
  difference is one line naming it and the ways out.
- Configs are compared when there is a checkpoint to resume (a run stopped before its first one
  starts again with the new settings).
- ``trainer.resume=false`` on a folder that holds a run is refused unless ``overwrite=true``,
  which removes that run's checkpoints, metrics, TensorBoard files and rollout dumps first.
- Each invocation's resolved config is kept: ``config.yaml`` for the first, then ``config.1.yaml``,
  ``config.2.yaml``, ...; the original is never overwritten.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from nemo_rcgrpo.utils.config import RENAMED, RENAMED_RL, ConfigError

RESUME_FREE = (
    "run_dir",
    "trainer.resume",
    "trainer.stop_after",
    "trainer.resume_may_change",
    "overwrite",
    # bookkeeping: what is logged, saved and shown, not what is computed
    "logging",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.log_every",
    "trainer.export_hf",
    "trainer.on_nonfinite",  # what happens if a step goes non-finite, not what a finite step computes
    "rl.eval_every",
    "rl.eval_tasks",
    "rl.max_failed_share",
    "data.prepare_if_missing",
    # where and how the generation server is reached
    "generation.vllm.url",
    "generation.vllm.engines",
    "generation.vllm.host",
    "generation.vllm.port",
    "generation.vllm.devices",
    "generation.vllm.python",
    "generation.vllm.weight_dir",
    "generation.vllm.nccl_master",
    "generation.vllm.startup_timeout",
    "generation.vllm.request_timeout",
    "generation.vllm.max_retries",
    "generation.vllm.max_concurrency",
    # how the same tokens are generated and scored (prefixes shared or not: the same up to rounding)
    "generation.share_prefixes",
    "trainer.share_prefix",
    "trainer.pack_sequences",
    # how the same computation is laid out (checkpoints reshard to another TP x PP x DP)
    "policy.megatron.tp",
    "policy.megatron.pp",
    "policy.megatron.recompute",
    "layout",
    "trainer.micro_batch_size",
    "trainer.micro_batch_tokens",
)
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "tensorboard",
    "rollouts",
    "eval",
    "generator",
    "data_stats.json",
    "wandb",
    "wandb_id",
    "hf",
    "nemo_rcgrpo_training.json",
    "run.log",
)


# settings added after runs were saved: a run saved without one resumes while it keeps the value that means what
# the run did before the setting existed
NEWER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "plugins": ([], ()),
    "env.task_source": ("bfcl",),
    # a label (the model group's); the paths it makes are compared
    "model.name": (None, "llama8b", "qwen7b"),
    # registered parts chosen by name: the values that mean what ran before
    "env.settings.reward": ("state_x_action",),
    "rl.group_filter": (None,),
    "rl.loss.policy_loss": ("clipped",),
    "data.dataset": (None,),
    "rl.loss.correction": ("none",),
    "rl.loss.correction_cap": (2.0,),
    "rl.max_staleness": (0,),  # generated, then trained
    # runs before it answered a rejected message with error observations
    "chat.rejected_message": ("error",),
}


def _upgraded(flat: dict[str, Any]) -> dict[str, Any]:
    """A saved run's flat settings in today's keys: the renamed ones (``RENAMED``, ``RENAMED_RL``), and
    ``rl.loss.tis_cap`` (null: off), which became ``rl.loss.correction`` (token_tis where a cap was set) and
    ``rl.loss.correction_cap``."""
    out = {RENAMED.get(k, RENAMED_RL.get(k, k)): v for k, v in flat.items()}
    if "rl.loss.tis_cap" in out:
        cap = out.pop("rl.loss.tis_cap")
        out["rl.loss.correction"] = "none" if cap is None else "token_tis"
        if cap is not None:
            out["rl.loss.correction_cap"] = cap
    return out


# settings only an RL stage reads: a stage-1 run saved without one resumes whatever its value now
RL_ONLY = ("chat.rejected_message",)


def _rl_stage(stage: Any) -> bool:
    """Whether the saved run's ``stage`` runs the RL loop (unknown stages count as RL: the strict reading)."""
    from nemo_rcgrpo.stages import loop_of, stage_of

    try:
        return loop_of(stage_of(str(stage))).rl
    except Exception:  # noqa: BLE001 - a stage no longer registered
        return True


def flat_config(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: leaf value} (an empty section is a leaf {})."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flat_config(v, f"{prefix}{k}."))
        return out if value else {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): value}


def _free(key: str, allowed: tuple[str, ...]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allowed)


def config_files(run_dir: Path) -> list[Path]:
    """The saved configs in invocation order: config.yaml, config.1.yaml, config.2.yaml, ..."""
    numbered = sorted(
        (int(m.group(1)), p)
        for p in run_dir.glob("config.*.yaml")
        if (m := re.fullmatch(r"config\.(\d+)\.yaml", p.name))
    )
    first = [run_dir / "config.yaml"] if (run_dir / "config.yaml").is_file() else []
    return first + [p for _, p in numbered]


def holds_run(run_dir: Path) -> bool:
    return (run_dir / "config.yaml").is_file() or any((run_dir / "checkpoints").glob("step_*"))


def differences(saved: dict[str, Any], now: dict[str, Any], may_change: tuple[str, ...]) -> list[str]:
    a, b = _upgraded(flat_config(saved)), flat_config(now)
    # the old env section held BFCL's settings whatever the env: those today's env does not take were never read
    a = {k: v for k, v in a.items() if k in b or k not in RENAMED.values()}
    allowed = RESUME_FREE + tuple(RENAMED.get(k, RENAMED_RL.get(k, k)) for k in may_change)  # old names too
    out = []
    for key in sorted(set(a) | set(b)):
        if _free(key, allowed):
            continue
        if key in NEWER_DEFAULTS and key not in a and b.get(key) in NEWER_DEFAULTS[key]:  # newer than that run
            continue
        if key in RL_ONLY and key not in a and not _rl_stage(a.get("stage")):  # a setting stage 1 never reads
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            ran = (
                f" (that run ran as {key}={NEWER_DEFAULTS[key][0]})"
                if key in NEWER_DEFAULTS and key not in a and key in RL_ONLY
                else ""
            )
            out.append(f"{key} is {a.get(key, '<unset>')!r} there{ran} and {b.get(key, '<unset>')!r} now")
    return out


def check_run_dir(
    run_dir: str | Path, config: dict[str, Any], *, resume: bool, overwrite: bool, may_change: tuple[str, ...] = ()
) -> None:
    """Refuse (ConfigError, one line) a ``run_dir`` that holds another run; every rank calls it, nothing is written.

    The configs are compared only when there is a checkpoint to resume: a run stopped before its first
    checkpoint has nothing to continue, so it starts again with this invocation's settings."""
    run_dir = Path(run_dir)
    if not holds_run(run_dir):
        return
    if not resume:
        if not overwrite:
            raise ConfigError(
                f"run_dir {run_dir} holds a run; resume it (trainer.resume=true), start it over "
                f"(overwrite=true: its checkpoints and metrics are removed) or choose a new run_dir"
            )
        return
    if overwrite:
        raise ConfigError(
            "overwrite=true starts the run over and needs trainer.resume=false; "
            "with trainer.resume=true the run in run_dir is continued"
        )
    saved_files = config_files(run_dir)
    if not saved_files or not any((run_dir / "checkpoints").glob("step_*")):
        return
    saved = yaml.safe_load(saved_files[-1].read_text()) or {}
    diff = differences(saved, config, may_change)
    if diff:
        more = (
            f" (and {len(diff) - 1} more: {'; '.join(diff[1:3])}{'; ...' if len(diff) > 3 else ''})"
            if len(diff) > 1
            else ""
        )
        keys = [d.split(" is ", 1)[0] for d in diff]
        raise ConfigError(
            f"cannot resume run_dir {run_dir} ({saved_files[-1].name}): {diff[0]}{more}; use a new run_dir, "
            f"or allow the change: trainer.resume_may_change=[{','.join(keys)}]"
        )


def save_run_config(run_dir: str | Path, config: dict[str, Any], *, resume: bool, overwrite: bool) -> Path:
    """After check_run_dir, on one rank: remove the old run (overwrite) and keep this invocation's config,
    written atomically (``config.yaml`` first, then ``config.N.yaml`` with N one above the highest)."""
    run_dir = Path(run_dir)
    if overwrite and not resume and holds_run(run_dir):
        for path in run_dir.glob("run.rank*.log"):  # the other ranks' logs of the old run
            path.write_bytes(b"")
        for name in RUN_OUTPUTS:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif name == "run.log" and path.exists():  # emptied, not removed: this run may be appending to it
                path.write_bytes(b"")
            elif path.exists():
                path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    existing = config_files(run_dir)
    if not existing:
        path = run_dir / "config.yaml"
    else:
        numbers = [int(p.name.split(".")[1]) for p in existing if p.name != "config.yaml"]
        path = run_dir / f"config.{max(numbers, default=0) + 1}.yaml"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, path)
    return path


def prepare_run_dir(
    run_dir: str | Path, config: dict[str, Any], *, resume: bool, overwrite: bool, may_change: tuple[str, ...] = ()
) -> Path:
    """check_run_dir then save_run_config (one process)."""
    check_run_dir(run_dir, config, resume=resume, overwrite=overwrite, may_change=may_change)
    return save_run_config(run_dir, config, resume=resume, overwrite=overwrite)
