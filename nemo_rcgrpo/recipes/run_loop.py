"""What every training loop does around its steps (stage 1 and RL alike), in one place:

- ``open_run``: refuse another run's folder, keep this invocation's config (config.N.yaml), and where resuming load
  the newest checkpoint into the policy (refused when it was written for another model) and the RNG state;
- ``RunLoop``: the progress bar and the metrics logger of the steps from ``start`` to ``end``; after each step a
  clean stop on a signal (the step finishes and is saved), a checkpoint every ``trainer.save_every`` steps and at
  the end; after the loop the stop reported, or the HF export when the run reached its last step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from nemo_rcgrpo.models.factory import save_policy_checkpoint
from nemo_rcgrpo.models.setup import export_hf
from nemo_rcgrpo.utils.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, set_rng_state
from nemo_rcgrpo.utils.dist import DistInfo, barrier
from nemo_rcgrpo.utils.logging import MetricsLogger
from nemo_rcgrpo.utils.run_dir import check_run_dir, save_run_config
from nemo_rcgrpo.utils.signals import StopFlag, StopRequested


def open_run(cfg, dist: DistInfo, policy, fingerprint: str) -> tuple[Path | None, dict[str, Any]]:
    """The run folder checked and this invocation's config kept; where ``trainer.resume`` finds a checkpoint, its
    weights, optimizer, scheduler and RNG state restored. Returns (that checkpoint, its trainer state) or (None, {})."""
    t, run_dir = cfg.trainer, Path(cfg.run_dir)
    # every rank refuses another run's folder; then rank 0 keeps this invocation's config (config.N.yaml)
    check_run_dir(run_dir, cfg.to_dict(), resume=t.resume, overwrite=cfg.overwrite, may_change=t.resume_may_change)
    barrier(dist)
    if dist.is_main:
        save_run_config(run_dir, cfg.to_dict(), resume=t.resume, overwrite=cfg.overwrite)
    barrier(dist)
    ckpt = latest_checkpoint(run_dir) if t.resume else None
    if ckpt is None:
        return None, {}
    state = load_checkpoint(ckpt)
    ts = state["trainer_state"]
    if ts.get("fingerprint") != fingerprint:
        raise CheckpointError(f"checkpoint {ckpt} was written for another model ({ts.get('model_path')}); "
                              f"use a new run_dir, or start over with trainer.resume=false overwrite=true")
    policy.load_state_dict(state["model"], state["optimizer"], state["scheduler"])
    set_rng_state(state["rng"])
    return ckpt, ts


class RunLoop:
    """Steps ``start + 1 .. end`` of ``total`` (``end``: ``total``, or ``trainer.stop_after`` steps on). Use as a
    context manager; ``steps()`` yields each step's number (from 1) and ``end_step`` ends it::

        with RunLoop(cfg, dist, policy, tokenizer, record, start, total, fingerprint) as loop:
            for step in loop.steps():
                ...  # train
                signum = loop.end_step(step, metrics, log=True, trainer_state={...})
        loop.finish()   # raises StopRequested after a signal; exports run_dir/hf at the last step
    """

    def __init__(self, cfg, dist: DistInfo, policy, tokenizer, record: dict, start: int, total: int, fingerprint: str):
        self.cfg, self.dist, self.policy, self.tokenizer, self.record = cfg, dist, policy, tokenizer, record
        self.start, self.total, self.fingerprint = start, total, fingerprint
        t = cfg.trainer
        self.end = total if t.stop_after is None else min(total, start + t.stop_after)
        self.run_dir = Path(cfg.run_dir)
        self.step = start  # the last step that finished
        self.stopped: StopRequested | None = None
        self._stop = StopFlag()

    def __enter__(self) -> "RunLoop":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg
        self.logger = MetricsLogger(self.run_dir, rank=self.dist.rank, tensorboard=cfg.logging.tensorboard,
                                    wandb_cfg=cfg.logging.wandb, config=cfg.to_dict(), resume_step=self.start)
        self.bar = tqdm(total=self.total, initial=self.start, desc=cfg.stage, unit="step",
                        disable=not (cfg.logging.progress and self.dist.is_main), file=sys.stderr)
        self._stop.install()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.restore()
        self.bar.close()
        self.logger.close()

    def steps(self) -> Iterator[int]:
        """The number (from 1) of each step to run, until ``end`` or a stop."""
        for step in range(self.start + 1, self.end + 1):
            yield step
            if self.stopped is not None:
                return

    def end_step(self, step: int, metrics: dict[str, float], log: bool, trainer_state: dict[str, Any]) -> int | None:
        """After step ``step`` finished: whether a signal arrived (asked of every rank alike), the metrics logged
        (where ``log``, and always on a stop or at the end), a checkpoint written where due (every
        ``trainer.save_every`` steps, at the end, on a stop). Returns the signal number, or None."""
        self.step = step
        signum = self._stop.requested(self.dist)  # a signal arrived: this step is the last of the invocation
        if log or step == self.end or signum:
            self.logger.log(step, metrics)
        self.bar.update(1)
        if step % self.cfg.trainer.save_every == 0 or step == self.end or signum:
            save_policy_checkpoint(self.policy, self.dist, self.run_dir, step, keep_last=self.cfg.trainer.keep_last,
                                   tokenizer=self.tokenizer, record=self.record,
                                   trainer_state={**trainer_state, "fingerprint": self.fingerprint,
                                                  "model_path": self.cfg.model.path, "stage": self.cfg.stage})
        if signum and step < self.end:
            self.stopped = StopRequested(signum, step, latest_checkpoint(self.run_dir))
        return signum

    def finish(self) -> None:
        """After the loop: the stop raised (every rank), or the HF export (run_dir/hf) where the run reached its
        last step and ``trainer.export_hf``."""
        if self.stopped is not None:
            barrier(self.dist)
            raise self.stopped
        if self.cfg.trainer.export_hf and self.step == self.total:
            hf = self.policy.sync_hf_model()  # a collective with the megatron backend
            if self.dist.is_main:
                export_hf(hf, self.tokenizer, self.run_dir / "hf", self.record, chat=self.cfg.chat)
        barrier(self.dist)
