"""docs/layout.md names every module of the package and every config group, so "where the code is" follows the
tree (a file added or moved without a line there fails here)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_and_config_group_is_in_the_layout_page():
    text = (ROOT / "docs" / "layout.md").read_text()
    modules = sorted(p for p in (ROOT / "nemo_rcgrpo").rglob("*.py") if p.name != "__init__.py")
    assert len(modules) > 50
    missing = [str(p.relative_to(ROOT)) for p in modules if p.name not in text]
    assert not missing, f"docs/layout.md does not name {missing}"
    # a name several folders use (config.py, run.py) is named once for each of them
    from collections import Counter

    shared = {name: n for name, n in Counter(p.name for p in modules).items() if n > 1}
    short = {name: n for name, n in shared.items() if len(re.findall(rf"\b{re.escape(name)}\b", text)) < n}
    assert not short, f"docs/layout.md names these fewer times than the folders that have them: {short}"
    groups = sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir())
    assert {g.name for g in groups} >= {"model", "init", "algorithm", "hardware", "generation"}
    assert not [g.name for g in groups if f"conf/{g.name}/" not in text]


def test_the_plugin_reference_page_is_generated_from_the_code():
    """docs/reference.md is what `python -m nemo_rcgrpo.utils.reference` prints today: a Protocol, a field or a
    kind changed without regenerating the page fails here (regenerate it with that command)."""
    from nemo_rcgrpo.registry import KINDS
    from nemo_rcgrpo.utils.reference import render

    page = (ROOT / "docs" / "reference.md").read_text()
    assert page == render(), "docs/reference.md is stale: python -m nemo_rcgrpo.utils.reference > docs/reference.md"
    for name in (
        "Suite",
        "Task",
        "EnvOpener",
        "Env",
        "StepResult",
        "ToolCall",
        "ToolCallError",
        "Observation",
        "RewardInfo",
        "Generator",
        "SamplingParams",
        "Completion",
    ):
        assert f"### `{name}`" in page
    assert all(f"| `{kind}` |" in page for kind in KINDS)
    # the declarations are the code's: a field's line comment and a method signature come through
    assert "    category: str  # what the per-category metrics are keyed on" in page
    assert "    def step(self, calls: Sequence[ToolCall | ToolCallError]) -> StepResult: ..." in page
    assert "](reference.md)" in (ROOT / "docs" / "extending.md").read_text()


def test_the_unit_tests_mirror_the_package():
    """tests/unit/<folder>/ is the tests of nemo_rcgrpo/<folder>/ (or of scripts/): a test module in a folder the
    package does not have fails here."""
    unit = ROOT / "tests" / "unit"
    folders = {p.parent.relative_to(unit) for p in unit.rglob("test_*.py")}
    assert len(folders) > 8
    stray = [
        str(f) for f in folders if str(f) != "." and not (ROOT / "nemo_rcgrpo" / f).is_dir() and f.parts[0] != "scripts"
    ]
    assert not stray, f"tests/unit folders without a package folder: {stray}"
