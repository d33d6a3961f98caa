"""R = R_state x R_action on hand-made perturbations of one ground truth (the RC-GRPO paper, Appendix D)."""

import pytest

from nemo_rcgrpo.envs.bfcl import BFCLEnv
from nemo_rcgrpo.envs.bfcl.executor import ExecutedCall
from nemo_rcgrpo.envs.bfcl.reward import GoldAction, GoldReplay, OfficialChecker, action_matches, missing_actions
from nemo_rcgrpo.types import OfficialVerdict
from tests.conftest import run_turns

# multi_turn_base_0, GorillaFileSystem, ground truth per turn:
BASE_0 = [
    ["cd(folder='document')", "mkdir(dir_name='temp')", "mv(source='final_report.pdf', destination='temp')"],
    ["cd(folder='temp')", "grep(file_name='final_report.pdf',pattern='budget analysis')"],
    ["sort('final_report.pdf')"],
    [
        "cd(folder='..')",
        "mv(source='previous_report.pdf',destination='temp')",
        "cd(folder='temp')",
        "diff(file_name1='final_report.pdf',file_name2='previous_report.pdf')",
    ],
]


def _score(suite, turns, task_id="multi_turn_base_0"):
    env = run_turns(BFCLEnv(mode="per_turn"), suite[task_id], turns)
    r = env.reward()
    return r.value, r.state_ok, r.actions_ok, r.details


def _edit(turn, index, new=None, insert=False):
    turns = [list(t) for t in BASE_0]
    if insert:
        turns[turn].insert(index, new)
    elif new is None:
        del turns[turn][index]
    else:
        turns[turn][index] = new
    return turns


def test_ground_truth_scores_one(suite):
    assert _score(suite, BASE_0)[:3] == (1.0, True, True)


@pytest.mark.parametrize(
    "turns, expected",
    [
        # copy instead of move: previous_report.pdf stays in document/ (state) and mv is missing (action)
        (_edit(3, 1, "cp(source='previous_report.pdf',destination='temp')"), (0.0, False, False)),
        # dropped read-only call: state is right, the grep action is missing
        (_edit(1, 1), (0.0, True, False)),
        # extra state-changing call (the paper's touch example): every action present, state differs
        (_edit(2, 1, "touch(file_name='temp.log')", insert=True), (0.0, False, True)),
        # changed argument value
        (_edit(1, 1, "grep(file_name='final_report.pdf',pattern='budget')"), (0.0, True, False)),
        # extra read-only call
        (_edit(2, 0, "ls(a=True)", insert=True), (1.0, True, True)),
        # reordered independent calls: sort before grep (both read-only) -> 1
        (
            [
                BASE_0[0],
                ["cd(folder='temp')", "sort('final_report.pdf')"],
                ["grep(file_name='final_report.pdf',pattern='budget analysis')"],
                BASE_0[3],
            ],
            (1.0, True, True),
        ),
        # keyword form of a positional gold argument, and OpenAI-style JSON calls
        (_edit(2, 0, {"name": "sort", "arguments": '{"file_name": "final_report.pdf"}'}), (1.0, True, True)),
    ],
    ids=["cp-for-mv", "dropped-call", "extra-touch", "changed-arg", "extra-read-only", "reordered", "json-keyword"],
)
def test_perturbations(suite, turns, expected):
    assert _score(suite, turns)[:3] == expected


def test_extra_optional_argument_is_allowed(suite):
    # multi_turn_base_33: gold calls ls() with no arguments; the model adds the optional a=True
    gold = [list(t) for t in suite["multi_turn_base_33"].ground_truth]
    assert gold[0] == ["ls()"]
    gold[0] = ["ls(a=True)"]
    assert _score(suite, gold, "multi_turn_base_33")[:3] == (1.0, True, True)


def test_missing_call_reported_in_details(suite):
    *_, details = _score(suite, _edit(1, 1))
    assert details["missing_actions"] == ["grep(file_name='final_report.pdf', pattern='budget analysis')"]
    assert details["state_differences"] == {}
    *_, details = _score(suite, _edit(3, 1, "cp(source='previous_report.pdf',destination='temp')"))
    assert details["state_differences"] == {"GorillaFileSystem": ["root"]}


def _call(name, explicit, full=None):
    return ExecutedCall(name, explicit, full if full is not None else explicit, "", True)


def test_action_matching_by_hand():
    gold = GoldAction("tail", {"file_name": "log.txt", "lines": 20})
    assert action_matches(gold, _call("tail", {"file_name": "log.txt", "lines": 20}))
    assert not action_matches(gold, _call("tail", {"file_name": "log.txt"}, {"file_name": "log.txt", "lines": 10}))
    assert not action_matches(gold, _call("head", {"file_name": "log.txt", "lines": 20}))
    # an argument equal to its default counts as given; tuples equal lists; ints equal floats
    assert action_matches(GoldAction("ls", {"a": False}), _call("ls", {}, {"a": False}))
    assert action_matches(GoldAction("f", {"xs": [1, 2]}), _call("f", {"xs": (1, 2)}))
    assert action_matches(GoldAction("f", {"x": 2}), _call("f", {"x": 2.0}))
    calls = [_call("cd", {"folder": "a"}), _call("ls", {}, {"a": False})]
    gold_actions = [GoldAction("cd", {"folder": "a"}), GoldAction("cd", {"folder": "b"}), GoldAction("ls", {})]
    assert missing_actions(gold_actions, calls) == [GoldAction("cd", {"folder": "b"})]


