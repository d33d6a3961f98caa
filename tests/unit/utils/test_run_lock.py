"""utils/run_lock.py: one holder per run folder and rank, folders checked without writing, a full disk told apart."""

import errno
import os
import subprocess
import sys

import pytest

from nemo_rcgrpo.utils.run_lock import (
    DiskFull,
    FolderNotWritable,
    RunLocked,
    check_writable,
    disk_full,
    run_lock,
    writing,
)


def test_a_second_holder_is_refused_naming_the_first_and_the_next_one_takes_over(tmp_path):
    run = tmp_path / "run"
    with run_lock(run):
        owner = (run / ".lock" / "rank0.owner").read_text()
        assert f"pid {os.getpid()}," in owner
        with pytest.raises(RunLocked) as e:
            with run_lock(run):
                pass
        assert f"run_dir {run} is in use by another run (host " in str(e.value) and f"pid {os.getpid()}," in str(
            e.value
        )
        with run_lock(run, rank=1):  # another rank of the same run has a lock of its own
            pass
    with run_lock(run):  # released: taken again
        pass
    assert not run.exists()  # a folder it made that holds only the lock is not left behind


def test_a_killed_holders_lock_is_released_by_the_kernel(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from nemo_rcgrpo.utils.run_lock import run_lock\n"
            f"with run_lock({str(run)!r}):\n    print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"pid {holder.pid},"):
            with run_lock(run):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(run):  # the stale owner file is overwritten
        assert f"pid {os.getpid()}," in (run / ".lock" / "rank0.owner").read_text()
    assert run.is_dir()  # it existed before: kept


def test_check_writable_creates_nothing_and_names_the_problem(tmp_path):
    check_writable(tmp_path / "a" / "b", "run_dir")
    assert not (tmp_path / "a").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(FolderNotWritable, match="is a file, not a folder"):
        check_writable(tmp_path / "f", "run_dir")
    with pytest.raises(FolderNotWritable, match="cannot be made: .* is a file"):
        check_writable(tmp_path / "f" / "run", "out_dir")


def test_a_full_disk_is_told_from_other_errors():
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert disk_full(RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"), where="/")  # the root file system has space
    assert not disk_full(RuntimeError("unexpected pos 4672 vs 4566"))  # no errno, no place to look
    with pytest.raises(DiskFull, match="no space left on device while writing the metrics in /x/metrics.jsonl"):
        with writing("the metrics", "/x/metrics.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(PermissionError):  # anything else passes unchanged
        with writing("the metrics", "/"):
            raise PermissionError(errno.EACCES, "Permission denied")
