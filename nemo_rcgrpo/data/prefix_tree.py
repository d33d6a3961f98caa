"""The shared prefixes of a micro-batch's rollouts as a two-level tree, found from their token ids (pure).

All G rollouts of a group start with the same prompt; in RC-GRPO they differ first at the reward token, so a group
is a two-level tree: the root (the tokens every row shares), then one branch per token that follows the root (a
stratified group has exactly two: high and low), each branch holding the tokens all of its rows share, then each
row's own suffix. A one-level group (GRPO, or an SFT-initialised run) has one branch of length 0 or a root that
reaches the end of the prompt. Nothing is assumed from the task: the tree is the longest common prefix of the ids.

Every row keeps at least one token of its own, so each segment is a non-empty forward pass. A token's attention
path is root -> its branch -> its suffix, causally; its position is its position in the unshared row.

``hidden_index`` maps each row's positions to the rows of the flat [root | branches | suffixes] hidden states, so a
shared forward gives back the [B, T] grid of the unshared, right-padded micro-batch, and the loss is unchanged.
``forward_flops`` counts a micro-batch's forward FLOPs with and without the sharing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def common_prefix_length(rows: Sequence[Sequence[int]]) -> int:
    """The length of the longest prefix every row starts with."""
    if not rows:
        return 0
    n = min(len(r) for r in rows)
    first = rows[0]
    for i in range(n):
        t = first[i]
        if any(r[i] != t for r in rows):
            return i
    return n


@dataclass(frozen=True)
class Branch:
    """The rows (indices into the micro-batch, ascending) that share ``length`` tokens after the root."""

    rows: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class GroupLayout:
    """A micro-batch's prefix tree: the root's length, the branches (each row in exactly one) and each row's
    length; row r's suffix is its tokens from ``root + branch.length`` to ``lengths[r]`` (at least one)."""

    root: int
    branches: tuple[Branch, ...]
    lengths: tuple[int, ...]

    def branch_of(self, row: int) -> int:
        return next(i for i, b in enumerate(self.branches) if row in b.rows)

    def suffix_start(self, row: int) -> int:
        return self.root + self.branches[self.branch_of(row)].length

    @property
    def branch_width(self) -> int:
        """Q: the longest branch part, the width every branch part is padded to in the branch pass."""
        return max(b.length for b in self.branches)

    @property
    def suffix_width(self) -> int:
        """S: the longest suffix, the width every suffix is padded to in the suffix pass."""
        return max(n - self.suffix_start(r) for r, n in enumerate(self.lengths))

    @property
    def shared_tokens(self) -> int:
        """The tokens the tree computes once that the unshared batch computes once per row."""
        unshared = sum(self.lengths)
        return unshared - self.tokens

    @property
    def tokens(self) -> int:
        """The tokens the shared forward computes: the root once, each branch once, every suffix."""
        return (
            self.root
            + sum(b.length for b in self.branches)
            + sum(n - self.suffix_start(r) for r, n in enumerate(self.lengths))
        )


