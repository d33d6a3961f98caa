import random
from collections import Counter

import pytest

from nemo_rcgrpo.data.chat_format import TokenCounter, render_hermes
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.envs.bfcl.failures import assign_types, premature_termination, wrong_param, wrong_tool
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan, play, replay_messages
from nemo_rcgrpo.envs.splits import split_by_scenario
from nemo_rcgrpo.types import ToolCall


def test_reward_goal_goes_into_the_first_user_message_only():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "do it"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    out = RewardGoal().apply(msgs, success=True)
    assert out[1]["content"] == "do it [Reward Goal: <|high_reward|>]"
    assert [m["content"] for m in out[2:]] == ["ok", "again"] and msgs[1]["content"] == "do it"  # input untouched
    pre = RewardGoal(template="<goal={token}>", position="prefix", separator="\n").apply(msgs, success=False)
    assert pre[1]["content"] == "<goal=<|low_reward|>>\ndo it"
    with pytest.raises(ValueError, match="must contain"):
        RewardGoal(template="[Reward Goal]")
    with pytest.raises(ValueError, match="no user message"):
        RewardGoal().apply([{"role": "system", "content": "S"}], True)


def test_assign_types_largest_remainder():
    types = assign_types(10, {"wrong_tool": 1, "wrong_param": 1, "premature_termination": 1}, random.Random(0))
    # 10/3 = 3.33 each: one type gets the leftover (ties broken by name: premature_termination)
    assert Counter(types) == {"premature_termination": 4, "wrong_param": 3, "wrong_tool": 3}
    assert Counter(assign_types(4, {"wrong_tool": 3, "wrong_param": 1}, random.Random(0))) == {
        "wrong_tool": 3,
        "wrong_param": 1,
    }
    with pytest.raises(
        ValueError,
        match=r"failures.types \(prepare-data\), generation.scripted.failure_type='typo': no failure of that name",
    ):
        assign_types(3, {"typo": 1}, random.Random(0))


def test_wrong_tool_picks_a_compatible_tool(suite):
    task = suite["multi_turn_base_0"]
    plan = [[ToolCall("mv", {"source": "a.txt", "destination": "temp"})]] + [[] for _ in range(task.num_turns - 1)]
    new, detail = wrong_tool(task, plan, random.Random(0))
    assert new[0][0] == ToolCall("cp", {"source": "a.txt", "destination": "temp"}) and detail == "turn 0: mv -> cp"


def test_wrong_param_changes_exactly_one_value(suite):
    task = suite["multi_turn_base_0"]
    plan = gold_plan(task)
    for seed in range(20):
        new, _ = wrong_param(task, plan, random.Random(seed))
        changed = [(a, b) for ta, tb in zip(plan, new) for a, b in zip(ta, tb) if a != b]
        assert len(changed) == 1
        a, b = changed[0]
        assert a.name == b.name and a.kwargs.keys() == b.kwargs.keys()
        assert sum(a.kwargs[k] != b.kwargs[k] for k in a.kwargs) == 1


def test_premature_termination_keeps_a_strict_prefix(suite):
    task = suite["multi_turn_base_0"]
    plan = gold_plan(task)
    flat = [c for t in plan for c in t]
    for seed in range(10):
        new, detail = premature_termination(task, plan, random.Random(seed))
        kept = [c for t in new for c in t]
        assert kept == flat[: len(kept)] and len(kept) < len(flat)
        assert detail == f"stopped after {len(kept)} of {len(flat)} calls"


@pytest.mark.parametrize("mode", ["merged", "per_turn"])
def test_expert_play_and_replay(suite, mode):
    task = suite["multi_turn_miss_func_0"]
    played = play(task, gold_plan(task), mode)
    assert played.reward.value == 1.0 and played.observations_ok
    roles = [m["role"] for m in played.messages]
    assert roles[:2] == ["system", "user"]
    if mode == "merged":
        assert played.messages[-1]["tool_calls"][0]["function"]["name"] == "done"
        assert roles.count("user") == 1
    else:
        assert roles.count("user") == task.num_turns and roles[-1] == "assistant"
        assert "sort" not in {t["function"]["name"] for t in played.tools}  # held out at the start
    reward, results = replay_messages(task, played.messages, mode)
    assert reward.value == 1.0 and results == [m["content"] for m in played.messages if m["role"] == "tool"]
    # replay uses the stored calls: drop the last tool-calling message and the reward is gone
    calls = [i for i, m in enumerate(played.messages) if m.get("tool_calls")]
    cut = played.messages[: calls[-2]] if mode == "merged" else played.messages[: calls[-1]]
    assert replay_messages(task, cut, mode)[0].value == 0.0


def test_split_groups_scenarios(suite):
    split = split_by_scenario(suite, seed=3)
    assert len(split.test_scenarios) == 20 and len(split.train_scenarios) == 180
    assert not set(split.test_scenarios) & set(split.train_scenarios)
    assert split_by_scenario(suite, seed=3) == split and split_by_scenario(suite, seed=4) != split


def test_render_hermes_by_hand():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "ls", "arguments": '{"a": true}'}}],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "R"},
    ]
    tools = [{"type": "function", "function": {"name": "ls"}}]
    text = render_hermes(msgs, tools)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "ls"}}\n</tools>' in text
    assert text.endswith(
        "<|im_start|>user\nU<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {"a": true}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n"
    )


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from nemo_rcgrpo.models.hf import load_tokenizer

    return load_tokenizer("smollm2")


def test_block_wise_token_counts_are_exact(suite, smollm2_tokenizer):
    convs = []
    for task_id in ("multi_turn_base_0", "multi_turn_long_context_151", "multi_turn_miss_param_3"):
        task = suite[task_id]
        for mode in ("merged", "per_turn"):
            played = play(task, gold_plan(task), mode)
            convs.append((played.messages, played.tools))
            convs.append((RewardGoal().apply(played.messages, True), played.tools))
    counter = TokenCounter(smollm2_tokenizer)
    direct = [len(smollm2_tokenizer(render_hermes(m, t), add_special_tokens=False)["input_ids"]) for m, t in convs]
    assert counter.lengths(convs) == direct
