"""One registration idiom for the parts a user can bring: ``@register(kind, name)``.

    from nemo_rcgrpo import register

    @register("advantage_baseline", "median")
    def median_baseline(rewards):             # rewards: [num_groups, G] float64
        return rewards - rewards.median(dim=1, keepdim=True).values

and then ``rl.advantage.baseline=median plugins=[my_module]`` on any command. A module named in ``plugins`` (every
command's setting) and every entry point of the group ``nemo_rcgrpo.plugins`` is imported before the config is
validated, so the names it registers are valid choices there; a wrong name gets one line listing the registered
ones. ``rcgrpo plugins [plugins=[mod,...]]`` prints every kind and its names.

``KINDS`` says, per kind, what a registered object must be and which setting chooses it. A part that is not what its
kind asks (a registered object of the wrong class or not callable, a factory whose return misses a member of its
Protocol) is one ``PluginContractError`` line when it is looked up or built, at start: the kind, the name, where it
was registered or its factory defined (file and line), and what is missing (`check_part`).
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from nemo_rcgrpo.utils.config import ConfigError, did_you_mean

_ENVS = "nemo_rcgrpo.envs.builtin"  # the shipped environments' names, of every kind
KINDS: dict[str, tuple[str, str]] = {  # kind -> (the setting that names one, what it must be)
    "stage": (
        "stage",
        "Stage(loop: a registered loop, conditioned, data_file and dataset (stage 1), keep_group: a "
        "group_filter name or fn(rewards) -> bool (RL)): nemo_rcgrpo.stages",
    ),
    "loop": (
        "a Stage's loop",
        "Loop(run: fn(train config, recipe name) -> result dict, rl: trains from rollouts): "
        "nemo_rcgrpo.stages ('stage1': recipes/stage1.py, 'rl': recipes/rl.py)",
    ),
    "stage1_dataset": (
        "data.dataset (null: the stage's)",
        "Stage1Dataset(prepare(row, reward goal) -> row, conditioned): nemo_rcgrpo.data.stage1_datasets",
    ),
    "group_filter": (
        "rl.group_filter (or a stage's keep_group)",
        "fn(rewards of one group) -> bool (True: train on it)",
    ),
    "reward_token_sampler": (
        "rl.reward_token_sampling",
        "fn(num_groups, group_size, p_high, rng) -> [[bool] * G] * num_groups (True: high token)",
    ),
    "advantage_baseline": ("rl.advantage.baseline", "fn(rewards [N, G] float64) -> centred rewards [N, G]"),
    "advantage_scale": ("rl.advantage.scale", "fn(rewards [N, G], centred [N, G], eps) -> advantages [N, G]"),
    "policy_loss": (
        "rl.loss.policy_loss",
        "fn(ratio [B, T], advantages [B, 1], clip_low, clip_high) -> (per-token loss [B, T], clipped [B, T] bool)",
    ),
    "kl_estimator": ("rl.loss.kl_estimator", "fn(logprobs [B, T], ref_logprobs [B, T]) -> per-token KL [B, T]"),
    "sampler_correction": (
        "rl.loss.correction",
        "fn(gap [B, T] = old - sampler logprobs, mask [B, T], cap) -> "
        "weights [B, T] on the policy loss (nemo_rcgrpo.algorithms.corrections)",
    ),
    "loss_aggregation": (
        "rl.loss.aggregation",
        "fn(per_token [B, T], mask [B, T], num_valid_tokens, num_sequences) -> scalar loss",
    ),
    "generator": ("generation.backend", "factory(setup: config.PolicySetup, policy model, tokenizer) -> Generator"),
    "policy_backend": (
        "policy.backend",
        "factory(build: config.PolicyBuild, HF model, dist, total_steps) -> Policy: nemo_rcgrpo.models.interfaces",
    ),
    "chat_format": (
        "chat.format",
        "FormatSpec(pieces, generation_prompt, special_tokens, stop_tokens, after_stop, "
        "parse, vllm_tool_parser, ...): nemo_rcgrpo.data.chat_format",
    ),
    "failure": (
        "failures.types (prepare-data), generation.scripted.failure_type",
        "fn(task, plan, rng) -> (perturbed plan, description) or None",
    ),
    "task_source": (
        "env.task_source (train), task_source (prepare-data, eval)",
        "fn(categories) -> suite (.tasks {id: task}; for prepare-data and BFCL's env also .gold(task), "
        ".split(seed, test_fraction))",
    ),
    "reward": (
        "env.settings.reward",
        "fn(components: RewardInfo(value, state_ok, actions_ok, details)) -> float (BFCL's env: "
        "the paper's R_state and R_action, nemo_rcgrpo.envs.bfcl.reward)",
    ),
    "env": (
        "env.name",
        "factory(env settings, suite) -> EnvOpener (.open(task) -> (Env, opening messages)): "
        "nemo_rcgrpo.envs.interfaces",
    ),
    "env_settings": (
        "env.settings (of the env of the same name)",
        "a dataclass: its fields are env.settings, their defaults the section's (nemo_rcgrpo.envs.config)",
    ),
    "eval_policy": (
        "policy (rcgrpo eval)",
        "factory(eval config, suite) -> EvalPolicy (.run(suite, task_ids, sample, "
        "seed, on_done, only) -> episode records; .description; .close()): "
        "nemo_rcgrpo.evaluation.policies",
    ),
    "data_builder": (
        "task_source (rcgrpo prepare-data; the builder of the same name as the task source)",
        "fn(prepare-data config, suite, split, rng) -> (experts, failures, extra stats): the "
        "stage-1 records of every task (nemo_rcgrpo.prepare_data)",
    ),
    "official_pipeline": (
        "protocol=bfcl of rcgrpo eval (the pipeline of the same name as env)",
        "factory(eval config) -> OfficialPipeline (.policy(name, cfg, suite, context) -> EvalPolicy "
        "or None; .finish(records, cfg, out_dir) -> (key, scores, table) or None) or None: "
        "nemo_rcgrpo.evaluation.policies",
    ),
    "command": (
        "rcgrpo NAME",
        "fn(argv: list[str]) -> exit code, with .help: one line for rcgrpo --help (nemo_rcgrpo.cli)",
    ),
}
# where the shipped entries of each kind are registered (imported on first use of the kind); the environments that
# ship with the package register theirs from one module, imported for every kind (`envs/builtin.py`)
_BUILTINS = {
    "stage": "nemo_rcgrpo.stages",
    "group_filter": "nemo_rcgrpo.stages",
    "loop": "nemo_rcgrpo.loops",
    "eval_policy": "nemo_rcgrpo.evaluation.policies",
    "stage1_dataset": "nemo_rcgrpo.data.stage1_datasets",
    "reward_token_sampler": "nemo_rcgrpo.algorithms.reward_tokens",
    "advantage_baseline": "nemo_rcgrpo.algorithms.advantages",
    "advantage_scale": "nemo_rcgrpo.algorithms.advantages",
    "kl_estimator": "nemo_rcgrpo.algorithms.kl",
    "sampler_correction": "nemo_rcgrpo.algorithms.corrections",
    "policy_loss": "nemo_rcgrpo.algorithms.losses",
    "loss_aggregation": "nemo_rcgrpo.algorithms.losses",
    "generator": "nemo_rcgrpo.generation",
    "policy_backend": "nemo_rcgrpo.models.factory",
    "chat_format": "nemo_rcgrpo.data.chat_format",
    "failure": _ENVS,
    "task_source": _ENVS,
    "env": _ENVS,
    "env_settings": _ENVS,
    "reward": _ENVS,
    "data_builder": _ENVS,
    "official_pipeline": _ENVS,
    "command": _ENVS,
}
ENTRY_POINT_GROUP = "nemo_rcgrpo.plugins"
_TABLES: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_SITES: dict[tuple[str, str], str] = {}  # (kind, name) -> "file.py:line" of the register() call, for the error lines
# kinds whose entries are objects of one class (lookup's ``of``), not functions or factories
_OBJECT_KINDS = ("stage", "loop", "stage1_dataset", "chat_format")
_loaded: set[str] = set()


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; the kinds are {list(KINDS)}")
    return kind


def register(kind: str, name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``obj`` becomes the ``name`` of ``kind``. A name taken by another object is refused unless
    ``replace`` (registering the same object again, as a re-imported module does, is fine)."""
    table = _TABLES[_kind(kind)]
    caller = sys._getframe(1)  # the plugin's line that registers it
    site = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
    # the shipped names first, so a clash is refused here (a no-op while that module registers them); the shipped
    # environments' only for a plugin's name (theirs register from envs/builtin.py, which they must not import)
    shipped = caller.f_globals.get("__name__", "").startswith("nemo_rcgrpo.")
    if _BUILTINS[kind] != _ENVS or not shipped:
        importlib.import_module(_BUILTINS[kind])
    if not shipped:
        importlib.import_module(_ENVS)
    if not isinstance(name, str) or not name:
        raise ValueError(f"register({kind!r}, {name!r}): the name must be a non-empty string")

    def wrap(obj: Any) -> Any:
        old = table.get(name)
        qualname = getattr(obj, "__qualname__", "")
        same = old is obj or (
            old is not None
            and "<" not in qualname  # lambdas and closures are never "the same"
            and getattr(old, "__qualname__", None) == qualname
            and getattr(old, "__module__", None) == getattr(obj, "__module__", 0)
        )
        if old is not None and not same and not replace:
            where = f"{getattr(old, '__module__', '?')}.{getattr(old, '__qualname__', old)}"
            raise ValueError(
                f"{kind} {name!r} is already registered ({where}); pick another name or "
                f"register({kind!r}, {name!r}, replace=True)"
            )
        table[name] = obj
        _SITES[(kind, name)] = site
        return obj

    return wrap


