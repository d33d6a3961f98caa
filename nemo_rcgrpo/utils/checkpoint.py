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
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_rcgrpo.utils.atomic import swap_in

STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why."""


def rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain numbers, so checkpoints load with ``weights_only=True`` (no pickled code)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    if isinstance(state["python"], tuple):  # checkpoints written before the states were stored as tensors
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        return
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
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


def save_checkpoint(run_dir: str | Path, step: int, *, model_state: dict, optimizer_state: dict,
                    scheduler_state: dict, trainer_state: dict[str, Any], keep_last: int,
                    tokenizer=None, prepared: bool = False, record: dict[str, Any] | None = None) -> Path:
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
    (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=1))
    swap_in(tmp, final)  # an older step_N is set aside, not deleted, until the new one is in place
    complete = _complete(root)
    for old in complete[:-keep_last]:
        if old != final:  # never the checkpoint just written
            shutil.rmtree(old, ignore_errors=True)
    return final


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
        # memory-mapped: ranks that do not need the full model (sharded backends) never read it
        model = torch.load(path / "model.pt", map_location="cpu", weights_only=True, mmap=True)
        optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        if isinstance(optimizer, dict) and isinstance(optimizer.get("dir"), str):
            optimizer = {**optimizer, "path": str(path / optimizer["dir"])}
        extra = _load_extra(path / "extra.pt")
    except Exception as e:  # noqa: BLE001 - torch.load raises pickle, EOF, zip and value errors on a bad file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    return {"trainer_state": trainer_state, "model": model, "optimizer": optimizer, **extra}
