"""The BFCL v4 multi-turn suite: the tasks of the installed bfcl-eval, their tool docs, the train / held-out
split and the memoised gold replays (`reward.py: replay_gold`) that environments are reset with.

The task and tool records themselves, and the reading of bfcl-eval's files, are `tasks.py`; this module sits
above them and the reward, so nothing below it imports back up.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import MappingProxyType
from typing import Iterable

from nemo_rcgrpo.envs.bfcl.reward import GoldReplay, replay_gold
from nemo_rcgrpo.envs.bfcl.tasks import (
    API_CLASSES,
    CATEGORIES,
    BFCLDataError,
    BFCLTask,
    ToolDoc,
    _holdout_schedule,
    _public_method_signature,
    _read_jsonl,
    bfcl_data_dir,
    category_order,
)
from nemo_rcgrpo.envs.splits import split_by_scenario


class BFCLSuite:
    """All multi-turn tasks of the installed bfcl-eval, plus memoised gold replays.

    A task family of its own on BFCL's classes subclasses it and overrides ``_make_tasks`` (and ``split`` if it
    has a fixed held-out set): the tool docs, the gold replays and the split come with it (`envs/bfcl/micro.py`).
    """

    data_builder = "bfcl"  # what prepare-data builds a source's data with, where none is registered in its name
    title = "BFCL v4 multi-turn"  # what `rcgrpo eval` results and `rcgrpo compare` tables say they were run on
    category_order = staticmethod(category_order)  # BFCL's categories in BFCL's order (the per-category tables)

    def __init__(self, categories: Iterable[str] = CATEGORIES, data_dir: Path | None = None):
        self.data_dir = Path(data_dir) if data_dir else bfcl_data_dir()
        # none given (a plugin's source built on this class, which declares no categories of its own): BFCL's four
        categories = tuple(categories) or CATEGORIES
        unknown = set(categories) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown BFCL multi-turn categories {sorted(unknown)}; choose from {CATEGORIES}")
        self._gold: dict[str, GoldReplay] = {}
        self.docs = self._load_docs()
        self.tasks: dict[str, BFCLTask] = {t.id: t for t in self._make_tasks(tuple(categories))}

    def oracle_calls(self, task: BFCLTask):
        """The ground truth as a plan: per BFCL turn, its calls with their arguments by name (`rcgrpo eval
        policy=oracle`; `trajectories.py: gold_plan`)."""
        from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan

        return gold_plan(task)

    def scripted_messages(self, task: BFCLTask, success: bool, variant: int, settings, failure_type: str):
        """The conversation a scripted rollout plays (``generation.backend=scripted``; `scripted.py`): the ground
        truth, or a verified failure (``variant``: the seed of the perturbation, ``failure_type`` the preferred
        one), in the episode mode of the env's ``settings`` (BFCL's; merged for settings without one)."""
        from nemo_rcgrpo.envs.bfcl.scripted import scripted_messages

        mode = getattr(settings, "mode", "merged")
        return scripted_messages(task, self.gold(task), success, variant, mode, failure_type)

    def _make_tasks(self, categories: tuple[str, ...]) -> list[BFCLTask]:
        """The tasks of ``categories`` (BFCL's, checked; ``self.docs`` is loaded): those of BFCL v4 multi-turn."""
        return [task for category in categories for task in self._load_category(category)]

    def _load_docs(self) -> dict[str, tuple[ToolDoc, ...]]:
        docs = {}
        for class_name, (module_name, doc_file) in API_CLASSES.items():
            cls = getattr(importlib.import_module(module_name), class_name)
            rows = _read_jsonl(self.data_dir / "multi_turn_func_doc" / doc_file)
            docs[class_name] = tuple(
                ToolDoc(r["name"], class_name, MappingProxyType(r), _public_method_signature(cls, r["name"]))
                for r in rows
            )
        return docs

    def _load_category(self, category: str) -> list[BFCLTask]:
        name = f"BFCL_v4_multi_turn_{category}.json"
        entries = _read_jsonl(self.data_dir / name)
        try:
            answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(self.data_dir / "possible_answer" / name)}
            ids = [e["id"] for e in entries]
        except (KeyError, TypeError):
            raise BFCLDataError(f"{name} lacks 'id'/'ground_truth' fields; reinstall bfcl-eval==2026.3.23") from None
        if len(set(ids)) != len(ids):
            raise BFCLDataError(f"{name} has duplicate ids; reinstall bfcl-eval==2026.3.23")
        tasks = []
        for e in entries:
            if e["id"] not in answers:
                raise BFCLDataError(f"{e['id']} has no ground truth in possible_answer/{name}")
            gt = answers[e["id"]]
            if not isinstance(e.get("question"), list) or not isinstance(gt, list):
                raise BFCLDataError(f"{e['id']} in {name} is malformed; reinstall bfcl-eval==2026.3.23 (make install)")
            if len(gt) != len(e["question"]):
                raise BFCLDataError(f"{e['id']}: {len(gt)} ground-truth turns for {len(e['question'])} questions")
            unknown = [c for c in e["involved_classes"] if c not in API_CLASSES]
            if unknown:
                raise BFCLDataError(f"{e['id']} involves unsupported classes {unknown}")
            tasks.append(
                BFCLTask(
                    id=e["id"],
                    category=category,
                    turns=tuple(tuple(MappingProxyType(m) for m in turn) for turn in e["question"]),
                    ground_truth=tuple(tuple(turn) for turn in gt),
                    initial_config=MappingProxyType(e["initial_config"]),
                    involved_classes=tuple(e["involved_classes"]),
                    tools=tuple(d for c in e["involved_classes"] for d in self.docs[c]),
                    missed_functions=MappingProxyType(_holdout_schedule(e, gt)),
                    excluded_functions=tuple(e.get("excluded_function") or ()),
                )
            )
        return tasks

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):
        return iter(self.tasks.values())

    def __getitem__(self, task_id: str) -> BFCLTask:
        try:
            return self.tasks[task_id]
        except KeyError:
            raise KeyError(f"unknown task id {task_id!r} (e.g. {next(iter(self.tasks), 'none')!r})") from None

    def split(self, seed: int, test_fraction: float = 0.1):
        """The train / held-out split of the tasks: by scenario, seeded (`envs/splits.py`)."""
        return split_by_scenario(self, seed, test_fraction)

    def gold(self, task: BFCLTask | str) -> GoldReplay:
        """The ground-truth replay of a task, computed once per suite."""
        task = self[task] if isinstance(task, str) else task
        if task.id not in self._gold:
            self._gold[task.id] = replay_gold(task)
        return self._gold[task.id]
