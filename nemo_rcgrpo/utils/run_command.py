"""How a command ends when it fails: `run_command` runs the body of an entry point (``rcgrpo train|eval|prepare-data|
score|...``, ``python nemo_rcgrpo/train.py``) and turns a failure the user can act on (a wrong setting, missing or
bad data or model files, a folder another run holds or that cannot be written, a full disk, a generation server that
died, a signal) into one line on stderr and an exit code. Any other exception is a bug and keeps its traceback.

The one table of which exception gives which line and exit code is `FAILURES`:

    0        the command did its work
    2        a failure its line explains (``error: ...``)
    3        an evaluation that stopped before it scored every episode (``error: evaluation stopped: ...``)
    128 + N  a stop on signal N: a clean stop after a saved step, or a second signal that abandoned the step
    1        `rcgrpo serve`: the server it runs ended on its own
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Callable


class CommandError(Exception):
    """A failure a command words itself (a usage error, a file it names): ``error: <message>``, exit ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Failure:
    """An exception of one of the classes ``names`` ("module.Class"; a subclass too) ends a command with ``line``
    (``{e}``: the exception's text) and exits ``code`` (None: the exception's own ``exit_code``)."""

    names: tuple[str, ...]
    line: str
    code: int | None


# First match first. The classes are named, not imported: an exception of a module that was never imported cannot
# have been raised, so a command loads BFCL's, torch's or vLLM's modules only where it uses them.
FAILURES: tuple[Failure, ...] = (
    Failure(("nemo_rcgrpo.utils.signals.StopRequested",), "{e}", None),  # the step was saved; exit 128 + signal
    Failure(("nemo_rcgrpo.utils.run_command.CommandError",), "error: {e}", None),
    Failure(("nemo_rcgrpo.evaluation.run.EvaluationIncomplete",), "error: evaluation stopped: {e}", 3),
    Failure(
        (
            "builtins.ValueError",  # ConfigError, PluginContractError, the data's and the chat format's errors, ...
            "builtins.OSError",  # a file not found or already there, a full disk (DiskFull), a folder not writable
            "nemo_rcgrpo.envs.interfaces.DataError",  # a task source's data missing (BFCL's: BFCLDataError)
            "nemo_rcgrpo.models.hf.ModelFilesError",
            "nemo_rcgrpo.utils.checkpoint.CheckpointError",
            "nemo_rcgrpo.generation.vllm_client.GeneratorError",  # a generation server that died or cannot be reached
            "nemo_rcgrpo.recipes.run_loop.NonFiniteTraining",
            "nemo_rcgrpo.utils.run_lock.RunLocked",
            "nemo_rcgrpo.utils.run_lock.FolderNotWritable",
        ),
        "error: {e}",
        2,
    ),
)


def _name(cls: type) -> str:
    module = cls.__module__
    if module == "__main__":  # an entry run as `python -m nemo_rcgrpo.x`: its own classes are __main__'s
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else module
    return f"{module}.{cls.__qualname__}"


def explain(error: BaseException, disk_full: Callable[[OSError], str] | None = None) -> tuple[str, int] | None:
    """(the line, the exit code) that ``error`` ends a command with, or None: not a failure of `FAILURES` (a bug).
    ``disk_full``: see `run_command`."""
    if disk_full is not None and isinstance(error, OSError):
        from nemo_rcgrpo.utils.run_lock import disk_full as is_disk_full

        if is_disk_full(error):
            return f"error: {disk_full(error)}", 2
    names = [_name(cls) for cls in type(error).__mro__]
    for failure in FAILURES:
        if any(name in failure.names for name in names):
            code = failure.code if failure.code is not None else getattr(error, "exit_code")
            return failure.line.format(e=error), code
    return None


def run_command(
    command: Callable[[], int],
    *,
    disk_full: Callable[[OSError], str] | None = None,
    interrupted: Callable[[KeyboardInterrupt], str] | None = None,
) -> int:
    """``command()``'s exit code; or, where it raised a failure of `FAILURES`, that failure's line on stderr and its
    exit code. Another exception propagates, with its traceback.

    ``disk_full``: the line (after ``error: ``) of a full disk or quota (an OSError that `run_lock.disk_full`
    recognises), naming what the command was writing and what is safe (default: the error's own text).
    ``interrupted``: the line of a KeyboardInterrupt (a second signal, `utils/signals.py`: Abandoned), which then
    exits 128 + its signal; without it the interrupt propagates (Python's own traceback and exit)."""
    try:
        return command()
    except KeyboardInterrupt as e:
        if interrupted is None:
            raise
        print(interrupted(e), file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    except Exception as e:
        explained = explain(e, disk_full)
        if explained is None:
            raise
        print(explained[0], file=sys.stderr)
        return explained[1]
