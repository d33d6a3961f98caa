"""algorithms/rl_batch.py: the training batches of an RL step, its metrics and its rollout dump, on hand-made
trajectories with hand-computed answers."""

import dataclasses
import json
import math

import pytest
import torch

from nemo_rcgrpo.algorithms.losses import PolicyLossStats
from nemo_rcgrpo.algorithms.rl_batch import (
    UpdateTotals,
    pearson,
    rl_micro_batch,
    step_metrics,
    token_batches,
    write_rollouts,
)
from nemo_rcgrpo.rollout.multi_turn import Trajectory


def _traj(ids, mask, reward, token, group=0, lp=None):
    return Trajectory(
        task_id=f"t{group}",
        category="base",
        group=group,
        reward_token=token,
        token_ids=ids,
        loss_mask=mask,
        sampler_logprobs=lp or [0.0] * len(ids),
        prompt_length=2,
        reward=reward,
        num_turns=1,
    )


def test_micro_batches_carry_their_rows_advantages_and_logprobs():
    trajs = [
        _traj([1, 2, 3], [0, 0, 1], 1.0, "high", lp=[0, 0, -0.5]),
        _traj([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], 0.0, "low", lp=[0, 0, -1, -2, -3]),
        _traj([1, 2], [0, 1], 0.0, None),
    ]
    adv = torch.tensor([0.5, -0.25, 2.0])
    t1, t2 = token_batches(trajs, pad_id=0, micro=2)
    assert t1.input_ids.tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]] and t2.input_ids.tolist() == [[1, 2]]
    assert t1.loss_mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert t1.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    ref, old = torch.full((2, 5), -0.1), torch.full((2, 5), -0.2)
    b1 = rl_micro_batch(t1, trajs, 0, adv, ref, old)
    b2 = rl_micro_batch(t2, trajs, 2, adv, torch.zeros(1, 2), None)
    assert b1.advantages.tolist() == [0.5, -0.25] and b2.advantages.tolist() == [2.0]
    assert b1.sampler_logprobs[1].tolist() == [0, 0, -1, -2, -3] and b1.sampler_logprobs[0, 3:].sum() == 0
    assert (b1.first, b2.first) == (0, 2) and b1.ref_logprobs is ref and b1.old_logprobs is old
    assert b2.old_logprobs is None and torch.equal(b1.input_ids, t1.input_ids)
    # built complete or not at all: a field of the wrong shape is refused where the batch is made
    with pytest.raises(ValueError, match=r"RLMicroBatch.ref_logprobs has shape \(1, 2\), expected \(2, 5\)"):
        rl_micro_batch(t1, trajs, 0, adv, torch.zeros(1, 2), None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b1.old_logprobs = None
    # each field has its own rank: a [B] where a [B, T] belongs (or the reverse) is refused, never broadcast
    with pytest.raises(ValueError, match=r"RLMicroBatch.ref_logprobs has shape \(2,\), expected \(2, 5\)"):
        rl_micro_batch(t1, trajs, 0, adv, torch.zeros(2), None)
    with pytest.raises(ValueError, match=r"RLMicroBatch.advantages has shape \(2, 5\), expected \(2,\)"):
        rl_micro_batch(t1, trajs, 0, torch.zeros(3, 5), ref, None)


def test_a_micro_batch_moves_and_pads_whole():
    """MicroBatch.to moves every tensor; padded zero-pads [B, T] fields in both dimensions and [B] ones in rows."""
    from nemo_rcgrpo.data.batch import MicroBatch

    t = MicroBatch(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]]))
    b = rl_micro_batch(
        t,
        [_traj([5, 6, 7], [0, 1, 1], 1.0, None, lp=[0, -1, -2])],
        0,
        torch.tensor([1.5]),
        torch.full((1, 3), -0.5),
        None,
    )
    p = b.padded(2, 4)
    assert p.input_ids.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0]] and p.advantages.tolist() == [1.5, 0.0]
    assert p.sampler_logprobs.tolist() == [[0, -1, -2, 0], [0, 0, 0, 0]] and p.old_logprobs is None and p.first == 0
    assert int(p.loss_mask.sum()) == 2  # padding trains nothing
    assert (
        b.to("cpu").tensors().keys()
        == b.tensors().keys()
        == {"input_ids", "attention_mask", "loss_mask", "advantages", "ref_logprobs", "sampler_logprobs"}
    )
    with pytest.raises(ValueError, match="cannot pad a 1 x 3 batch to 1 x 2"):
        b.padded(1, 2)