def _import_builtins(kind: str) -> None:
    importlib.import_module(_BUILTINS[kind])
    importlib.import_module(_ENVS)


def table(kind: str) -> dict[str, Any]:
    """The live name -> object table of a kind (the shipped entries included)."""
    _import_builtins(_kind(kind))
    return _TABLES[kind]


def names(kind: str) -> tuple[str, ...]:
    return tuple(table(kind))


def lookup(kind: str, name: str, of: type | None = None, setting: str | None = None) -> Any:
    """The ``name`` of ``kind``, the one way every part chosen by name is found; with ``of``, an entry that is not an
    instance of it is refused (kinds whose entries are objects of one class: Stage, FormatSpec, Stage1Dataset).
    An unknown name is a ConfigError (a ValueError) in one format: the setting, the registered names, the closest
    one, and that a plugin's names need its module in ``plugins``. ``setting``: the setting that named it, where
    the kind's own (``KINDS``) is not the one (config validation, a stage's keep_group, prepare-data's)."""
    entries = table(kind)
    if not isinstance(name, str) or name not in entries:  # a list or a mapping given for a name is refused too
        raise ConfigError(
            f"{setting or KINDS[kind][0]}={name!r}: no {kind} of that name; registered: {list(entries)}"
            f"{did_you_mean(name, list(entries))} (a plugin's {kind} needs plugins=[its module])"
        )
    entry = entries[name]
    if of is not None and not isinstance(entry, of):
        raise _contract_error(
            f"{registered(kind, name)} is a {type(entry).__name__}, not a {of.__name__}: "
            f"register a {of.__name__}(...) ({of.__module__})"
        )
    if kind not in _OBJECT_KINDS and not callable(entry):
        raise _contract_error(
            f"{registered(kind, name)} is {_short(entry)}, which cannot be called: register a {KINDS[kind][1]}"
        )
    return entry


