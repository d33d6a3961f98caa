"""docs/layout.md names every module of the package and every config group, so "where the code is" follows the
tree (a file added or moved without a line there fails here)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_and_config_group_is_in_the_layout_page():
    text = (ROOT / "docs" / "layout.md").read_text()
    modules = sorted(p for p in (ROOT / "nemo_rcgrpo").rglob("*.py") if p.name != "__init__.py")
    assert len(modules) > 50
    missing = [str(p.relative_to(ROOT)) for p in modules if p.name not in text]
    assert not missing, f"docs/layout.md does not name {missing}"
    groups = sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir())
    assert {g.name for g in groups} >= {"model", "init", "algorithm", "hardware", "generation"}
    assert not [g.name for g in groups if f"conf/{g.name}/" not in text]
