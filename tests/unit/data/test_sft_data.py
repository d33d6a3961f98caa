"""data/sft_data.py: what a prepared stage-1 row trains, token by token; which rows are kept; the epochs' batches
(deterministic in seed and epoch, different across epochs, length-bucketed); the padded micro-batch."""

import random

import pytest
import torch

from nemo_rcgrpo.data.sft_data import Example, build_examples, collate, epoch_batches
from nemo_rcgrpo.data.tokenize import ChatRenderer, Tokenized


class _Renderer:
    """Renders a row as one token per message: the message's number (+100 where it is an assistant's, masked)."""

    def render(self, messages, tools=None):
        ids = [100 * (m["role"] == "assistant") + int(m["content"]) for m in messages]
        return Tokenized(ids, [int(m["role"] == "assistant") for m in messages])


def _row(task, *turns, **extra):
    return {"task_id": task, "messages": [{"role": r, "content": str(c)} for r, c in turns], **extra}


def test_a_prepared_row_trains_its_assistant_tokens_only():
    """The real renderer: the trained tokens of an example are exactly the assistant messages' completion ids, in
    order, and nothing of the system, user or tool turns."""
    from nemo_rcgrpo.models.hf import load_tokenizer

    renderer = ChatRenderer(load_tokenizer("smollm2"), "hermes", tool_description="compact")
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "ls", "content": "a.txt"},
        {"role": "assistant", "content": "There is a.txt."},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "ls", "description": "list", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    (ex,), stats = build_examples([{"task_id": "t0", "messages": messages, "tools": tools}], renderer, 4096, 0, None)
    assert stats == {"examples": 1, "dropped_too_long": 0, "records": 1}
    trained = [i for i, m in zip(ex.ids, ex.mask) if m]
    expected = renderer.completion_ids(messages[2]) + renderer.completion_ids(messages[4])
    assert trained == expected and ex.ids == renderer.render(messages, tools).ids and ex.task_id == "t0"
    assert len(ex.ids) == len(ex.mask) == len(ex)


def test_rows_kept_and_dropped_with_their_counts():
    rows = [
        _row("long", ("user", 1), ("assistant", 2), ("user", 3), ("assistant", 4)),  # 4 tokens
        _row("fits", ("user", 5), ("assistant", 6), ("user", 7)),  # exactly max_length = 3
        _row("untrained", ("user", 8), ("user", 9)),  # nothing to train on
        {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]},
    ]  # no task_id
    examples, stats = build_examples(rows, _Renderer(), max_length=3, seed=0, max_examples=None)
    assert stats == {"examples": 2, "dropped_too_long": 2, "records": 4}
    by_task = {e.task_id: e for e in examples}
    assert set(by_task) == {"fits", "3"}  # a row without a task_id is named by its index
    assert by_task["fits"].ids == [5, 106, 7] and by_task["fits"].mask == [0, 1, 0]
    assert by_task["3"].ids == [1, 102] and by_task["3"].mask == [0, 1]


def test_the_rows_are_a_seeded_shuffle_cut_at_max_examples():
    rows = [_row(f"t{i}", ("user", i), ("assistant", i)) for i in range(20)]
    order = list(range(20))
    random.Random(7).shuffle(order)
    examples, stats = build_examples(rows, _Renderer(), 8, seed=7, max_examples=5)
    assert [e.task_id for e in examples] == [f"t{i}" for i in order[:5]]
    assert stats == {"examples": 5, "dropped_too_long": 0, "records": 20}
    again, _ = build_examples(rows, _Renderer(), 8, seed=7, max_examples=5)
    other, _ = build_examples(rows, _Renderer(), 8, seed=8, max_examples=5)
    assert [e.ids for e in again] == [e.ids for e in examples] != [e.ids for e in other]
    assert len(build_examples(rows, _Renderer(), 8, seed=7, max_examples=0)[0]) == 0
    assert len(build_examples(rows, _Renderer(), 8, seed=7, max_examples=20)[0]) == 20


@pytest.mark.parametrize("bucket", [False, True])
def test_an_epochs_batches_cover_whole_batches_once_and_repeat_for_its_seed(bucket):
    lengths = [random.Random(i).randrange(1, 500) for i in range(103)]
    batches = epoch_batches(lengths, 4, seed=3, epoch=0, bucket_by_length=bucket)
    flat = [i for b in batches for i in b]
    assert len(batches) == 25 and all(len(b) == 4 for b in batches)  # 103 // 4 whole batches, the rest dropped
    assert len(set(flat)) == 100 and set(flat) <= set(range(103))
    assert epoch_batches(lengths, 4, seed=3, epoch=0, bucket_by_length=bucket) == batches  # resume is exact
    assert epoch_batches(lengths, 4, seed=3, epoch=1, bucket_by_length=bucket) != batches
    assert epoch_batches(lengths, 4, seed=4, epoch=0, bucket_by_length=bucket) != batches
    # distinct draws for (seed, epoch) pairs that a careless seed formula would merge
    assert epoch_batches(lengths, 4, seed=0, epoch=1, bucket_by_length=bucket) != epoch_batches(
        lengths, 4, seed=1, epoch=0, bucket_by_length=bucket
    )
    assert epoch_batches(lengths, 4, seed=0, epoch=0, bucket_by_length=bucket) != epoch_batches(
        lengths, 4, seed=0, epoch=1, bucket_by_length=bucket
    )


def test_exactly_whole_batches_keep_every_example():
    batches = epoch_batches([1] * 12, 4, seed=0, epoch=0, bucket_by_length=True)
    assert sorted(i for b in batches for i in b) == list(range(12)) and len(batches) == 3
    assert epoch_batches([1] * 3, 4, seed=0, epoch=0, bucket_by_length=False) == []


def test_bucketing_sorts_by_length_inside_chunks_of_eight_batches_and_shuffles_the_batches():
    size = 2
    lengths = [random.Random(100 + i).randrange(1, 10_000) for i in range(64)]  # 4 chunks of 8 batches of 2
    batches = epoch_batches(lengths, size, seed=5, epoch=2, bucket_by_length=True)
    # the unbucketed order of the same (seed, epoch), cut into the chunks that bucketing sorts
    rng = random.Random(5 * 1_000_003 + 2)
    order = list(range(64))
    rng.shuffle(order)
    chunks = [order[s : s + 16] for s in range(0, 64, 16)]
    expected = [sorted(c, key=lambda j: lengths[j])[k : k + size] for c in chunks for k in range(0, 16, size)]
    rng.shuffle(expected)
    assert batches == expected
    # every batch holds neighbours in length within its chunk: much less padding than the unbucketed batches
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    plain = epoch_batches(lengths, size, seed=5, epoch=2, bucket_by_length=False)
    assert spread * 4 < sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in plain)
    # the batches are not in length order: their order is shuffled
    means = [sum(lengths[i] for i in b) for b in batches]
    assert means != sorted(means) and means != sorted(means, reverse=True)


def test_collate_pads_on_the_right_with_attention_and_loss_masks():
    batch = collate(
        [Example([5, 6, 7], [0, 1, 1], "a"), Example([8], [1], "b"), Example([1, 2], [0, 0], "c")], pad_id=0
    )
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0], [1, 2, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.loss_mask.dtype == torch.long
    assert collate([Example([3, 4], [1, 1], "x")], pad_id=9).input_ids.tolist() == [[3, 4]]
