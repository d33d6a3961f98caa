"""R_state x R_action in every BFCL API class, alone and in two-class tasks (the RC-GRPO paper, Appendix D).

test_reward.py perturbs one file-system task; here every one of the eight API
classes gets its state changed, and in each two-class task (540 of the 800
tasks) the state of EACH class is changed in turn, so a state reward that
compares only some of the involved instances (e.g. only the last) fails.

Two kinds of perturbation, each touching one class only:
- an extra state-changing call of that class at the end of the last turn:
  every gold action is still present (R_action = 1), only R_state can catch it;
- a different argument to a state-changing ground-truth call of that class.
"""

import pytest

from nemo_rcgrpo.envs.bfcl import BFCLEnv
from nemo_rcgrpo.envs.bfcl.apis import build_instances, public_state
from tests.conftest import run_turns

CLASSES = (
    "GorillaFileSystem",
    "MathAPI",
    "MessageAPI",
    "TwitterAPI",
    "TicketAPI",
    "TradingBot",
    "TravelAPI",
    "VehicleControlAPI",
)
STATELESS = "MathAPI"  # no public attributes, no _load_scenario: nothing to compare

# Single-class tasks. All 260 single-class BFCL v4 tasks involve one of these four
# classes; MessageAPI, TwitterAPI, TicketAPI and MathAPI only ever appear next to
# another class, so they are covered by the two-class tasks below.
SINGLE = {
    "GorillaFileSystem": "multi_turn_base_1",
    "TradingBot": "multi_turn_base_100",
    "TravelAPI": "multi_turn_base_150",
    "VehicleControlAPI": "multi_turn_base_50",
}

# Two-class tasks, one per pair of classes, each with ground-truth calls of both
# classes: (task, involved_classes in task order). Every class appears in at
# least one of them; the first class's last ground-truth call comes before the
# final turn in some (its gold state is then a kept reference, not a new copy)
# and in the final turn in others.
PAIRS = [
    ("multi_turn_base_4", ("TwitterAPI", "GorillaFileSystem")),
    ("multi_turn_base_14", ("MessageAPI", "GorillaFileSystem")),
    ("multi_turn_base_15", ("GorillaFileSystem", "MathAPI")),
    ("multi_turn_base_23", ("TicketAPI", "GorillaFileSystem")),
    ("multi_turn_base_51", ("MessageAPI", "VehicleControlAPI")),
    ("multi_turn_base_52", ("TwitterAPI", "VehicleControlAPI")),
    ("multi_turn_base_55", ("TicketAPI", "VehicleControlAPI")),
    ("multi_turn_base_57", ("VehicleControlAPI", "MathAPI")),
    ("multi_turn_base_101", ("MessageAPI", "TradingBot")),
    ("multi_turn_base_102", ("TradingBot", "TicketAPI")),
    ("multi_turn_base_109", ("TwitterAPI", "TradingBot")),
    ("multi_turn_base_144", ("TradingBot", "MathAPI")),
    ("multi_turn_base_151", ("TwitterAPI", "TravelAPI")),
    ("multi_turn_base_152", ("TicketAPI", "TravelAPI")),
    ("multi_turn_base_154", ("MessageAPI", "TravelAPI")),
    ("multi_turn_base_161", ("MathAPI", "TravelAPI")),
]
ALL_TASKS = sorted(set(SINGLE.values()) | {t for t, _ in PAIRS}, key=lambda t: int(t.rsplit("_", 1)[1]))

# (task, class, position of the class in the task): every stateful class of every chosen task
CASES = [(t, c, "only") for c, t in SINGLE.items()] + [
    (t, c, f"{i}of2") for t, classes in PAIRS for i, c in enumerate(classes, 1) if c != STATELESS
]
CASE_IDS = [f"{c}-{pos}-{t}" for t, c, pos in CASES]


