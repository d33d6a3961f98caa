"""Atomic, resumable checkpoints: ``run_dir/checkpoints/step_N/``.

A checkpoint is written into ``.tmp-step_N`` and renamed into place only when
complete (``trainer_state.json`` is its last file), so a kill mid-save never
leaves a checkpoint that looks valid, and older ones are removed only after a
newer one is complete. It holds the model and optimizer state, the scheduler,
the RNG states and the data position, so a resumed run continues exactly.

Backends that shard their state (Megatron) write their shards from every rank
into the temporary folder first (``prepare_checkpoint``), then rank 0 adds the
rest and moves the whole folder into place; a relative ``dir`` in the saved
optimizer state is resolved against the checkpoint on load (``path``).

Each checkpoint proves itself: ``manifest.json``, written last (atomically,
fsynced with every file before the folder is renamed into place), holds the
step and every file's size and sha256. A resume verifies the newest checkpoint
against it and falls back to the newest one that verifies (`choose_checkpoint`):
a flipped byte, an edited state file, a missing or truncated file is never
loaded. Checkpoints written before manifests existed resume with a note.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from nemo_rcgrpo.utils.atomic import _fsync, fsync_tree, swap_in

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_MARK = "manifest"  # trainer_state.json of a checkpoint written with a manifest has "manifest": 1
CORRUPT_PREFIX = "corrupt-"  # a checkpoint that failed verification is set aside as checkpoints/corrupt-step_N
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why."""


def rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain numbers, so checkpoints load with ``weights_only=True`` (no pickled code)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    if isinstance(state["python"], tuple):  # checkpoints written before the states were stored as tensors
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        return
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached"])
    )
    torch.set_rng_state(state["torch"])


_STEP = re.compile(r"step_(\d+)")


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints (``step_N`` with its state file), oldest first; other folders are ignored."""
    found = [p for p in root.glob("step_*") if _STEP.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (one whose state file exists), or None."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    done = _complete(root)
    return done[-1] if done else None


def checkpoint_tmp_dir(run_dir: str | Path, step: int) -> Path:
    """Where checkpoint ``step`` is written before it is moved into place."""
    return checkpoint_dir(run_dir) / f".tmp-step_{step}"


def prepare_checkpoint(run_dir: str | Path, step: int) -> Path:
    """An empty temporary folder for checkpoint ``step`` (rank 0 calls it; then all ranks may write into it)."""
    tmp = checkpoint_tmp_dir(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model_state: dict,
    optimizer_state: dict,
    scheduler_state: dict,
    trainer_state: dict[str, Any],
    keep_last: int,
    tokenizer=None,
    prepared: bool = False,
    record: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` and move it into place. ``prepared``: the temporary folder from
    ``prepare_checkpoint`` already holds shards written by every rank; keep them. ``record``: the training record,
    written beside the tokenizer."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = checkpoint_tmp_dir(run_dir, step)
    if not prepared:
        prepare_checkpoint(run_dir, step)
    elif not tmp.is_dir():
        raise CheckpointError(f"{tmp} was not prepared")
    torch.save(model_state, tmp / "model.pt")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save({"scheduler": scheduler_state, "rng": rng_state()}, tmp / "extra.pt")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "tokenizer")
        if record is not None:  # the training record travels with the tokenizer (utils/provenance.py)
            from nemo_rcgrpo.utils.provenance import write_record

            write_record(tmp / "tokenizer", record)
    (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step, MANIFEST_MARK: 1}, indent=1))
    fsync_tree(tmp)  # every file on disk before the manifest vouches for it
    write_manifest(tmp, step)
    swap_in(tmp, final)  # an older step_N is set aside, not deleted, until the new one is in place
    complete = _complete(root)
    for old in complete[:-keep_last]:
        if old != final:  # never the checkpoint just written
            shutil.rmtree(old, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)  # hashlib releases the GIL on large buffers: files hash in parallel threads
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    own = folder / MANIFEST  # only the checkpoint's own manifest is left out (a tokenizer's file of that name is not)
    return sorted(p for p in folder.rglob("*") if p.is_file() and p != own)


def file_digests(folder: Path, threads: int | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file under ``folder`` but the manifest (files hashed in
    parallel, ``threads`` at most: by default up to 8, one per CPU)."""
    files = _files(folder)
    workers = max(1, min(len(files) or 1, threads or min(8, os.cpu_count() or 1)))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(_sha256, files))
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)}


def _fsync_dir(folder: Path) -> None:
    _fsync(folder, directory=True)


def write_manifest(folder: Path, step: int) -> Path:
    """``folder/manifest.json``: the step and every file's size and sha256, written atomically (a temporary file,
    fsynced, renamed) after every other file."""
    manifest = {"format": 1, "step": step, "files": file_digests(folder)}
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    _fsync_dir(folder)  # the rename on the disk
    return folder / MANIFEST


