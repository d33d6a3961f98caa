"""The RL task pointers (which tasks stage 2 rolls out, ``rl_train``, and evaluates, ``rl_test``) as a
`datasets.Dataset` with a declared schema, from any of the stage-1 data's three forms.

In ``data.dir``, ``rl_SPLIT.jsonl`` (as `rcgrpo prepare-data` writes it), else ``rl_SPLIT.parquet`` (as verl users
keep their prompts), else a folder ``rl_SPLIT/`` written by ``Dataset.save_to_disk``. Each row points at one task
of the run's task source; the environment builds the prompt at run time (the RC-GRPO paper, Appendix B):

    task_id      string   required: a task of ``env.task_source``
    category     string   optional
    env          string   optional (the env it was prepared for)
    task_source  string   optional
    mode         string   optional (the episode shape it was prepared for)

A row that does not fit is a `DataSchemaError` of one line naming the file, the row and the field.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from nemo_rcgrpo.data.consistency import check_task_source
from nemo_rcgrpo.data.dataset import DataSchemaError, jsonl_objects, open_table
from nemo_rcgrpo.envs.sources import make_suite

FIELDS = ("task_id", "category", "env", "task_source", "mode")


def pointer_features():
    from datasets import Features, Value

    return Features({name: Value("string") for name in FIELDS})


def find_pointers(data_dir: str | Path, split: str) -> Path | None:
    """``rl_SPLIT.jsonl``, ``rl_SPLIT.parquet`` or the folder ``rl_SPLIT`` in ``data_dir``, the first that exists."""
    for candidate in (f"rl_{split}.jsonl", f"rl_{split}.parquet", f"rl_{split}"):
        path = Path(data_dir) / candidate
        if path.exists():
            return path
    return None


def _check(row: Any, where: str) -> dict[str, str | None]:
    if not isinstance(row, dict):
        raise DataSchemaError(f"{where}: must be an object with a task_id, not {type(row).__name__}")
    task_id = row.get("task_id")
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or task_id == "":
        raise DataSchemaError(
            f"{where}: field 'task_id' must be a task id (a string)"
            + ("" if "task_id" in row else f" (the row has {sorted(row)})")
        )
    out: dict[str, str | None] = {"task_id": str(task_id)}
    for key in FIELDS[1:]:
        value = row.get(key)
        if value is not None and not isinstance(value, str):
            raise DataSchemaError(f"{where}: field {key!r} must be a string, not {type(value).__name__}")
        out[key] = value
    return out


def load_pointers(path: str | Path):
    """The pointer Dataset at ``path`` (.jsonl, .parquet or a saved-Dataset folder), rows checked and cast."""
    import datasets

    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        rows = [(f"{path}: row {i}", r) for i, r in enumerate(open_table(datasets, path))]
    elif path.is_file():
        rows = jsonl_objects(path)
    else:
        raise FileNotFoundError(
            f"RL task pointers {path} do not exist; run `rcgrpo prepare-data out_dir={path.parent}`"
        )
    checked = [_check(r, where) for where, r in rows]
    return datasets.Dataset.from_list(checked, features=pointer_features())


def task_ids(data_dir: str | Path, split: str, required: bool = True) -> list[str]:
    """The task ids of the ``split`` pointers in ``data_dir``, in order; [] when there are none and not ``required``."""
    path = find_pointers(data_dir, split)
    if path is None:
        if required:
            raise FileNotFoundError(
                f"no RL task pointers rl_{split}.jsonl / .parquet / folder in {data_dir}; run "
                f"`rcgrpo prepare-data out_dir={data_dir}`"
            )
        return []
    return list(load_pointers(path)["task_id"])


def stratified_sample(task_ids: Sequence[str], category_of: Callable[[str], str], k: int, seed: int) -> list[str]:
    """``k`` of ``task_ids`` (all of them when there are fewer), stratified by ``category_of``: each category gets
    its share ``k * n_c / n`` rounded down, the ``k`` left over go to the largest remainders (ties: the category
    named first), and each category's picks are a seeded shuffle's first ones. Returned in ``task_ids``' order, so
    the sample depends only on the set of ids, their categories, ``k`` and ``seed``."""
    if k >= len(task_ids):
        return list(task_ids)
    by_category: dict[str, list[str]] = {}
    for task_id in task_ids:
        by_category.setdefault(category_of(task_id), []).append(task_id)
    total = len(task_ids)
    share = {c: k * len(ids) // total for c, ids in by_category.items()}
    left = k - sum(share.values())
    for c in sorted(by_category, key=lambda c: (-(k * len(by_category[c]) % total), c))[:left]:
        share[c] += 1
    picked: set[str] = set()
    for c, ids in sorted(by_category.items()):
        order = sorted(ids)
        random.Random(f"{seed}:{c}").shuffle(order)
        picked.update(order[: share[c]])
    return [t for t in task_ids if t in picked]


@dataclass(frozen=True)
class RLTasks:
    """What stage 2 rolls out and evaluates: the task source's suite, the training tasks (the ``rl_<split>``
    pointers that the suite holds, in their order) and the held-out sample (``rl_test``'s, stratified by category:
    the test split's order would favour its first category)."""

    suite: Any
    train: list[str]
    held_out: list[str]


def load_rl_tasks(data_dir: str | Path, split: str, env: Any, eval_tasks: int, seed: int) -> RLTasks:
    """The run's tasks from ``data_dir``'s pointers and the env section (``task_source``, ``categories``); refuses,
    in one line, data prepared from another task source and pointers of which the suite holds none."""
    check_task_source(data_dir, env.task_source)
    suite = make_suite(env.task_source, env.categories)
    train = [t for t in task_ids(data_dir, split) if t in suite.tasks]
    if not train:
        raise ValueError(
            f"no task of the rl_{split} pointers in {data_dir} is in task source {env.task_source} "
            f"(categories {list(env.categories)})"
        )
    test = [t for t in task_ids(data_dir, "test", required=False) if t in suite.tasks]
    return RLTasks(suite, train, stratified_sample(test, lambda t: suite[t].category, eval_tasks, seed))
