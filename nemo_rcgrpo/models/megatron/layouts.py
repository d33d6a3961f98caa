"""A micro-batch's prefix tree or packed rows as one flat row of megatron-core's GPTModel.

The local layer spec's attention takes an explicit mask ([1, 1, N, N], True where a query may not look) in place
of its causal default, but megatron-core's rotary embedding numbers the positions 0..N-1 along the sequence. This
module supplies what megatron-core lacks for a prefix tree (`data/prefix_tree.py`) or packed rows
(`data/packing.py: Packed`):

- ``flat_row``: the flat sequence, each token's position in its unshared row, the mask in which every token sees
  exactly its own root -> branch -> suffix path (or its own packed row), causally, and the index that maps the
  flat positions back to the right-padded [B, T] grid. The order of the flat slots is the torch backend's
  (`data/prefix_tree.hidden_index`, `data/packing.packed_index`), so both backends read the same slots;
- ``rotary_at``: RoPE at those positions while a forward runs (megatron's own frequencies, gathered per token).

Pure torch: nothing here imports megatron-core at import time.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from nemo_rcgrpo.data.packing import Layout, Packed, packed_index, packed_positions
from nemo_rcgrpo.data.prefix_tree import GroupLayout, hidden_index, padded_tokens


@dataclass(frozen=True)
class FlatRow:
    """One micro-batch as one sequence of N slots."""

    ids: torch.Tensor  # [N] long: the tokens (0 in a padding slot)
    positions: torch.Tensor  # [N] long: each token's position in its unshared row (0 in a padding slot)
    blocked: torch.Tensor  # [N, N] bool: True where query i may not attend to key j (a padding slot sees itself)
    index: torch.Tensor  # [B, T] long: the slot of each row's position t (0 past a row's length)

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    def padded(self, length: int) -> "FlatRow":
        """The same row with padding slots up to ``length`` (pipeline stages exchange one shape): each sees only
        itself, and no real token sees it."""
        extra = length - self.length
        if extra <= 0:
            return self
        blocked = torch.ones(length, length, dtype=torch.bool, device=self.blocked.device)
        blocked[:self.length, :self.length] = self.blocked
        blocked[torch.arange(self.length, length), torch.arange(self.length, length)] = False
        zeros = self.ids.new_zeros(extra)
        return FlatRow(torch.cat([self.ids, zeros]), torch.cat([self.positions, zeros]), blocked, self.index)

    def to(self, device: torch.device) -> "FlatRow":
        return FlatRow(self.ids.to(device), self.positions.to(device), self.blocked.to(device), self.index.to(device))


def _tree_slots(layout: GroupLayout, input_ids: torch.Tensor):
    """(ids, positions, segment of each slot (-1: padding), which segments each segment sees) of the flat
    [root (R) | branch parts, each padded to Q | suffixes, each padded to S] order."""
    R, Q, S = layout.root, layout.branch_width, layout.suffix_width
    nb, B = len(layout.branches), len(layout.lengths)
    n = padded_tokens(layout)
    ids = torch.zeros(n, dtype=torch.long)
    positions = torch.zeros(n, dtype=torch.long)
    segment = torch.full((n,), -1, dtype=torch.long)
    ids[:R], positions[:R], segment[:R] = input_ids[0, :R], torch.arange(R), 0
    sees = torch.eye(1 + nb + B, dtype=torch.bool)  # segments: 0 the root, 1 + b branch b, 1 + nb + r row r's suffix
    for b, branch in enumerate(layout.branches):
        start, q = R + b * Q, branch.length
        ids[start:start + q] = input_ids[branch.rows[0], R:R + q]
        positions[start:start + q] = R + torch.arange(q)
        segment[start:start + q] = 1 + b
        sees[1 + b, 0] = True
    for r, length in enumerate(layout.lengths):
        start, first = R + nb * Q + r * S, layout.suffix_start(r)
        ids[start:start + length - first] = input_ids[r, first:length]
        positions[start:start + length - first] = first + torch.arange(length - first)
        segment[start:start + length - first] = 1 + nb + r
        sees[1 + nb + r, 0] = sees[1 + nb + r, 1 + layout.branch_of(r)] = True
    return ids, positions, segment, sees


def flat_row(layout: Layout, input_ids: torch.Tensor) -> FlatRow:
    """The flat row of a right-padded micro-batch ``input_ids`` [B, T] (on the CPU) under ``layout`` (a prefix tree
    or packed rows). A slot sees a slot of a segment on its own path at the same or an earlier position."""
    if isinstance(layout, Packed):
        ids = torch.cat([input_ids[r, :n] for r, n in enumerate(layout.lengths)])
        positions = packed_positions(layout)
        segment = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(layout.lengths)])
        sees = torch.eye(len(layout.lengths), dtype=torch.bool)  # a row sees only itself
        index = packed_index(layout, input_ids.shape[1])
    elif isinstance(layout, GroupLayout):
        ids, positions, segment, sees = _tree_slots(layout, input_ids)
        index = hidden_index(layout, input_ids.shape[1])
    else:
        raise TypeError(f"flat_row takes a prefix tree or packed rows, not {type(layout).__name__}")
    real = segment >= 0
    seg = segment.clamp(min=0)
    visible = sees[seg][:, seg] & (positions[None, :] <= positions[:, None]) & real[None, :] & real[:, None]
    visible |= torch.eye(len(ids), dtype=torch.bool)  # a padding slot sees itself (its softmax stays finite)
    return FlatRow(ids, positions, ~visible, index)


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return [m for m in model.modules() if type(m) is RotaryEmbedding]


@contextmanager
def rotary_at(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """While inside, every RoPE module of ``model`` gives the frequencies of ``positions`` [N] (one flat row) in
    place of 0..N-1: megatron's ``RotaryEmbedding.get_emb`` up to the largest position, gathered per token
    ([N, 1, 1, dim], what its forward returns for a sequence of N). Refused for a model without plain RoPE
    (YaRN, multimodal RoPE, learned positions), whose positions this does not set."""
    modules = _rotary_modules(model)
    if not modules:
        raise NotImplementedError("flat rows need a model with megatron's RotaryEmbedding (plain RoPE)")
    top = int(positions.max()) + 1

    def at_positions(module):
        def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
            return module.get_emb(top, 0)[positions.to(module.inv_freq.device)]
        return forward

    for m in modules:
        m.forward = at_positions(m)  # an instance attribute: nn.Module.__call__ runs it in place of the method
    try:
        yield
    finally:
        for m in modules:
            del m.forward