def _extra_calls(cls, instances):
    """Calls of ``cls`` that change its state whatever the state (read from the live instances)."""
    inst = instances[cls]
    if cls == "GorillaFileSystem":
        return ["touch(file_name='rcgrpo_extra.txt')"]
    if cls == "MessageAPI":
        return ["add_contact(user_name='rcgrpo_extra')"]
    if cls == "TwitterAPI":  # following needs a login; the login alone may change nothing
        return [
            f"authenticate_twitter(username={inst.username!r}, password={inst.password!r})",
            "follow_user(username_to_follow='rcgrpo_extra')",
        ]
    if cls == "TicketAPI":
        return ["ticket_login(username='rcgrpo_extra', password='x')"]
    if cls == "TradingBot":
        stock = sorted(set(inst.stocks) - set(inst.watch_list))[0]
        return [f"add_to_watchlist(stock={stock!r})"]
    if cls == "TravelAPI":
        assert inst.budget_limit != 98765.0
        return [f"set_budget_limit(access_token={inst.access_token!r}, budget_limit=98765.0)"]
    if cls == "VehicleControlAPI":
        return ["set_navigation(destination='1 Extra Street, Nowhere, ZZ')"]
    raise AssertionError(f"no state-changing call for {cls}")


def _gold(suite, task_id):
    return [list(t) for t in suite[task_id].ground_truth]


def _play(suite, task_id, turns):
    return run_turns(BFCLEnv(mode="per_turn"), suite[task_id], turns)


def _assert_only_state_of(env, cls):
    r = env.reward()
    assert (r.value, r.state_ok) == (0.0, False)
    assert set(r.details["state_differences"]) == {cls}, r.details["state_differences"]
    assert env.official_verdict().error_type == "multi_turn:instance_state_mismatch"
    return r


def test_tasks_cover_every_class(suite):
    assert set(CLASSES) == {c for task in suite for c in task.involved_classes}
    for cls, task_id in SINGLE.items():
        assert suite[task_id].involved_classes == (cls,)
    assert {t.involved_classes[0] for t in suite if len(t.involved_classes) == 1} == set(SINGLE)
    for task_id, classes in PAIRS:
        assert suite[task_id].involved_classes == classes
    assert {c for _, cs in PAIRS for c in cs} == set(CLASSES)
    assert public_state(build_instances(suite["multi_turn_base_15"])[STATELESS]) == {}


@pytest.mark.parametrize("task_id", ALL_TASKS)
def test_ground_truth_scores_one(suite, task_id):
    env = _play(suite, task_id, _gold(suite, task_id))
    r = env.reward()
    assert (r.value, r.state_ok, r.actions_ok) == (1.0, True, True), r.details
    assert env.official_verdict().valid


@pytest.mark.parametrize("task_id, cls, position", CASES, ids=CASE_IDS)
def test_extra_state_change_of_one_class(suite, task_id, cls, position):
    gold = _gold(suite, task_id)
    final = _play(suite, task_id, gold).instances  # the state the extra calls will meet
    gold[-1] += _extra_calls(cls, final)
    r = _assert_only_state_of(_play(suite, task_id, gold), cls)
    assert r.actions_ok  # every gold action is still there: only R_state catches this


