"""`rcgrpo score`: replay recorded tool calls through the BFCL environment and score them.

Input (JSONL), one trajectory per line::

    {"id": "multi_turn_base_0", "turns": [["cd(folder='document')", {"name": "ls", "arguments": {}}], ...]}

A turn is a list of calls (one assistant step) or a list of steps (lists of
calls). Calls are BFCL-style call strings or ``{"name", "arguments"}`` objects.
Each line is replayed as a per-turn episode (the official protocol: tools are
offered turn by turn) and written out, in order, as::

    {"id", "reward", "state_ok", "actions_ok", "official_valid", "official_error",
     "num_errors", "observations": [[str, ...] per turn], "details"}

A line that cannot be scored (bad JSON, unknown id, wrong shape) becomes
``{"line": n, "id": ..., "error": "..."}``; the rest of the file goes on.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, TextIO

from nemo_rcgrpo.envs.bfcl.env import BFCLEnv
from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, BFCLSuite, BFCLTask

MAX_LINE_CHARS = 4_000_000


class ScoreInputError(ValueError):
    pass


def _steps_of_turn(turn: Any, index: int) -> list[list[Any]]:
    if not isinstance(turn, list):
        raise ScoreInputError(f"turn {index} must be a list of calls, got {type(turn).__name__}")
    if turn and all(isinstance(step, list) for step in turn):
        return [step for step in turn if step]
    return [turn] if turn else []


def score_trajectory(suite: BFCLSuite, task: BFCLTask, turns: list[Any], arg_types: str = "bfcl") -> dict[str, Any]:
    """Replay ``turns`` of calls for ``task`` in a fresh per-turn episode and score it."""
    if not isinstance(turns, list):
        raise ScoreInputError(f"'turns' must be a list of turns, got {type(turns).__name__}")
    if len(turns) > task.num_turns:
        raise ScoreInputError(f"{len(turns)} turns given but {task.id} has {task.num_turns}")
    env = BFCLEnv(mode="per_turn", arg_types=arg_types)
    env.reset(task, gold=suite.gold(task))
    for index, turn in enumerate(turns):
        for step in _steps_of_turn(turn, index):
            if env.done:
                break
            env.step(step)
        if env.done:
            break
        env.step([])  # the assistant ends the turn
    if not env.done:
        env.truncate(f"input ended after {len(turns)} of {task.num_turns} turns")
    reward = env.reward()
    verdict = env.official_verdict()
    return {
        "id": task.id,
        "reward": reward.value,
        "state_ok": reward.state_ok,
        "actions_ok": reward.actions_ok,
        "official_valid": verdict.valid,
        "official_error": verdict.error_type,
        "num_errors": env.num_errors,
        "observations": env.observations_by_turn(),
        "details": reward.details,
    }


def score_lines(suite: BFCLSuite, lines: Iterable[str], arg_types: str = "bfcl") -> Iterator[dict[str, Any]]:
    """Score every non-blank line; bad lines yield an error record instead of raising."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record_id = None
        try:
            if len(line) > MAX_LINE_CHARS:
                raise ScoreInputError(f"line is longer than {MAX_LINE_CHARS} characters")
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise ScoreInputError(f"not valid JSON: {e}") from None
            if not isinstance(record, dict):
                raise ScoreInputError("each line must be a JSON object with 'id' and 'turns'")
            record_id = record.get("id")
            if not isinstance(record_id, str) or record_id not in suite.tasks:
                raise ScoreInputError(f"unknown task id {record_id!r} (expected e.g. 'multi_turn_base_0')")
            if "turns" not in record:
                raise ScoreInputError("missing 'turns'")
            yield score_trajectory(suite, suite[record_id], record["turns"], arg_types)
        except ScoreInputError as e:
            yield {"line": number, "id": record_id, "error": str(e)}


def ground_truth_lines(suite: BFCLSuite) -> Iterator[str]:
    for task in suite:
        yield json.dumps({"id": task.id, "turns": [list(t) for t in task.ground_truth]})


@dataclass
class CategoryStats:
    n: int = 0
    reward: float = 0.0
    official: int = 0
    errors: int = 0


def summary_table(results: Iterable[dict[str, Any]]) -> str:
    """Markdown table: per category, mean reward and official accuracy (percent)."""
    stats: dict[str, CategoryStats] = defaultdict(CategoryStats)
    for r in results:
        if "error" in r and "reward" not in r:
            stats["(unscorable lines)"].errors += 1
            continue
        category = next((c for c in CATEGORIES if r["id"].startswith(f"multi_turn_{c}_")), "other")
        for key in (category, "overall"):
            s = stats[key]
            s.n += 1
            s.reward += r["reward"]
            s.official += bool(r["official_valid"])
    rows = ["| category | entries | reward (%) | official accuracy (%) |", "|---|---:|---:|---:|"]
    order = [c for c in (*CATEGORIES, "other", "overall") if c in stats]
    for key in order:
        s = stats[key]
        rows.append(f"| {key} | {s.n} | {100 * s.reward / s.n:.2f} | {100 * s.official / s.n:.2f} |")
    if "(unscorable lines)" in stats:
        rows.append(f"| unscorable lines | {stats['(unscorable lines)'].errors} | - | - |")
    return "\n".join(rows)


def write_jsonl(records: Iterable[dict[str, Any]], out: TextIO) -> list[dict[str, Any]]:
    kept = []
    for r in records:
        out.write(json.dumps(r, default=str) + "\n")
        kept.append(r)
    return kept