def verify_checkpoint(path: Path, hashed: Callable[[str], bool] | None = None) -> str | None:
    """Why checkpoint ``path`` must not be loaded (a short reason), or None when it verifies against its manifest.
    A checkpoint without a manifest (written before manifests) returns None; `has_manifest` tells them apart; one
    whose state says it was written with one fails. ``hashed``: which files (by relative path) to hash; all of
    them by default (every file's presence and size is checked in any case)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        if not (path / STATE_FILE).is_file():
            return f"no {STATE_FILE}"
        try:  # a checkpoint written with a manifest says so in its state: a missing manifest is then damage
            marked = json.loads((path / STATE_FILE).read_text()).get(MANIFEST_MARK)
        except Exception as e:  # noqa: BLE001
            return f"unreadable {STATE_FILE} ({type(e).__name__})"
        return f"{MANIFEST} is missing" if marked else None
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, step = dict(manifest["files"]), int(manifest["step"])
    except Exception as e:  # noqa: BLE001 - any damage to the manifest itself
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    m = _STEP.fullmatch(path.name)
    if m and int(m.group(1)) != step:
        return f"{MANIFEST} is of step {step}"
    on_disk = {p.relative_to(path).as_posix() for p in _files(path)}
    missing = sorted(set(files) - on_disk)
    if missing:
        return f"{missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    extra = sorted(on_disk - set(files))
    if extra:
        return f"{extra[0]} is not in {MANIFEST}"
    for name, want in files.items():
        size = (path / name).stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} written"
    names = [n for n in files if hashed is None or hashed(n)]
    workers = max(1, min(len(names) or 1, min(8, os.cpu_count() or 1)))
    with ThreadPoolExecutor(workers) as pool:
        digests = dict(zip(names, pool.map(lambda n: _sha256(path / n), names)))
    for name in names:
        if digests[name] != files[name]["sha256"]:
            return f"{name} differs from what was written (sha256)"
    try:
        state_step = json.loads((path / STATE_FILE).read_text()).get("step")
    except Exception as e:  # noqa: BLE001
        return f"unreadable {STATE_FILE} ({type(e).__name__})"
    if state_step != step:
        return f"{STATE_FILE} says step {state_step}"
    return None


def has_manifest(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of ``run_dir`` (``step_N`` with its state file), oldest first."""
    root = checkpoint_dir(run_dir)
    return _complete(root) if root.is_dir() else []


def choose_checkpoint(run_dir: str | Path, note: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint of ``run_dir`` that verifies (`verify_checkpoint`), or None when there is none.

    Each newer one that fails is named in one ``note`` line with the checkpoint resumed instead, and set aside as
    ``checkpoints/corrupt-step_N`` (kept for a look, never loaded, out of the way of the steps to come). When
    checkpoints exist and none verifies: CheckpointError naming them and what to remove."""
    candidates = complete_checkpoints(run_dir)
    failed: list[tuple[Path, str]] = []
    for path in reversed(candidates):
        reason = verify_checkpoint(path)
        if reason is None:
            if not has_manifest(path):
                note(
                    f"note: checkpoint {path} has no {MANIFEST} (written before checkpoints were verified); "
                    "resuming from it unverified"
                )
            for bad, why in failed:
                aside, n = bad.parent / f"{CORRUPT_PREFIX}{bad.name}", 1
                while aside.exists():  # an earlier one set aside under that name is kept too
                    aside, n = bad.parent / f"{CORRUPT_PREFIX}{bad.name}.{n}", n + 1
                os.replace(bad, aside)
                note(
                    f"note: checkpoint {bad} fails verification ({why}); set aside as {aside.name}, "
                    f"resuming from {path}"
                )
            return path
        failed.append((path, reason))
    if failed:
        listed = "; ".join(f"{p.name}: {why}" for p, why in failed)
        raise CheckpointError(
            f"no checkpoint in {checkpoint_dir(run_dir)} verifies ({listed}); remove "
            f"{' '.join(str(p) for p, _ in failed)} to start over, or use a new run_dir"
        )
    return None


def _load_extra(path: Path) -> dict[str, Any]:
    """Scheduler and RNG states, without unpickling code; older checkpoints kept numpy's RNG state as an array,
    which only numpy's array reconstruction (allow-listed here, nothing else) can read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as first:  # noqa: BLE001
        if "Weights only load failed" not in str(first):
            raise
        core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
        allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(path: Path) -> dict[str, Any]:
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    try:
        trainer_state = json.loads(state_file.read_text())
        trainer_state.pop(MANIFEST_MARK, None)  # the checkpoint's own bookkeeping, not the trainer's
        # memory-mapped: ranks that do not need the full model (sharded backends) never read it
        model = torch.load(path / "model.pt", map_location="cpu", weights_only=True, mmap=True)
        optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        if isinstance(optimizer, dict) and isinstance(optimizer.get("dir"), str):
            optimizer = {**optimizer, "path": str(path / optimizer["dir"])}
        extra = _load_extra(path / "extra.pt")
    except Exception as e:  # noqa: BLE001 - torch.load raises pickle, EOF, zip and value errors on a bad file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    return {"trainer_state": trainer_state, "model": model, "optimizer": optimizer, **extra}
