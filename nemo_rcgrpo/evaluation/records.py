"""One evaluated episode's record (a line of trajectories.jsonl) and the reason it failed, as every policy writes
them (`policies.py` for the message-level and checkpoint policies, `envs/bfcl/leaderboard.py` for BFCL's pipelines)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from nemo_rcgrpo.envs.interfaces import Task
from nemo_rcgrpo.rollout.record import EpisodeRecord


def failure_reason(
    protocol: str, *, success: bool, truncated: str | None, official_error: str | None, details: dict[str, Any]
) -> str | None:
    if success:
        return None
    if protocol == "bfcl" and official_error:
        return official_error
    if truncated:
        return f"truncated: {truncated}"
    parts = []
    diffs = details.get("state_differences") or {}
    if diffs:
        parts.append(f"final state differs ({', '.join(sorted(diffs))})")
    missing = details.get("missing_actions") or []
    if missing:
        parts.append(f"{len(missing)} gold action(s) missing, first: {missing[0]}")
    return "; ".join(parts) or "reward 0"


def episode_record(
    cfg,
    task: Task,
    sample: int,
    seed: int,
    reward_token: str | None,
    *,
    reward,
    official_valid,
    official_error,
    truncated,
    details,
    num_turns,
    tool_errors,
    generated_tokens,
    calls,
    observations,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The episode's line of trajectories.jsonl: the one episode record (`rollout/record.py`) of every dump.
    ``extra``: what the policy adds; a key that names a field (messages, prompt, ...) fills it."""
    success = bool(official_valid) if cfg.protocol == "bfcl" else reward == 1.0
    names = {f.name for f in fields(EpisodeRecord)} - {"extra"}
    record = EpisodeRecord(
        task_id=task.id,
        category=task.category,
        reward=reward,
        reward_token=reward_token,
        turns=calls,
        official_valid=official_valid,
        truncated=truncated,
        num_turns=num_turns,
        tool_errors=tool_errors,
        generated_tokens=generated_tokens,
        reward_details=details or {},
        sample=sample,
        seed=seed,
        success=success,
        failure_reason=failure_reason(
            cfg.protocol, success=success, truncated=truncated, official_error=official_error, details=details
        ),
        observations=observations,
        extra={k: v for k, v in extra.items() if k not in names},
    )
    for key, value in extra.items():
        if key in names:
            setattr(record, key, value)
    return record.to_json()


def run_episodes(one, task_ids: list[str], only: set[str] | None, concurrency: int) -> list[dict[str, Any]]:
    """``one(index, task_id)`` for the tasks of ``task_ids`` in ``only`` (all without it), on ``concurrency`` threads,
    records in task order; the first failure (a dead endpoint) cancels what has not started and is raised."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    jobs = [(i, t) for i, t in enumerate(task_ids) if only is None or t in only]
    if concurrency == 1:
        return [one(i, t) for i, t in jobs]
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, i, t) for i, t in jobs]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]
