"""G rollouts of one task never touch each other (nor the gold replay, nor BFCL's module dicts)."""

import copy
import json
import threading

from bfcl_eval.eval_checker.multi_turn_eval.func_source_code.long_context import CREDIT_CARD_EXTENSION

from nemo_rcgrpo.envs.bfcl import BFCLEnv

TASK = "multi_turn_long_context_151"  # TravelAPI with the long-context credit-card extension
DISTRACTOR = "1234567812345678"  # a card that only exists through CREDIT_CARD_EXTENSION
CHARGE = (
    f"book_flight(access_token='abc123xyz', card_id='{DISTRACTOR}', travel_date='2026-11-10', "
    "travel_from='SFO', travel_to='LAX', travel_class='business')"
)


def test_five_rollouts_one_charging_a_distractor_card(suite):
    task = suite[TASK]
    gold = suite.gold(task)
    gold_before = copy.deepcopy(gold.final_state)
    module_before = copy.deepcopy(CREDIT_CARD_EXTENSION)
    envs = [BFCLEnv(mode="merged") for _ in range(5)]
    for env in envs:
        env.reset(task, gold=gold)
    start_balance = envs[0].instances["TravelAPI"].credit_card_list[DISTRACTOR]["balance"]

    result = envs[2].step([CHARGE])
    assert result.observations[0].ok and "booking_id" in result.observations[0].content
    charged = envs[2].instances["TravelAPI"].credit_card_list[DISTRACTOR]["balance"]
    assert charged < start_balance

    for i, env in enumerate(envs):
        if i != 2:
            assert env.instances["TravelAPI"].credit_card_list[DISTRACTOR]["balance"] == start_balance
            assert env.instances["TravelAPI"].booking_record == envs[0].instances["TravelAPI"].booking_record
    assert CREDIT_CARD_EXTENSION == module_before
    assert gold.final_state == gold_before
    # the four untouched rollouts still solve the task; the charged one cannot
    flat = [c for turn in task.ground_truth for c in turn]
    rewards = []
    for env in envs:
        env.step(flat + ["done()"])
        rewards.append(env.reward().value)
    assert rewards == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_concurrent_rollouts_in_threads(suite):
    # MathAPI + VehicleControl long-context tasks touch process-wide state in BFCL's code
    tasks = [t for t in suite if t.long_context and {"MathAPI", "VehicleControlAPI"} & set(t.involved_classes)][:6]
    assert len(tasks) == 6
    rewards, errors = [], []

    def rollout(task):
        try:
            for _ in range(3):
                env = BFCLEnv(mode="merged")
                env.reset(task, gold=suite.gold(task))
                env.step([c for turn in task.ground_truth for c in turn] + ["done()"])
                rewards.append(env.reward().value)
        except Exception as e:  # noqa: BLE001 - pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=rollout, args=(t,)) for t in tasks for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and rewards == [1.0] * (len(tasks) * 6)


