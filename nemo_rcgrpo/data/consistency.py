"""Stage 1 and stage 2 see the same prompts: the reward-goal settings come from the prepared data, and at start an
RL prompt must be an id-prefix of the same task's stage-1 rendering.

`prepare-data` writes its settings (reward goal template, position, separator and tokens; episode mode) into
``data.dir/config.yaml``. RL rollouts and in-training evaluation read the reward goal from there instead of
rebuilding it from defaults, and the training record carries it to `rcgrpo eval`. What the data cannot carry (the
env's system prompt, tool offer and result rendering, the chat settings) is checked on ids: the first training
task's RL prompt is rendered by the rollout engine and compared with the rendering of its stage-1 line, as stage 1
rendered it: for a conditioned run through the ``rctp`` dataset's own templating (`data/stage1_datasets.py:
reward_conditioned`), so a user's row that carries only ``reward: 1`` gets the same reward goal here as there.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.stage1_datasets import reward_conditioned


class DataMismatchError(ValueError):
    """The run would train on prompts that differ from its stage-1 data; the message names the setting."""


def data_settings(data_dir: str | Path) -> dict[str, Any]:
    """The prepare-data settings saved with the data ({} for data without them)."""
    path = Path(data_dir) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        settings = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DataMismatchError(
            f"{path} is not valid YAML ({str(e).splitlines()[0]}); prepare the data again"
        ) from None
    return settings if isinstance(settings, dict) else {}


def check_task_source(data_dir: str | Path, task_source: str, setting: str = "env.task_source") -> None:
    """Refuse (one line) a run whose ``setting`` (the task source) is not the one its data was prepared from."""
    saved = data_settings(data_dir).get("task_source", "bfcl")  # data from before the setting: BFCL v4
    if saved != task_source:
        raise DataMismatchError(
            f"{setting}={task_source} but {data_dir} was prepared with task_source={saved}: "
            f"set {setting}={saved} or prepare the data with task_source={task_source}"
        )


def reward_goal_of(data_dir: str | Path, high: str, low: str) -> RewardGoal:
    """The data's reward goal, checked against the run's ``reward_tokens``; the defaults for data without one."""
    saved = data_settings(data_dir).get("reward_goal")
    if not saved:
        return RewardGoal(high_token=high, low_token=low)
    known = {f.name for f in dataclasses.fields(RewardGoal)}
    goal = RewardGoal(**{k: v for k, v in saved.items() if k in known})
    if (goal.high_token, goal.low_token) != (high, low):
        raise DataMismatchError(
            f"{data_dir} was prepared with reward_goal tokens {goal.high_token} / {goal.low_token} but the run's "
            f"reward_tokens are {high} / {low}: set reward_tokens.high={goal.high_token} reward_tokens.low="
            f"{goal.low_token}, or prepare the data with reward_goal.high_token={high} reward_goal.low_token={low}"
        )
    return goal


def _first_line(data_dir: Path, task_ids: set[str], reward_goal: str | None) -> dict[str, Any] | None:
    name = "rctp.jsonl" if reward_goal else "sft.jsonl"
    path = data_dir / name
    if not path.is_file():
        return None
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            # an RCTP line carries its token as reward_goal (prepare-data); a user's line may say only reward: 1
            token = record.get("reward_goal", reward_goal if record.get("reward") == 1 else None)
            if record.get("task_id") in task_ids and (reward_goal is None or token == reward_goal):
                return record
    return None


def check_prompt_prefix(
    engine, renderer, suite, data_dir: str | Path, task_ids: list[str], env_config, conditioned: bool
) -> str | None:
    """Refuse (DataMismatchError, one line) when the RL prompt of a training task is not an id-prefix of its stage-1
    rendering; returns the task checked (None when the data has no line for the run's tasks)."""
    data_dir = Path(data_dir)
    high = engine.reward_goal.high_token
    record = _first_line(data_dir, set(task_ids), high if conditioned else None)
    if record is None:
        return None
    # the env's settings may say which of the data's settings they must agree with (BFCL's: the episode mode)
    settings = env_config.settings
    prepared = {**({"mode": record["mode"]} if record.get("mode") else {}), **data_settings(data_dir)}
    mismatch = getattr(settings, "data_mismatch", None)
    problem = mismatch(prepared, str(data_dir)) if callable(mismatch) else None
    if problem:
        raise DataMismatchError(problem)
    # the row as the rctp dataset prepared it for stage 1 (its goal templated from ``reward`` when it has none)
    messages = reward_conditioned(record, engine.reward_goal)["messages"] if conditioned else record["messages"]
    stage1 = renderer.render(messages, record.get("tools")).ids
    prompt = engine.prompt_ids(suite[record["task_id"]], True if conditioned else None)
    if stage1[: len(prompt)] == prompt:
        return record["task_id"]
    hint = getattr(settings, "prompt_mismatch", None)  # which of its settings the env suspects, where it can tell
    setting = hint(record, engine.opening(suite[record["task_id"]], None)[2]) if callable(hint) else None
    setting = setting or f"the opening messages and tools of env {env_config.name} against the data's"
    at = next((i for i, (a, b) in enumerate(zip(stage1, prompt)) if a != b), min(len(stage1), len(prompt)))
    tok = renderer.tokenizer
    raise DataMismatchError(
        f"the RL prompt of {record['task_id']} is not a prefix of its stage-1 rendering in {data_dir} (first "
        f"difference at token {at}: data {tok.decode(stage1[at : at + 8])!r} vs prompt {tok.decode(prompt[at : at + 8])!r}); "
        f"check {setting}: the run must render prompts as the data was prepared"
    )
