"""The data a training step hands a policy backend (`models/interfaces.py: Policy`), typed and frozen.

- ``MicroBatch``: B rows of tokens, right-padded to T (stage 1 trains on it; stage 2's batches extend it).
- ``RLMicroBatch``: one micro-batch of an RL step, built complete in one place (`algorithms/rl_batch.py`): its
  rollouts' tokens, advantages, reference, sampler and (where recomputed) old logprobs.
- ``LossStats``: what a loss says about one micro-batch, a record of summable floats (torchtune's ``PPOStats`` is
  the model); ``total`` sums the records of the micro-batches and then over the data-parallel replicas, in one
  collective.

Tensors are CPU tensors until a backend moves a batch (``to``); a batch is never changed after it is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, TypeVar

import torch

B = TypeVar("B", bound="MicroBatch")
S = TypeVar("S", bound="LossStats")


@dataclass(frozen=True)
class MicroBatch:
    """B rows of tokens, right-padded to length T. Every tensor field is [B, T] but those in ``ROW_FIELDS``, which
    are [B] (one value per row)."""

    ROW_FIELDS: ClassVar[frozenset[str]] = frozenset()
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long: 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] long: 1 on the tokens the loss trains (an assistant's, a rollout's generated)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(self.input_ids.shape)}")
        rows, length = self.input_ids.shape
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not torch.is_tensor(value):
                continue
            want = (rows,) if f.name in self.ROW_FIELDS else (rows, length)
            if tuple(value.shape) != want:
                raise ValueError(f"{type(self).__name__}.{f.name} has shape {tuple(value.shape)}, expected {want}")

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's tensor fields by name (None fields left out)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if torch.is_tensor(getattr(self, f.name))
        }

    def to(self: B, device: torch.device | str) -> B:
        """The same batch with every tensor on ``device``."""
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def padded(self: B, rows: int, length: int) -> B:
        """Zero-padded at the right to ``rows`` x ``length``: [B, T] tensors in both dimensions, [B] ones in rows.
        Added rows and positions have no loss-mask tokens, so they add nothing to a loss or its gradient, and
        attention is causal, so positions added at the right change nothing before them."""
        if rows < self.rows or length < self.length:
            raise ValueError(f"cannot pad a {self.rows} x {self.length} batch to {rows} x {length}")
        out = {}
        for k, v in self.tensors().items():
            pad = [0, rows - self.rows] if k in self.ROW_FIELDS else [0, length - self.length, 0, rows - self.rows]
            out[k] = torch.nn.functional.pad(v, pad)  # F.pad lists the last dimension first
        return dataclasses.replace(self, **out)


@dataclass(frozen=True)
class RLMicroBatch(MicroBatch):
    """One micro-batch of an RL step: B rollouts of the step (rows ``first`` .. ``first + B - 1`` of its rollouts,
    in group order), every field there before the first update."""

    ROW_FIELDS: ClassVar[frozenset[str]] = frozenset({"advantages"})
    advantages: torch.Tensor  # [B] float: one per rollout, broadcast over its tokens
    ref_logprobs: torch.Tensor  # [B, T] float: the frozen reference's token logprobs (0 off the loss mask)
    sampler_logprobs: torch.Tensor  # [B, T] float: the generator's logprobs of the generated tokens (0 elsewhere)
    # [B, T] float: the policy's before the first update, where the loss takes its ratio against them
    # (rl.loss ratio "old"); None where it takes the ratio against the detached logprobs of its own pass ("current")
    old_logprobs: torch.Tensor | None = None
    first: int = 0  # the index of row 0 among the step's rollouts


@dataclass(frozen=True)
class LossStats:
    """What a loss says about one micro-batch: floats that add up (sums and counts, never means). A loss's record
    subclasses this with its own fields; ``loss`` is the micro-batch's share of the step's (globally normalised)
    loss, so that the total over micro-batches and replicas is the step's loss."""

    loss: float = 0.0

    def __add__(self: S, other: S) -> S:
        if type(other) is not type(self):
            return NotImplemented
        return type(self)(*(a + b for a, b in zip(self.values(), other.values())))

    def values(self) -> tuple[float, ...]:
        return tuple(float(getattr(self, f.name)) for f in dataclasses.fields(self))

    def as_dict(self) -> dict[str, float]:
        return dict(zip((f.name for f in dataclasses.fields(self)), self.values()))

    @classmethod
    def total(cls: type[S], records: Iterable[S], reduce: Callable[[Any], Any] | None = None) -> S:
        """The sum of this replica's ``records`` (none: zeros), then over the data-parallel replicas with
        ``reduce`` (one collective on a float64 vector; every replica calls it, with or without records)."""
        sums = cls()
        for r in records:
            if type(r) is not cls:
                raise TypeError(f"{cls.__name__}.total got a {type(r).__name__}")
            sums = sums + r
        if reduce is None:
            return sums
        vector = reduce(torch.tensor(sums.values(), dtype=torch.float64))
        return cls(*(float(v) for v in vector.tolist()))
