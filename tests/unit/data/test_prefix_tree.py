"""data/prefix_tree.py: a micro-batch's prefix tree from its token ids, the hidden-state map, the counted FLOPs and
attention scores, by hand."""

import pytest

from nemo_rcgrpo.data.prefix_tree import (
    Branch,
    attention_scores,
    common_prefix_length,
    forward_flops,
    group_layout,
    hidden_index,
    layout_flops,
    padded_tokens,
)


def test_common_prefix_length():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[1, 2], [1, 2]]) == 2 and common_prefix_length([[5], [6]]) == 0
    assert common_prefix_length([]) == 0 and common_prefix_length([[7, 8, 9]]) == 3


def test_an_rc_grpo_group_is_a_two_level_tree():
    # prompt [1 2 | reward token 8 (high) or 9 (low) | 3 4], then each rollout's own tokens
    rows = [[1, 2, 8, 3, 4, 10, 11], [1, 2, 9, 3, 4, 12, 15], [1, 2, 8, 3, 4, 13], [1, 2, 9, 3, 4, 12, 14]]
    layout = group_layout(rows)
    assert layout.root == 2 and layout.lengths == (7, 7, 6, 7)
    # the branches in order of first appearance; low's rows share one generated token too (12)
    assert layout.branches == (Branch((0, 2), 3), Branch((1, 3), 4))
    assert [layout.suffix_start(r) for r in range(4)] == [5, 6, 5, 6]
    assert layout.tokens == 2 + (3 + 4) + (2 + 1 + 1 + 1)  # the root, the branch parts, the suffixes
    assert layout.shared_tokens == 27 - 14
    # a branch's part stops short of its shortest row's last token; a branch of one row shares nothing
    assert group_layout([[1, 9, 3, 4], [1, 9, 3, 4, 5], [1, 8, 6]]).branches == (Branch((0, 1), 2), Branch((2,), 0))


def test_every_row_keeps_a_token_of_its_own():
    same = [[1, 2, 3], [1, 2, 3]]  # identical rows: the tree stops one short so each suffix is a token
    layout = group_layout(same)
    assert layout.root == 2 and layout.branches == (Branch((0, 1), 0),)
    assert [layout.suffix_start(r) for r in range(2)] == [2, 2]
    short = group_layout([[1, 2, 3, 4], [1, 2]])  # a row that is all prefix
    assert short.root == 1 and short.branches == (Branch((0, 1), 0),)
    one_level = group_layout([[1, 2, 3, 5], [1, 2, 3, 6, 7]])  # GRPO: no reward token, one branch per token
    assert one_level.root == 3 and one_level.branches == (Branch((0,), 0), Branch((1,), 0))
    single = group_layout([[4], [4]])  # one token each: nothing to share, each row's own
    assert single.root == 0 and single.branches == (Branch((0, 1), 0),) and single.tokens == 2
    with pytest.raises(ValueError, match="no empty row"):
        group_layout([[1], []])


def test_hidden_index_points_each_position_at_its_segment():
    rows = [[1, 2, 8, 3, 10], [1, 2, 9, 3, 4, 12, 13], [1, 2, 8, 3, 11, 5]]
    layout = group_layout(rows)  # root [1 2]; branch 8: rows 0, 2 share [8 3]; branch 9: row 1 alone, nothing shared
    assert layout.root == 2 and layout.branches == (Branch((0, 2), 2), Branch((1,), 0))
    # flat: root 0-1 | branch 0 at 2-3 (Q = 2) | branch 1 at 4-5 (empty) | suffixes of S = 5 at 6-10, 11-15, 16-20
    index = hidden_index(layout, 7)
    assert index.tolist() == [[0, 1, 2, 3, 6, 0, 0], [0, 1, 11, 12, 13, 14, 15], [0, 1, 2, 3, 16, 17, 0]]
    assert hidden_index(layout, 5)[1].tolist() == [0, 1, 11, 12, 13]  # a narrower grid: cut at its width
    # the three passes run 2 + 2 x 2 + 3 x 5 = 21 positions, padding included: no fewer than the 3 x 7 unshared
    assert padded_tokens(layout) == 21
    # two branches with parts of their own: root [1] | branch 5 (rows 0, 1) part [5 6] | branch 7 (rows 2, 3)
    # part [7 8 9], padded to Q = 3 | suffixes of S = 2
    two = group_layout([[1, 5, 6, 2], [1, 5, 6, 3, 4], [1, 7, 8, 9, 5], [1, 7, 8, 9, 6, 7]])
    assert two.root == 1 and two.branches == (Branch((0, 1), 2), Branch((2, 3), 3))
    # flat: root 0 | branch 0 at 1-3 | branch 1 at 4-6 | suffixes at 7-8, 9-10, 11-12, 13-14
    assert hidden_index(two, 6).tolist() == [
        [0, 1, 2, 7, 0, 0],
        [0, 1, 2, 9, 10, 0],
        [0, 4, 5, 6, 11, 0],
        [0, 4, 5, 6, 13, 14],
    ]


