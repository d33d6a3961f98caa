"""Fresh, private BFCL API instances for one rollout (or one gold replay).

BFCL's long-context TravelAPI puts the module-level credit-card and booking
dicts into instances without copying them, so one rollout charging a card
changes it for every other instance in the process. Each instance's whole
``__dict__`` is therefore deep-copied in one pass after ``_load_scenario``
(one memo, so internal references such as the file system's current
directory still point into the copied tree).
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Mapping

from nemo_rcgrpo.envs.bfcl.tasks import API_CLASSES, STATELESS_CLASSES, BFCLTask


def api_class(class_name: str) -> type:
    module_name, _ = API_CLASSES[class_name]
    return getattr(importlib.import_module(module_name), class_name)


def build_instances(task: BFCLTask) -> dict[str, object]:
    """class name -> a new instance loaded from the task's initial config."""
    instances: dict[str, object] = {}
    for class_name in task.involved_classes:
        instance = api_class(class_name)()
        if class_name not in STATELESS_CLASSES:
            config = copy.deepcopy(task.initial_config.get(class_name, {}))
            instance._load_scenario(config, long_context=task.long_context)
        instance.__dict__ = copy.deepcopy(instance.__dict__)
        instances[class_name] = instance
    return instances


def public_state(instance: object) -> dict[str, Any]:
    """What BFCL's state checker compares: every attribute not starting with '_'."""
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


def snapshot(instances: Mapping[str, object]) -> dict[str, dict[str, Any]]:
    """Deep copy of the public state of every instance (for later comparison)."""
    return {name: copy.deepcopy(public_state(inst)) for name, inst in instances.items()}


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
