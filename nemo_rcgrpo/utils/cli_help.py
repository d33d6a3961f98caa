"""Self-describing config commands (`rcgrpo train|eval|prepare-data|layout`).

``--help`` lists the recipes in ``conf/`` (with the first line of each file's comment), every setting with its
default and one-line meaning, read from the schema dataclass and the comments of its fields (the one place they are
written), then what the base files change (their values and comments); ``--cfg job`` prints the resolved config and
exits; a command with no sensible default recipe (``train``, ``layout``) refuses to run without ``--config-name``
and lists the recipes instead.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from nemo_rcgrpo.utils.config import ConfigError, add_config_dir, compose, conf_dir, config_dirs, plain, split_argv


@dataclass(frozen=True)
class Command:
    usage: str
    root: str  # the defaults file every recipe of this command builds on
    default_name: str | None  # None: --config-name is required
    schema: str  # "module:Class": the defaults and their meanings (the comments of its fields)
    # (title, YAML file relative to conf/, key prefix the file's keys live under): what a base file changes
    changes: tuple[tuple[str, str, str], ...] = ()
    only: tuple[str, ...] = ()  # key prefixes shown (() for all)


COMMANDS = {
    "train": Command(
        "rcgrpo train --config-name RECIPE [key=value ...]   (also: torchrun nemo_rcgrpo/train.py ...)",
        "stage1_defaults",
        None,
        "nemo_rcgrpo.config:TrainConfig",
        (
            ("every recipe (conf/stage1_defaults.yaml)", "stage1_defaults", ""),
            ("stage 2: GRPO / RC-GRPO (conf/rl_defaults.yaml, over the above)", "rl_defaults", ""),
            ("generation=vllm (conf/generation/vllm.yaml)", "generation/vllm", "generation."),
            ("generation=scripted (conf/generation/scripted.yaml)", "generation/scripted", "generation."),
        ),
    ),
    "layout": Command(
        "rcgrpo layout --config-name RECIPE [key=value ...] [--json]",
        "stage1_defaults",
        None,
        "nemo_rcgrpo.config:TrainConfig",
        (),
        (
            "layout.",
            "policy.",
            "generation.backend",
            "generation.vllm.tp",
            "generation.vllm.devices",
            "generation.vllm.url",
            "generation.vllm.engines",
        ),
    ),
    "eval": Command(
        "rcgrpo eval [--config-name RECIPE] policy=oracle|null|checkpoint|endpoint out_dir=PATH [key=value ...]",
        "eval",
        "eval",
        "nemo_rcgrpo.evaluation.config:EvalConfig",
    ),
    "prepare-data": Command(
        "rcgrpo prepare-data [key=value ...]",
        "prepare_data",
        "prepare_data",
        "nemo_rcgrpo.prepare_data:PrepareDataConfig",
    ),
}


@dataclass(frozen=True)
class Invocation:
    name: str
    overrides: list[str]
    print_config: bool  # --cfg job: print the resolved config and exit


def _parents(text: str) -> list[str]:
    """Config names in a file's ``defaults`` list (not ``_self_``, not group options such as ``generation: hf``)."""
    try:
        defaults = (yaml.safe_load(text) or {}).get("defaults") or []
    except yaml.YAMLError:
        return []
    return [d.lstrip("/") for d in defaults if isinstance(d, str) and d != "_self_"]


def _description(text: str) -> str:
    """The file's leading comment paragraph, up to its first full stop."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    words = " ".join(l for l in lines if l)
    m = re.search(r"\.(\s|$)", words)
    return words[: m.start() + 1] if m else words


def recipes(root: str, directory: Path | None = None) -> list[tuple[str, str]]:
    """(name, description) of every config in ``directory`` built on ``root``; bases (``*_defaults``) left out."""
    dirs = [directory] if directory is not None else config_dirs()
    texts: dict[str, str] = {}
    for folder in reversed(dirs):  # a user's recipe of the same name as a shipped one wins
        texts.update({p.stem: p.read_text() for p in sorted(folder.glob("*.yaml"))})
    texts = dict(sorted(texts.items()))

    def reaches(name: str, seen: frozenset = frozenset()) -> bool:
        if name == root:
            return True
        return name in texts and name not in seen and any(reaches(p, seen | {name}) for p in _parents(texts[name]))

    return [
        (name, _description(text))
        for name, text in texts.items()
        if not name.endswith("_defaults") and reaches(name) and not (name == root and root.endswith("_defaults"))
    ]


def _split_comment(rest: str) -> tuple[str, str]:
    """``value  # comment`` -> (value, comment). A value that starts with a quote keeps a ``#`` inside the quotes
    (YAML's rule; ``\\"`` inside double quotes, ``''`` inside single ones); elsewhere ``#`` after a space starts the
    comment."""
    text = rest.strip()
    if text.startswith("#"):  # a section (no value) with a comment
        return "", text[1:].strip()
    i = 0
    if text[:1] in ("'", '"'):
        quote, i = text[0], 1
        while i < len(text):
            if quote == '"' and text[i] == "\\":
                i += 2
                continue
            if text[i] == quote:
                if quote == "'" and text[i + 1 : i + 2] == "'":
                    i += 2
                    continue
                break
            i += 1
    m = re.search(r"\s#", text[i:])
    if m is None:
        return text, ""
    return text[: i + m.start()].strip(), text[i + m.end() :].strip()


def _written(value: Any) -> str:
    """A value as YAML writes it in flow style (true, null, [a, b])."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _leaves(key: str, value: str) -> list[tuple[str, str]]:
    """A flow mapping (``{clip_low: 0.2, kl_beta: 0.1}``) as its dotted leaves; anything else as it is written."""
    if value.startswith("{"):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = None
        if isinstance(parsed, dict):
            out = []
            for k, v in parsed.items():
                out += _leaves(f"{key}.{k}", _written(v)) if isinstance(v, dict) else [(f"{key}.{k}", _written(v))]
            return out
    return [(key, value)]


def documented_settings(path: Path, prefix: str = "") -> list[tuple[str, str, str]]:
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
        key = prefix + ".".join([k for _, k in stack] + [m.group(1)])
        out += [(k, v, comment) for k, v in _leaves(key, value)]
    return out


def field_comments(cls: type) -> dict[str, str]:
    """{field: its meaning} of a dataclass, read from its source: the comment lines right above a field, then the
    comment on the field's own lines (the one place a default's meaning is written). A section heading
    (``# -- which tasks --``) belongs to no field."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, a line of its own)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and comments[line][1] and not comments[line][0].startswith("--"):
            above.insert(0, comments[line][0])
            line -= 1
        trailing = [
            comments[n][0] for n in range(node.lineno, node.end_lineno + 1) if n in comments and not comments[n][1]
        ][:1]
        out[node.target.id] = " ".join(p for p in above + trailing if p)
    return out


def schema_settings(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, meaning) of every leaf of a config dataclass, in field order; a section (a field whose
    default is a dataclass, e.g. env.settings: the default env's) is walked into."""
    instance, comments, out = cls(), field_comments(cls), []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            out += schema_settings(type(value), f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, plain(value), comments.get(f.name, "")))
    return out