def test_attention_scores_by_hand():
    """The rest of the tree's (query, key) entries after the root, run as one flat row or as the row passes."""
    rows = [[1, 5, 6, 2], [1, 5, 6, 3, 4], [1, 7, 8, 9, 5], [1, 7, 8, 9, 6, 7]]
    two = group_layout(rows)  # R = 1; branch parts of 2 and 3 (Q = 3); suffixes of 1, 2, 1, 2 (S = 2)
    # flat: M = 2 + 3 + 1 + 2 + 1 + 2 = 11 tokens after the root, each with an entry for the root and all 11;
    # rows: 2 branch parts x 3 queries over 1 + 3 keys, then 4 suffixes x 2 queries over 1 + 3 + 2 keys
    assert attention_scores(two) == (11 * (1 + 11), 2 * 3 * (1 + 3) + 4 * 2 * (1 + 3 + 2))
    one_level = group_layout([[1, 2, 3, 4], [1, 2, 3, 5, 6, 7]])  # R = 3, no branch parts, suffixes of 1 and 3
    assert attention_scores(one_level) == (4 * (3 + 4), 2 * 3 * (3 + 0 + 3))


def test_flops_by_hand_and_the_goal_shape():
    # one segment of 3 tokens after 2: 2 N x 3 + 4 L h x (3 + 4 + 5) keys
    assert forward_flops([(2, 3)], params=10, layers=1, hidden=1) == 2 * 10 * 3 + 4 * (3 + 4 + 5)
    assert forward_flops([(2, 3)], params=10, layers=2, hidden=3) == 2 * 10 * 3 + 4 * 2 * 3 * (3 + 4 + 5)
    layout = group_layout([[1, 2, 3, 4], [1, 2, 3, 5]])  # root 3 once, two suffixes of one token at context 3
    unshared, shared = layout_flops(layout, params=10, layers=1, hidden=1)
    assert unshared == 2 * forward_flops([(0, 4)], 10, 1, 1)
    assert shared == forward_flops([(0, 3)], 10, 1, 1) + 2 * forward_flops([(3, 1)], 10, 1, 1)
    # the 8B shape at P = 5400, S = 300, G = 5 (the goal: at least 3.9x fewer)
    prompt = list(range(5400))
    group = [prompt + [10_000 + g] * 300 for g in range(5)]
    unshared, shared = layout_flops(group_layout(group), params=8_030_000_000, layers=32, hidden=4096)
    assert unshared / shared >= 3.9


def test_a_steps_savings_add_its_micro_batches():
    from nemo_rcgrpo.data.prefix_tree import step_savings

    shared = group_layout([[1, 2, 3, 4], [1, 2, 3, 5]])  # 3 tokens computed once: 3 saved
    full = [4, 2]  # a micro-batch whose rows ran in full
    out = step_savings([(shared, shared.lengths), (None, full)], params=10, layers=2, hidden=3)
    unshared, once = layout_flops(shared, 10, 2, 3)
    rest = forward_flops([(0, 4), (0, 2)], 10, 2, 3)
    assert out["prefix_tokens_saved"] == 3.0
    assert out["forward_flops_saved"] == pytest.approx(1 - (once + rest) / (unshared + rest), rel=1e-12)
    assert step_savings([(None, [3])], 10, 2, 3) == {"prefix_tokens_saved": 0.0, "forward_flops_saved": 0.0}
    assert step_savings([], 10, 2, 3)["forward_flops_saved"] == 0.0