def test_step_metrics_by_hand():
    g0 = [_traj([1, 2, 3, 4], [0, 0, 1, 1], 1.0, "high"), _traj([1, 2, 3, 4], [0, 0, 1, 1], 0.0, "low")]
    g1 = [_traj([1, 2, 3], [0, 0, 1], 0.0, "high", 1), _traj([1, 2, 3], [0, 0, 1], 0.0, "low", 1)]
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0], [0.0, 0.0]])
    out = UpdateTotals(
        PolicyLossStats(loss=0.3, kl_sum=0.6, clipped_tokens=3.0, tokens=6.0), updates=1, grad_norm=1.5, lr=1e-6
    )
    m = step_metrics([g0, g1], rewards, adv, [0.4, 1.2, 0.3, 0.3], out, num_valid=6.0)
    assert m["reward_mean"] == 0.25 and m["zero_variance_fraction"] == 0.5
    assert m["reward_mean_high"] == 0.5 and m["reward_mean_low"] == 0.0
    assert m["entropy"] == pytest.approx(2.2 / 6) and m["entropy_seq_mean"] == pytest.approx(
        (0.2 + 0.6 + 0.3 + 0.3) / 4
    )
    assert m["kl"] == pytest.approx(0.1) and m["clip_fraction"] == 0.5
    assert m["nonzero_advantage_share"] == 0.5 and m["advantage_abs_mean"] == 0.5
    assert m["loss"] == 0.3 and m["grad_norm"] == 1.5 and m["lr"] == 1e-6 and m["updates"] == 1.0  # one update
    assert m["advantage_mean"] == 0.0 and m["advantage_std"] == pytest.approx(math.sqrt(2 / 3))  # unbiased, 4 values
    # per-rollout mean entropies 0.2, 0.6, 0.3, 0.3 against rewards 1, 0, 0, 0
    assert m["entropy_reward_corr"] == pytest.approx(pearson([0.2, 0.6, 0.3, 0.3], [1, 0, 0, 0]))
    assert m["entropy_reward_corr"] < 0 and "sampler_logprob_abs_diff" not in m
    # within each token: high's mean entropies 0.2, 0.3 against rewards 1, 0 (r = -1); low's rewards are all 0 (none)
    assert m["entropy_reward_corr_high"] == pytest.approx(-1.0) and "entropy_reward_corr_low" not in m


def test_pearson():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1], [0, 1]) is None and pearson([1], [1]) is None
    assert pearson([1, 2], [5, 3]) == pytest.approx(-1.0)  # two points are enough
    # by hand, away from zero means: x = 1, 2, 6 (mean 3), y = 2, 2, 5 (mean 3); deviations -2, -1, 3 and -1, -1, 2;
    # cov = (2 + 1 + 6) / 3 = 3, sd_x = sqrt(14 / 3), sd_y = sqrt(6 / 3): r = 3 / sqrt(28 / 3) = 0.98198
    assert pearson([1, 2, 6], [2, 2, 5]) == pytest.approx(3 / math.sqrt(28 / 3))


def test_the_dump_writes_each_prompt_once_per_group_and_token(tmp_path):
    groups = [
        [
            _traj([7, 8, 9], [0, 0, 1], 1.0, "high"),
            _traj([7, 8, 9], [0, 0, 1], 0.0, "high"),
            _traj([5, 8, 9], [0, 0, 1], 0.0, "low"),
        ]
    ]
    path = tmp_path / "rollouts" / "step_3.jsonl"
    write_rollouts(path, 3, groups, torch.tensor([[0.5, -0.5, 0.0]]), decode=lambda ids: " ".join(map(str, ids)))
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    assert [l["advantage"] for l in lines] == [0.5, -0.5, 0.0] and {l["step"] for l in lines} == {3}
    assert lines[0]["prompt"] == "7 8" and lines[1]["prompt_line"] == 1 and lines[1]["prompt"] is None
    assert lines[2]["prompt"] == "5 8"
    # a run folder made on the way (rank 0 may dump before anything else wrote there), and the next step beside it
    deep = tmp_path / "new_run" / "rollouts"
    for step in (1, 2):
        write_rollouts(deep / f"step_{step}.jsonl", step, groups, torch.zeros(1, 3), decode=str)
    assert sorted(p.name for p in deep.iterdir()) == ["step_1.jsonl", "step_2.jsonl"]


