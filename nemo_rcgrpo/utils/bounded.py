"""Records written as bounded JSON lines: tool results clipped, longest first, until the line fits its cap.

An environment caps each tool result (BFCL: ``max_observation_chars``, 64 Ki characters) and the calls of a message
(``max_calls_per_step``, 128), but a rollout records its last message's results before the context-budget check
ends it, so one record could reach about 8 MB. The dumps (``rollouts/step_N.jsonl``, ``eval/step_N.jsonl``, `rcgrpo
eval`'s ``trajectories.jsonl``) write each record through `bounded_line`, and `rcgrpo score` its output through
`clip_observations` under its own bound: past its cap
every tool result longer than some length ``keep`` (the largest that fits) is cut to ``keep`` characters and ends in
``... [clipped N characters]``, shorter ones are whole, and the record says ``"observations_clipped": true``.

Tool results are the strings of ``observations`` (per message, a list) and the ``content`` of the ``role: tool``
entries of ``messages``, the two places a record holds them. Nothing else is clipped: rewards, calls and what the
model wrote stay whole, and the reward and training never see a dump.

A dump record's cap (`dump_cap`) follows what the model generated: ``DUMP_FLOOR_CHARS`` plus
``DUMP_CHARS_PER_GENERATED_CHAR`` per character of its assistant messages (their text and calls), at most
``MAX_DUMP_RECORD_CHARS``.
"""

from __future__ import annotations

import json
from typing import Any

CLIPPED_FLAG = "observations_clipped"
MIN_CLIPPED_CHARS = 32  # a tool result is not cut shorter than this (its marker takes about 30)
# a dump record: a floor that holds any gold episode whole (the longest, long_context, about 150 K characters),
# plus room for what the model's calls could fetch, at most a ceiling (about 7 x the longest gold episode)
DUMP_FLOOR_CHARS = 262_144
DUMP_CHARS_PER_GENERATED_CHAR = 64
MAX_DUMP_RECORD_CHARS = 1_048_576


def clip(text: str, keep: int) -> str:
    """``text``, or its first ``keep`` characters and the marker saying how many were cut (when that is shorter)."""
    if len(text) <= keep:
        return text
    cut = text[:keep] + f"... [clipped {len(text) - keep} characters]"
    return cut if len(cut) < len(text) else text


def _tool_results(record: dict[str, Any]) -> list[str]:
    texts = [
        o for turn in record.get("observations") or () if isinstance(turn, list) for o in turn if isinstance(o, str)
    ]
    texts += [
        m["content"]
        for m in record.get("messages") or ()
        if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("content"), str)
    ]
    return texts


def _clipped(record: dict[str, Any], keep: int) -> dict[str, Any]:
    """A copy of ``record`` with every tool result cut to ``keep`` characters, flagged when one was (the record
    itself is not changed)."""
    cut = False

    def one(text: Any) -> Any:
        nonlocal cut
        if not isinstance(text, str):
            return text
        short = clip(text, keep)
        cut = cut or short is not text
        return short

    out = dict(record)
    if isinstance(record.get("observations"), list):
        out["observations"] = [
            [one(o) for o in turn] if isinstance(turn, list) else turn for turn in record["observations"]
        ]
    if isinstance(record.get("messages"), list):
        out["messages"] = [
            {**m, "content": one(m.get("content"))}
            if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("content"), str)
            else m
            for m in record["messages"]
        ]
    if cut:
        out[CLIPPED_FLAG] = True
    return out


def clip_observations(record: dict[str, Any], limit: int, min_keep: int = MIN_CLIPPED_CHARS) -> str | None:
    """``record`` as one JSON line of at most ``limit`` characters, its tool results clipped longest first: the
    largest ``keep >= min_keep`` whose clipped line fits (found by bisection). None when even ``min_keep`` does
    not fit, or the record has no tool result to clip."""
    text = json.dumps(record, default=str)
    if len(text) <= limit:
        return text
    texts = _tool_results(record)
    if not texts:
        return None
    lo, hi = min_keep, min(max(map(len, texts)), limit)  # every text longer than keep is cut to keep
    best = json.dumps(_clipped(record, lo), default=str)
    if len(best) > limit:
        return None
    while lo < hi:  # invariant: keep=lo fits
        mid = (lo + hi + 1) // 2
        line = json.dumps(_clipped(record, mid), default=str)
        if len(line) <= limit:
            lo, best = mid, line
        else:
            hi = mid - 1
    return best


def generated_chars(record: dict[str, Any]) -> int:
    """Characters of the record's assistant messages: their text and their calls (as JSON)."""
    total = 0
    for m in record.get("messages") or ():
        if isinstance(m, dict) and m.get("role") == "assistant":
            content = m.get("content")
            if content:
                total += len(content) if isinstance(content, str) else len(json.dumps(content, default=str))
            total += len(json.dumps(m.get("tool_calls") or [], default=str))
    return total


def dump_cap(record: dict[str, Any]) -> int:
    return min(MAX_DUMP_RECORD_CHARS, DUMP_FLOOR_CHARS + DUMP_CHARS_PER_GENERATED_CHAR * generated_chars(record))


def bounded_line(record: dict[str, Any], limit: int | None = None) -> str:
    """One dump line for ``record`` (no newline): as it is when it fits ``limit`` (default: `dump_cap`), else its
    tool results clipped to fit; when even ``MIN_CLIPPED_CHARS`` of each does not fit (the rest of the record is
    longer than the cap: a very long prompt or generation), each is cut to that and the line is written as it is."""
    if limit is None:
        line = json.dumps(record, default=str)
        if len(line) <= DUMP_FLOOR_CHARS:  # every record's cap is at least the floor
            return line
        limit = dump_cap(record)
    line = clip_observations(record, limit)
    if line is not None:
        return line
    return json.dumps(_clipped(record, MIN_CLIPPED_CHARS), default=str)
