"""Every benchmark script imports, names the Markdown section it writes, and its section markers are unique."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_bench_script_imports_and_names_its_section(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs nothing: main() only under __main__
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
