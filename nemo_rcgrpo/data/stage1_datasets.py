"""Stage-1 datasets (kind ``stage1_dataset``, ``data.dataset``; null: the stage's): what a row of the stage-1 schema
(`data/dataset.py`) becomes before it is rendered and trained on.

- ``sft``: the conversation as it is (SFT on experts).
- ``rctp``: RCTP-FT's reward-token templating (the RC-GRPO paper, Stage 1): the reward goal of the row's outcome
  (``[Reward Goal: <|high_reward|>]`` for ``reward: 1``, the low token for ``reward: 0``) in its first user message.
  Rows written by `rcgrpo prepare-data` carry it already (and say which in ``reward_goal``); a row of a user's own
  data (JSONL, Parquet, a saved Dataset) that has only ``reward`` gets it here, so mixed-quality data trains
  RCTP-FT with no code. A row whose first user message holds a goal token that its ``reward`` contradicts, that
  holds a goal token in another system or user message, or that has neither a goal nor a 0/1 ``reward``, is
  refused in one line.

A user's dataset:

    from nemo_rcgrpo import register
    from nemo_rcgrpo.data.stage1_datasets import Stage1Dataset

    register("stage1_dataset", "no_system")(Stage1Dataset(
        lambda record, goal: {**record, "messages": [m for m in record["messages"] if m["role"] != "system"]}))

then ``data.dataset=no_system plugins=[my_module]``.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nemo_rcgrpo.data.dataset import DataSchemaError
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.registry import lookup, register

Record = dict[str, Any]


@dataclass(frozen=True)
class Stage1Dataset:
    prepare: Callable[[Record, RewardGoal], Record]  # (row as the renderer takes it, the run's reward goal) -> row
    conditioned: bool = False  # its rows carry reward goals: only a conditioned stage (rctp) may train on it
    description: str = ""


def as_is(record: Record, goal: RewardGoal) -> Record:
    return record


def _first_user(record: Record) -> int | None:
    return next((i for i, m in enumerate(record.get("messages") or []) if m.get("role") == "user"), None)


def reward_conditioned(record: Record, goal: RewardGoal) -> Record:
    """The row with ``goal`` of its outcome in its first user message (unchanged when it is there already)."""
    where = f"row {record.get('task_id', '?')}"
    first = _first_user(record)
    if first is None:
        raise DataSchemaError(f"{where}: no user message to carry the reward goal")
    content = record["messages"][first].get("content") or ""
    elsewhere = next(
        (
            i
            for i, m in enumerate(record["messages"])
            if i != first
            and m.get("role") in ("system", "user")
            and any(goal.token(ok) in (m.get("content") or "") for ok in (True, False))
        ),
        None,
    )
    if elsewhere is not None:
        raise DataSchemaError(
            f"{where}: messages[{elsewhere}] holds a reward goal token; RCTP-FT puts the goal in "
            "the first user message only"
        )
    present = [success for success in (True, False) if goal.token(success) in content]
    reward = record.get("reward")
    said = record.get("reward_goal")
    if reward not in (0, 1, None) or isinstance(reward, bool):
        raise DataSchemaError(f"{where}: reward={reward!r}; an RCTP row's reward is 1 (expert) or 0 (failure)")
    if said is not None and said not in (goal.high_token, goal.low_token):
        raise DataSchemaError(f"{where}: reward_goal={said!r} is neither {goal.high_token} nor {goal.low_token}")
    outcome = (reward == 1) if reward is not None else (said == goal.high_token if said is not None else None)
    if len(present) > 1:
        raise DataSchemaError(f"{where}: the first user message holds both reward tokens")
    if present:
        if outcome is not None and present[0] != outcome:
            raise DataSchemaError(
                f"{where}: the first user message holds {goal.token(present[0])} but the row's "
                f"reward says {goal.token(outcome)}"
            )
        return record
    if outcome is None:
        raise DataSchemaError(
            f"{where}: no reward goal in the first user message and no reward (1 expert, 0 "
            "failure) to template one from"
        )
    return {**record, "messages": goal.apply(record["messages"], outcome)}


register("stage1_dataset", "sft")(Stage1Dataset(as_is, description="the conversations as they are"))
register("stage1_dataset", "rctp")(
    Stage1Dataset(
        reward_conditioned,
        conditioned=True,
        description="RCTP-FT: each row's reward goal (from reward: 1 / 0) in its first user message",
    )
)


def stage1_dataset(name: str) -> Stage1Dataset:
    """The registered stage-1 dataset ``name`` (a ValueError listing the registered names when there is none)."""
    return lookup("stage1_dataset", name, Stage1Dataset)


class Prepared(SequenceABC):
    """``records`` seen through a dataset's ``prepare``, one row at a time (the rows stay memory-mapped)."""

    def __init__(self, records: Sequence[Record], dataset: Stage1Dataset, goal: RewardGoal):
        self.records, self.dataset, self.goal = records, dataset, goal

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Record:  # type: ignore[override]
        return self.dataset.prepare(self.records[i], self.goal)
