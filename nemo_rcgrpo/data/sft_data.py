"""Stage-1 examples: dataset lines -> token ids + loss masks, and deterministic length-bucketed batches."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.data.tokenize import ChatRenderer


@dataclass
class Example:
    ids: list[int]
    mask: list[int]
    task_id: str

    def __len__(self) -> int:
        return len(self.ids)


def load_records(path: Path, split: str, progress: bool = False) -> Sequence[dict[str, Any]]:
    """The stage-1 rows of ``split`` at ``path`` (JSONL, Parquet or a saved Dataset: `data/dataset.py`), as renderer
    records read one at a time from the memory-mapped Dataset."""
    from nemo_rcgrpo.data.dataset import Rows, load_stage1

    return Rows(load_stage1(path, split, progress=progress))


def build_examples(
    records: Sequence[dict[str, Any]], renderer: ChatRenderer, max_length: int, seed: int, max_examples: int | None
) -> tuple[list[Example], dict[str, int]]:
    """Seeded shuffle, optional slice, tokenise; examples longer than max_length are dropped."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    examples, dropped = [], 0
    for i in order:
        if max_examples is not None and len(examples) >= max_examples:
            break
        r = records[i]
        tok = renderer.render(r["messages"], r.get("tools"))
        if len(tok) > max_length or sum(tok.mask) == 0:
            dropped += 1
            continue
        examples.append(Example(tok.ids, tok.mask, r.get("task_id", str(i))))
    return examples, {"examples": len(examples), "dropped_too_long": dropped, "records": len(records)}


def epoch_batches(
    lengths: list[int], global_batch_size: int, seed: int, epoch: int, bucket_by_length: bool
) -> list[list[int]]:
    """Global batches of example indices for one epoch (the remainder is dropped).

    With bucketing, indices are sorted by length inside chunks of 8 batches, so
    a batch holds similar lengths and padding stays small; batch order is
    shuffled. Deterministic in (seed, epoch), which makes resume exact.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if bucket_by_length:
        chunk = global_batch_size * 8
        order = [i for s in range(0, len(order), chunk) for i in sorted(order[s : s + chunk], key=lambda j: lengths[j])]
    batches = [
        order[s : s + global_batch_size] for s in range(0, len(order) - global_batch_size + 1, global_batch_size)
    ]
    rng.shuffle(batches)
    return batches


def collate(examples: list[Example], pad_id: int) -> MicroBatch:
    """The examples as one right-padded micro-batch (shifted targets are the policy's)."""
    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : len(e)] = torch.tensor(e.ids)
        attn[row, : len(e)] = 1
        mask[row, : len(e)] = torch.tensor(e.mask)
    return MicroBatch(ids, attn, mask)
