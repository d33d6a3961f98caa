"""One episode record: what every dump writes of an episode, and what `rcgrpo report` reads.

Three writers, one type:

- training rollouts, ``rollouts/step_N.jsonl`` (`algorithms/rl_batch.py: write_rollouts`): ``step``, ``group``,
  ``advantage``, and the rendered ``prompt`` once per group and token (the others name its line,
  ``prompt_line``);
- in-training evaluation, ``eval/step_N.jsonl`` (`recipes/rl.py`): ``step`` and the ``prompt``;
- ``rcgrpo eval``, ``trajectories.jsonl`` (`evaluation/records.py`): ``sample``, ``seed``, ``success`` (the
  protocol's verdict), ``failure_reason``, the tool results per message (``observations``), and what an official
  pipeline adds (BFCL's: ``bfcl_result``, ``force_quit``) at the top level.

Every line holds every field (``null`` where the writer has none), so one reader serves all three. Dumps written
before this type load too (`EpisodeRecord.from_json`): an evaluation's ``calls`` are its ``turns``, ``details``
its ``reward_details``, and its ``text`` / ``calls`` / ``observations`` make its ``messages`` where it has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


@dataclass
class EpisodeRecord:
    task_id: str
    category: str
    reward: float
    reward_token: str | None = None  # high | low | None (no reward goal in the prompt)
    turns: list[list[dict[str, Any]]] = field(default_factory=list)  # per assistant message: its calls
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation after the prompt
    state_ok: bool | None = None
    actions_ok: bool | None = None
    official_valid: bool | None = None  # an external checker's verdict (BFCL's), where there is one
    truncated: str | None = None  # why the episode was cut short (reward 0)
    error: str | None = None  # an exception that ended this rollout alone
    num_turns: int = 0  # assistant messages
    tool_errors: int = 0
    rejected_messages: int = 0  # assistant messages the chat format's parser rejected whole
    generated_tokens: int = 0
    reward_details: dict[str, Any] = field(default_factory=dict)  # the env's reward components
    weight_version: int | None = None  # the generator's weights at the first turn
    turn_versions: list[int] = field(default_factory=list)  # ... and at each turn
    step: int | None = None  # training and in-training evaluation: the RL step (from 1)
    group: int | None = None  # training: the rollout's group in the step
    advantage: float | None = None  # training: its advantage
    sample: int | None = None  # rcgrpo eval: the sample index (pass@k) and the episode's seed
    seed: int | None = None
    success: bool | None = None  # the protocol's verdict (paper: reward 1; bfcl: the official checker's)
    failure_reason: str | None = None  # rcgrpo eval: why it failed, one line
    observations: list[list[str]] | None = None  # rcgrpo eval: the tool results of each assistant message
    prompt: str | None = None  # the rendered prompt (reward goal included)
    prompt_line: int | None = None  # training: the line (from 1) whose prompt this one shares
    extra: dict[str, Any] = field(default_factory=dict)  # what a pipeline adds, written at the top level

    def to_json(self) -> dict[str, Any]:
        """The dump line's object: every field, then ``extra``'s keys (which never replace a field)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> EpisodeRecord:
        """A dump line of any writer, this type's or one written before it (an evaluation's ``calls``,
        ``details`` and ``text``); keys that are not fields go to ``extra``."""
        record = dict(record)
        if "turns" not in record and "calls" in record:
            record["turns"] = record.pop("calls")
        if "reward_details" not in record and "details" in record:
            record["reward_details"] = record.pop("details")
        if record.get("messages") is None:  # an evaluation's texts, calls and tool results side by side
            texts = record.get("text") or []
            texts = texts if isinstance(texts, list) else [texts]
            calls, results = record.get("turns") or [], record.get("observations") or []
            messages: list[dict[str, Any]] = []
            for i, text in enumerate(texts):
                messages.append(
                    {"role": "assistant", "content": text, "tool_calls": calls[i] if i < len(calls) else []}
                )
                messages += [{"role": "tool", "content": r} for r in (results[i] if i < len(results) else [])]
            record["messages"] = messages
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in record.items() if k in names}
        for key, empty in (("turns", []), ("messages", []), ("reward_details", {}), ("turn_versions", [])):
            if known.get(key) is None:
                known[key] = empty
        for key in ("num_turns", "tool_errors", "rejected_messages", "generated_tokens"):
            if known.get(key) is None:
                known[key] = 0
        known.setdefault("task_id", None)
        known.setdefault("category", None)
        known.setdefault("reward", None)
        return cls(**known, extra={k: v for k, v in record.items() if k not in names})