def _contract_error(message: str) -> ValueError:
    from nemo_rcgrpo.envs.contract import PluginContractError

    return PluginContractError(message)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def registered(kind: str, name: str) -> str:
    """``kind 'name' (registered at file.py:line)``: an entry, located for an error line."""
    site = _SITES.get((kind, name))
    return f"{kind} {name!r}" + (f" (registered at {site})" if site else "")


def _defined(obj: Any) -> str:
    """``Class (file.py:line)`` of an object's class, or its type's name where the source cannot be found."""
    import inspect

    cls = type(obj)
    try:
        line = inspect.getsourcelines(cls)[1]
        return f"{cls.__qualname__} ({Path(inspect.getsourcefile(cls) or '?').name}:{line})"
    except (OSError, TypeError):
        return cls.__qualname__


def protocol_members(protocol: type) -> tuple[list[str], list[str]]:
    """(attributes, methods) a ``Protocol`` declares: its annotated fields and properties, and its methods."""
    attributes = list(getattr(protocol, "__annotations__", {}))
    methods = []
    for member, value in vars(protocol).items():
        if isinstance(value, property):
            attributes.append(member)
        elif callable(value) and not member.startswith("_"):
            methods.append(member)
    return attributes, methods


def check_part(kind: str, name: str, factory: Any, part: Any, protocol: type, what: str) -> Any:
    """``part``, what the ``kind`` entry ``name`` (``factory``) built, when it has every attribute and method its
    Protocol declares (a method: something callable); else one ``PluginContractError`` line: the kind and name, the
    factory's function with its file and line, the class it returned and where that is defined, what is missing,
    and ``what`` (the Protocol and its file). A presence check, once per part, when the run builds it."""
    attributes, methods = protocol_members(protocol)
    missing = [m for m in attributes if not hasattr(part, m)]
    missing += [f"{m}()" for m in methods if not callable(getattr(part, m, None))]
    if not missing:
        return part
    from nemo_rcgrpo.envs.contract import where

    made = where(factory) or registered(kind, name)
    returned = "None" if part is None else f"a {_defined(part)}"
    raise _contract_error(f"{kind} {name}: its factory {made} returned {returned} without {', '.join(missing)}: {what}")


