"""Run metrics: ``metrics.jsonl`` always, TensorBoard and W&B (offline by default) when enabled.

Only rank 0 writes them. Every record has ``step``; values must be numbers. A NaN or infinite value is recorded
as such: the string ``"nan"``, ``"inf"`` or ``"-inf"`` in ``metrics.jsonl`` (strict JSON), a float again in
`read_metrics`, the float itself in TensorBoard and W&B. ``metrics.jsonl`` keeps the flat names;
TensorBoard and W&B get them in namespaces (`namespaced`): ``train/``, ``rollout/``, ``timing/``, ``eval/``.

The run's log file (`run_log`): ``run_dir/run.log``, every log record of the package while the run lasts, with the
full traceback of each rollout that failed (its dump and the console keep the one line).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

# rollout statistics (what the sampled trajectories were), by name or prefix; everything else not timing / eval
# is an optimisation quantity (train/)
_ROLLOUT = (
    "reward",
    "zero_variance_fraction",
    "success_",
    "entropy_reward_corr",
    "advantage_",
    "nonzero_advantage",
    "response_tokens",
    "turns",
    "tool_error_rate",
    "rejected_message_rate",
    "truncated_share",
    "groups",
    "rollouts",
    "sampler_",
    "token_mult_prob_error",
    "dropped_zero_variance",
    "sampled_groups",
)


def namespaced(key: str) -> str:
    """The TensorBoard / W&B tag of a metric: ``eval/``, ``timing/``, ``rollout/`` or ``train/`` + its name."""
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key.endswith("_seconds") or key == "tokens_per_s":
        return f"timing/{key}"
    if key.startswith(_ROLLOUT):
        return f"rollout/{key}"
    return f"train/{key}"


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        rank: int = 0,
        tensorboard: bool = True,
        wandb_cfg: Any = None,
        config: dict[str, Any] | None = None,
        resume_step: int = 0,
    ):
        """``resume_step``: records after this step (written by a run killed before its next
        checkpoint) are dropped, so a resumed run's metrics have each step once."""
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            keep_history(path, resume_step)
        self._file = path.open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb_cfg is not None and wandb_cfg.enabled and wandb_cfg.mode != "disabled":
            try:
                import wandb
            except ImportError:
                raise RuntimeError("logging.wandb.enabled=true needs the wandb package (pip install wandb)") from None
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(**wandb_init_args(wandb_cfg, self.run_dir, config, resume_step))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        self._file.write(json.dumps({"step": step, **{k: _json_number(v) for k, v in clean.items()}}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(namespaced(k), v, step)
        if self._wandb is not None:
            self._wandb.log({namespaced(k): v for k, v in clean.items()}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _json_number(value: float) -> float | str:
    """A finite float as itself; NaN and the infinities as the strings "nan", "inf", "-inf" (JSON has no such
    numbers: Python's NaN token breaks other readers)."""
    return value if math.isfinite(value) else str(value)


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _from_json(record: dict[str, Any]) -> dict[str, Any]:
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def wandb_run_id(run_dir: Path) -> str:
    """The run folder's W&B run id, made once and kept in ``run_dir/wandb_id``: a resumed run logs into the
    same W&B run (not a new one per invocation)."""
    path = Path(run_dir) / "wandb_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    import secrets

    run_id = secrets.token_hex(8)
    path.write_text(run_id + "\n")
    return run_id


def wandb_init_args(wandb_cfg: Any, run_dir: Path, config: dict[str, Any] | None, resume_step: int) -> dict[str, Any]:
    """Keyword arguments of ``wandb.init`` for this run (testable without wandb installed)."""
    return {
        "project": wandb_cfg.project,
        "entity": wandb_cfg.entity,
        "group": wandb_cfg.group,
        "tags": list(wandb_cfg.tags) or None,
        "mode": wandb_cfg.mode,
        "dir": str(run_dir),
        "config": config or {},
        "name": wandb_cfg.name or Path(run_dir).name,
        "id": wandb_run_id(run_dir),
        "resume": "allow",
        "reinit": "finish_previous",
    }


def _records(path: Path) -> tuple[list[str], list[dict[str, Any]], str | None]:
    """The lines of ``path`` that are whole records, the records, and the torn last line if there is one (a run
    killed while writing it). A malformed line anywhere else is not a torn write: it raises, naming the file."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    records, torn = [], None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("a record without an integer step")
        except ValueError as e:
            if number == len(lines):
                torn = line
                break
            raise ValueError(f"{path}: line {number} is not a metrics record ({e}); remove it to go on") from None
        records.append(record)
    return lines[: len(records)], records, torn


def keep_history(path: Path, resume_step: int) -> None:
    """``metrics.jsonl`` for a run resumed after ``resume_step``: records past it (written by a run killed before
    its next checkpoint) and a torn last line are dropped, so each step is there once. The file is only ever
    appended to; when lines must go, the kept ones are written to a new file, flushed to disk and renamed over
    it, so a kill at any moment leaves the old history or the new one, never a shorter one."""
    lines, records, torn = _records(path)
    unterminated = False  # a whole last record whose newline was never written: the next line would join it
    if path.stat().st_size > 0:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            unterminated = f.read(1) != b"\n"
    if torn is not None:
        print(
            f"note: {path}: its last line was cut off (a run stopped while writing it) and is dropped: {torn[:80]!r}",
            file=sys.stderr,
        )
    kept = [line for line, record in zip(lines, records) if record["step"] <= resume_step]
    if torn is None and len(kept) == len(lines) and not unterminated:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (a torn last line left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [_from_json(r) for r in _records(path)[1]] if path.exists() else []


class _RunLogHandler(logging.FileHandler):
    """``run_dir/run.log`` (rank r > 0: ``run.rank<r>.log``), made with its folder at the first record only, so a
    run that stops at its config check leaves no folder behind. A log file that cannot be written (a full disk,
    no permission) is said once on stderr and given up: it never stops the run."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def emit(self, record):
        if self.level > logging.CRITICAL:
            return
        try:
            if self.stream is None:
                self.stream = self._open()
            super().emit(record)
        except OSError as e:
            self.setLevel(logging.CRITICAL + 1)
            print(
                f"warning: the run log {self.baseFilename} cannot be written ({e}); it is not written further",
                file=sys.stderr,
            )

    def flush(self):
        try:
            super().flush()
        except OSError:  # a full disk: what could not be written is lost, the run is not
            self.setLevel(logging.CRITICAL + 1)

    def close(self):
        try:
            super().close()
        except OSError:
            self.stream = None


class _ToRoot(logging.Handler):
    """What propagation would do, for WARNING and up only: the run log's DEBUG records (tracebacks) stay in the
    file whatever handlers the root logger has (a notebook's, pytest's); with none, Python's last resort prints."""

    def emit(self, record):
        logging.getLogger().handle(record)


@contextlib.contextmanager
def run_log(run_dir: str | Path):
    """While a run lasts, the package's log records (``nemo_rcgrpo.*``, DEBUG and up: a failed rollout's full
    traceback among them) are appended to the run's log file, each with its time; the console keeps the one-line
    warnings it showed before (WARNING and up, as Python prints them when nothing is configured)."""
    rank = int(os.environ.get("RANK", "0"))
    handler = _RunLogHandler(
        Path(run_dir) / ("run.log" if rank == 0 else f"run.rank{rank}.log"), delay=True, encoding="utf-8"
    )
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package = logging.getLogger("nemo_rcgrpo")
    console = _ToRoot(logging.WARNING)
    level, propagate = package.level, package.propagate
    package.setLevel(logging.DEBUG)
    package.propagate = False
    package.addHandler(handler)
    package.addHandler(console)
    try:
        yield handler.baseFilename
    finally:
        package.removeHandler(handler)
        package.removeHandler(console)
        handler.close()
        package.setLevel(level)
        package.propagate = propagate
