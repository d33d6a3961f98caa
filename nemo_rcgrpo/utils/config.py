"""Composing the Hydra configs in ``conf/`` from any entry point.

Entries (``rcgrpo <command> key=value ...``, ``python nemo_rcgrpo/<entry>.py
--config-name X key=value``) compose with Hydra's compose API, so overrides use
Hydra's grammar but the process keeps its working directory and logging.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, Union

from omegaconf import OmegaConf


class ConfigError(ValueError):
    """A setting is wrong; the message says which and what to change."""


def conf_dir() -> Path:
    """``$NEMO_RCGRPO_CONF`` or the repository's ``conf/``."""
    path = Path(os.environ.get("NEMO_RCGRPO_CONF", Path(__file__).resolve().parents[2] / "conf"))
    if not path.is_dir():
        raise ConfigError(f"config folder {path} not found; set NEMO_RCGRPO_CONF to the repository's conf/")
    return path


def split_argv(argv: Sequence[str], default_name: str) -> tuple[str, list[str]]:
    """``--config-name X`` / ``--config-name=X`` plus Hydra overrides; ``--config-dir DIR`` (Hydra's flag) adds a
    folder of the user's recipes (`add_config_dir`)."""
    name, overrides, args = default_name, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--config-name", "-cn"):
            if not args:
                raise ConfigError("--config-name needs a value")
            name = args.pop(0)
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        elif arg in ("--config-dir", "-cd"):
            if not args:
                raise ConfigError("--config-dir needs a folder")
            add_config_dir(args.pop(0))
        elif arg.startswith("--config-dir="):
            add_config_dir(arg.split("=", 1)[1])
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; give settings as key=value overrides")
        else:
            overrides.append(arg)
    return name, overrides


_USER_DIRS: list[Path] = []  # --config-dir: the user's recipe folders, searched before the shipped conf/


def add_config_dir(path: str | Path) -> Path:
    """A folder of the user's recipes (``--config-dir DIR``), layered over the shipped ``conf/``: a recipe there can
    build on a shipped one (``defaults: [rcgrpo_smollm_cpu, _self_]``) and the shipped groups (``generation=vllm``)."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(f"--config-dir {path}: not a folder")
    if folder not in _USER_DIRS:
        _USER_DIRS.insert(0, folder)
    return folder


def config_dirs() -> list[Path]:
    """Where recipes are looked up, first match first: the user's folders, then the shipped conf/."""
    return [*_USER_DIRS, conf_dir()]


# The schemas whose defaults the recipes build on, as config nodes (``defaults: [train_schema, ...]`` in
# conf/stage1_defaults.yaml, conf/eval.yaml, conf/prepare_data.yaml): the dataclasses state every default once, and a
# YAML file states only what it changes. "module:Class" of a dataclass whose every field has a default.
SCHEMAS = {
    "train_schema": "nemo_rcgrpo.config:TrainConfig",
    "eval_schema": "nemo_rcgrpo.evaluation.config:EvalConfig",
    "prepare_data_schema": "nemo_rcgrpo.prepare_data:PrepareDataConfig",
}
# sections whose keys are another registered part's (env.settings: the env's own dataclass, chosen by env.name): the
# schema node leaves them empty, the recipe's keys are merged in, and ``section.key=value`` adds or replaces a key
OPEN_SECTIONS = ("env.settings",)

# settings that became others, named in the error of a command line or a recipe that still gives them
MOVED = {
    "rl.loss.tis_cap": "rl.loss.correction=token_tis rl.loss.correction_cap=<the cap> (null: rl.loss.correction=none)"
}


# settings that moved: ``moved_line`` names the new key, and a run saved under the old key resumes where the new key
# holds the same value (`utils/run_dir.py`). BFCL's env settings went from env.* to env.settings.* when each env got a
# settings section of its own
RENAMED = {
    f"env.{key}": f"env.settings.{key}"
    for key in (
        "mode",
        "max_steps",
        "max_calls_per_step",
        "arg_types",
        "on_parse_failure",
        "tool_response",
        "system_prompt",
        "holdout_tools_in_message",
        "max_observation_chars",
        "reward",
    )
}
# settings renamed for what they govern (the same value means the same thing): the refill rounds of any group
# filter (rl.group_filter, a stage's keep_group), not of dapo_filter's only
RENAMED_RL = {
    "rl.dapo_max_rounds": "rl.group_filter_refills",
    "rl.dapo_shortfall": "rl.group_filter_shortfall",
}


