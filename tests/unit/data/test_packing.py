"""data/packing.py by hand: packed rows' positions and index, the cheapest layout, and token-budget micro-batches."""

import pytest
import torch

from nemo_rcgrpo.data.packing import (
    Packed,
    budget_batches,
    choose_layout,
    forward_cost,
    packed_index,
    packed_positions,
    positions,
    positions_saved,
)
from nemo_rcgrpo.data.prefix_tree import GroupLayout


def test_packed_rows_restart_their_positions_and_map_back_to_the_padded_grid():
    p = Packed((3, 1, 2))
    assert p.tokens == 6
    assert packed_positions(p).tolist() == [0, 1, 2, 0, 0, 1]
    assert packed_index(p, 4).tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 0, 0]]
    assert packed_index(p, 2).tolist() == [[0, 1], [3, 0], [4, 5]]  # a narrower grid keeps each row's start


def test_positions_of_each_layout():
    assert positions(None, [4, 2, 3]) == 12  # padded: B x T
    assert positions(Packed((4, 2, 3)), [4, 2, 3]) == 9
    tree = choose_layout([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], share=True, pack=None)
    assert isinstance(tree, GroupLayout) and positions(tree, [5, 5]) == 4 + 2  # root 4, two suffixes of 1
    assert positions(None, []) == 0
    # a step: one micro-batch padded (8 of which 6 real), one tree (6 of 10)
    assert positions_saved([(None, [4, 2]), (tree, [5, 5])]) == pytest.approx(1 - (8 + 6) / (8 + 10))
    assert positions_saved([]) == 0.0


def test_the_layout_that_runs_fewest_positions():
    alike = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 8]]
    # tree: root 4, two branches padded to 1, three suffixes of 1 = 9 positions; packed 17; padded 18
    assert positions(choose_layout(alike, share=True, pack="varlen"), [6, 6, 5]) == 9
    apart = [[1, 2, 3, 4], [5, 6], [7]]  # nothing shared: packed 7 < 12 padded
    even = [[1, 2], [3, 4]]  # nothing to gain: no padding, nothing shared
    assert isinstance(choose_layout(alike, share=True, pack="varlen"), GroupLayout)
    assert choose_layout(alike, share=False, pack="varlen") == Packed((6, 6, 5))
    assert choose_layout(apart, share=True, pack="varlen") == Packed((4, 2, 1))
    assert choose_layout(apart, share=True, pack=None) is None  # the tree of rows apart runs more than B x T
    assert choose_layout(even, share=True, pack="varlen") is None
    assert choose_layout(alike, share=False, pack=None) is None
    assert choose_layout([[1, 2, 3]], share=True, pack="varlen") is None  # one row: nothing to share or pack
    assert choose_layout([[1, 2, 3], [4]], share=False, pack="varlen") == Packed((3, 1))  # two rows: 4 < 6
    assert choose_layout([], share=True, pack="varlen") is None


def test_a_dense_mask_packs_only_where_it_computes_no_more_scores_than_padded_rows():
    """sdpa / eager on CPU attend through an N x N mask: packed rows run fewer positions than padded ones but N^2
    scores against B x T^2; packed only where both are no more."""
    long_short = [[1] * 40, [2] * 5]  # N = 45: 2025 scores against 2 x 1600 = 3200 padded
    two_long = [[1] * 40, [2] * 30]  # N = 70: 4900 against 3200
    assert choose_layout(long_short, share=False, pack="dense") == Packed((40, 5))
    assert choose_layout(two_long, share=False, pack="dense") is None
    assert choose_layout(two_long, share=False, pack="varlen") == Packed((40, 30))  # no mask: fewer positions win
    edge = [[1] * 4, [2] * 4, [3] * 4, [4] * 4, [5] * 4, [6] * 4, [7] * 4, [8] * 4, [9] * 16]  # N = 48, 9 x 16
    assert choose_layout(edge, share=False, pack="dense") == Packed((4,) * 8 + (16,))  # 2304 = 9 x 256: the edge
    assert forward_cost(two_long, False, "dense") == 80 and forward_cost(long_short, False, "dense") == 45


def _lengths_cost(lengths):
    return lambda lo, hi: sum(lengths[lo:hi])


def test_budget_keeps_whole_groups_together_where_they_fit():
    lengths = [3] * 6  # groups of 2: (0, 1), (2, 3), (4, 5)
    assert budget_batches(6, 2, 12, _lengths_cost(lengths)) == [(0, 4), (4, 6)]  # two groups fit, not three
    assert budget_batches(6, 2, 6, _lengths_cost(lengths)) == [(0, 2), (2, 4), (4, 6)]
    assert budget_batches(6, 2, 100, _lengths_cost(lengths)) == [(0, 6)]
    # a group that does not fit the open micro-batch starts its own rather than being split
    assert budget_batches(6, 2, 9, _lengths_cost(lengths)) == [(0, 2), (2, 4), (4, 6)]


def test_budget_splits_a_group_only_where_it_cannot_fit_whole():
    lengths = [4, 4, 4, 2, 2, 2]  # groups of 3: 12 and 6
    # budget 8: the first group's rollouts fill 2 + 1; the second group (6) does not fit beside the open rollout
    # (4 + 6 > 8) but fits alone: it starts its own
    assert budget_batches(6, 3, 8, _lengths_cost(lengths)) == [(0, 2), (2, 3), (3, 6)]
    # budget 10: 4 + 4, then 4 + the whole next group (4 + 6 = 10)
    assert budget_batches(6, 3, 10, _lengths_cost(lengths)) == [(0, 2), (2, 6)]
    # a rollout longer than the budget is a micro-batch by itself
    assert budget_batches(3, 3, 3, _lengths_cost([2, 5, 1])) == [(0, 1), (1, 2), (2, 3)]
    assert budget_batches(0, 3, 3, _lengths_cost([])) == []
    # ... also where it opens a micro-batch: no empty micro-batch before it
    assert budget_batches(2, 2, 3, _lengths_cost([5, 1])) == [(0, 1), (1, 2)]
    # a group that costs exactly the budget fits alone (not split beside the open micro-batch)
    assert budget_batches(4, 2, 6, _lengths_cost([1, 1, 3, 3])) == [(0, 2), (2, 4)]
    assert budget_batches(2, 1, 1, _lengths_cost([1, 1])) == [(0, 1), (1, 2)]  # the smallest budget and groups
    with pytest.raises(ValueError, match="budget=0"):
        budget_batches(3, 3, 0, _lengths_cost([1, 1, 1]))


def test_a_budget_counted_through_the_tree_fits_a_group_that_padded_rows_would_not():
    prompt = list(range(100, 140))  # 40 shared tokens
    seqs = [prompt + [1, 2], prompt + [3], prompt + [4, 5, 6]]

    def cost(share):
        return lambda lo, hi: forward_cost(seqs[lo:hi], share, None)

    assert cost(True)(0, 3) == 40 + 3 * 3 and cost(False)(0, 3) == 3 * 43
    assert forward_cost(seqs, False, "varlen") == 42 + 41 + 43 and forward_cost(seqs[:1], True, "varlen") == 42
    assert budget_batches(3, 3, 60, cost(True)) == [(0, 3)]
    assert budget_batches(3, 3, 60, cost(False)) == [(0, 1), (1, 2), (2, 3)]
    assert torch.equal(packed_positions(Packed((2,))), torch.tensor([0, 1]))
