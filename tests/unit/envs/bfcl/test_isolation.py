"""G rollouts of one task never touch each other (nor the gold replay, nor BFCL's module dicts)."""

import copy
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
        except Exception as e:  # pragma: no cover - reported below
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
        "bfcl_eval.eval_checker.multi_turn_eval.func_source_code.long_context"]
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
