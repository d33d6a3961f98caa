import json
from collections import Counter

import pytest

from nemo_rcgrpo.envs.bfcl import BFCLEnv, BFCLSuite, merged_prompt
from nemo_rcgrpo.envs.bfcl.tasks import HOLDOUT_TURN_PROMPT


def test_all_four_categories_load(suite):
    assert len(suite) == 800
    assert Counter(t.category for t in suite) == {c: 200 for c in ("base", "miss_func", "miss_param", "long_context")}
    # entries with the same number are the same scenario across categories
    scenarios = Counter(t.scenario for t in suite)
    assert set(scenarios.values()) == {4} and len(scenarios) == 200
    assert all(len(t.ground_truth) == t.num_turns for t in suite)
    assert sum(t.long_context for t in suite) == 200


def test_unknown_category_and_id_are_clear_errors(suite):
    with pytest.raises(ValueError, match="unknown BFCL multi-turn categories"):
        BFCLSuite(["base", "memory"])
    with pytest.raises(KeyError, match=r"unknown task id .* \(e.g. .multi_turn_base_0.\)"):
        suite["multi_turn_base_9999"]


def test_miss_func_offers_held_out_tools_at_their_turn(suite):
    task = suite["multi_turn_miss_func_0"]
    assert dict(task.missed_functions) == {3: ("sort",)}
    assert "sort" not in task.offered_tool_names(0) and "sort" not in task.offered_tool_names(2)
    assert "sort" in task.offered_tool_names(3) and "sort" in task.offered_tool_names(None)
    env = BFCLEnv(mode="per_turn")
    env.reset(task)
    assert "sort" not in {t["function"]["name"] for t in env.tools}
    for _ in range(3):
        result = env.step([])
    assert result.tools_changed and len(result.messages) == 1
    content = result.messages[0]["content"]
    assert content.endswith("\n" + HOLDOUT_TURN_PROMPT)
    assert [t["function"]["name"] for t in json.loads(content.split("\n")[0])] == ["sort"]
    assert "sort" in {t["function"]["name"] for t in env.tools}


def test_miss_func_49_schedule_is_made_consistent_with_its_ground_truth(suite):
    # BFCL's ground truth calls tail at turn 1 although tail is held out until turn 3.
    task = suite["multi_turn_miss_func_49"]
    assert dict(task.missed_functions) == {3: ("wc", "cat")}
    assert "tail" in task.offered_tool_names(1)


def test_merged_prompt_and_done_tool(suite):
    task = suite["multi_turn_miss_func_0"]
    env = BFCLEnv(mode="merged")
    messages = env.reset(task)
    assert [m["role"] for m in messages] == ["system", "user"]
    lines = messages[1]["content"].split("\n")
    assert len(lines) == 4  # five turns, one of them the empty holdout turn
    assert lines[0].startswith("Step 1: Move 'final_report.pdf'") and lines[3].startswith("Step 4: ")
    names = [t["function"]["name"] for t in env.tools]
    assert names[-1] == "done" and "sort" in names  # everything offered at once
    assert merged_prompt(task) == messages[1]["content"]