def moved_line(key: str) -> str | None:
    """``"unknown setting KEY: ..."``, the line for a setting that moved: ``MOVED``'s, the renamed RL settings and
    the env section's keys that went into ``env.settings`` (``RENAMED_RL``, ``RENAMED``, which also
    let a run saved under them resume)."""
    if key in MOVED:
        return f"unknown setting {key}: it is now {MOVED[key]}"
    if key in RENAMED_RL:
        return (
            f"unknown setting {key}: it was renamed {RENAMED_RL[key]} (the same meaning: it governs any group "
            f"filter, rl.group_filter or a stage's, not only dapo_filter's)"
        )
    if key in RENAMED:
        return (
            f"unknown setting {key}: it moved to {RENAMED[key]} (each env has a settings section of its own; "
            f"in a recipe: env: {{settings: {{{key.rsplit('.', 1)[-1]}: ...}}}})"
        )
    return None


def schema_defaults(spec: str) -> dict[str, Any]:
    """The defaults of the schema ``spec`` ("module:Class") as a plain nested dict."""
    import dataclasses
    import importlib

    module, name = spec.split(":")
    return plain(dataclasses.asdict(getattr(importlib.import_module(module), name)()))


def _store_schemas() -> None:
    """The schema nodes, stored once per process (the dataclasses' defaults do not change while it runs)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if all(f"{name}.yaml" in store.repo for name in SCHEMAS):
        return
    for name, spec in SCHEMAS.items():
        node = schema_defaults(spec)
        for dotted in OPEN_SECTIONS:
            parent, _, leaf = dotted.rpartition(".")
            section = node
            for part in parent.split("."):
                section = section.get(part) if isinstance(section, dict) else None
            if isinstance(section, dict) and leaf in section:
                section[leaf] = {}
        store.store(name=name, node=node)


def _open_override(override: str) -> str:
    """``env.settings.mode=x`` as ``++env.settings.mode=x`` (add or replace: the section's keys are the env's)."""
    if override.startswith(("+", "~")):
        return override
    key = override.split("=", 1)[0]
    return "++" + override if any(key.startswith(s + ".") for s in OPEN_SECTIONS) else override


def compose(config_name: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The composed config as a plain dict (interpolations resolved)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _store_schemas()
    overrides = [_open_override(o) for o in overrides]

    dirs = config_dirs()
    primary = next((d for d in dirs if (d / f"{config_name}.yaml").is_file()), None)
    if primary is None:
        names = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
        where = ", ".join(str(d) for d in dirs)
        raise ConfigError(f"no config named {config_name!r} in {where}; available: {names}")
    if any(o.lstrip("+~").startswith("hydra.searchpath") for o in overrides):
        raise ConfigError("hydra.searchpath is set by --config-dir DIR (your recipe folders over conf/); use that")
    # Hydra looks in the recipe's own folder first, then in these, in order (quoted: a path may hold , = [ ')
    quoted = ["'file://" + str(d).replace("\\", "\\\\").replace("'", "\\'") + "'" for d in dirs if d != primary]
    search = ["hydra.searchpath=[" + ",".join(quoted) + "]"] if quoted else []
    try:
        with initialize_config_dir(config_dir=str(primary), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=[*overrides, *search])
        return OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        first = str(e).splitlines()[0]
        raise ConfigError(_suggest(first, config_name, overrides) or one_line(str(e))) from None


def one_line(message: str) -> str:
    """Hydra's message on one line, with its hints (``To append to your config use +model=...``, the available
    options of a group) and without the config search path it appends."""
    lines = []
    for line in message.splitlines():
        if line.strip().startswith("Config search path"):
            break
        if line.strip():
            lines.append(line.strip())
    return " ".join(lines)


def _flat_keys(value: Any, prefix: str = "") -> list[str]:
    if not isinstance(value, dict):
        return []
    return [k for key, v in value.items() for k in [prefix + str(key)] + _flat_keys(v, f"{prefix}{key}.")]


def _suggest(message: str, config_name: str, overrides: Sequence[str]) -> str | None:
    """Hydra's "Could not override 'trainer.stpes'" as one line naming the closest known setting."""
    import re

    m = re.match(r"Could not override '([^']+)'", message)
    if not m:
        return None
    key = m.group(1)
    if moved_line(key):
        return moved_line(key)
    try:
        keys = _flat_keys(compose(config_name, [o for o in overrides if not o.lstrip("+~").startswith(key + "=")]))
    except ConfigError:
        return None
    if key in keys:
        return None
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    section = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = sorted(
        k.rsplit(".", 1)[-1] for k in keys if (k.rsplit(".", 1)[0] if "." in k else "") == section and k != section
    )
    leaf = key.rsplit(".", 1)[-1]
    moved = f"{section}.settings.{leaf}"  # env.mode: the default env's settings are env.settings.*
    if f"{section}.settings" in OPEN_SECTIONS and any(
        moved in _flat_keys(schema_defaults(s)) for s in SCHEMAS.values()
    ):
        close = [moved]
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown setting {key}; {hint}known in {section or 'the top level'}: {siblings}"


