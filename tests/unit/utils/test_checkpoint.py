"""Atomic checkpoints: which one is the latest, what counts as complete, pruning, corrupt files, RNG."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_rcgrpo.utils.checkpoint import (
    MANIFEST,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
    choose_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    prepare_checkpoint,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)


def _save(run_dir, step, keep_last=10, **kw):
    """A tiny checkpoint whose tensors encode its step, so the right one can be told apart."""
    args = dict(
        model_state={"w": torch.full((2,), float(step))},
        optimizer_state={"lr": 0.1 * step},
        scheduler_state={"last_epoch": step},
        trainer_state={"epoch": step // 10},
        keep_last=keep_last,
    )
    args.update(kw)
    return save_checkpoint(run_dir, step, **args)


def _steps(run_dir):
    return sorted(p.name for p in checkpoint_dir(run_dir).iterdir())


def test_latest_is_the_newest_by_step_number_not_by_name(tmp_path):
    assert latest_checkpoint(tmp_path) is None  # no checkpoints folder at all
    for step in (9, 1, 10, 2):  # written out of order
        _save(tmp_path, step)
    # by name "step_9" > "step_2" > "step_10" > "step_1"; by number 10 is the newest
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path) / "step_10"
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["trainer_state"] == {"epoch": 1, "step": 10}  # 10 // 10 = 1; "step" added by save
    assert torch.equal(state["model"]["w"], torch.tensor([10.0, 10.0]))
    assert state["optimizer"] == {"lr": pytest.approx(1.0)} and state["scheduler"] == {"last_epoch": 10}


def test_partial_checkpoints_are_ignored(tmp_path):
    _save(tmp_path, 3)
    root = checkpoint_dir(tmp_path)
    (root / ".tmp-step_7").mkdir()  # a save killed before the rename (even one holding a state file)
    (root / ".tmp-step_7" / STATE_FILE).write_text("{}")
    (root / "step_8").mkdir()  # a folder without trainer_state.json
    torch.save({"w": torch.zeros(1)}, root / "step_8" / "model.pt")
    assert latest_checkpoint(tmp_path) == root / "step_3"
    with pytest.raises(CheckpointError, match=r"step_8 is not a complete checkpoint \(no trainer_state.json\)"):
        load_checkpoint(root / "step_8")


def test_only_partial_checkpoints_means_none(tmp_path):
    (checkpoint_dir(tmp_path) / ".tmp-step_1").mkdir(parents=True)
    (checkpoint_dir(tmp_path) / "step_2").mkdir()
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize(
    "name, content",
    [
        ("model.pt", "truncated"),  # half of a real zip archive
        ("model.pt", b"garbage, not a torch file"),
        ("model.pt", b""),
        ("optimizer.pt", "truncated"),
        ("extra.pt", "truncated"),
        (STATE_FILE, b'{"epoch": 0, "st'),  # truncated JSON
    ],
)
def test_corrupt_checkpoint_raises_checkpoint_error_naming_the_path(tmp_path, name, content):
    path = _save(tmp_path, 4)
    target = path / name
    if content == "truncated":
        data = target.read_bytes()
        content = data[: len(data) // 2]
    target.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


def test_failure_mid_save_leaves_the_previous_checkpoint_latest_and_intact(tmp_path, monkeypatch):
    good = _save(tmp_path, 5, keep_last=1)
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        if str(f).endswith("optimizer.pt"):
            raise OSError("disk full")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 6, keep_last=1)  # keep_last=1 would prune step_5 had step_6 completed
    monkeypatch.undo()
    assert _steps(tmp_path) == [".tmp-step_6", "step_5"]  # the half-written one never got a final name
    assert latest_checkpoint(tmp_path) == good
    state = load_checkpoint(good)
    assert state["trainer_state"]["step"] == 5 and torch.equal(state["model"]["w"], torch.tensor([5.0, 5.0]))
    # the next save of step 6 starts from a clean temporary folder and then prunes step 5
    _save(tmp_path, 6, keep_last=1)
    assert _steps(tmp_path) == ["step_6"]


def test_keep_last_prunes_only_the_oldest_and_only_after_the_new_one_is_complete(tmp_path, monkeypatch):
    for step in (1, 2, 10):
        _save(tmp_path, step, keep_last=3)
    assert _steps(tmp_path) == ["step_1", "step_10", "step_2"]  # 3 kept, none pruned yet
    root = checkpoint_dir(tmp_path)
    (root / ".tmp-step_99").mkdir()  # leftovers of a crashed save are not counted or touched
    (root / "step_50").mkdir()  # incomplete: not counted, not removed
    seen_at_rename = []
    real_replace = os.replace

    def spy_replace(src, dst):
        if Path(src).is_dir():  # the folder's move (the manifest's own rename comes before it)
            seen_at_rename.append(sorted(p.name for p in root.glob("step_*")))
            assert (src / STATE_FILE).is_file() and (src / MANIFEST).is_file()  # both written before the move
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy_replace)  # utils/atomic.py: swap_in
    _save(tmp_path, 11, keep_last=2)
    # complete by number: 1, 2, 10, 11 -> keep the last 2 (10, 11); 1 and 2 go, only after the rename
    assert seen_at_rename == [["step_1", "step_10", "step_2", "step_50"]]
    assert _steps(tmp_path) == [".tmp-step_99", "step_10", "step_11", "step_50"]
    assert latest_checkpoint(tmp_path) == root / "step_11"


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 3)
    path = _save(tmp_path, 3, model_state={"w": torch.tensor([7.0])})
    assert _steps(tmp_path) == ["step_3"]
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.tensor([7.0]))


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = _save(tmp_path, 1)
    after_save = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # something else moved the generators
    set_rng_state(load_checkpoint(path)["rng"])
    resumed = (random.random(), np.random.rand(), torch.rand(3))
    assert resumed[0] == after_save[0] and resumed[1] == after_save[1]
    assert torch.equal(resumed[2], after_save[2])


def test_prepared_without_prepare_raises(tmp_path):
    with pytest.raises(CheckpointError, match=r"\.tmp-step_4 was not prepared"):
        _save(tmp_path, 4, prepared=True)
    assert latest_checkpoint(tmp_path) is None


def test_prepared_shards_are_kept_and_relative_optimizer_dir_is_resolved(tmp_path):
    tmp = prepare_checkpoint(tmp_path, 8)
    assert tmp == checkpoint_dir(tmp_path) / ".tmp-step_8" and list(tmp.iterdir()) == []
    (tmp / "optim").mkdir()
    (tmp / "optim" / "shard_0.pt").write_bytes(b"rank 0")  # written by every rank before rank 0 saves
    path = _save(tmp_path, 8, optimizer_state={"dir": "optim", "format": "dist"}, prepared=True)
    assert (path / "optim" / "shard_0.pt").read_bytes() == b"rank 0"
    opt = load_checkpoint(path)["optimizer"]
    assert opt == {"dir": "optim", "format": "dist", "path": str(path / "optim")}  # resolved, not the .tmp name
    # a non-string dir is left alone
    path = _save(tmp_path, 9, optimizer_state={"dir": 3})
    assert load_checkpoint(path)["optimizer"] == {"dir": 3}


def test_prepare_clears_a_stale_temporary_folder(tmp_path):
    tmp = prepare_checkpoint(tmp_path, 2)
    (tmp / "stale.pt").write_bytes(b"old")
    assert list(prepare_checkpoint(tmp_path, 2).iterdir()) == []


def test_trainer_state_json_and_tokenizer(tmp_path):
    class Tok:
        def save_pretrained(self, d):
            d.mkdir()
            (d / "tokenizer.json").write_text("{}")

    path = _save(tmp_path, 12, trainer_state={"epoch": 1, "step": 0, "data_pos": 37}, tokenizer=Tok())
    assert json.loads((path / STATE_FILE).read_text()) == {
        "epoch": 1,
        "step": 12,
        "data_pos": 37,
        "manifest": 1,
    }  # step wins
    assert load_checkpoint(path)["trainer_state"] == {"epoch": 1, "step": 12, "data_pos": 37}  # the mark is not state
    assert (path / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "name, content",
    [("optimizer.pt", b"garbage" * 10), ("optimizer.pt", b""), ("extra.pt", b"garbage" * 10), ("extra.pt", b"")],
    ids=["garbage-optimizer", "empty-optimizer", "garbage-extra", "empty-extra"],
)
def test_unpicklable_files_are_checkpoint_errors(tmp_path, name, content):
    path = _save(tmp_path, 1)
    (path / name).write_bytes(content)
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {path}"):
        load_checkpoint(path)


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickled_code_in_a_checkpoint_is_refused_not_run(tmp_path):
    path = _save(tmp_path, 1)
    torch.save({"scheduler": {}, "rng": _Payload()}, path / "extra.pt")
    with pytest.raises(CheckpointError, match="Weights only load failed"):
        load_checkpoint(path)


def test_other_folders_next_to_checkpoints_are_ignored(tmp_path):
    _save(tmp_path, 2)
    root = checkpoint_dir(tmp_path)
    (root / "step_7.bak").mkdir()
    (root / "step_7.bak" / STATE_FILE).write_text("{}")  # complete-looking, but not a step_N name
    assert latest_checkpoint(tmp_path) == root / "step_2"
    _save(tmp_path, 3, keep_last=1)  # pruning is not confused by it either
    assert _steps(tmp_path) == ["step_3", "step_7.bak"]


def test_a_checkpoint_just_written_is_never_pruned(tmp_path):
    _save(tmp_path, 5)
    path = _save(tmp_path, 3, keep_last=1)  # an older step written after a newer one
    assert path.is_dir() and (path / STATE_FILE).is_file()


def test_checkpoints_with_the_older_rng_format_still_load(tmp_path):
    """Before the RNG states were stored as tensors, extra.pt held numpy's state array: loaded with numpy's array
    reconstruction allow-listed (and nothing else), and restored."""
    path = _save(tmp_path, 1)
    random.seed(5)
    np.random.seed(5)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"scheduler": {"last_epoch": 1}, "rng": old}, path / "extra.pt")
    expected = (random.random(), float(np.random.rand()))
    state = load_checkpoint(path)
    random.seed(0)
    np.random.seed(0)
    set_rng_state(state["rng"])
    assert (random.random(), float(np.random.rand())) == expected


# ------------------------------------------------------------------ manifests: checkpoints that prove themselves


def _flip(path: Path, at: int = -40) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    import hashlib

    ckpt = _save(tmp_path, 3)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["step"] == 3
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(manifest["files"]) == on_disk and STATE_FILE in on_disk and "model.pt" in on_disk
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(ckpt) is None


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("flip model", "model.pt differs from what was written"),
        ("flip optimizer", "optimizer.pt differs from what was written"),
        ("edit step", f"{STATE_FILE} differs from what was written"),
        ("truncate", "model.pt has"),
        ("delete", "extra.pt is missing"),
        ("extra file", "stray.bin is not in"),
        ("bad manifest", f"unreadable {MANIFEST}"),
    ],
)
def test_any_damage_fails_verification_and_the_newest_good_checkpoint_is_resumed(tmp_path, fault, reason):
    _save(tmp_path, 2)
    bad = _save(tmp_path, 4)
    if fault == "flip model":
        _flip(bad / "model.pt")
    elif fault == "flip optimizer":
        _flip(bad / "optimizer.pt")
    elif fault == "edit step":  # valid JSON, one step on: would skip a step silently
        state = json.loads((bad / STATE_FILE).read_text())
        (bad / STATE_FILE).write_text(json.dumps({**state, "step": 5}, indent=1))
    elif fault == "truncate":
        (bad / "model.pt").write_bytes((bad / "model.pt").read_bytes()[:100])
    elif fault == "delete":
        (bad / "extra.pt").unlink()
    elif fault == "extra file":
        (bad / "stray.bin").write_bytes(b"x")
    else:
        (bad / MANIFEST).write_text("{")
    assert reason in verify_checkpoint(bad)
    notes = []
    chosen = choose_checkpoint(tmp_path, note=notes.append)
    assert chosen == checkpoint_dir(tmp_path) / "step_2"
    assert (
        len(notes) == 1
        and "step_4 fails verification" in notes[0]
        and reason in notes[0]
        and "resuming from" in notes[0]
        and "step_2" in notes[0]
    )
    # set aside, kept for a look, out of the way of the steps to come (and of pruning)
    assert _steps(tmp_path) == ["corrupt-step_4", "step_2"]
    assert latest_checkpoint(tmp_path) == chosen
    assert load_checkpoint(chosen)["trainer_state"]["step"] == 2


def test_when_no_checkpoint_verifies_the_error_names_them_and_what_to_remove(tmp_path):
    for step in (2, 4):
        _flip(_save(tmp_path, step) / "model.pt")
    with pytest.raises(CheckpointError) as e:
        choose_checkpoint(tmp_path, note=lambda _: None)
    text = str(e.value)
    assert (
        "\n" not in text
        and "no checkpoint in" in text
        and "step_4: model.pt differs" in text
        and "step_2: model.pt differs" in text
        and "remove" in text
    )
    assert _steps(tmp_path) == ["step_2", "step_4"]  # nothing moved when there is nothing to resume instead


def test_a_checkpoint_without_a_manifest_resumes_with_a_note(tmp_path):
    ckpt = _save(tmp_path, 3)
    (ckpt / MANIFEST).unlink()  # as written before manifests existed: no manifest, no mark in its state
    state = json.loads((ckpt / STATE_FILE).read_text())
    del state["manifest"]
    (ckpt / STATE_FILE).write_text(json.dumps(state, indent=1))
    notes = []
    assert choose_checkpoint(tmp_path, note=notes.append) == ckpt
    assert len(notes) == 1 and "no manifest.json" in notes[0] and "unverified" in notes[0]
    assert choose_checkpoint(tmp_path / "empty", note=notes.append) is None


def test_a_deleted_manifest_does_not_turn_verification_off(tmp_path):
    _save(tmp_path, 2)
    bad = _save(tmp_path, 3)
    (bad / MANIFEST).unlink()
    _flip(bad / "model.pt")  # what a missing manifest would otherwise let through
    assert verify_checkpoint(bad) == "manifest.json is missing"
    assert choose_checkpoint(tmp_path, note=lambda _: None).name == "step_2"


def test_a_file_named_like_the_manifest_inside_the_checkpoint_is_verified_too(tmp_path):
    ckpt = _save(tmp_path, 3, tokenizer=None)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / MANIFEST).write_text("{}")
    assert verify_checkpoint(ckpt) == f"sub/{MANIFEST} is not in {MANIFEST}"


def test_verification_can_hash_only_the_files_a_reader_loads(tmp_path):
    ckpt = _save(tmp_path, 3)
    _flip(ckpt / "optimizer.pt")
    assert verify_checkpoint(ckpt, hashed=lambda name: name != "optimizer.pt") is None
    assert "optimizer.pt differs" in verify_checkpoint(ckpt)
    (ckpt / "optimizer.pt").write_bytes(b"short")
    assert "optimizer.pt has 5 bytes" in verify_checkpoint(ckpt, hashed=lambda name: name != "optimizer.pt")


def test_a_second_corrupt_copy_of_a_step_is_kept_beside_the_first(tmp_path):
    _save(tmp_path, 1)
    for _ in range(2):
        _flip(_save(tmp_path, 2) / "model.pt")
        assert choose_checkpoint(tmp_path, note=lambda _: None).name == "step_1"
    assert _steps(tmp_path) == ["corrupt-step_2", "corrupt-step_2.1", "step_1"]
