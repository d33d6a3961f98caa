"""The flat row of a prefix tree or packed rows (``data/packing.py: flat_row``), pure: each slot's token and
position are its rows', and it sees exactly the slots of its own root -> branch -> suffix path up to itself.

The forward through megatron-core (TP, PP, DP) against padded rows is tests/megatron/policy_worker.py."""

import pytest
import torch

from nemo_rcgrpo.data.packing import Packed, flat_row
from nemo_rcgrpo.data.prefix_tree import group_layout

HI, LO = 900, 901


def _rows(prompt, tails):
    return [list(prompt) + list(t) for t in tails]


CASES = {
    # RC-GRPO: a shared prompt, two reward-token branches that share more tokens, suffixes of several lengths
    "two-level": _rows([5, 6, 7, 8], [[HI, 40, 41, 1], [LO, 40, 2, 3, 4], [HI, 40, 41, 9, 9, 9], [LO, 40, 2]]),
    "one-level": _rows([5, 6, 7], [[1], [2, 3], [4, 5, 6, 7]]),
    # the first branch is one row (no part of its own), so its padded part's slots, right after the root, are padding
    "first-branch-alone": _rows([5, 6], [[HI, 1], [LO, 40, 41, 2], [LO, 40, 41, 3, 4]]),
    "no-root": [[1, 2, 3], [4, 5], [6]],
    "one-row": [[3, 4, 5, 6]],
    "identical": [[1, 2, 3], [1, 2, 3]],
}


def _padded(rows):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def _expected_visible(index, lengths, n):
    """What each slot must see: the slots of its rows' earlier-or-same positions (the same set from every row that
    reads the slot)."""
    sees = {}
    for r, length in enumerate(lengths):
        for t in range(length):
            path = frozenset(int(index[r, u]) for u in range(t + 1))
            slot = int(index[r, t])
            assert sees.setdefault(slot, path) == path, (slot, r, t)  # a shared slot has one path
    visible = torch.eye(n, dtype=torch.bool)
    for slot, path in sees.items():
        visible[slot, list(path)] = True
    return visible, set(sees)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", ["tree", "packed"])
def test_each_slot_sees_exactly_its_own_path(name, kind):
    rows = CASES[name]
    ids = _padded(rows)
    lengths = [len(r) for r in rows]
    layout = group_layout(rows) if kind == "tree" else Packed(tuple(lengths))
    flat = flat_row(layout, ids)
    for r, length in enumerate(lengths):
        slots = flat.index[r, :length]
        assert flat.ids[slots].tolist() == rows[r]
        assert flat.positions[slots].tolist() == list(range(length))  # each row's own positions, never restarted
    visible, real = _expected_visible(flat.index, lengths, flat.length)
    assert torch.equal(~flat.blocked, visible)
    assert len(real) == (sum(lengths) if kind == "packed" else layout.tokens)  # computed once where shared
    if kind == "tree" and name == "two-level":  # a suffix never sees another row's suffix or the other branch
        a, b = flat.index[0, lengths[0] - 1], flat.index[2, lengths[2] - 1]
        assert flat.blocked[a, b] and flat.blocked[b, a]
        assert flat.blocked[flat.index[0, 5], flat.index[1, 5]]


def test_padding_slots_see_only_themselves_and_are_seen_by_no_one():
    rows = CASES["two-level"]
    flat = flat_row(group_layout(rows), _padded(rows))
    longer = flat.padded(flat.length + 3)
    n = flat.length
    assert longer.length == n + 3 and torch.equal(longer.blocked[:n, :n], flat.blocked)
    assert longer.blocked[:n, n:].all() and longer.blocked[n:, :n].all()
    assert torch.equal(~longer.blocked[n:, n:], torch.eye(3, dtype=torch.bool))
    assert torch.equal(longer.index, flat.index) and flat.padded(n) is flat
    assert flat.padded(n + 1).length == n + 1 and not flat.padded(n + 1).blocked[n, n]
    moved = flat.to(torch.device("cpu"))
    assert all(torch.equal(getattr(moved, f), getattr(flat, f)) for f in ("ids", "positions", "blocked", "index"))


def test_only_trees_and_packed_rows():
    with pytest.raises(TypeError, match="prefix tree or packed rows"):
        flat_row(None, torch.zeros(1, 2, dtype=torch.long))
