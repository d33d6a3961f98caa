"""Folders that appear whole or not at all: checkpoints, exports, prepared datasets, weight folders for vLLM.

A folder is written under a temporary sibling name and moved into place by a rename once it is complete. A folder
it replaces is set aside first (``.old-NAME``) and removed only after the new one is in place. So the final name
never holds a partial folder, and a crash leaves the old folder or the new one there, except between the two
renames, when the old one is still whole as ``.old-NAME``.

    with staged_folder(run_dir / "hf") as tmp:      # a unique .tmp-hf.XXXX sibling
        model.save_pretrained(tmp)                  # an exception: tmp removed, run_dir/hf untouched
    # here run_dir/hf is the new folder
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; the files themselves were synced
        if not directory or e.errno not in (22, 95):  # EINVAL, EOPNOTSUPP
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Every file under ``folder``, and the folders themselves, flushed to the disk: what a rename then makes
    visible is what survives a power loss."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root), directory=True)


def swap_in(staged: Path, target: Path, durable: bool = True) -> Path:
    """Move the complete folder ``staged`` to ``target`` (same file system); an existing ``target`` is set aside as
    ``.old-NAME`` and removed once the new one is in place."""
    staged, target = Path(staged), Path(target)
    aside = target.parent / f".old-{target.name}"
    if target.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
    os.replace(staged, target)
    if durable:
        _fsync(target.parent, directory=True)  # the rename itself on the disk
    shutil.rmtree(aside, ignore_errors=True)
    return target


@contextlib.contextmanager
def staged_folder(target: Path, durable: bool = True) -> Iterator[Path]:
    """A new empty sibling of ``target`` to write into; when the block ends without an exception it replaces
    ``target`` (`swap_in`; ``durable``: its files fsynced first), and it is removed in any case. One writer per target: temporary siblings left by a
    writer that was killed (no ``finally`` runs on SIGKILL) are removed first."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".tmp-{glob.escape(target.name)}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}.", dir=target.parent))
    tmp.chmod(0o777 & ~umask())  # mkdtemp makes it private; the result is an ordinary folder, as the umask says
    try:
        yield tmp
        if durable:
            fsync_tree(tmp)  # complete on the disk before it counts as complete
        swap_in(tmp, target, durable)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def merge_into(target: Path, write) -> None:
    """``write(tmp)`` into a new sibling, then move each file it wrote into ``target`` (created if missing) by a
    rename: a file appears whole or not at all. For a cache folder that several writers fill with different files
    (the SmolLM2 tokenizer first, its weights later), where `staged_folder` would replace the other's files."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        target.mkdir(exist_ok=True)
        for item in tmp.iterdir():
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
