"""scripts/mutation.py: the mutants it lists as equivalent are found by keys that do not depend on the source's
layout, every one of them is still generated, and every target runs its module's own tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mutation():
    from scripts import mutation

    return mutation


@pytest.fixture(scope="module")
def sources(mutation):
    return {name: (ROOT / target.path).read_text() for name, target in mutation.TARGETS.items()}


def test_every_equivalent_entry_names_a_generated_mutant(mutation, sources):
    keys = {m.key for name, source in sources.items() for m in mutation.generate(name, source)}
    stale = [k for k in mutation.EQUIVALENT if k not in keys]
    assert not stale, f"EQUIVALENT entries that match no mutant (the code changed?): {stale}"


def test_the_keys_do_not_depend_on_the_layout(mutation, sources):
    """ast.unparse rewrites a module as far as a formatter can: its own line breaks, quotes and parentheses, no
    comments. Every mutant keeps its key, so every equivalent one is still found."""
    for name, source in sources.items():
        redone = ast.unparse(ast.parse(source))
        assert redone != source
        before = {m.key: m.equivalent for m in mutation.generate(name, source)}
        after = {m.key: m.equivalent for m in mutation.generate(name, redone)}
        assert before == after, name


def test_statement_text_is_one_line_and_a_compound_statements_header(mutation):
    source = "if (a >\n        b):  # a comment\n    x = {\"k\": 1,\n         'j': (2)}\nelse:\n    pass\n"
    tree = ast.parse(source)
    assert mutation.statement_text(tree.body[0]) == "if a > b:"
    assert mutation.statement_text(tree.body[0].body[0]) == "x = {'k': 1, 'j': 2}"


def test_every_target_runs_its_own_tests(mutation):
    for name, target in mutation.TARGETS.items():
        tests = target.tests
        assert tests == tuple(dict.fromkeys(tests)), name
        own = mutation.mirror_tests(target.path)
        assert tests[: len(own)] == own, name
        for test in tests:
            assert (ROOT / test.split("::")[0]).is_file(), (name, test)
