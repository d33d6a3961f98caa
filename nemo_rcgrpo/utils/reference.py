"""The plugin reference page, `docs/reference.md`, generated from the code itself: each Protocol's and value type's
docstring as its prose and its declaration (fields with their types and line comments, method signatures) as its
code, then every registered kind's setting and signature (`registry.KINDS`).

    python -m nemo_rcgrpo.utils.reference > docs/reference.md

`tests/unit/test_docs_layout.py` fails when the page and the code disagree.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

# (section title, its lead, [(module, class name)]): what a plugin implements or receives, in reading order
SECTIONS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Task sources and tasks",
        "A task source (kind `task_source`, setting `env.task_source`) is `fn(categories) -> Suite`.",
        [("nemo_rcgrpo.envs.interfaces", "Suite"), ("nemo_rcgrpo.envs.interfaces", "Task")],
    ),
    (
        "Environments",
        "An environment (kind `env`, setting `env.name`) is `factory(env settings, suite) -> EnvOpener`.",
        [
            ("nemo_rcgrpo.envs.interfaces", "EnvOpener"),
            ("nemo_rcgrpo.envs.interfaces", "Env"),
            ("nemo_rcgrpo.envs.interfaces", "StepResult"),
        ],
    ),
    (
        "Values an environment receives and returns",
        "Frozen dataclasses (`from nemo_rcgrpo.types import ...`); messages are plain OpenAI chat dicts.",
        [
            ("nemo_rcgrpo.types", "ToolCall"),
            ("nemo_rcgrpo.types", "ToolCallError"),
            ("nemo_rcgrpo.types", "Observation"),
            ("nemo_rcgrpo.types", "RewardInfo"),
            ("nemo_rcgrpo.types", "OfficialVerdict"),
        ],
    ),
    (
        "Generators",
        "A generator (kind `generator`, setting `generation.backend`) is `factory(setup, policy model, tokenizer) -> "
        "Generator`.",
        [
            ("nemo_rcgrpo.generation.base", "Generator"),
            ("nemo_rcgrpo.generation.base", "SamplingParams"),
            ("nemo_rcgrpo.generation.base", "Completion"),
        ],
    ),
]


def _declaration(cls: type) -> str:
    """The class statement as written, its docstring (and its methods' bodies past their docstrings) left out."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    node = ast.parse(source).body[0]
    drop: set[int] = set()  # 0-based line numbers
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        drop.update(range(body[0].lineno - 1, body[0].end_lineno))
    for item in body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = item.body[0]
            keeps_docstring = (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            )
            rest = item.body[1:] if keeps_docstring else item.body
            if rest and not (
                len(rest) == 1
                and isinstance(rest[0], ast.Expr)
                and isinstance(rest[0].value, ast.Constant)
                and rest[0].value.value is Ellipsis
            ):
                indent = " " * (rest[0].col_offset)
                drop.update(range(rest[0].lineno - 1, rest[-1].end_lineno))
                lines[rest[0].lineno - 1] = f"{indent}..."
                drop.discard(rest[0].lineno - 1)
    kept = [line for i, line in enumerate(lines) if i not in drop]
    out: list[str] = []
    for line in kept:  # no blank line right after the class line
        if not (line.strip() == "" and out and out[-1].startswith("class ")):
            out.append(line)
    return "\n".join(out).rstrip()


def render() -> str:
    """The whole page (markdown)."""
    from nemo_rcgrpo.registry import KINDS

    parts = [
        "# Plugin reference",
        "",
        "Generated from the code by `python -m nemo_rcgrpo.utils.reference > docs/reference.md` (a test keeps "
        "it in step): the Protocols and value types a plugin implements or receives, as declared, and the "
        "signature of every registered kind. The guide, with the rules the engine checks at the seam and a "
        "minimal environment: [extending.md](extending.md).",
        "",
    ]
    for title, lead, classes in SECTIONS:
        parts += [f"## {title}", "", lead, ""]
        for module, name in classes:
            cls = getattr(importlib.import_module(module), name)
            doc = inspect.cleandoc(cls.__doc__ or "")
            path = module.replace(".", "/") + ".py"
            parts += [f"### `{name}`", "", f"`{path}`", ""]
            if doc:
                parts += [doc, ""]
            parts += ["```python", _declaration(cls), "```", ""]
    parts += [
        "## Registered kinds",
        "",
        "`@register(kind, name)` (`from nemo_rcgrpo import register`) on a module named in `plugins=[...]`; "
        "`rcgrpo plugins` lists every kind and its names.",
        "",
        "| kind | chosen by | a registered object is |",
        "|---|---|---|",
    ]
    parts += [
        f"| `{kind}` | `{setting}` | {what.replace('|', chr(92) + '|')} |" for kind, (setting, what) in KINDS.items()
    ]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
