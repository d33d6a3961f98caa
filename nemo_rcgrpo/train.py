"""Training entry: ``torchrun nemo_rcgrpo/train.py --config-name sft_smollm_cpu [key=value ...]``.

Also ``python nemo_rcgrpo/train.py ...`` (one process) and ``rcgrpo train ...``.
The config (``conf/<name>.yaml``) is composed with Hydra, validated against
`nemo_rcgrpo.config.TrainConfig` and dispatched on the loop of the registered
``stage`` (`nemo_rcgrpo/stages.py`): ``sft`` and ``rctp`` run the stage-1 loop
(`recipes/stage1.py`); ``grpo``, ``rcgrpo`` and ``dapo_filter`` the stage-2 loop
(`recipes/rl.py`); so does a user's stage of either loop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script (torchrun nemo_rcgrpo/train.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("nemo_rcgrpo.train")


def _wrote_config(run_dir: str, since: float) -> bool:
    """This invocation saved its config into ``run_dir`` (its run was accepted there), on any rank's disk."""
    from nemo_rcgrpo.utils.run_dir import config_files

    try:
        return any(p.stat().st_mtime >= since - 1.0 for p in config_files(Path(run_dir)))
    except OSError:
        return False


def _disk_full_line(error: OSError, run_dir: str | None) -> str:
    """``no space left on device while writing <what> in <where>; the newest complete checkpoint is <path>``."""
    from nemo_rcgrpo.utils.checkpoint import latest_checkpoint
    from nemo_rcgrpo.utils.run_lock import DiskFull

    head = str(error) if isinstance(error, DiskFull) else f"no space left on device ({error})"
    if run_dir is None:
        return head
    ckpt = latest_checkpoint(run_dir)
    return f"{head}; the newest complete checkpoint is {ckpt}" if ckpt else f"{head}; no checkpoint was written"


def _interrupted_line(error: KeyboardInterrupt, run_dir: str | None) -> str:
    """A second signal abandoned what was under way: ``interrupted by a second SIGINT (<newest checkpoint>); ...``."""
    import signal

    from nemo_rcgrpo.utils.checkpoint import latest_checkpoint

    signum = getattr(error, "signum", signal.SIGINT)
    ckpt = latest_checkpoint(run_dir) if run_dir is not None else None
    where = f"the newest complete checkpoint is {ckpt}" if ckpt else "no checkpoint was written"
    return f"interrupted by a second {signal.Signals(signum).name} ({where}); to resume, run the same command again"


def main(argv: Sequence[str] | None = None) -> int:
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.cli_help import resolve
    from nemo_rcgrpo.utils.logging import run_log
    from nemo_rcgrpo.utils.run_command import run_command
    from nemo_rcgrpo.utils.run_lock import check_writable, run_lock
    from nemo_rcgrpo.utils.signals import StopFlag, StopRequested

    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = None  # the run's config once read: the lines of a full disk and of a second signal name its checkpoint

    def train() -> int:
        nonlocal cfg
        resolved = resolve("train", argv, TrainConfig)
        if resolved is None:  # --help, or --cfg job (validated, printed, nothing run)
            return 0
        invocation, cfg = resolved
        started = time.time()
        check_writable(cfg.run_dir, "run_dir")  # before any model loads
        # a signal at start-up (loading, a server starting) is held here and answered before the first step
        with StopFlag() as outer, run_lock(cfg.run_dir, int(os.environ.get("RANK", "0"))), run_log(cfg.run_dir):
            try:
                from nemo_rcgrpo.stages import loop_of

                result = loop_of(cfg.stage_spec).run(cfg, recipe=invocation.name)  # the stage's registered loop
            except Exception as e:  # into the run's log with its traceback; the console gets the line below
                if _wrote_config(cfg.run_dir, started):  # never into a folder this invocation was refused
                    log.debug("the run stopped: %s", e, exc_info=e)
                raise
            if outer.signum:  # it came as the run ended: all was done, said as any stop is
                from nemo_rcgrpo.utils.checkpoint import latest_checkpoint

                raise StopRequested(
                    outer.signum, result["steps"], latest_checkpoint(cfg.run_dir), done="the run is complete"
                )
        print(
            f"{cfg.stage}: {result['steps']} steps, final loss {result.get('loss', float('nan')):.4f}; run in "
            f"{cfg.run_dir} (metrics.jsonl, tensorboard/, checkpoints/{', rollouts/' if cfg.is_rl else ''})"
        )
        return 0

    # a full disk: what was being written and the newest complete checkpoint
    return run_command(
        train,
        disk_full=lambda e: _disk_full_line(e, cfg.run_dir if cfg is not None else None),
        interrupted=lambda e: _interrupted_line(e, cfg.run_dir if cfg is not None else None),
    )


if __name__ == "__main__":
    sys.exit(main())