def _schema_class(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def help_text(command: str, directory: Path | None = None) -> str:
    spec = COMMANDS[command]
    where = str(directory) if directory is not None else ", ".join(str(d) for d in config_dirs())
    directory = directory or conf_dir()
    lines = [
        f"usage: {spec.usage}",
        "       add --cfg job to print the resolved config and exit; --config-dir DIR "
        "adds a folder of your recipes (they can build on these)",
        "",
    ]
    if command in ("train", "layout", "eval"):
        found = recipes(spec.root, None if where != str(directory) else directory)
        lines.append(f"recipes ({where}):")
        width = max((len(n) for n, _ in found), default=0)
        lines += [f"  {n.ljust(width)}  {d}" for n, d in found]
        lines.append("")
    rows = [
        (k, _written(v), c)
        for k, v, c in schema_settings(_schema_class(spec.schema))
        if not spec.only or k.startswith(spec.only)
    ]
    sections = [(f"settings, the defaults (schema {spec.schema.replace(':', '.')}): key=default  meaning", rows)]
    for title, file, prefix in spec.changes:
        sections.append(
            (f"what {title} changes: key=value  meaning", documented_settings(directory / f"{file}.yaml", prefix))
        )
    for title, section in sections:
        lines.append(title)
        width = min(max((len(k) + len(v) for k, v, _ in section), default=0) + 1, 52)
        lines += [f"  {f'{k}={v}'.ljust(width)}  {c}".rstrip() for k, v, c in section]
        lines.append("")
    lines.append(
        "Overrides are Hydra's: key=value for a known key, +key=value to add one; a wrong key gets a one-line "
        "error with the nearest known keys."
    )
    return "\n".join(lines)


def parse_invocation(command: str, argv: Sequence[str]) -> Invocation | None:
    """``--help`` / ``--cfg job`` / ``--config-name`` and Hydra overrides; None when help was printed."""
    spec = COMMANDS[command]
    rest, show, args = [], False, list(argv)
    for i, arg in enumerate(args):  # first: --help lists the user's recipes too
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            add_config_dir(args[i + 1])
        elif arg.startswith("--config-dir="):
            add_config_dir(arg.split("=", 1)[1])
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
        elif arg.startswith("-") and not (
            arg in ("--config-name", "-cn", "--config-dir", "-cd")
            or arg.startswith(("--config-name=", "--config-dir="))
        ):
            raise ConfigError(f"unknown option {arg!r}; give settings as key=value overrides (rcgrpo {command} --help)")
        else:
            rest.append(arg)
    name, overrides = split_argv(rest, "")
    if not name:
        if spec.default_name is None:
            names = ", ".join(n for n, _ in recipes(spec.root))
            raise ConfigError(
                f"give a recipe: rcgrpo {command} --config-name NAME (--help describes them); recipes: {names}"
            )
        name = spec.default_name
    return Invocation(name, overrides, show)


def resolve(command: str, argv: Sequence[str], schema: Any) -> tuple[Invocation, Any] | None:
    """(invocation, config validated by ``schema.from_dict``), or None when the command only described itself:
    ``--help`` printed the help, or ``--cfg job`` printed the validated config."""
    invocation = parse_invocation(command, argv)
    if invocation is None:
        return None
    composed = compose(invocation.name, invocation.overrides)
    cfg = schema.from_dict(composed)  # loads the config's plugins before it validates
    if invocation.print_config:  # the validated config, as the run would write it to run_dir/config.yaml
        print_config(cfg.to_dict() if hasattr(cfg, "to_dict") else composed)
        return None
    return invocation, cfg


def print_config(composed: dict) -> None:
    """The resolved config as YAML that reads back to the same values (the string 'null' stays a string)."""
    import yaml

    print(yaml.safe_dump(composed, sort_keys=False, allow_unicode=True), end="")
