"""The ``env`` section of a training run: which environment, which tasks, and the environment's own settings.

    env:
      name: bfcl              # a registered environment (kind env)
      task_source: bfcl       # a registered task source (kind task_source)
      categories: [base, ...] # the task source's categories to play
      settings:               # the env's registered settings (kind env_settings, the same name as env.name)
        mode: per_turn

Each environment registers the dataclass of its settings under its own name (``@register("env_settings",
"kv_store")``); ``env.settings`` is built as that class, its unknown keys refused, and its defaults are that
class's. An environment that registers none takes no settings. The env's factory is given the settings object
(`envs/sources.py: make_opener`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping

from nemo_rcgrpo.utils.config import ConfigError, check_fields, reject_unknown


@dataclass(frozen=True)
class NoSettings:
    """The settings of an environment that registers none: there are none to give."""


def settings_class(env: str) -> type:
    """The dataclass of ``env``'s settings: its registered ``env_settings`` entry, else `NoSettings`."""
    from nemo_rcgrpo.registry import registered, table

    cls = table("env_settings").get(env, NoSettings)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(
            f"{registered('env_settings', env)} is {cls!r}: register a dataclass (its fields are env.settings)"
        )
    return cls


def build_settings(env: str, given: Mapping[str, Any] | None, prefix: str = "env.settings") -> Any:
    """``env``'s settings from the mapping a config gives (keys checked against the class, types against its
    annotations); what is not given keeps the class's default."""
    cls = settings_class(env)
    given = dict(given or {})
    reject_unknown(prefix, given, {f.name for f in fields(cls)})
    values = check_fields(cls, given, prefix + ".")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a plugin's own check of its settings: one line, as ours
        message = str(e)
        raise ConfigError(message if message.startswith(prefix) else f"{prefix} of env {env}: {message}") from None


@dataclass(frozen=True)
class EnvConfig:
    name: str = "bfcl"  # a registered environment: bfcl | a plugin's
    task_source: str = (
        "bfcl"  # a registered task source: bfcl (BFCL v4) | bfcl_micro (docs/experiments.md) | a plugin's
    )
    # the task source's categories played ([]: every one it declares; rl_*.jsonl pointers: the data's)
    categories: tuple[str, ...] = ()
    settings: Any = None  # env.name's registered settings (kind env_settings); null: that class's defaults

    def __post_init__(self) -> None:
        from nemo_rcgrpo.envs.sources import check_categories
        from nemo_rcgrpo.registry import lookup

        lookup("env", self.name, setting="env.name")
        lookup("task_source", self.task_source, setting="env.task_source")
        check_categories(self.task_source, self.categories, "env.categories")  # resolved by TrainConfig.validate
        cls = settings_class(self.name)
        if self.settings is None:
            object.__setattr__(self, "settings", cls())
        if type(self.settings) is not cls:
            raise ConfigError(
                f"env.settings is a {type(self.settings).__name__}, but env {self.name} takes "
                f"{cls.__name__} (its registered env_settings)"
            )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any] | None, prefix: str = "env") -> "EnvConfig":
        """The section from a config mapping; ``settings`` as the registered class of the ``name`` given."""
        cfg = dict(cfg or {})
        reject_unknown(prefix, cfg, {f.name for f in fields(cls)})
        settings = cfg.pop("settings", None)
        if settings is not None and not isinstance(settings, Mapping):
            raise ConfigError(f"{prefix}.settings must be a section (mapping), got {settings!r}")
        values = check_fields(cls, cfg, prefix + ".")
        if "categories" in values:
            values["categories"] = tuple(values["categories"])
        name = values.get("name", cls.name)
        if not isinstance(name, str):
            raise ConfigError(f"{prefix}.name={name!r} must be a string")
        from nemo_rcgrpo.registry import lookup

        lookup("env", name, setting=f"{prefix}.name")  # before its settings are looked up
        return cls(**values, settings=build_settings(name, settings, f"{prefix}.settings"))
