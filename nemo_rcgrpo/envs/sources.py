"""Task sources (``env.task_source``) and environments (``env.name``), registered by name.

    from nemo_rcgrpo import register

    @register("task_source", "my_tasks")
    def my_tasks(categories):          # -> a suite: .tasks {id: task}, .gold(task), .split(seed, test_fraction)
        return MySuite(categories)

A source may declare its category names as an attribute of the function (``my_tasks.categories = ("easy",
"hard")``): the settings that list categories are checked against them and default to them (`check_categories`).

Shipped (registered by `envs/builtin.py`): ``bfcl`` (the 800 BFCL v4 multi-turn tasks) and ``bfcl_micro`` (1,320
short generated tasks on BFCL's file-system and math classes, `envs/bfcl/micro.py`). `prepare-data`, stage 2, the scripted generator and
`rcgrpo eval` all build their suite through `make_suite`, so one name picks the tasks everywhere.

An environment is a factory of its settings and the suite that returns an opener (`envs/interfaces.py`); its
settings are a dataclass registered under the same name, ``env.settings`` of a run (`envs/config.py`):

    @register("env_settings", "my_env")
    @dataclass(frozen=True)
    class MySettings:
        max_steps: int = 8             # env.settings.max_steps

    @register("env", "my_env")
    def my_env(settings, suite):       # settings: a MySettings; -> .open(task) -> (Env, opening messages)
        return MyOpener(suite, max_steps=settings.max_steps)

Shipped: ``bfcl`` (settings `envs/bfcl/config.py: BFCLSettings`, registered in `envs/bfcl/plugin.py`). `examples/plugins/kv_store/` trains a key-value-store environment of its own from the CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from nemo_rcgrpo.envs.contract import PluginContractError, check_suite, where
from nemo_rcgrpo.envs.interfaces import EnvOpener
from nemo_rcgrpo.registry import check_part, error_line, lookup, plugin_frame, table


def source_categories(name: str) -> tuple[str, ...] | None:
    """The categories the task source ``name`` declares (its ``categories`` attribute, in its order), or None: it
    declares none and takes any."""
    categories = getattr(table("task_source").get(name), "categories", None)
    return tuple(categories) if categories else None


def check_categories(task_source: str, categories, setting: str) -> tuple[str, ...]:
    """``categories`` as a tuple: for a task source that declares its categories, a non-empty subset of them (empty:
    all of them, in its order), else what was given (empty: every task); a name the source does not declare is one
    ConfigError line."""
    from nemo_rcgrpo.utils.config import ConfigError

    declared = source_categories(task_source)
    categories = tuple(categories or ())
    if declared is None:
        return categories
    unknown = [c for c in categories if c not in declared]
    if unknown:
        raise ConfigError(
            f"{setting}={list(categories)}: unknown {unknown}; use a non-empty subset of "
            f"{list(declared)} (the categories of task source {task_source})"
        )
    return categories or declared


def category_key(suite):
    """The sort key of a suite's category names: its ``category_order`` where it has one, else by name."""
    order = getattr(suite, "category_order", None)
    return order if callable(order) else (lambda category: (0, category))


def _shipped(fn) -> bool:
    return getattr(fn, "__module__", "").startswith("nemo_rcgrpo.")


def make_opener(config, suite):
    """What the rollout engine opens its environments with: the ``env.name`` entry, given ``env.settings`` (an
    `envs/config.py: EnvConfig`'s) and the suite of ``env.task_source``."""
    factory = lookup("env", config.name, setting="env.name")
    try:
        opener = factory(config.settings, suite)
    except Exception as e:  # noqa: BLE001 - the plugin's error, one line with where it was raised
        if _shipped(factory) or plugin_frame(e) is None:  # this package's own errors: as they are
            raise
        raise PluginContractError(f"env {config.name}: its factory {where(factory)} failed: {error_line(e)}") from e
    return check_part(
        "env",
        config.name,
        factory,
        opener,
        EnvOpener,
        "an env factory returns an opener whose open(task) returns (Env, opening messages) "
        "(the EnvOpener Protocol, nemo_rcgrpo/envs/interfaces.py)",
    )


def make_suite(name: str, categories: Iterable[str], data_dir: str | Path | None = None):
    """The suite of the task source ``name`` holding the tasks of ``categories``; ``data_dir``: another copy of
    the bfcl-eval data (prepare-data's ``bfcl_data_dir``), passed only when given, so a plugin's source may take
    ``categories`` alone."""
    source = lookup("task_source", name, setting="task_source")
    try:
        suite = source(categories) if data_dir is None else source(categories, data_dir=Path(data_dir))
    except Exception as e:  # noqa: BLE001 - the plugin's error, one line with where it was raised
        if _shipped(source) or plugin_frame(e) is None:  # BFCL's data missing, ...: as it is
            raise
        raise PluginContractError(f"task source {name}: {where(source)} failed: {error_line(e)}") from e
    return check_suite(name, suite)  # its tasks' ids and categories, once, before anything trains on them
