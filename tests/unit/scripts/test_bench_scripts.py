"""Every benchmark script imports, names the Markdown section it writes, and its section markers are unique."""

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))  # _common.py: their shared helpers


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_bench_script_imports_and_names_its_section(path):
    module = importlib.import_module(f"scripts.bench.{path.stem}")  # runs nothing: main() only under __main__
    assert callable(getattr(module, "main", None)), path.name
    assert module.START == f"<!-- bench:{path.stem}:start -->" and module.END == f"<!-- bench:{path.stem}:end -->"


def test_sections_in_the_benchmarks_page_each_have_a_writer():
    text = (BENCH.parents[1] / "docs" / "benchmarks.md").read_text()
    names = {line.split(":")[1] for line in text.splitlines() if line.startswith("<!-- bench:") and ":start" in line}
    writers = set()
    for path in [*SCRIPTS, *BENCH.parent.glob("*.py")]:  # scripts/check_conditioning.py writes one too
        source = path.read_text()
        writers |= {n for n in names if f"<!-- bench:{n}:start -->" in source}
    assert names and names <= writers, sorted(names - writers)


def test_the_scripts_import_each_other_as_a_package():
    """scripts/ runs as `python -m scripts.X` from the root: no script puts a folder on sys.path to import another
    (gpu_site/sitecustomize.py, loaded through PYTHONPATH, and the mutation runner's children are the exceptions)."""
    scripts = BENCH.parent
    allowed = {scripts / "gpu_site" / "sitecustomize.py", scripts / "mutation.py"}
    found = [
        str(p.relative_to(scripts))
        for p in sorted(scripts.rglob("*.py"))
        if p not in allowed and ("sys.path.insert" in p.read_text() or "sys.path[:0]" in p.read_text())
    ]
    assert not found, found
    assert (scripts / "__init__.py").is_file() and (BENCH / "__init__.py").is_file()


def test_the_shared_helpers_need_only_the_standard_library():
    """_common.py is imported by every benchmark (and the GPU check): it pulls in no package of any one of them."""
    import ast
    import sys

    tree = ast.parse((BENCH / "_common.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules and modules <= set(sys.stdlib_module_names) | {"__future__"}, modules
