"""utils/atomic.py: a folder replaced whole or not at all (exports, prepared data, vLLM weight folders, checkpoints),
and files merged into a shared cache folder one whole file at a time."""

import os

import pytest

from nemo_rcgrpo.utils.atomic import staged_folder, swap_in


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_written_folder_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "out" / "hf"
    with staged_folder(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".tmp-hf.") and not target.exists()
        (tmp / "a.txt").write_text("1")
    assert _tree(target) == ["a.txt"] and oct(target.stat().st_mode & 0o777) == "0o755"
    with staged_folder(target) as tmp:
        (tmp / "b.txt").write_text("2")
        assert (target / "a.txt").read_text() == "1"  # the old folder stays readable while the new one is written
    assert _tree(target) == ["b.txt"]  # replaced, not merged
    assert sorted(p.name for p in target.parent.iterdir()) == ["hf"]  # no temporary or set-aside folder left


def test_an_error_while_writing_leaves_the_old_folder_untouched(tmp_path):
    target = tmp_path / "hf"
    with staged_folder(target) as tmp:
        (tmp / "a.txt").write_text("1")
    with pytest.raises(RuntimeError, match="disk full"):
        with staged_folder(target) as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("disk full")
    assert _tree(target) == ["a.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_crash_between_the_renames_keeps_the_old_folder_whole(tmp_path, monkeypatch):
    target, staged = tmp_path / "step_3", tmp_path / ".tmp-step_3"
    for folder, name in ((target, "old.pt"), (staged, "new.pt")):
        folder.mkdir()
        (folder / name).write_text(name)
    calls = []
    real = os.replace

    def replace(src, dst):
        calls.append((os.path.basename(src), os.path.basename(dst)))
        if len(calls) == 2:
            raise OSError("killed")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="killed"):
        swap_in(staged, target)
    assert calls == [("step_3", ".old-step_3"), (".tmp-step_3", "step_3")]
    assert not target.exists() and _tree(tmp_path / ".old-step_3") == ["old.pt"]  # never half of each
    monkeypatch.setattr(os, "replace", real)
    swap_in(staged, target)  # the next save goes through; the set-aside folder is cleared
    assert _tree(target) == ["new.pt"] and sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


def test_merge_into_adds_files_beside_the_others(tmp_path):
    from nemo_rcgrpo.utils.atomic import merge_into

    target = tmp_path / "cache"
    merge_into(target, lambda tmp: (tmp / "tokenizer.json").write_text("t"))
    merge_into(target, lambda tmp: (tmp / "model.safetensors").write_text("w"))
    assert _tree(target) == ["model.safetensors", "tokenizer.json"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "cache"
    ]


def test_a_killed_writer_leaves_no_copy_behind_for_good(tmp_path):
    """SIGKILL runs no ``finally``: the next write of the same target removes what the killed one left."""
    target = tmp_path / "hf"
    left = tmp_path / ".tmp-hf.abc123"
    left.mkdir()
    (left / "model.safetensors").write_text("half")
    (tmp_path / ".tmp-hfx.keep").mkdir()  # another target's temporary folder is not touched
    with staged_folder(target) as tmp:
        (tmp / "a.txt").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-hfx.keep", "hf"]


@pytest.mark.parametrize(
    "mask, folder_mode, file_mode", [(0o022, "0o755", "0o644"), (0o027, "0o750", "0o640"), (0o002, "0o775", "0o664")]
)
def test_a_staged_folder_keeps_the_users_umask_and_is_synced_before_it_counts(
    tmp_path, monkeypatch, mask, folder_mode, file_mode
):
    import nemo_rcgrpo.utils.atomic as atomic

    synced = []
    real = atomic._fsync
    monkeypatch.setattr(
        atomic, "_fsync", lambda path, directory=False: (synced.append((path.name, directory)), real(path, directory))
    )
    old = os.umask(mask)
    try:
        target = tmp_path / "hf"
        with staged_folder(target) as tmp:
            (tmp / "w.bin").write_bytes(b"x")
            assert not synced  # nothing is synced while it is written
    finally:
        os.umask(old)
    assert (
        oct(target.stat().st_mode & 0o777) == folder_mode
        and oct((target / "w.bin").stat().st_mode & 0o777) == file_mode
    )
    # every file and the folder before the rename, then the parent (the rename itself)
    assert ("w.bin", False) in synced and synced[-1] == (tmp_path.name, True)
    assert synced.index(("w.bin", False)) < len(synced) - 1
