"""`rcgrpo score`: replay recorded tool calls through the BFCL environment and score them.

Input (JSONL), one trajectory per line::

    {"id": "multi_turn_base_0", "turns": [["cd(folder='document')", {"name": "ls", "arguments": {}}], ...]}

A turn is a list of calls (one assistant step) or a list of steps (lists of
calls). Calls are BFCL-style call strings or ``{"name", "arguments"}`` objects.
Each line is replayed as a per-turn episode (the official protocol: tools are
offered turn by turn) and written out, in order, as::

    {"id", "reward", "state_ok", "actions_ok", "official_valid", "official_error",
     "num_errors", "observations": [[str, ...] per turn], "details"}

A line that cannot be scored (bad JSON, invalid UTF-8, longer than 4 MB, unknown
id, wrong shape) becomes ``{"line": n, "id": ..., "error": "..."}``; the rest of
the file goes on. Input and output are streamed (one line in memory at a time).

OUT is bounded in proportion to the input: at most ``OUTPUT_FLOOR_CHARS`` plus
``OUTPUT_CHARS_PER_INPUT_CHAR`` characters per character of input read so far,
and one record at most ``MAX_RECORD_CHARS``. A record past the bound has its
observations clipped, longest first (each clipped one ends in ``... [clipped N
characters]``; the record says ``"observations_clipped": true``; `utils/bounded.py`,
as in the training and evaluation dumps), or dropped when even that does not
fit; the scores are always written. OUT is written to ``OUT.partial`` and renamed
when the last line is scored, so a killed run never leaves a truncated OUT (the
lines scored so far are in ``OUT.partial``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from nemo_rcgrpo.envs.bfcl.env import BFCLEnv
from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite
from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, BFCLTask
from nemo_rcgrpo.utils.bounded import CLIPPED_FLAG, clip_observations

MAX_LINE_CHARS = 4_000_000
MAX_RECORD_CHARS = 1_000_000  # one output record
# all of OUT: 16 KB of calls wrote 36 MB of observations before (ground truth needs at most 10 per input character)
OUTPUT_FLOOR_CHARS = 65_536
OUTPUT_CHARS_PER_INPUT_CHAR = 128


class _TooLong:
    """A line of more than MAX_LINE_CHARS bytes (skipped without being held in memory)."""


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
        "category": task.category,
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
        record_id = None
        try:
            if isinstance(line, _TooLong) or len(line) > MAX_LINE_CHARS:
                raise ScoreInputError(f"line is longer than {MAX_LINE_CHARS} characters")
            if isinstance(line, bytes):
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ScoreInputError(f"line is not valid UTF-8 (byte {e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise ScoreInputError(f"not valid JSON: {e}") from None
            if not isinstance(record, dict):
                raise ScoreInputError("each line must be a JSON object with 'id' and 'turns'")
            record_id = record.get("id")
            if not isinstance(record_id, str) or record_id not in suite.tasks:
                example = next(iter(suite.tasks), "none")
                raise ScoreInputError(f"unknown task id {record_id!r} (expected e.g. {example!r})")
            if "turns" not in record:
                raise ScoreInputError("missing 'turns'")
            yield score_trajectory(suite, suite[record_id], record["turns"], arg_types)
        except ScoreInputError as e:  # bounded too: an id or a message can be as long as the line
            shown = (
                record_id
                if isinstance(record_id, str) and len(record_id) <= 200
                else (None if record_id is None else repr(record_id)[:200])
            )
            yield {"line": number, "id": shown, "error": str(e)[:1000]}


def read_lines(f: BinaryIO, limit: int = MAX_LINE_CHARS) -> Iterator[bytes | _TooLong]:
    """The lines of a binary file, one at a time; a line longer than ``limit`` is read past in chunks."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):  # drain the rest of the long line
                line = f.readline(1 << 20)
            yield _TooLong()
            continue
        yield line


def bounded_record(record: dict[str, Any], limit: int = MAX_RECORD_CHARS) -> str:
    """The record as one JSON line of at most about ``limit`` characters: observations clipped longest first
    (`utils/bounded.py`), dropped when that is too little; the scores always stay."""
    line = clip_observations(record, limit)
    if line is not None or "observations" not in record:  # a line that could not be scored is written as it is
        return line if line is not None else json.dumps(record, default=str)
    clipped = {**record, CLIPPED_FLAG: True, "observations": []}
    text = json.dumps(clipped, default=str)
    if len(text) <= limit:
        return text
    clipped["details"] = {"clipped": "the record was longer than the output bound"}
    return json.dumps(clipped, default=str)


class OutputBudget:
    """OUT's bound: OUTPUT_FLOOR_CHARS plus OUTPUT_CHARS_PER_INPUT_CHAR per character of input read so far."""

    def __init__(self) -> None:
        self.read = 0
        self.written = 0

    def count(self, lines: Iterable[Any]) -> Iterator[Any]:
        """``lines`` as they are, counted as they are read with their newline, once (a line too long to read
        counts as its limit)."""
        for line in lines:
            if isinstance(line, _TooLong):
                self.read += MAX_LINE_CHARS + 1
            else:
                self.read += len(line) + (not line.endswith(b"\n" if isinstance(line, bytes) else "\n"))
            yield line

    def limit(self) -> int:
        """The most characters the next record's line may have, its newline left out."""
        left = OUTPUT_FLOOR_CHARS + OUTPUT_CHARS_PER_INPUT_CHAR * self.read - self.written - 1
        return max(0, min(MAX_RECORD_CHARS, left))


