"""Packed rows and token-budget micro-batches, pure.

A micro-batch's rows can run three ways, each giving the same logprobs on the same right-padded [B, T] grid:

- padded: every row in full, padded to the longest (B x T positions);
- tree (`data/prefix_tree.py`): what the rows share computed once (``padded_tokens(layout)`` positions);
- packed (``Packed``): the rows one after another as one sequence, each row's positions restarting at 0 and no
  token attending across a row boundary (sum of the row lengths, no padding at all).

``flat_row`` lays a tree or packed rows out as one sequence with each token's position and the mask of what it
sees (the slots of its own path, causally). ``choose_layout`` takes the one that runs the fewest positions among
those the policy can run (packed rows behind a dense mask only where they also compute no more attention scores
than the padded rows), and ``budget_batches`` fills micro-batches to a token budget counted the same way: whole
groups where they fit, otherwise rollouts, each micro-batch a contiguous run of the step's rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nemo_rcgrpo.data.prefix_tree import GroupLayout, group_layout, hidden_index, padded_tokens


@dataclass(frozen=True)
class Packed:
    """The rows of a micro-batch run as one sequence [row 0 | row 1 | ...], without padding; ``lengths``: each
    row's real tokens."""

    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def packed_positions(packed: Packed) -> torch.Tensor:
    """[N] long: each token's position within its own row (0 at every row's first token)."""
    return torch.cat([torch.arange(n) for n in packed.lengths])


def packed_index(packed: Packed, width: int) -> torch.Tensor:
    """[B, width] long: where in the packed sequence each row's position t is; positions past a row's length
    point at 0."""
    out = torch.zeros(len(packed.lengths), width, dtype=torch.long)
    start = 0
    for r, n in enumerate(packed.lengths):
        k = min(n, width)
        out[r, :k] = start + torch.arange(k)
        start += n
    return out


Layout = GroupLayout | Packed | None  # how a micro-batch's forward runs (None: every row padded, in full)
# how a policy's attention takes packed rows: a varlen kernel (no mask), or a dense N x N block mask (sdpa / eager)
VARLEN, DENSE = "varlen", "dense"


def positions(layout: Layout, lengths: Sequence[int]) -> int:
    """The positions a micro-batch's forward runs, padding included, for rows of ``lengths`` under ``layout``."""
    if isinstance(layout, GroupLayout):
        return padded_tokens(layout)
    if isinstance(layout, Packed):
        return layout.tokens
    return len(lengths) * max(lengths, default=0)


def positions_saved(batches: Sequence[tuple[Layout, Sequence[int]]]) -> float:
    """The share of the padded micro-batches' positions (B x T each) a step's forward passes did not run, from each
    micro-batch's layout and row lengths (padding the packed rows drop, prefixes the tree runs once)."""
    padded = sum(len(lengths) * max(lengths, default=0) for _, lengths in batches)
    run = sum(positions(layout, lengths) for layout, lengths in batches)
    return 1.0 - run / padded if padded else 0.0


def choose_layout(rows: Sequence[Sequence[int]], share: bool, pack: str | None) -> Layout:
    """The layout that runs the fewest positions for these rows' token ids: the prefix tree (``share``), packed
    rows (``pack``: VARLEN, or DENSE where the attention builds an N x N mask, so packed only where N^2 is also at
    most the padded rows' B x T^2 scores) or, where neither runs fewer than B x T, None. A tie keeps the simpler
    (padded, then packed)."""
    lengths = [len(r) for r in rows]
    best: Layout = None
    width = max(lengths, default=0)
    cost = len(rows) * width
    n = sum(lengths)
    if pack and n < cost and (pack == VARLEN or n * n <= len(rows) * width * width):  # one row: never fewer
        best, cost = Packed(tuple(lengths)), n
    if share and len(rows) > 1:
        tree = group_layout(rows)
        if padded_tokens(tree) < cost:
            best = tree
    return best


def forward_cost(rows: Sequence[Sequence[int]], share: bool, pack: str | None) -> int:
    """The positions the forward runs for these rows' token ids under the layout ``choose_layout`` picks: what a
    token budget counts."""
    return positions(choose_layout(rows, share, pack), [len(r) for r in rows])


def budget_batches(count: int, group_size: int, budget: int, cost: Callable[[int, int], int]) -> list[tuple[int, int]]:
    """Micro-batches of ``count`` rollouts (groups of ``group_size`` consecutive ones) as [lo, hi) ranges in
    order, each costing at most ``budget`` positions (``cost(lo, hi)``) where it can: a whole group joins the
    open micro-batch where it fits, else starts one of its own where it fits alone, else its rollouts fill
    micro-batches one by one. A rollout that alone costs more than the budget is a micro-batch by itself."""
    if budget < 1 or group_size < 1:
        raise ValueError(f"budget={budget}, group_size={group_size}: both must be >= 1")
    out: list[tuple[int, int]] = []
    lo = hi = 0  # the open micro-batch [lo, hi)
    for start in range(0, count, group_size):
        end = min(count, start + group_size)
        if cost(lo, end) <= budget:  # the whole group joins (or opens) the micro-batch
            hi = end
            continue
        if cost(start, end) <= budget:  # the group alone fits: it starts the next micro-batch
            out.append((lo, hi))
            lo, hi = start, end
            continue
        for r in range(start, end):  # the group does not fit whole: rollout by rollout
            if hi > lo and cost(lo, r + 1) > budget:
                out.append((lo, hi))
                lo = hi
            hi = r + 1
    if hi > lo:
        out.append((lo, hi))
    return out


@dataclass(frozen=True)
class FlatRow:
    """One micro-batch (a prefix tree or packed rows) as one sequence of N slots, in the order of the flat hidden
    states `prefix_tree.hidden_index` / ``packed_index`` map back to the [B, T] grid: what Megatron's flat row and
    the torch backend's flat pass (`models/shared_prefix.py`) run, behind an explicit mask."""

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
        blocked[: self.length, : self.length] = self.blocked
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
        ids[start : start + q] = input_ids[branch.rows[0], R : R + q]
        positions[start : start + q] = R + torch.arange(q)
        segment[start : start + q] = 1 + b
        sees[1 + b, 0] = True
    for r, length in enumerate(layout.lengths):
        start, first = R + nb * Q + r * S, layout.suffix_start(r)
        ids[start : start + length - first] = input_ids[r, first:length]
        positions[start : start + length - first] = first + torch.arange(length - first)
        segment[start : start + length - first] = 1 + nb + r
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