def group_layout(rows: Sequence[Sequence[int]]) -> GroupLayout:
    """The prefix tree of ``rows`` (each row's token ids, unpadded): the root is the longest common prefix, the
    branches the rows grouped by the token after it (in order of first appearance), each branch's part the
    longest prefix its rows share after the root (none for a branch of one row: nothing is shared there, its
    tokens are its suffix); each kept short of a row's last token."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("group_layout needs at least one row and no empty row")
    lengths = tuple(len(r) for r in rows)
    root = min(common_prefix_length(rows), min(lengths) - 1)
    by_token: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_token.setdefault(int(r[root]), []).append(i)
    branches = []
    for members in by_token.values():
        tails = [rows[i][root:] for i in members]
        length = min(common_prefix_length(tails), min(len(t) for t in tails) - 1) if len(members) > 1 else 0
        branches.append(Branch(tuple(members), length))
    return GroupLayout(root, tuple(branches), lengths)


def padded_tokens(layout: GroupLayout) -> int:
    """The positions the row passes run (ROWS in `models/shared_prefix.py`), padding included: the root, every branch part padded to the longest
    (Q), every suffix padded to the longest (S)."""
    return layout.root + len(layout.branches) * layout.branch_width + len(layout.lengths) * layout.suffix_width


def attention_scores(layout: GroupLayout) -> tuple[int, int]:
    """(flat, rows): the (query, key) entries the rest of the tree's attention holds after the root, run one way or
    the other (`models/shared_prefix.py`): as one row of its M real tokens behind a dense [M, R + M] mask, or as
    the branch parts padded to Q over [R + Q] keys and the suffixes padded to S over [R + Q + S]. The flat row
    skips padding but every token holds a score for every other token of the tree; with many rows and a short root
    it is the larger by far (8 rows of 2k tokens after a 200-token root: 210M against 30M)."""
    R, Q, S, B = layout.root, layout.branch_width, layout.suffix_width, len(layout.lengths)
    M = layout.tokens - R
    return M * (R + M), len(layout.branches) * Q * (R + Q) + B * S * (R + Q + S)


def hidden_index(layout: GroupLayout, width: int) -> torch.Tensor:
    """[B, width] long: for each row's position t, the row of the flat hidden states [root (R) | branch 0 part
    padded to the longest branch part (Q) | ... | suffix 0 padded to the longest suffix (S) | ...] that holds its
    hidden state (the layout `models/shared_prefix.py` runs). Positions past a row's length point at 0."""
    R, Q, S = layout.root, layout.branch_width, layout.suffix_width
    out = torch.zeros(len(layout.lengths), width, dtype=torch.long)
    suffixes = R + len(layout.branches) * Q  # where the first suffix starts in the flat states
    for b, branch in enumerate(layout.branches):
        q = branch.length
        for r in branch.rows:
            n = min(layout.lengths[r], width)
            row = torch.cat(
                [
                    torch.arange(R),
                    R + b * Q + torch.arange(q),
                    suffixes + r * S + torch.arange(layout.lengths[r] - R - q),
                ]
            )
            out[r, :n] = row[:n]
    return out


def forward_flops(lengths_per_pass: Sequence[tuple[int, int]], params: int, layers: int, hidden: int) -> float:
    """Forward FLOPs of segments given as (context before the segment, segment tokens): 2 N per token for the
    weights plus the causal attention term, 4 L h per (query, key) pair (QK^T and AV), a token at position p
    attending to p + 1 keys. Training (forward + backward) is 3x this, the accounting of
    scripts/bench/megatron_gpu.py (6 N plus attention)."""
    total = 0.0
    for context, n in lengths_per_pass:
        keys = n * context + n * (n + 1) / 2  # sum over the segment's tokens of the keys each attends to
        total += 2.0 * params * n + 4.0 * layers * hidden * keys
    return total


def layout_flops(layout: GroupLayout, params: int, layers: int, hidden: int) -> tuple[float, float]:
    """(unshared, shared) forward FLOPs of a micro-batch: every row in full, or the root once, each branch part
    once and every suffix (each at the context its path gives it). Padding is not counted in either."""
    unshared = forward_flops([(0, n) for n in layout.lengths], params, layers, hidden)
    passes = [(0, layout.root)] + [(layout.root, b.length) for b in layout.branches]
    passes += [(layout.suffix_start(r), n - layout.suffix_start(r)) for r, n in enumerate(layout.lengths)]
    return unshared, forward_flops(passes, params, layers, hidden)


def step_savings(
    batches: Sequence[tuple[GroupLayout | None, Sequence[int]]], params: int, layers: int, hidden: int
) -> dict[str, float]:
    """What a step's prefix-once passes did not compute: ``batches`` holds each micro-batch's layout (a prefix tree;
    anything else, None or packed rows, ran every row in full) and row lengths. ``prefix_tokens_saved``: tokens computed once instead of once per row;
    ``forward_flops_saved``: the share of the step's forward FLOPs (`layout_flops`) not spent."""
    saved, unshared, shared = 0, 0.0, 0.0
    for layout, lengths in batches:
        if not isinstance(layout, GroupLayout):
            full = forward_flops([(0, n) for n in lengths], params, layers, hidden)
            unshared, shared = unshared + full, shared + full
        else:
            u, s = layout_flops(layout, params, layers, hidden)
            unshared, shared, saved = unshared + u, shared + s, saved + layout.shared_tokens
    return {
        "prefix_tokens_saved": float(saved),
        "forward_flops_saved": 1.0 - shared / unshared if unshared > 0 else 0.0,
    }