class Summary:
    """What summary_table needs of each record, accumulated without keeping the records."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.bad = 0

    def add(self, r: dict[str, Any]) -> None:
        if "error" in r and "reward" not in r:
            self.bad += 1
            self.rows.append({"error": True})
        else:
            self.rows.append(
                {
                    "id": r["id"],
                    "category": r.get("category"),
                    "reward": r["reward"],
                    "official_valid": r["official_valid"],
                }
            )


def write_scores(
    records: Iterable[dict[str, Any]], out_path: Path | None, budget: OutputBudget | None = None
) -> Summary:
    """Stream records to ``out_path`` through ``OUT.partial`` (renamed at the end); returns the summary.
    With ``budget`` (which counted the lines the records came from) OUT stays within its bound."""
    summary = Summary()
    if out_path is None:
        for r in records:
            summary.add(r)
        return summary
    partial = out_path.with_name(out_path.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        for r in records:
            line = bounded_record(r, MAX_RECORD_CHARS if budget is None else budget.limit()) + "\n"
            if budget is not None:
                budget.written += len(line)
            out.write(line)
            out.flush()
            summary.add(r)
    os.replace(partial, out_path)
    return summary


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
        if "error" in r and "reward" not in r or r.get("error") is True:
            stats["(unscorable lines)"].errors += 1
            continue
        category = r.get("category") or next((c for c in CATEGORIES if r["id"].startswith(f"multi_turn_{c}_")), "other")
        for key in (category, "overall"):
            s = stats[key]
            s.n += 1
            s.reward += r["reward"]
            s.official += bool(r["official_valid"])
    rows = ["| category | entries | reward (%) | official accuracy (%) |", "|---|---:|---:|---:|"]
    own = sorted(c for c in stats if c not in (*CATEGORIES, "other", "overall", "(unscorable lines)"))  # a plugin's
    order = [c for c in (*CATEGORIES, *own, "other", "overall") if c in stats]
    for key in order:
        s = stats[key]
        rows.append(f"| {key} | {s.n} | {100 * s.reward / s.n:.2f} | {100 * s.official / s.n:.2f} |")
    if "(unscorable lines)" in stats:
        rows.append(f"| unscorable lines | {stats['(unscorable lines)'].errors} | - | - |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the command: rcgrpo score


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rcgrpo score",
        description="score recorded tool calls with the paper's reward and BFCL's checker (docs/scoring.md)",
    )
    p.add_argument("input", nargs="?", help='JSONL of {"id", "turns": [[call, ...], ...]}')
    p.add_argument("output", nargs="?", help="JSONL of per-line scores (omit to print only the summary)")
    p.add_argument("--ground-truth", action="store_true", help="score the ground truth itself (a self-check)")
    p.add_argument("--categories", nargs="+", help="restrict to these BFCL categories (default: all four)")
    p.add_argument(
        "--task-source",
        default="bfcl",
        help="the registered task source whose tasks the lines name "
        "(default bfcl: BFCL v4 multi-turn; bfcl_micro; a plugin's, with --plugins)",
    )
    p.add_argument(
        "--plugins", nargs="+", metavar="MODULE", help="modules to import first (they may register a task source)"
    )
    p.add_argument(
        "--arg-types",
        choices=("bfcl", "strict"),
        default="bfcl",
        help="argument type checking: 'bfcl' lets the API judge (leaderboard behaviour), "
        "'strict' rejects values that do not match the documented type",
    )
    p.add_argument("--summary", action="store_true", help="print the per-category table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _score(args: argparse.Namespace) -> int:
    from nemo_rcgrpo.utils.run_command import run_command

    return run_command(lambda: _score_lines(args))


def _score_lines(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from nemo_rcgrpo.envs.sources import make_suite
    from nemo_rcgrpo.registry import load_plugins
    from nemo_rcgrpo.utils.run_command import CommandError

    load_plugins(args.plugins or [])
    suite = make_suite(args.task_source, args.categories or CATEGORIES)
    source = None
    if args.ground_truth:
        lines: Any = ground_truth_lines(suite)
        total = len(suite)
    elif args.input:
        try:
            source = Path(args.input).open("rb")
        except OSError as e:
            raise CommandError(f"cannot read {args.input}: {e.strerror}") from None
        lines, total = read_lines(source), None
    else:
        raise CommandError("give IN.jsonl (and OUT.jsonl), or --ground-truth")
    out_path = Path(args.output) if args.output else None
    if out_path is not None:
        if out_path.is_dir():
            if source is not None:
                source.close()
            raise CommandError(f"OUT {out_path} is a directory; give a file path")
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            probe = out_path.with_name(out_path.name + ".partial")
            probe.open("w").close()
        except OSError as e:
            if source is not None:
                source.close()
            raise CommandError(f"cannot write {out_path}: {e.strerror or e}") from None
    try:
        progress = tqdm(lines, desc="scoring", unit="traj", total=total, file=sys.stderr, disable=args.quiet)
        budget = OutputBudget()  # OUT is bounded in proportion to the input (docs/scoring.md)
        summary = write_scores(score_lines(suite, budget.count(progress), arg_types=args.arg_types), out_path, budget)
    except OSError as e:
        raise CommandError(f"while scoring: {e.strerror or e}") from None
    finally:
        if source is not None:
            source.close()
    if args.summary or not args.output:
        print(summary_table(summary.rows))
    if summary.bad:
        print(f"{summary.bad} line(s) could not be scored (see 'error' in the output)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``rcgrpo score [IN.jsonl [OUT.jsonl]] [--ground-truth] ...`` (registered as the command ``score``)."""
    return _score(build_parser().parse_args(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
