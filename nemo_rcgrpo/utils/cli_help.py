"""Self-describing config commands (`rcgrpo train|eval|prepare-data|layout`).

``--help`` lists the recipes in ``conf/`` (with the first line of each file's comment) and the main settings
with their defaults and one-line meanings, read from the defaults YAML and its comments (the one place they are
written); ``--cfg job`` prints the resolved config and exits; a command with no sensible default recipe
(``train``, ``layout``) refuses to run without ``--config-name`` and lists the recipes instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from nemo_rcgrpo.utils.config import ConfigError, compose, conf_dir, split_argv


@dataclass(frozen=True)
class Command:
    usage: str
    root: str  # the defaults file every recipe of this command builds on
    default_name: str | None  # None: --config-name is required
    settings: tuple[tuple[str, str, tuple[str, ...]], ...]  # (title, defaults file, key prefixes or () for all)


COMMANDS = {
    "train": Command("rcgrpo train --config-name RECIPE [key=value ...]   (also: torchrun nemo_rcgrpo/train.py ...)",
                     "stage1_defaults", None,
                     (("stage 1 and shared (conf/stage1_defaults.yaml)", "stage1_defaults", ()),
                      ("stage 2: GRPO / RC-GRPO (conf/rl_defaults.yaml, over the above)", "rl_defaults", ()))),
    "layout": Command("rcgrpo layout --config-name RECIPE [key=value ...] [--json]", "stage1_defaults", None,
                      (("GPU layout (conf/stage1_defaults.yaml)", "stage1_defaults", ("layout.", "policy.")),)),
    "eval": Command("rcgrpo eval [--config-name RECIPE] policy=oracle|null|checkpoint|endpoint out_dir=PATH "
                    "[key=value ...]", "eval", "eval", (("evaluation (conf/eval.yaml)", "eval", ()),)),
    "prepare-data": Command("rcgrpo prepare-data [key=value ...]", "prepare_data", "prepare_data",
                            (("data preparation (conf/prepare_data.yaml)", "prepare_data", ()),)),
}


@dataclass(frozen=True)
class Invocation:
    name: str
    overrides: list[str]
    print_config: bool  # --cfg job: print the resolved config and exit


def _parents(text: str) -> list[str]:
    """Config names in a file's ``defaults:`` list (not ``_self_``, not group options such as ``generation: hf``)."""
    names, inside = [], False
    for line in text.splitlines():
        if re.match(r"^defaults:\s*$", line):
            inside = True
            continue
        if inside:
            m = re.match(r"^\s+-\s+([A-Za-z0-9_]+)\s*(#.*)?$", line)
            if m:
                if m.group(1) != "_self_":
                    names.append(m.group(1))
            elif not re.match(r"^\s+-", line) and line.strip() and not line.lstrip().startswith("#"):
                inside = False
    return names


def recipes(root: str, directory: Path | None = None) -> list[tuple[str, str]]:
    """(name, description) of every config in ``directory`` built on ``root``; bases (``*_defaults``) left out."""
    directory = directory or conf_dir()
    texts = {p.stem: p.read_text() for p in sorted(directory.glob("*.yaml"))}

    def reaches(name: str, seen: frozenset = frozenset()) -> bool:
        if name == root:
            return True
        return name in texts and name not in seen and any(reaches(p, seen | {name}) for p in _parents(texts[name]))

    out = []
    for name, text in texts.items():
        if name.endswith("_defaults") or not reaches(name) or (name == root and root.endswith("_defaults")):
            continue
        first = next((l.lstrip("# ").strip() for l in text.splitlines() if l.startswith("#")), "")
        out.append((name, first))
    return out


def _split_comment(rest: str) -> tuple[str, str]:
    """``value  # comment`` -> (value, comment); a ``#`` inside quotes is part of the value."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].strip(), rest[i + 1:].strip()
    return rest.strip(), ""


def documented_settings(path: Path) -> list[tuple[str, str, str]]:
    """(dotted key, default as written, comment) of every leaf of a defaults YAML file, in file order."""
    out: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    in_defaults = False
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            in_defaults = stripped.startswith("defaults:")
        if in_defaults or stripped.startswith("- "):
            continue
        m = re.match(r"^([A-Za-z0-9_]+):(.*)$", stripped)
        if not m:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value, comment = _split_comment(m.group(2))
        if value == "":
            stack.append((indent, m.group(1)))
            continue
        out.append((".".join([k for _, k in stack] + [m.group(1)]), value, comment))
    return out


def help_text(command: str, directory: Path | None = None) -> str:
    spec = COMMANDS[command]
    directory = directory or conf_dir()
    lines = [f"usage: {spec.usage}", "       add --cfg job to print the resolved config and exit", ""]
    found = recipes(spec.root, directory)
    if command in ("train", "layout", "eval"):
        lines.append(f"recipes ({directory}):")
        width = max((len(n) for n, _ in found), default=0)
        lines += [f"  {n.ljust(width)}  {d}" for n, d in found]
        lines.append("")
    for title, file, prefixes in spec.settings:
        rows = [r for r in documented_settings(directory / f"{file}.yaml")
                if not prefixes or r[0].startswith(prefixes)]
        lines.append(f"settings, {title}: key=default  meaning")
        width = min(max((len(k) + len(v) for k, v, _ in rows), default=0) + 1, 52)
        for key, value, comment in rows:
            item = f"{key}={value}"
            lines.append(f"  {item.ljust(width)}  {comment}".rstrip())
        lines.append("")
    lines.append("Overrides are Hydra's: key=value for a known key, +key=value to add one; a wrong key gets a one-line "
                 "error with the nearest known keys.")
    return "\n".join(lines)


def parse_invocation(command: str, argv: Sequence[str]) -> Invocation | None:
    """``--help`` / ``--cfg job`` / ``--config-name`` and Hydra overrides; None when help was printed."""
    spec = COMMANDS[command]
    rest, show, args = [], False, list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(help_text(command))
            return None
        if arg in ("--cfg", "-c") or arg.startswith("--cfg="):
            value = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else None)
            if value != "job":
                raise ConfigError("--cfg takes one value: job (print the resolved config and exit)")
            show = True
        elif arg.startswith("-") and not (arg in ("--config-name", "-cn") or arg.startswith("--config-name=")):
            raise ConfigError(f"unknown option {arg!r}; give settings as key=value overrides (rcgrpo {command} --help)")
        else:
            rest.append(arg)
    name, overrides = split_argv(rest, "")
    if not name:
        if spec.default_name is None:
            names = ", ".join(n for n, _ in recipes(spec.root))
            raise ConfigError(f"give a recipe: rcgrpo {command} --config-name NAME (--help describes them); "
                              f"recipes: {names}")
        name = spec.default_name
    return Invocation(name, overrides, show)


def resolve(command: str, argv: Sequence[str], schema: Any) -> tuple[Invocation, Any] | None:
    """(invocation, config validated by ``schema.from_dict``), or None when the command only described itself:
    ``--help`` printed the help, or ``--cfg job`` printed the validated config."""
    invocation = parse_invocation(command, argv)
    if invocation is None:
        return None
    composed = compose(invocation.name, invocation.overrides)
    cfg = schema.from_dict(composed)
    if invocation.print_config:
        print_config(composed)
        return None
    return invocation, cfg


def print_config(composed: dict) -> None:
    """The resolved config as YAML that reads back to the same values (the string 'null' stays a string)."""
    import yaml

    print(yaml.safe_dump(composed, sort_keys=False, allow_unicode=True), end="")