def _mutable_ids(obj, seen, depth=0):
    """ids of every mutable container reachable from obj (dicts, lists, sets, objects)."""
    if id(obj) in seen or depth > 60 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    if isinstance(obj, (dict, list, set)) or hasattr(obj, "__dict__"):
        seen.add(id(obj))
    if isinstance(obj, dict):
        for v in obj.values():
            _mutable_ids(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _mutable_ids(v, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        for v in vars(obj).values():
            _mutable_ids(v, seen, depth + 1)


def test_no_instance_state_is_reachable_from_bfcl_module_globals(suite):
    import importlib

    from nemo_rcgrpo.envs.bfcl.apis import build_instances, public_state
    from nemo_rcgrpo.envs.bfcl.tasks import API_CLASSES

    module_objects: set[int] = set()
    names = [API_CLASSES[c][0] for c in API_CLASSES] + [
        "bfcl_eval.eval_checker.multi_turn_eval.func_source_code.long_context"
    ]
    for name in names:
        for key, value in vars(importlib.import_module(name)).items():
            if key.isupper():  # module-level constants such as CREDIT_CARD_EXTENSION, DEFAULT_STATE
                _mutable_ids(value, module_objects)
    assert module_objects
    shared = []
    for task in suite:
        for class_name, instance in build_instances(task).items():
            reachable: set[int] = set()
            _mutable_ids(public_state(instance), reachable)
            if reachable & module_objects:
                shared.append((task.id, class_name))
    assert shared == []


# --------------------------------------------------------------------------- BFCL's own module state

_PROCESS = r'''
import hashlib, importlib, inspect, json, pickle, sys
from nemo_rcgrpo.envs.bfcl import BFCLEnv, BFCLSuite
from nemo_rcgrpo.envs.bfcl.apis import public_state
from nemo_rcgrpo.envs.bfcl.tasks import API_CLASSES

VEHICLE = "multi_turn_long_context_50"  # long-context VehicleControlAPI; its ground truth reads no weather
HOSTILE = {  # a long-context task of each class, then calls at every method that touches module-level objects
    VEHICLE: ["get_current_speed()", "get_outside_temperature_from_google()", "displayCarStatus(option='fuel')",
              "check_tire_pressure()", "estimate_distance(cityA='83214', cityB='74532')",
              "lockDoors(unlock=True, door=['driver'])", "get_outside_temperature_from_google()"],
    "multi_turn_long_context_150": ["get_all_credit_cards()", "cancel_booking(access_token='abc', booking_id='1')"],
    "multi_turn_long_context_100": ["get_stock_info(symbol='AAPL')", "get_watchlist()", "get_transaction_history()",
                                    "get_available_stocks(sector='Technology')", "add_to_watchlist(stock='NVDA')"],
    "multi_turn_long_context_0": ["post_tweet(content='x')", "ls(a=True)", "touch(file_name='new.txt')"],
    "multi_turn_long_context_15": ["logarithm(value=10, base=2, precision=50)", "round_number(number=2.5, decimal_places=3)"],
    "multi_turn_long_context_14": ["send_message(sender_id='USR001', receiver_id='USR002', message='x')"],
    "multi_turn_long_context_2": ["create_ticket(title='t', description='d')"],
}
MODULES = sorted({m for m, _ in API_CLASSES.values()} | {
    "bfcl_eval.eval_checker.multi_turn_eval.func_source_code.long_context"})


def fingerprint():
    """A digest of every mutable module global, class attribute and default argument of BFCL's API code."""
    out = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for key, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == name:
                for attr, v in vars(value).items():
                    if inspect.isfunction(v) and (v.__defaults__ or v.__kwdefaults__):
                        out[f"{name}.{key}.{attr}()"] = repr((v.__defaults__, v.__kwdefaults__))
                    elif not attr.startswith("__") and isinstance(v, (dict, list, set)):
                        out[f"{name}.{key}.{attr}"] = hashlib.sha256(pickle.dumps(v)).hexdigest()
            elif not key.startswith("__") and isinstance(value, (dict, list, set)):
                out[f"{name}.{key}"] = hashlib.sha256(pickle.dumps(value)).hexdigest()
    return out


suite = BFCLSuite(categories=("long_context",))
if sys.argv[1] == "hostile":
    for task_id, calls in HOSTILE.items():
        task = suite[task_id]
        env = BFCLEnv(mode="merged", max_calls_per_step=1000)
        env.reset(task, gold=suite.gold(task))
        env.step([c for turn in task.ground_truth for c in turn] + [t.name + "()" for t in task.tools] + calls)
task = suite[VEHICLE]
env = BFCLEnv(mode="merged")
env.reset(task, gold=suite.gold(task))
fresh = [c for turn in task.ground_truth for c in turn] + ["displayCarStatus(option='fuel')", "check_tire_pressure()"]
observations = [o.content for o in env.step(fresh).observations]
state = {k: repr(v) for k, v in public_state(env.instances["VehicleControlAPI"]).items()}
print(json.dumps({"observations": observations, "state": state, "reward": env.reward().value,
                  "modules": fingerprint()}))
'''


def _run(kind: str):  # -> subprocess.Popen
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", _PROCESS, kind], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_hostile_long_context_episode_leaves_the_next_rollout_as_in_a_fresh_process():
    """Hostile episodes over every class (the long-context VehicleControl one first), then a fresh VehicleControl
    rollout, in one process; the same fresh rollout alone in a fresh process. Its observations, state and reward,
    and every mutable module-level object of BFCL's API code, are the same in both."""
    import json

    procs = {kind: _run(kind) for kind in ("hostile", "fresh")}  # both at once: about 3 s
    out = {}
    for kind, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-2000:]
        out[kind] = json.loads(stdout.strip().splitlines()[-1])
    hostile, fresh = out["hostile"], out["fresh"]
    assert fresh["reward"] == 1.0 and len(fresh["modules"]) > 20
    assert hostile["observations"] == fresh["observations"]
    assert hostile["state"] == fresh["state"]
    changed = sorted(k for k in fresh["modules"] if hostile["modules"].get(k) != fresh["modules"][k])
    assert changed == []  # was LONG_WEATHER_EXTENSION in long_context and vehicle_control


def test_bfcl_module_objects_never_change_and_each_rollout_keeps_its_own_writes(suite):
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context, vehicle_control

    module_dict = vehicle_control.LONG_WEATHER_EXTENSION
    before = copy.deepcopy(module_dict)
    task = suite["multi_turn_long_context_99"]
    envs = [BFCLEnv(mode="merged") for _ in range(2)]
    for env in envs:
        env.reset(task, gold=suite.gold(task))
    first = envs[0].step(["get_current_speed()", "get_outside_temperature_from_google()"]).observations[1].content
    second = envs[1].step(["get_outside_temperature_from_google()"]).observations[0].content
    assert first != second  # a different draw of each rollout's own generator, into its own dict
    assert vehicle_control.LONG_WEATHER_EXTENSION is module_dict is long_context.LONG_WEATHER_EXTENSION
    # unchanged by these rollouts (BFCL's own executor, run in this process by other tests, may have written it
    # before; the fresh-process test above checks the first use)
    assert module_dict == before
    again = envs[0].step(["get_outside_temperature_from_google()"]).observations[0].content
    assert list(json.loads(again)) == list(json.loads(first))  # a rollout sees its own earlier write, in place