# (task, class, turn, index, call replacing the ground-truth call there): a different
# argument to a state-changing call of that class; the gold call's name is kept.
CHANGED_ARGS = [
    ("multi_turn_base_1", "GorillaFileSystem", 1, 1, "mv(source='log.txt',destination='archive2')"),
    ("multi_turn_base_100", "TradingBot", 1, 0, "fund_account(amount=2203.5)"),
    ("multi_turn_base_150", "TravelAPI", 1, 1, "set_budget_limit(access_token='abc123token', budget_limit=21000.0)"),
    ("multi_turn_base_50", "VehicleControlAPI", 0, 1, "setHeadlights(mode='off')"),
    ("multi_turn_base_52", "TwitterAPI", 3, 0, "comment(tweet_id=10, comment_content='Safety first!')"),
    ("multi_turn_base_52", "VehicleControlAPI", 0, 0, "pressBrakePedal(pedalPosition=0.5)"),
    ("multi_turn_base_102", "TradingBot", 0, 0, "place_order(order_type='Buy',symbol='TSLA',price=700,amount=50)"),
    ("multi_turn_base_102", "TicketAPI", 4, 0, "create_ticket(title='Account Error',description='Not syncing.')"),
    (
        "multi_turn_base_152",
        "TicketAPI",
        2,
        1,
        "create_ticket(title='Flight Cancellation Alert', description='Request to cancel.',priority=4)",
    ),
    ("multi_turn_base_152", "TravelAPI", 1, 0, "cancel_booking(access_token='secureAccessToken12345', booking_id='1')"),
    ("multi_turn_base_14", "MessageAPI", 3, 1, "add_contact(user_name='John Levi')"),
    ("multi_turn_base_23", "TicketAPI", 2, 0, "resolve_ticket(ticket_id=7423,resolution='done')"),
    (
        "multi_turn_base_23",
        "GorillaFileSystem",
        0,
        1,
        "echo(content='A shorter guide.',file_name='Project_Guide_1.md')",
    ),
    ("multi_turn_base_15", "GorillaFileSystem", 1, 0, "echo(content='Student | Math',file_name='DataSet1.csv')"),
    (
        "multi_turn_base_161",
        "TravelAPI",
        0,
        0,
        "authenticate_travel(client_id='client_520', client_secret='rise_to_sky', refresh_token='token990125', "
        "grant_type='read_write', user_first_name='Mike', user_last_name='Thompson')",
    ),
    ("multi_turn_base_154", "TravelAPI", 2, 0, "set_budget_limit(access_token='token_ABC123XYZ', budget_limit=1600)"),
]


@pytest.mark.parametrize(
    "task_id, cls, turn, index, call", CHANGED_ARGS, ids=[f"{c}-{t}-turn{i}" for t, c, i, _, _ in CHANGED_ARGS]
)
def test_changed_argument_of_one_class(suite, task_id, cls, turn, index, call):
    turns = _gold(suite, task_id)
    assert turns[turn][index].split("(")[0] == call.split("(")[0]
    assert suite[task_id].tool(call.split("(")[0]).class_name == cls
    turns[turn][index] = call
    r = _assert_only_state_of(_play(suite, task_id, turns), cls)
    assert not r.actions_ok  # the gold call with its argument is missing too


# MathAPI has no state: a wrong argument is caught by R_action alone, and an extra
# MathAPI call changes nothing at all (extra read-only calls are allowed).
@pytest.mark.parametrize("task_id", [t for t, cs in PAIRS if STATELESS in cs])
def test_math_api_is_stateless(suite, task_id):
    gold = _gold(suite, task_id)
    ((turn, index),) = [
        (t, i)
        for t, calls in enumerate(gold)
        for i, c in enumerate(calls)
        if suite[task_id].tool(c.split("(")[0]).class_name == STATELESS
    ]
    name = gold[turn][index].split("(")[0]
    assert name in ("mean", "logarithm")
    wrong = [list(t) for t in gold]
    wrong[turn][index] = "mean(numbers=[1, 2, 3])" if name == "mean" else "logarithm(value=631.0, base=10, precision=5)"
    r = _play(suite, task_id, wrong).reward()
    assert (r.value, r.state_ok, r.actions_ok) == (0.0, True, False)
    assert r.details["state_differences"] == {} and len(r.details["missing_actions"]) == 1
    extra = [list(t) for t in gold]
    extra[-1] += ["add(a=1, b=2)", "square_root(number=16, precision=2)"]
    r = _play(suite, task_id, extra).reward()
    assert (r.value, r.state_ok, r.actions_ok) == (1.0, True, True)