def did_you_mean(name: Any, choices: Sequence[Any]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``name`` (difflib, ignoring case), or ``""``."""
    strings = {c.lower(): c for c in choices if isinstance(c, str)}
    close = difflib.get_close_matches(name.lower(), list(strings), n=1, cutoff=0.6) if isinstance(name, str) else []
    return f"; did you mean {strings[close[0]]!r}?" if close else ""


def reject_unknown(section: str, given: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        where = f"{section}." if section else ""
        renamed = [where + k for k in unknown if moved_line(where + k)]
        if renamed:  # a recipe written before the setting moved: where it went
            others = [where + k for k in unknown if where + k not in renamed]
            raise ConfigError(
                moved_line(renamed[0])
                + (f" (moved too: {renamed[1:]})" if renamed[1:] else "")
                + (f" (also unknown: {others})" if others else "")
            )
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1, cutoff=0.5)
        hint = f"did you mean {where}{close[0]}? " if close else ""
        raise ConfigError(
            f"unknown setting {where}{unknown[0]}; {hint}known: {sorted(known)}"
            + (f" (also unknown: {[where + k for k in unknown[1:]]})" if unknown[1:] else "")
        )


_SCALARS = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def check_type(key: str, value: Any, hint: Any) -> Any:
    """``value`` checked against the annotation ``hint``; returns it (an int given for a float as a float).

    Strings are never read as booleans or numbers (``enabled=no`` is refused, not taken as true), and a
    boolean is not an integer. Raises ConfigError naming the setting."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return check_type(key, value, option)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0] + (" or null" if type(None) in options else ""))
        raise ConfigError(f"{key}={value!r} has the wrong type (expected {_describe(hint)})")
    if origin is Literal:
        if value not in typing.get_args(hint):
            choices = list(typing.get_args(hint))
            raise ConfigError(f"{key}={value!r}: choose one of {choices}{did_you_mean(value, choices)}")
        return value
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # Hydra reads `devices=4` or `name=1` as a number; the setting is text
    if hint in _SCALARS:
        if hint is float and isinstance(value, int) and not isinstance(value, bool) and abs(value) > 1e300:
            raise ConfigError(f"{key}={value!r} is too large for a number")
        ok = (
            isinstance(value, bool)
            if hint is bool
            else isinstance(value, (int, float)) and not isinstance(value, bool)
            if hint is float
            else isinstance(value, hint) and not isinstance(value, bool)
            if hint is int
            else isinstance(value, str)
        )
        if not ok:
            raise ConfigError(f"{key}={value!r} must be {_SCALARS[hint]}")
        return float(value) if hint is float else value
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if len(args) == 1:
            value = [check_type(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
        return tuple(value) if (origin is tuple or hint is tuple) else list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return value
    return value  # dataclass sections and other types are checked where they are built


def _describe(hint: Any) -> str:
    """A union's options as a reader writes them: ``int or auto or null``."""
    names = []
    for option in typing.get_args(hint):
        if typing.get_origin(option) is Literal:
            names += [str(v) for v in typing.get_args(option)]
        else:
            names.append("null" if option is type(None) else getattr(option, "__name__", str(option)))
    return " or ".join(names)


def check_fields(cls: type, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every given field of dataclass ``cls`` checked against its annotation (see check_type)."""
    import dataclasses

    hints = typing.get_type_hints(cls)
    out = dict(values)
    for f in dataclasses.fields(cls):
        if (
            f.name in out
            and not dataclasses.is_dataclass(out[f.name])
            and not (isinstance(out[f.name], dict) and dataclasses.is_dataclass(f.default))
        ):
            out[f.name] = check_type(prefix + f.name, out[f.name], hints[f.name])
    return out


def check_choices(instance: Any, prefix: str = "") -> None:
    """The ``Literal``-annotated fields of dataclass ``instance`` checked against their choices (see check_type): for
    a dataclass that checks itself when built in code too, not only when read from a config (check_fields)."""
    import dataclasses

    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        if typing.get_origin(hints[f.name]) is Literal:
            check_type(prefix + f.name, getattr(instance, f.name), hints[f.name])


def plain(value: Any) -> Any:
    """Dataclass-derived values as YAML/JSON-friendly plain containers (tuples -> lists)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