def test_step_metrics_of_errors_truncation_categories_and_the_sampler_gap():
    """tool_error_rate = errors / calls over the step, truncated_share the truncated rollouts' share, success_<cat>
    per category, and the sampler-gap metrics only when the generator's logprobs were in the batch:
    calls 2 + 1 + 0 + 1 = 4 with 1 + 0 + 0 + 1 = 2 errors -> 0.5; 1 of 4 truncated; base: rewards 1, 0 -> 0.5,
    put: 0, 0 -> 0; the sums 0.8 and 4.4 over 8 tokens -> 0.1 and 0.55."""
    import dataclasses

    t = [
        _traj([1, 2, 3, 4], [0, 0, 1, 1], 1.0, "high"),
        _traj([1, 2, 3, 4], [0, 0, 1, 1], 0.0, "low"),
        _traj([1, 2, 3, 4], [0, 0, 1, 1], 0.0, "high", 1),
        _traj([1, 2, 3, 4], [0, 0, 1, 1], 0.0, "low", 1),
    ]
    t[0] = dataclasses.replace(t[0], calls=[[{"name": "ls"}, {"error": "bad"}]], tool_errors=1)
    t[1] = dataclasses.replace(t[1], calls=[[{"name": "cd"}]], rejected_messages=1)
    t[2] = dataclasses.replace(t[2], category="put", truncated="context budget")
    t[3] = dataclasses.replace(t[3], category="put", calls=[[], [{"name": "rm"}]], tool_errors=1)
    out = UpdateTotals(
        PolicyLossStats(tokens=8.0, sampler_mult_err_sum=4.4, sampler_abs_diff_sum=0.8),
        updates=1,
        grad_norm=0.0,
        lr=1e-6,
    )
    m = step_metrics([t[:2], t[2:]], torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.zeros(2, 2), [0.1] * 4, out, 8.0)
    assert m["tool_error_rate"] == 0.5 and m["truncated_share"] == 0.25
    assert m["rejected_message_rate"] == 0.25  # 1 rejected message of 4 turns
    assert (m["success_base"], m["success_put"]) == (0.5, 0.0)
    assert m["sampler_logprob_abs_diff"] == pytest.approx(0.1) and m["token_mult_prob_error"] == pytest.approx(0.55)


def test_step_metrics_average_the_updates():
    """Several updates (epochs x mini-batches): loss, grad norm and lr are the means over them; the KL and clip
    fraction are per token over every update's tokens."""
    g = [_traj([1, 2, 3], [0, 0, 1], 1.0, None), _traj([1, 2, 3], [0, 0, 1], 0.0, None)]
    # 4 updates whose losses add up to 2.0; each update saw the 2 generated tokens (8 in all), 0.8 KL, 2 clipped
    out = UpdateTotals(
        PolicyLossStats(loss=2.0, kl_sum=0.8, clipped_tokens=2.0, tokens=8.0), updates=4, grad_norm=0.75, lr=1e-5
    )
    m = step_metrics([g], torch.tensor([[1.0, 0.0]]), torch.tensor([[0.7, -0.7]]), [0.2, 0.4], out, num_valid=2.0)
    assert m["loss"] == pytest.approx(0.5) and m["updates"] == 4.0
    assert m["grad_norm"] == 0.75 and m["lr"] == 1e-5
    assert m["kl"] == pytest.approx(0.1) and m["clip_fraction"] == pytest.approx(0.25)
    assert m["tokens"] == 2.0 and m["entropy"] == pytest.approx(0.3)  # the step's tokens, each once
    assert m["advantage_std"] == pytest.approx(0.7 * math.sqrt(2))  # two advantages have a spread (unbiased)


