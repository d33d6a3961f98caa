"""What every training loop does around its steps (stage 1 and RL alike), in one place:

- ``RunSettings``: the settings it reads, and only those (``RunSettings.of(cfg)``): the run folder, the trainer's
  checkpoint, resume and stop settings, logging, and what the banner and the HF export name;
- ``open_run``: refuse another run's folder, keep this invocation's config (config.N.yaml), and where resuming load
  the newest checkpoint that verifies against its manifest into the policy (refused when it was written for another
  model) and the RNG state;
- ``RunLoop``: the progress bar and the metrics logger of the steps from ``start`` to ``end``; after each step a
  clean stop on a signal (the step finishes and is saved), a checkpoint every ``trainer.save_every`` steps and at
  the end; after the loop the stop reported, or the HF export when the run reached its last step.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from nemo_rcgrpo.config_schema import ChatConfig, LoggingConfig, ModelConfig, TrainerConfig
from nemo_rcgrpo.models.factory import save_policy_checkpoint
from nemo_rcgrpo.models.setup import export_hf
from nemo_rcgrpo.utils.banner import say
from nemo_rcgrpo.utils.checkpoint import (
    CheckpointError,
    choose_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    set_rng_state,
)
from nemo_rcgrpo.utils.dist import DistInfo, all_reduce_sum, barrier, broadcast_object
from nemo_rcgrpo.utils.logging import MetricsLogger
from nemo_rcgrpo.utils.run_dir import check_run_dir, save_run_config
from nemo_rcgrpo.utils.run_lock import writing
from nemo_rcgrpo.utils.signals import StopFlag, StopRequested


@dataclass(frozen=True)
class RunSettings:
    """What the loop around a run's steps reads of its config, and nothing else."""

    run_dir: Path
    stage: str
    trainer: TrainerConfig  # resume, save_every, keep_last, stop_after, on_nonfinite, export_hf
    logging: LoggingConfig
    model: ModelConfig  # its path (checkpoints, banner) and what the banner says of it
    chat: ChatConfig  # the chat template the HF export carries
    policy_backend: str
    generation_backend: str | None  # an RL stage's generator; None in stage 1
    overwrite: bool
    config: dict[str, Any]  # the whole config: compared with the run folder's, kept as config.N.yaml, logged

    @classmethod
    def of(cls, cfg) -> "RunSettings":
        return cls(
            Path(cfg.run_dir),
            cfg.stage,
            cfg.trainer,
            cfg.logging,
            cfg.model,
            cfg.chat,
            cfg.policy.backend,
            cfg.generation.backend if cfg.is_rl else None,
            cfg.overwrite,
            cfg.to_dict(),
        )


def _check_settings(who: str, run: Any) -> None:
    """A whole config is not what the loop takes: one line naming the call that makes its settings."""
    if not isinstance(run, RunSettings):
        raise TypeError(f"{who} takes RunSettings.of(cfg), not {type(run).__name__}")


def open_run(run: RunSettings, dist: DistInfo, policy, fingerprint: str) -> tuple[Path | None, dict[str, Any]]:
    """The run folder checked and this invocation's config kept; where ``trainer.resume`` finds a checkpoint, its
    weights, optimizer, scheduler and RNG state restored. Returns (that checkpoint, its trainer state) or (None, {})."""
    _check_settings("open_run", run)
    t, run_dir = run.trainer, run.run_dir
    # every rank refuses another run's folder; then rank 0 keeps this invocation's config (config.N.yaml)
    check_run_dir(run_dir, run.config, resume=t.resume, overwrite=run.overwrite, may_change=t.resume_may_change)
    barrier(dist)
    if dist.is_main:
        with writing("the run's config", run_dir):
            save_run_config(run_dir, run.config, resume=t.resume, overwrite=run.overwrite)
    barrier(dist)
    ckpt = resume_checkpoint(run_dir, dist) if t.resume else None
    if ckpt is None:
        return None, {}
    state = load_checkpoint(ckpt)
    ts = state["trainer_state"]
    if ts.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {ckpt} was written for another model ({ts.get('model_path')}); "
            f"use a new run_dir, or start over with trainer.resume=false overwrite=true"
        )
    policy.load_state_dict(state["model"], state["optimizer"], state["scheduler"])
    set_rng_state(state["rng"])
    return ckpt, ts


NONFINITE_KEYS = ("loss", "grad_norm")
MAX_CONSECUTIVE_SKIPS = 5  # trainer.on_nonfinite=skip: the run stops after this many skipped steps in a row


