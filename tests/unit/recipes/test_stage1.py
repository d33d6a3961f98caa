"""recipes/stage1.py's micro-batches: fixed counts of examples, or filled to a token budget (trainer.micro_batch_tokens)
counted as the policy runs them, split evenly over data-parallel replicas."""

import pytest

from nemo_rcgrpo.data.sft_data import Example
from nemo_rcgrpo.recipes.stage1 import micro_batches_for_rank
from nemo_rcgrpo.utils.dist import DistInfo


def _examples(lengths, prefix=0):
    """Examples of ``lengths`` tokens whose first ``prefix`` tokens are the same (a shared system prompt)."""
    return [
        Example(list(range(1000, 1000 + prefix)) + [i + 1] * (n - prefix), [0] * prefix + [1] * (n - prefix), f"t{i}")
        for i, n in enumerate(lengths)
    ]


def _split(examples, batch, rank=0, world=1, **kw):
    mine, groups = micro_batches_for_rank(examples, batch, 2, DistInfo(rank=rank, world_size=world), 0, **kw)
    return mine, groups


def test_fixed_counts_sorted_by_length():
    ex = _examples([5, 2, 4, 3])
    mine, groups = _split(ex, [0, 1, 2, 3])
    assert groups == [[1, 3], [2, 0]] and [tuple(b.input_ids.shape) for b in mine] == [(2, 3), (2, 5)]
    assert _split(ex, [0, 1, 2, 3], rank=1, world=2)[1] == groups  # every rank knows them all
    assert len(_split(ex, [0, 1, 2, 3], rank=1, world=2)[0]) == 1


def test_a_budget_fills_micro_batches_by_positions_as_the_policy_runs_them():
    ex = _examples([5, 2, 4, 3, 1, 6])  # by length: example 4 (1 token), 1 (2), 3 (3), 2 (4), 0 (5), 5 (6)
    # padded rows, B x T <= 8: [4, 1] (2 x 2; with 3: 3 x 3), [3, 2] (2 x 4), [0] (with 5: 2 x 6), [5]
    assert _split(ex, list(range(6)), budget=8)[1] == [[4, 1], [3, 2], [0], [5]]
    # packed rows, sum of lengths <= 8: [4, 1, 3] (6; with 2: 10), [2] (with 0: 9), [0] (with 5: 11), [5]
    assert _split(ex, list(range(6)), budget=8, pack="varlen")[1] == [[4, 1, 3], [2], [0], [5]]
    assert _split(ex, list(range(6)), budget=10, pack="varlen")[1] == [[4, 1, 3, 2], [0], [5]]
    mine, _ = _split(ex, list(range(6)), budget=10, pack="varlen")
    assert [b.rows for b in mine] == [4, 1, 1]
    # a 10-token system prompt shared by all four: the tree runs 10 + 4 suffixes of 3 = 22 positions; padded 2 x 12
    shared = _examples([12, 11, 13, 12], prefix=10)
    assert _split(shared, [0, 1, 2, 3], budget=24)[1] == [[1, 0], [3], [2]]
    assert _split(shared, [0, 1, 2, 3], budget=24, share=True)[1] == [[1, 0, 3, 2]]


def test_the_costliest_micro_batch_is_split_where_the_count_does_not_divide():
    ex = _examples([8, 1, 3, 1, 1, 2, 1, 1])  # by length: the five 1s, then 2 (5), 3 (2), 8 (0)
    # padded, B x T <= 8: [the five 1s] (5), [5, 2] (2 x 3 = 6), [0] (8, one row: cannot split)
    assert _split(ex, list(range(8)), budget=8)[1] == [[1, 3, 4, 6, 7], [5, 2], [0]]
    # two replicas: [5, 2] (6) is split in place, not the five 1s (5) nor the single 8
    assert _split(ex, list(range(8)), budget=8, world=2)[1] == [[1, 3, 4, 6, 7], [5], [2], [0]]
    # five: then the five 1s too, into 2 + 3
    assert _split(ex, list(range(8)), budget=8, world=5)[1] == [[1, 3], [4, 6, 7], [5], [2], [0]]
    with pytest.raises(ValueError, match="3 examples cannot give each of 2 data-parallel replicas"):
        _split(_examples([4, 4, 4]), [0, 1, 2], budget=4, world=2)


@pytest.mark.parametrize("world", [2, 3])
def test_a_budget_gives_every_replica_as_many_micro_batches(world):
    """The count is made a multiple of the data-parallel size by splitting the largest micro-batches (each replica
    runs as many forward and backward passes); every example is trained once."""
    shared = _examples([12, 11, 13, 12, 10, 14], prefix=10)
    groups = _split(shared, list(range(6)), budget=64, share=True, world=world)[1]
    assert len(groups) % world == 0 and sorted(i for g in groups for i in g) == list(range(6))
    for rank in range(world):
        mine, same = _split(shared, list(range(6)), rank=rank, world=world, budget=64, share=True)
        assert same == groups and len(mine) == len(groups) // world
