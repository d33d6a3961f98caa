"""Fresh, private BFCL API instances for one rollout (or one gold replay).

``_load_scenario`` gets a deep copy of the task's config and itself deep-copies
the class defaults, so ordinary instances share nothing. The long-context
load is different: TravelAPI puts BFCL's module-level credit-card and booking
dicts into the instance without copying them, so one rollout charging a card
would change it for every other instance in the process. The attributes
that the long-context load fills with module-level objects are deep-copied
right after loading (`LONG_CONTEXT_SHARED`); a test walks every instance of
all 800 tasks and proves no public state is reachable from BFCL's
module-level objects, so a new bfcl-eval that adds aliasing fails loudly.
(Deep-copying whole instances instead costs about as much as the replay.)
"""

from __future__ import annotations

import copy
import importlib
import pickle
from types import MappingProxyType
from typing import Any, Mapping

from nemo_rcgrpo.envs.bfcl.tasks import API_CLASSES, STATELESS_CLASSES, BFCLTask

# class -> attributes that BFCL's long-context _load_scenario fills with module-level objects
LONG_CONTEXT_SHARED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"TravelAPI": ("credit_card_list", "booking_record")}
)


def api_class(class_name: str) -> type:
    module_name, _ = API_CLASSES[class_name]
    return getattr(importlib.import_module(module_name), class_name)


def build_instances(task: BFCLTask) -> dict[str, object]:
    """class name -> a new instance loaded from the task's initial config."""
    instances: dict[str, object] = {}
    for class_name in task.involved_classes:
        instance = api_class(class_name)()
        if class_name not in STATELESS_CLASSES:
            config = deep_copy(task.initial_config.get(class_name, {}))
            instance._load_scenario(config, long_context=task.long_context)
        if task.long_context:
            for attr in LONG_CONTEXT_SHARED.get(class_name, ()):
                setattr(instance, attr, deep_copy(getattr(instance, attr)))
        instances[class_name] = instance
    return instances


def public_state(instance: object) -> dict[str, Any]:
    """What BFCL's state checker compares: every attribute not starting with '_'."""
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


def deep_copy(value: Any) -> Any:
    """``copy.deepcopy`` for the project's own plain state, about twice as fast via pickle.

    Only ever applied to data this process built (task configs, API state),
    never to untrusted bytes.
    """
    try:
        return pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except (pickle.PicklingError, TypeError, AttributeError):
        return copy.deepcopy(value)


def snapshot(instances: Mapping[str, object]) -> dict[str, dict[str, Any]]:
    """Deep copy of the public state of every instance (for later comparison)."""
    return {name: deep_copy(public_state(inst)) for name, inst in instances.items()}


def state_differences(
    instances: Mapping[str, object], expected: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[str]]:
    """Attributes whose value differs from ``expected`` (BFCL's `_compare_instances`).

    As in BFCL, the attributes of the expected (ground-truth) state are the ones
    compared. Returns {class name: [attribute, ...]}; empty means equal.
    """
    diffs: dict[str, list[str]] = {}
    for class_name, attrs in expected.items():
        instance = instances[class_name]
        bad = [k for k, v in attrs.items() if getattr(instance, k, _MISSING) != v]
        if bad:
            diffs[class_name] = bad
    return diffs


_MISSING = object()
