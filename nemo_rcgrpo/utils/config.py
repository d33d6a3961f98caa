"""Composing the Hydra configs in ``conf/`` from any entry point.

Entries (``rcgrpo <command> key=value ...``, ``python nemo_rcgrpo/<entry>.py
--config-name X key=value``) compose with Hydra's compose API, so overrides use
Hydra's grammar but the process keeps its working directory and logging.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

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
    """``--config-name X`` / ``--config-name=X`` plus Hydra overrides."""
    name, overrides, args = default_name, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--config-name", "-cn"):
            if not args:
                raise ConfigError("--config-name needs a value")
            name = args.pop(0)
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; give settings as key=value overrides")
        else:
            overrides.append(arg)
    return name, overrides


def compose(config_name: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The composed config as a plain dict (interpolations resolved)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    directory = conf_dir()
    if not (directory / f"{config_name}.yaml").is_file():
        names = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ConfigError(f"no config named {config_name!r} in {directory}; available: {names}")
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        return OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def reject_unknown(section: str, given: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        where = f"{section}." if section else ""
        raise ConfigError(f"unknown setting(s) {[where + k for k in unknown]}; known: {sorted(known)}")


def plain(value: Any) -> Any:
    """Dataclass-derived values as YAML/JSON-friendly plain containers (tuples -> lists)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