_PACKAGE = Path(__file__).resolve().parent
_PYTHON = tuple(Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib"))
_INSTALLED = tuple(Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib"))


def _shown(path: Path) -> str:
    try:
        return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
    except ValueError:
        return str(path)


def plugin_frame(error: BaseException) -> str | None:
    """``path:line in function`` where ``error`` was raised in a plugin's code: the innermost traceback frame
    outside this package and the Python installation (a plugin installed as a package: outside this package and the
    standard library); a SyntaxError's own file and line. None when no such frame is on the traceback."""
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        return f"{_shown(Path(error.filename))}:{error.lineno}"
    frames = [(Path(f.filename).resolve(), f) for f in traceback.extract_tb(error.__traceback__)]
    ours = [
        (p, f)
        for p, f in frames
        if not p.is_relative_to(_PACKAGE)
        and not p.name.startswith("<")
        and not any(p.is_relative_to(d) for d in _PYTHON)
    ]
    best = [(p, f) for p, f in ours if not any(p.is_relative_to(d) for d in _INSTALLED)] or ours
    if not best:
        return None
    path, frame = best[-1]
    return f"{_shown(path)}:{frame.lineno} in {frame.name}"


def error_line(error: BaseException, typed: bool = True) -> str:
    """``Type: message (at path:line in function)``: an error from a plugin's code with where it was raised."""
    frame = plugin_frame(error)
    text = f"{type(error).__name__}: {error}" if typed else str(error)
    return text + ("" if frame is None or frame in text else f" (at {frame})")


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def load_plugins(modules: Sequence[str] = ()) -> list[str]:
    """Import the entry points of ``nemo_rcgrpo.plugins`` and then ``modules`` (each once per process); returns
    what was imported. A module that cannot be imported is a ConfigError naming it."""
    if (
        isinstance(modules, str)
        or not isinstance(modules, (list, tuple))
        or not all(isinstance(m, str) and m for m in modules)
    ):
        raise ConfigError(f"plugins={modules!r}: give a list of module names, e.g. plugins=[my_parts]")
    done = []
    for ep in _entry_points():
        if f"entry_point:{ep.name}" in _loaded:
            continue
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin is the user's one-line error
            raise ConfigError(f"plugin entry point {ep.name!r} ({ep.value}) failed to load: {error_line(e)}") from None
        _loaded.add(f"entry_point:{ep.name}")
        done.append(ep.value)
    for module in modules:
        if module in _loaded:
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module and not module.startswith(f"{e.name}."):
                # one of the plugin's own imports is missing
                raise ConfigError(f"plugins: importing {module!r} failed: {error_line(e, typed=False)}") from None
            raise ConfigError(f"plugins: cannot import {module!r} ({e}); is its folder on PYTHONPATH?") from None
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"plugins: importing {module!r} failed: {error_line(e)}") from None
        _loaded.add(module)
        done.append(module)
    return done


def describe() -> str:
    """One line per kind: ``kind (setting): name, name, ...``."""
    return "\n".join(f"{kind} ({setting}): {', '.join(names(kind))}" for kind, (setting, _) in KINDS.items())


def main(argv: Sequence[str] | None = None) -> int:
    """``rcgrpo plugins [plugins=[mod,...]]``: every kind and its registered names."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: rcgrpo plugins [plugins=[module,...]]\n\nevery kind a plugin can register, the setting that "
            "chooses one, and the registered names.\n\nkinds:"
        )
        print("\n".join(f"  {kind}: {what}" for kind, (_, what) in KINDS.items()))
        return 0
    from nemo_rcgrpo.utils.run_command import CommandError, run_command

    def plugins() -> int:
        modules: list[str] = []
        for arg in argv:
            key, _, value = arg.partition("=")
            if key.lstrip("+") != "plugins" or not value:
                raise CommandError(f"unknown argument {arg!r}; give plugins=[module,...]")
            modules += [m.strip() for m in value.strip("[]").split(",") if m.strip()]
        load_plugins(modules)
        print(describe())
        return 0

    return run_command(plugins)


if __name__ == "__main__":  # run as a script, this file is a second module with empty tables: use the package's
    from nemo_rcgrpo.registry import main as _main

    sys.exit(_main())