def test_step_metrics_of_one_token_one_rollout_and_one_call():
    """The smallest step: one rollout of one generated token, one turn and one call (every per-token, per-turn and
    per-call rate is a division by 1, never by a floor above it)."""
    t = dataclasses.replace(
        _traj([1, 2, 3], [0, 0, 1], 1.0, None),
        calls=[[{"name": "ls"}]],
        tool_errors=1,
        num_turns=1,
        rejected_messages=1,
    )
    # the generator agreed with the trainer on the token: |gap| 0, exp(0) = 1 (the gap metrics are reported still)
    out = UpdateTotals(
        PolicyLossStats(
            loss=0.4, kl_sum=0.3, clipped_tokens=1.0, tokens=1.0, sampler_abs_diff_sum=0.0, sampler_mult_err_sum=1.0
        ),
        updates=1,
        grad_norm=1.0,
        lr=1e-6,
    )
    m = step_metrics([[t]], torch.tensor([[1.0]]), torch.tensor([[0.25]]), [0.7], out, num_valid=1.0)
    assert m["sampler_logprob_abs_diff"] == 0.0 and m["token_mult_prob_error"] == 1.0
    gap = dataclasses.replace(
        out, stats=dataclasses.replace(out.stats, sampler_abs_diff_sum=0.5, sampler_mult_err_sum=math.exp(0.5))
    )  # |gap| 0.5
    m = step_metrics([[t]], torch.tensor([[1.0]]), torch.tensor([[0.25]]), [0.7], gap, num_valid=1.0)
    assert m["sampler_logprob_abs_diff"] == 0.5 and m["token_mult_prob_error"] == pytest.approx(math.exp(0.5))
    assert m["loss"] == 0.4 and m["entropy"] == pytest.approx(0.7)
    assert m["kl"] == pytest.approx(0.3) and m["clip_fraction"] == 1.0
    assert m["tool_error_rate"] == 1.0 and m["rejected_message_rate"] == 1.0
    assert m["advantage_std"] == 0.0 and m["nonzero_advantage_share"] == 1.0  # one advantage: no spread


def test_a_rollout_dump_line_is_bounded_by_what_the_model_generated(tmp_path):
    """A rollout whose last message fetched 128 results of 64 Ki characters (8 MB: recorded before the context
    budget ended it) is dumped within its cap, the longest results clipped with the marker and the record flagged;
    a normal rollout beside it is dumped byte for byte as its record, and the trajectory itself is unchanged."""
    from nemo_rcgrpo.utils.bounded import DUMP_CHARS_PER_GENERATED_CHAR, DUMP_FLOOR_CHARS

    calls = [{"name": "cat", "arguments": {"file_name": f"f{i}.txt"}} for i in range(128)]
    huge = _traj([7, 8, 9], [0, 0, 1], 0.0, "high")
    huge.texts, huge.calls = ["cat(...) x 128"], [calls]
    huge.observations = [["x" * 65_536 for _ in range(127)] + ["short result"]]
    normal = _traj([7, 8, 9], [0, 0, 1], 1.0, "high")
    normal.texts, normal.calls, normal.observations = ["ls()"], [[{"name": "ls", "arguments": {}}]], [["a.txt"]]
    path = tmp_path / "step_1.jsonl"
    write_rollouts(path, 1, [[huge, normal]], torch.tensor([[0.5, -0.5]]), decode=str)
    first, second = path.read_text().splitlines()
    # generated: the text (14 characters) and the calls as JSON; cap = 256 Ki + 64 per generated character
    generated = len("cat(...) x 128") + len(json.dumps(calls))
    assert len(first) <= DUMP_FLOOR_CHARS + DUMP_CHARS_PER_GENERATED_CHAR * generated < 1_048_576  # 8.3 MB before
    record = json.loads(first)
    assert record["observations_clipped"] is True and record["reward"] == 0.0 and record["turns"] == [calls]
    results = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert len(results) == 128 and results[-1] == "short result"  # the shortest is whole
    keep = results[0].index("...")
    assert all(r == "x" * keep + f"... [clipped {65_536 - keep} characters]" for r in results[:-1])
    assert len(huge.observations[0][0]) == 65_536  # what trained is not touched
    expected = normal.episode(step=1, advantage=-0.5, success=True, prompt_line=1)
    expected.group = 0
    expected = expected.to_json()
    assert second == json.dumps(expected, default=str) and "observations_clipped" not in second
