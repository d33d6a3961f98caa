"""Fresh, private BFCL API instances for one rollout (or one gold replay).

``_load_scenario`` gets a deep copy of the task's config and itself deep-copies the class defaults. The
long-context load also puts BFCL's module-level objects into the instance (TravelAPI's credit-card and booking
dicts, without copying them), so construction and loading run under `isolation.isolated`, as every later call
does: what the instance takes from module level comes from its own private copies, and BFCL's module objects
are never touched. A test walks every instance of all 800 tasks and proves no public state is reachable from
BFCL's module-level objects.
"""

from __future__ import annotations

import copy
import importlib
import pickle
from typing import Any, Mapping

from nemo_rcgrpo.envs.bfcl.isolation import isolated
from nemo_rcgrpo.envs.bfcl.tasks import API_CLASSES, STATELESS_CLASSES, BFCLTask


def api_class(class_name: str) -> type:
    module_name, _ = API_CLASSES[class_name]
    return getattr(importlib.import_module(module_name), class_name)


def build_instances(task: BFCLTask) -> dict[str, object]:
    """class name -> a new instance loaded from the task's initial config."""
    instances: dict[str, object] = {}
    for class_name in task.involved_classes:
        cls = api_class(class_name)
        instance = cls.__new__(cls)
        config = None if class_name in STATELESS_CLASSES else deep_copy(task.initial_config.get(class_name, {}))
        with isolated(instance, "__init__", "_load_scenario"):
            instance.__init__()
            if config is not None:
                instance._load_scenario(config, long_context=task.long_context)
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