class NonFiniteTraining(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite: the run stops with nothing saved from that step."""


def nonfinite(metrics: dict[str, float]) -> dict[str, float]:
    """The step's loss and gradient norm where they are NaN or infinite."""
    return {
        k: float(metrics[k])
        for k in NONFINITE_KEYS
        if metrics.get(k) is not None and not math.isfinite(float(metrics[k]))
    }


def resume_checkpoint(run_dir: Path, dist: DistInfo) -> Path | None:
    """The checkpoint to resume: rank 0 verifies (`choose_checkpoint`: the newest that verifies, the failing newer
    ones named and set aside), every rank gets its choice, or the same one-line CheckpointError."""
    chosen: tuple[str | None, str | None] = (None, None)
    if dist.is_main:
        try:
            path = choose_checkpoint(run_dir, note=say)
            chosen = (str(path) if path else None, None)
        except CheckpointError as e:
            chosen = (None, str(e))
        except Exception as e:  # noqa: BLE001 - any failure reaches every rank as one line (none waits forever)
            chosen = (None, f"cannot verify the checkpoints in {run_dir}/checkpoints: {type(e).__name__}: {e}")
    path, error = broadcast_object(chosen, dist)
    if error:
        raise CheckpointError(error)
    return Path(path) if path else None


class RunLoop:
    """Steps ``start + 1 .. end`` of ``total`` (``end``: ``total``, or ``trainer.stop_after`` steps on). Use as a
    context manager; ``steps()`` yields each step's number (from 1) and ``end_step`` ends it::

        with RunLoop(run, dist, policy, tokenizer, record, start, total, fingerprint) as loop:
            for step in loop.steps():
                ...  # train
                signum = loop.end_step(step, metrics, log=True, trainer_state={...})
        loop.finish()   # raises StopRequested after a signal; exports run_dir/hf at the last step
    """

    def __init__(
        self,
        run: RunSettings,
        dist: DistInfo,
        policy,
        tokenizer,
        record: dict,
        start: int,
        total: int,
        fingerprint: str,
    ):
        _check_settings("RunLoop", run)
        self.run, self.dist, self.policy, self.tokenizer, self.record = run, dist, policy, tokenizer, record
        self.start, self.total, self.fingerprint = start, total, fingerprint
        t = run.trainer
        self.end = total if t.stop_after is None else min(total, start + t.stop_after)
        self.run_dir = run.run_dir
        self.step = start  # the last step that finished
        self.stopped: StopRequested | None = None
        self._stop = StopFlag()
        self.skips = 0  # steps skipped in a row (trainer.on_nonfinite=skip)
        if t.on_nonfinite == "skip" and not policy.skips_nonfinite_updates:
            from nemo_rcgrpo.utils.config import ConfigError

            raise ConfigError(
                f"trainer.on_nonfinite=skip needs a policy backend that skips non-finite updates; "
                f"policy.backend={run.policy_backend} applies them (use trainer.on_nonfinite=stop)"
            )
        self._last_state: dict[str, Any] | None = None  # the trainer state of the last finished step
        self._saved_step: int | None = None  # the last step this invocation saved

    def __enter__(self) -> "RunLoop":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run = self.run
        self.logger = MetricsLogger(
            self.run_dir,
            rank=self.dist.rank,
            tensorboard=run.logging.tensorboard,
            wandb_cfg=run.logging.wandb,
            config=run.config,
            resume_step=self.start,
        )
        self.bar = tqdm(
            total=self.total,
            initial=self.start,
            desc=run.stage,
            unit="step",
            disable=not (run.logging.progress and self.dist.is_main),
            file=sys.stderr,
        )
        self._stop.install()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:  # else `finish` keeps answering signals through the export, then restores
            self._stop.restore()
        self.bar.close()
        try:
            with writing("the metrics", self.run_dir / "metrics.jsonl"):
                self.logger.close()
        except OSError:
            if exc is None:  # an error already on its way is the one to report
                self._stop.restore()  # `finish` will not run
                raise

    def steps(self) -> Iterator[int]:
        """The number (from 1) of each step to run, until ``end`` or a stop. Before each step a signal that arrived
        since the last check (at start-up, during the last checkpoint) stops the run there, the step before it
        saved."""
        for step in range(self.start + 1, self.end + 1):
            if self.stopped is None:
                signum = self._stop.requested(self.dist)  # every rank alike
                if signum:
                    self._stop_here(signum)
            if self.stopped is not None:
                return
            yield step
            if self.stopped is not None:
                return

    def _stop_here(self, signum: int) -> None:
        """Stop before the next step: the last finished step saved first, where its checkpoint is not there yet."""
        if self.step > self.start and self._last_state is not None and self._saved_step != self.step:
            self._save(self.step, self._last_state)  # decided from memory: every rank alike
        self.stopped = StopRequested(signum, self.step, latest_checkpoint(self.run_dir))

    def _save(self, step: int, trainer_state: dict[str, Any]) -> None:
        self._saved_step = step
        with writing(f"checkpoint step_{step}", self.run_dir / "checkpoints"):
            save_policy_checkpoint(
                self.policy,
                self.dist,
                self.run_dir,
                step,
                keep_last=self.run.trainer.keep_last,
                tokenizer=self.tokenizer,
                record=self.record,
                trainer_state={
                    **trainer_state,
                    "fingerprint": self.fingerprint,
                    "model_path": self.run.model.path,
                    "stage": self.run.stage,
                },
            )

    def end_step(self, step: int, metrics: dict[str, float], log: bool, trainer_state: dict[str, Any]) -> int | None:
        """After step ``step`` finished: whether a signal arrived (asked of every rank alike), the metrics logged
        (where ``log``, and always on a stop or at the end), a checkpoint written where due (every
        ``trainer.save_every`` steps, at the end, on a stop). Returns the signal number, or None."""
        self.step = step
        signum = self._stop.requested(self.dist)  # a signal arrived: this step is the last of the invocation
        bad = nonfinite(metrics)
        with writing("the metrics", self.run_dir / "metrics.jsonl"):
            if log or step == self.end or signum or bad:
                self.logger.log(step, metrics)  # non-finite values recorded as such
        self.bar.update(1)
        stop = self._nonfinite(step, bad, metrics) if bad else None
        self.skips = self.skips if bad else 0
        if self.dist.world_size > 1 and all_reduce_sum(1.0 if stop else 0.0, self.dist) and not stop:
            stop = f"non-finite values on another rank at step {step}; the run stopped"  # every rank stops alike
        if stop:
            raise NonFiniteTraining(stop)
        self._last_state = trainer_state
        if step % self.run.trainer.save_every == 0 or step == self.end or signum:
            self._save(step, trainer_state)
        if signum:  # the last step too: the export is left to the resume
            self.stopped = StopRequested(
                signum,
                step,
                latest_checkpoint(self.run_dir),
                command_hint="run the same command again"
                if step < self.end
                else "run the same command again (it writes what is left)",
            )
        return signum

    def _nonfinite(self, step: int, bad: dict[str, float], metrics: dict[str, float]) -> str | None:
        """A NaN or infinite loss or gradient norm: why the run stops (nothing saved from this step), or None with
        ``trainer.on_nonfinite=skip`` where the policy applied no update from it."""
        what = " ".join(f"{k}={v}" for k, v in bad.items())
        skip = self.run.trainer.on_nonfinite == "skip"
        skipped = skip and metrics.get("skipped_updates", 0) > 0
        self.skips = self.skips + 1 if skipped else 0
        newest = latest_checkpoint(self.run_dir)
        where = f"the newest checkpoint is {newest}" if newest else "no checkpoint was written"
        if skipped and self.skips <= MAX_CONSECUTIVE_SKIPS:
            if self.dist.is_main:
                say(f"note: step {step}: non-finite {what}; its update was skipped (trainer.on_nonfinite=skip)")
            return None
        if skipped:
            return f"{self.skips} steps in a row had non-finite values (step {step}: {what}); the run stopped, {where}"
        advice = (
            "the update was applied all the same (its gradient norm was finite), so it cannot be skipped; "
            "lower trainer.lr"
            if skip
            else "lower trainer.lr, or skip such steps with trainer.on_nonfinite=skip"
        )
        return f"non-finite {what} at step {step}; the run stopped and nothing was saved from this step ({where}); {advice}"

    def finish(self) -> None:
        """After the loop: the stop raised (every rank), or the HF export (run_dir/hf) where the run reached its
        last step and ``trainer.export_hf``. A signal during the export lets it finish whole, then stops with the
        same line. The signal handlers are given back at the end."""
        try:
            if self.stopped is not None:
                barrier(self.dist)
                raise self.stopped
            signum = self._stop.requested(self.dist)
            if signum:  # it arrived during the last checkpoint: no export begins (the resume writes it)
                raise StopRequested(
                    signum,
                    self.step,
                    latest_checkpoint(self.run_dir),
                    command_hint="run the same command again (it writes what is left)",
                )
            exported = False
            if self.run.trainer.export_hf and self.step == self.total:
                hf = self.policy.sync_hf_model()  # a collective with the megatron backend
                if self.dist.is_main:
                    with writing("the HF export", self.run_dir / "hf"):
                        export_hf(hf, self.tokenizer, self.run_dir / "hf", self.record, chat=self.run.chat)
                exported = True
            barrier(self.dist)
            signum = self._stop.requested(self.dist)
            if signum:  # it arrived after the last step's check: what was under way finished
                done = f"the export {self.run_dir / 'hf'} is complete" if exported else "the steps are complete"
                raise StopRequested(signum, self.step, latest_checkpoint(self.run_dir), done=done)
        finally:
            self._stop.restore()
