"""Stopping a run cleanly: Ctrl-C, SIGTERM (schedulers, ``kill``) and SIGUSR1 (Slurm's warning before the end).

The first signal asks the run to stop: the step under way finishes, a checkpoint of that step is
written, and the run prints one line saying where it stopped and how to resume, then exits with
128 + the signal number (130 for Ctrl-C, 143 for SIGTERM, 138 for SIGUSR1). A second Ctrl-C
abandons the step at once (``KeyboardInterrupt``); checkpoints are written atomically, so the
newest complete one is what a resume continues from. So does a second SIGTERM or SIGUSR1 (a start-up that
hangs can be ended with a second ``kill``). With several ranks, every rank stops after
the same step (the request is combined across ranks once per step).

Every phase answers alike: the entry point installs a flag for the whole invocation (start-up, model loading,
the generation server's start), and the loop's own flag takes over what arrived before it. A signal before the
first step stops there; one during a checkpoint is acted on as soon as the checkpoint is complete; one during
the last step skips the export (a resume writes it); one during the export lets it finish (it is never left
partial) and then stops. Each ends with the same line and exit code.
"""

from __future__ import annotations

import signal
from typing import Any

SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGUSR1")) if s is not None)


class StopRequested(Exception):
    """Raised by a training loop after it stopped cleanly on a signal (caught by the entry point)."""

    def __init__(
        self,
        signum: int,
        step: int,
        checkpoint: Any,
        command_hint: str = "run the same command again",
        done: str | None = None,
    ):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        then = done if done else f"to resume, {command_hint}"
        super().__init__(f"stopped by {name} after step {step} ({where}); {then}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Abandoned(KeyboardInterrupt):
    """A second signal: what was under way is abandoned at once (exit 128 + ``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_ACTIVE: list["StopFlag"] = []  # the installed flags, innermost last


class StopFlag:
    """Installs handlers for SIGNALS while the loop runs; ``requested(dist)`` tells whether to stop now. A flag
    installed inside another takes over the signal the outer one received, and hands back its own on restore."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise Abandoned(signum)  # a second signal (Ctrl-C, kill): abandon what is under way
        self.signum = signum

    def install(self) -> "StopFlag":
        import threading

        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            if _ACTIVE:
                self.signum = self.signum or _ACTIVE[-1].signum
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            _ACTIVE.append(self)
        return self

    def __enter__(self) -> "StopFlag":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
            if _ACTIVE and self.signum:
                _ACTIVE[-1].signum = _ACTIVE[-1].signum or self.signum

    def requested(self, dist: Any = None) -> int | None:
        """The signal to stop on, agreed by every rank (a collective when there are several)."""
        if dist is None or getattr(dist, "world_size", 1) == 1:
            return self.signum
        import torch
        import torch.distributed as tdist

        box = torch.tensor([self.signum or 0], dtype=torch.long, device=getattr(dist, "device", "cpu"))
        tdist.all_reduce(box, op=tdist.ReduceOp.MAX)
        return int(box.item()) or None
