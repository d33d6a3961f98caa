"""BFCL is a plugin that ships inside the package: only envs/builtin.py imports it (the import contract of
pyproject.toml, which `make test` runs), and the generic commands find its parts through the registry."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT)], cwd=root, capture_output=True, text=True, timeout=120)


def test_the_contract_holds_and_catches_an_import_of_bfcl(tmp_path):
    recipe = (ROOT / "Makefile").read_text().split("\ntest:")[1].split("\n\n")[0]
    assert "lint-imports" in recipe and "ruff format --check" in recipe and "ruff check" in recipe
    kept = _lint(ROOT)
    assert kept.returncode == 0 and "1 kept, 0 broken" in kept.stdout, kept.stdout + kept.stderr
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copytree(ROOT / "nemo_rcgrpo", copy / "nemo_rcgrpo", ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "nemo_rcgrpo" / "evaluation" / "run.py").open("a") as f:
        f.write("\nfrom nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES  # noqa\n")
    broken = _lint(copy)
    assert broken.returncode == 1
    assert "nemo_rcgrpo.evaluation.run -> nemo_rcgrpo.envs.bfcl.tasks" in broken.stdout


def test_bfcls_parts_are_registered_by_name():
    from nemo_rcgrpo.registry import names, table

    assert {"bfcl", "bfcl_micro"} <= set(names("task_source")) and names("env")[:1] == ("bfcl",)
    assert {"bfcl", "bfcl_micro"} <= set(names("data_builder")) and "bfcl" in names("official_pipeline")
    # the scripted generator is the generic layer's (generation/scripted.py): it plays any env, BFCL's included
    scripted = table("generator")["scripted"]
    assert scripted.__module__ == "nemo_rcgrpo.generation" and callable(scripted.check)
    assert table("command")["score"].help
    from nemo_rcgrpo.envs.sources import source_categories

    assert source_categories("bfcl") == ("base", "miss_func", "miss_param", "long_context")


def test_bfcls_own_pipeline_plays_only_the_sources_that_hold_its_leaderboard_entries(monkeypatch):
    """protocol=bfcl's pipeline is BFCL's inference code on BFCL's entries: the bfcl task source's, never
    bfcl_micro's tasks or a plugin source's (it asks the registered source, not its name)."""
    import types

    from nemo_rcgrpo import registry
    from nemo_rcgrpo.envs.bfcl.leaderboard import BFCLPipeline
    from nemo_rcgrpo.registry import register, table

    pipeline = table("official_pipeline")["bfcl"]
    monkeypatch.setitem(registry._TABLES, "task_source", dict(registry._TABLES["task_source"]))  # undone after
    assert isinstance(pipeline(types.SimpleNamespace(task_source="bfcl")), BFCLPipeline)
    assert pipeline(types.SimpleNamespace(task_source="bfcl_micro")) is None
    register("task_source", "bfcl_lookalike", replace=True)(lambda categories, data_dir=None: None)
    assert pipeline(types.SimpleNamespace(task_source="bfcl_lookalike")) is None


def test_a_registered_command_runs_from_the_cli_and_cannot_take_a_built_in_name(capsys):
    from nemo_rcgrpo.cli import _commands, build_parser, main
    from nemo_rcgrpo.registry import register, table

    def hello(argv):
        print("hello", *argv)
        return 7

    hello.help = "say hello"
    register("command", "hello")(hello)
    register("command", "train")(hello)
    try:
        assert "hello" in _commands() and "train" not in _commands()
        assert main(["hello", "a", "b"]) == 7 and capsys.readouterr().out == "hello a b\n"
        assert "say hello" in build_parser().format_help()
    finally:
        table("command").pop("hello")
        table("command").pop("train")
