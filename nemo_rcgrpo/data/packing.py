"""Packed rows and token-budget micro-batches, pure.

A micro-batch's rows can run three ways, each giving the same logprobs on the same right-padded [B, T] grid:

- padded: every row in full, padded to the longest (B x T positions);
- tree (`data/prefix_tree.py`): what the rows share computed once (``padded_tokens(layout)`` positions);
- packed (``Packed``): the rows one after another as one sequence, each row's positions restarting at 0 and no
  token attending across a row boundary (sum of the row lengths, no padding at all).

``choose_layout`` takes the one that runs the fewest positions among those the policy can run (packed rows behind
a dense mask only where they also compute no more attention scores than the padded rows), and
``budget_batches`` fills micro-batches to a token budget counted the same way: whole groups where they fit,
otherwise rollouts, each micro-batch a contiguous run of the step's rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nemo_rcgrpo.data.prefix_tree import GroupLayout, group_layout, padded_tokens


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


def budget_batches(count: int, group_size: int, budget: int,
                   cost: Callable[[int, int], int]) -> list[tuple[int, int]]:
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