def test_official_checker_by_hand():
    # two turns: turn 0 gold produced results ["A"], turn 1 has an empty ground truth
    gold = GoldReplay(turn_results=(("A",), ()), turn_states=({}, {}), turn_has_calls=(True, False), actions=())
    ok = OfficialChecker(gold)
    ok.end_turn(0, {}, ["X", "A"], decoded_steps=1)
    ok.end_turn(1, {}, [], decoded_steps=0)  # unchecked turn
    assert ok.verdict().valid
    missing = OfficialChecker(gold)
    missing.end_turn(0, {}, ["X"], decoded_steps=1)
    missing.end_turn(1, {}, [], decoded_steps=0)
    assert missing.verdict().error_type == "multi_turn:execution_response_mismatch"
    empty = OfficialChecker(gold)
    empty.end_turn(0, {}, [], decoded_steps=0)
    assert empty.verdict().error_type == "multi_turn:force_terminated"  # turn 1 never played
    empty.end_turn(1, {}, [], decoded_steps=0)
    assert empty.verdict().error_type == "multi_turn:empty_turn_model_response"
    short = OfficialChecker(gold)
    short.end_turn(0, {}, ["A"], decoded_steps=1)
    assert short.verdict().error_type == "multi_turn:force_terminated"
    # multiset inclusion: a gold result needed twice must appear twice
    twice = GoldReplay(turn_results=(("A", "A"),), turn_states=({},), turn_has_calls=(True,), actions=())
    c = OfficialChecker(twice)
    c.end_turn(0, {}, ["A"], decoded_steps=1)
    assert c.verdict().error_type == "multi_turn:execution_response_mismatch"


def test_truncated_episode_scores_zero(suite):
    env = BFCLEnv(mode="merged")
    env.reset(suite["multi_turn_base_0"])
    env.step([c for turn in BASE_0 for c in turn])
    env.truncate("context budget")
    r = env.reward()
    assert (r.value, r.state_ok, r.actions_ok, r.details["truncated"]) == (0.0, True, True, "context budget")


def test_merged_episode_ends_on_done_and_ignores_later_calls(suite):
    env = BFCLEnv(mode="merged")
    env.reset(suite["multi_turn_base_0"])
    flat = [c for turn in BASE_0 for c in turn]
    result = env.step(flat + ["done()", "touch(file_name='after_done.txt')"])
    assert result.done and len(result.observations) == len(flat)
    assert env.reward().value == 1.0 and env.official_verdict() is None
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(["ls()"])


def test_step_limit_force_quits(suite):
    # turn 0 solved in the first step, then two more steps hit the limit of 3: force quit
    env = BFCLEnv(mode="per_turn", max_steps=3)
    env.reset(suite["multi_turn_base_0"])
    assert not env.step(BASE_0[0]).done and not env.step(["ls()"]).done and not env.step(["ls()"]).done
    assert env.step(["ls()"]).done  # the fourth step exceeds the limit
    assert env.force_quit == "more than 3 tool-calling steps in turn 0"
    assert env.official_verdict().error_type == "multi_turn:force_terminated"
    # as in BFCL, missing turns are reported before a failed check of an earlier turn
    env.reset(suite["multi_turn_base_0"])
    for _ in range(4):
        env.step(["ls()"])
    assert env.done and env.official_verdict().error_type == "multi_turn:force_terminated"
    # a force quit in the last turn leaves every turn played: BFCL checks them normally
    env = BFCLEnv(mode="per_turn")
    env.reset(suite["multi_turn_base_0"])
    for calls in BASE_0[:3]:
        env.step(calls)
        env.step([])
    env.step(BASE_0[3])
    for _ in range(20):
        env.step(["pwd()"])
    assert env.done and env.force_quit and env.official_verdict().valid and env.reward().value == 1.0


def test_parse_failure_modes(suite):
    task = suite["multi_turn_base_0"]
    observe = BFCLEnv(mode="per_turn")
    observe.reset(task)
    result = observe.step(["mv(", "not a call"])
    assert observe.turn == 0 and [o.ok for o in result.observations] == [False, False]
    bfcl_like = BFCLEnv(mode="per_turn", on_parse_failure="end_turn")
    bfcl_like.reset(task)
    result = bfcl_like.step(["mv("])
    assert bfcl_like.turn == 1 and result.observations == [] and result.messages[0]["role"] == "user"
    assert bfcl_like.step(["mv(", "ls()"]).observations[1].ok  # one decodable call: the step runs
    with pytest.raises(ValueError, match="on_parse_failure"):
        BFCLEnv(on_parse_failure="ignore")


