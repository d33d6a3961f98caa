"""One run per folder, folders checked before anything loads, and a full disk said in one line.

- `check_writable`: a run or output folder that cannot be written (a file in its place, no permission, a
  read-only disk) is refused at start, before any model loads, in one line.
- `run_lock`: while a run lasts, every rank holds an exclusive lock on ``run_dir/.lock/rank<r>.lock`` (`filelock`,
  an OS lock: a killed run's lock is released by the kernel, so the next run takes it over safely). A second
  invocation on the same folder is refused in one line naming the holder's host, pid and start time, kept in
  ``rank<r>.owner`` beside the lock.
- `DiskFull` and `writing`: ENOSPC (or its quota cousin EDQUOT) while writing a checkpoint, the export, the
  metrics or a dump becomes one error naming what was being written and where; the entry point adds the newest
  complete checkpoint and exits with 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

LOCK_DIR = ".lock"
_FULL = (errno.ENOSPC, errno.EDQUOT)
_CODE_28 = re.compile(r"\bcode: 28\b")  # Rust's io::Error (safetensors): Os { code: 28, kind: StorageFull }
_WRITER = re.compile(r"iostream|unexpected pos|PytorchStreamWriter|IoError|write", re.IGNORECASE)


class RunLocked(RuntimeError):
    """Another invocation holds the run folder."""


class FolderNotWritable(RuntimeError):
    """A run or output folder that cannot be written."""


class DiskFull(OSError):
    """No space left while writing ``what`` in ``where``."""

    def __init__(self, what: str, where: str | Path):
        self.what, self.where = what, str(where)
        super().__init__(errno.ENOSPC, f"no space left on device while writing {what} in {where}")

    def __str__(self) -> str:
        return self.strerror


def disk_full(error: BaseException, where: str | Path | None = None) -> bool:
    """Whether ``error`` (an OSError, or a library's own error around one: safetensors', torch's zip writer's
    ``iostream error``, which carry no errno) is a full disk or quota: by its errno or text, or, for an error while
    writing in ``where``, by that file system having less than 1 MiB left."""
    if isinstance(error, DiskFull):
        return True
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in _FULL
    text = str(error)
    if "No space left on device" in text or "Disk quota exceeded" in text or _CODE_28.search(text):
        return True
    # a writer's error without an errno (torch's zip writer: "iostream error", "unexpected pos"), where the disk
    # has nothing left
    return (
        where is not None
        and not isinstance(error, OSError)
        and bool(_WRITER.search(text))
        and free_bytes(where) < (1 << 20)
    )


def free_bytes(where: str | Path) -> int:
    """Bytes an unprivileged writer has left on the file system of ``where`` (its nearest existing folder)."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def writing(what: str, where: str | Path) -> Iterator[None]:
    """A full disk inside the block is raised as `DiskFull(what, where)`; other errors pass unchanged."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:  # noqa: BLE001 - only a full disk is translated
        if disk_full(e, where):
            raise DiskFull(what, where) from e
        raise


def check_writable(folder: str | Path, what: str) -> None:
    """Refuse (FolderNotWritable, one line) a ``folder`` this process could not write: one that is a file, or
    whose nearest existing folder denies writing (permissions, a read-only disk). Nothing is created."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise FolderNotWritable(f"{what} {folder} is a file, not a folder; choose another {what}")
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise FolderNotWritable(f"{what} {folder} cannot be made: {probe} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only(probe) else "no permission to write"
        raise FolderNotWritable(f"{what} {folder} cannot be written ({why}: {probe}); choose another {what}")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@contextlib.contextmanager
def run_lock(run_dir: str | Path, rank: int = 0) -> Iterator[Path]:
    """Hold this rank's exclusive lock on ``run_dir`` while the block runs (RunLocked, one line, if another
    invocation holds it). A folder this call created that holds nothing but the lock is removed at the end."""
    run_dir = Path(run_dir).expanduser()
    created = not run_dir.exists()
    lock_dir = run_dir / LOCK_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_dir / f"rank{rank}.lock", timeout=0)
    owner = lock_dir / f"rank{rank}.owner"
    try:
        lock.acquire()
    except Timeout:  # (a TimeoutError, so before OSError)
        try:
            holder = owner.read_text().strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise RunLocked(
            f"run_dir {run_dir} is in use by another run ({holder}); wait for it to end, stop it, "
            "or choose another run_dir"
        ) from None
    except (NotImplementedError, OSError) as e:  # a file system without OS locks (some Lustre / NFS mounts)
        if rank == 0:
            print(
                f"note: run_dir {run_dir} is on a file system without file locks ({e}); one run per folder is "
                "not enforced there",
                file=sys.stderr,
            )
        yield lock_dir
        return
    try:
        owner.write_text(
            f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        yield lock_dir
    finally:
        with contextlib.suppress(OSError):
            owner.unlink()
        lock.release()
        if created and rank == 0:
            with contextlib.suppress(OSError):
                if all(p.name == LOCK_DIR for p in run_dir.iterdir()):
                    shutil.rmtree(run_dir)