@pytest.mark.parametrize(
    "turns, turn, error_type",
    [
        (_edit(3, 1, "cp(source='previous_report.pdf',destination='temp')"), 3, "multi_turn:instance_state_mismatch"),
        (_edit(1, 1), 1, "multi_turn:execution_response_mismatch"),  # grep's result is missing
        (_edit(0, 2), 0, "multi_turn:instance_state_mismatch"),  # the first mv is missing
        ([BASE_0[0], [], BASE_0[2], BASE_0[3]], 1, "multi_turn:empty_turn_model_response"),
    ],
    ids=["cp-for-mv", "dropped-grep", "dropped-mv", "silent-turn"],
)
def test_official_verdict_names_the_failing_turn(suite, turns, turn, error_type):
    env = run_turns(BFCLEnv(mode="per_turn"), suite["multi_turn_base_0"], turns)
    verdict = env.official_verdict()
    assert (verdict.valid, verdict.turn, verdict.error_type) == (False, turn, error_type)


@pytest.mark.parametrize(
    "reward, expected",
    [
        # per perturbation (cp-for-mv, dropped-call, extra-touch, extra-read-only): (state_ok, actions_ok) =
        # (F, F), (T, F), (F, T), (T, T): the product pays only the last; R_state alone also the dropped read-only
        # call; R_action alone also the extra touch
        ("state_x_action", [0.0, 0.0, 0.0, 1.0]),
        ("state", [0.0, 1.0, 0.0, 1.0]),
        ("action", [0.0, 0.0, 1.0, 1.0]),
    ],
)
def test_env_reward_picks_a_registered_reward(suite, reward, expected):
    """env.settings.reward names what the env pays, from the same components; a truncated episode pays 0 under each."""
    cases = [
        _edit(3, 1, "cp(source='previous_report.pdf',destination='temp')"),
        _edit(1, 1),
        _edit(2, 1, "touch(file_name='temp.log')", insert=True),
        _edit(2, 0, "ls(a=True)", insert=True),
    ]
    got = [
        run_turns(BFCLEnv(mode="per_turn", reward=reward), suite["multi_turn_base_0"], t).reward().value for t in cases
    ]
    assert got == expected
    env = run_turns(BFCLEnv(mode="per_turn", reward=reward), suite["multi_turn_base_0"], BASE_0)
    env.truncate("context budget")
    assert env.reward().value == 0.0


def test_a_plugin_reward_is_chosen_by_env_settings_reward(suite):
    from nemo_rcgrpo import register
    from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
    from nemo_rcgrpo.registry import table
    from nemo_rcgrpo.utils.config import ConfigError

    register("reward", "test_half_credit")(lambda info: 0.5 * info.state_ok + 0.5 * info.actions_ok)
    try:
        env = BFCLSettings(mode="per_turn", reward="test_half_credit").make_env()
        env = run_turns(env, suite["multi_turn_base_0"], _edit(1, 1))
        assert env.reward().value == 0.5
        with pytest.raises(
            ConfigError,
            match=r"env.settings.reward='nope': no reward of that name; registered: \['state_x_action', 'state', "
            r"'action', 'test_half_credit'\]",
        ):
            BFCLSettings(reward="nope")
    finally:
        table("reward").pop("test_half_credit")


# -------------------- `make mutation`'s survivors killed (docs/testing.md); each test names its mutants


def test_action_matching_compares_dict_arguments():
    # kills: _canon's dict branch returning None (every dict would equal every other)
    gold = GoldAction("f", {"d": {"a": 1, "b": [1, 2]}})
    assert action_matches(gold, _call("f", {"d": {"a": 1, "b": (1, 2)}}))  # tuples inside dicts equal lists
    assert not action_matches(gold, _call("f", {"d": {"a": 2, "b": [1, 2]}}))
    assert not action_matches(gold, _call("f", {"d": {"a": 1}}))


def test_action_matches_returns_a_bool():
    # kills: `return False` -> `return None` for a different tool name
    assert action_matches(GoldAction("f", {}), _call("g", {})) is False
    assert action_matches(GoldAction("f", {}), _call("f", {})) is True


def test_verdict_before_any_turn_is_force_terminated():
    # kills: turns_checked = 0 -> 1; valid=False -> True; `stopped_early or msg` -> `and`
    gold = GoldReplay(turn_results=((),), turn_states=({},), turn_has_calls=(False,), actions=())
    assert OfficialChecker(gold).verdict() == OfficialVerdict(
        valid=False, error_type="multi_turn:force_terminated", error_message="episode ended after 0 of 1 turns", turn=0
    )
    stopped = OfficialChecker(gold).verdict(stopped_early="step limit")
    assert stopped.valid is False and stopped.error_message == "step limit"
