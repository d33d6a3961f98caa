"""``protocol=bfcl``: the leaderboard's number. Message-level policies (endpoint, oracle, null) play BFCL's own
multi-turn FC pipeline (`envs/bfcl/official.py`: BFCL's requests, tool schemas, held-out turns, decoding, step
limit and checker), and the run also writes BFCL's result files, which BFCL's own `bfcl evaluate` scores to the
same accuracies (tests/functional/test_bfcl_oracle.py checks both against BFCL's code).

Scores are BFCL's: accuracy per category, and "Multi Turn Overall Acc", the unweighted mean of the four
categories with a category not run counted as 0. A run on fewer than all 800 entries says that its overall is
not the leaderboard's.
"""

from __future__ import annotations

import json
import statistics
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

from nemo_rcgrpo.envs.bfcl.official import BFCL_TEMPERATURE, BFCL_VERSION, InferenceError, Respond, bfcl, play_entry
from nemo_rcgrpo.envs.bfcl.reward import compute_reward
from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, BFCLTask
from nemo_rcgrpo.evaluation.agents import EpisodeRefused

# the handler BFCL runs for an OpenAI-compatible FC endpoint of unknown family, and its name in BFCL's code
OPENAI_FC_HANDLER = "OpenAICompletionsHandler"
ENTRIES_PER_CATEGORY = 200


def _usage(message: dict) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}}


def oracle_responder(task: BFCLTask, closing: Callable[[int], str]) -> Respond:
    """The ground truth: a turn's gold calls in one message, then a closing text."""
    from nemo_rcgrpo.envs.bfcl.calls import parse_call_string
    from nemo_rcgrpo.envs.bfcl.executor import named_arguments

    def respond(body: dict, turn: int, step: int) -> dict:
        gold = task.ground_truth[turn] if turn < len(task.ground_truth) else ()
        if step == 0 and gold:
            calls = [parse_call_string(c) for c in gold]
            return _usage({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{turn}_{i}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(named_arguments(task.tool(c.name), c))}}
                for i, c in enumerate(calls)]})
        return _usage({"role": "assistant", "content": closing(turn)})

    return respond


def null_responder(task: BFCLTask) -> Respond:
    return lambda body, turn, step: _usage({"role": "assistant", "content": "I will not use any tools."})


def endpoint_responder(cfg) -> Respond:
    """BFCL's request as it is, posted to the endpoint (with the endpoint's retries for a busy or dead server; a
    refused request is BFCL's inference error for the entry)."""
    from nemo_rcgrpo.evaluation.endpoint import EndpointAgent

    agent = EndpointAgent(cfg.endpoint, temperature=BFCL_TEMPERATURE, top_p=1.0, max_new_tokens=1)

    def respond(body: dict, turn: int, step: int) -> Any:
        try:
            return agent._post(body)
        except EpisodeRefused as e:
            raise InferenceError(str(e)) from None

    return respond


class LeaderboardPolicy:
    """A message-level policy through BFCL's pipeline (`play_entry`), one entry per thread."""

    def __init__(self, cfg, make_responder: Callable[[BFCLTask], Respond], concurrency: int, description: dict,
                 model_name: str, reward_token: bool | None = None, goal=None):
        self.cfg, self.make_responder, self.concurrency = cfg, make_responder, concurrency
        self.model_name, self.reward_token, self.goal = model_name, reward_token, goal
        self.temperature = cfg.temperature if cfg.temperature > 0 else BFCL_TEMPERATURE
        differs = []
        if reward_token is not None:
            differs.append("the reward goal in the first user message")
        if cfg.max_steps != bfcl().max_steps:
            differs.append(f"max_steps={cfg.max_steps} (BFCL: {bfcl().max_steps})")
        self.description = {**description, "pipeline": f"bfcl-eval {BFCL_VERSION} multi-turn FC",
                            "handler": OPENAI_FC_HANDLER, "temperature": self.temperature,
                            "requests_differ_from_bfcl": differs}

    def run(self, suite, task_ids: list[str], sample: int, seed: int, on_done: Callable,
            only: set[str] | None = None) -> list[dict]:
        from nemo_rcgrpo.evaluation.policies import _record

        for t in task_ids:
            suite.gold(t)  # memoised before the threads start
        token = None if self.reward_token is None else ("high" if self.reward_token else "low")
        edit = None if self.reward_token is None else (lambda msgs: self.goal.apply(list(msgs), self.reward_token))

        def one(index: int, task_id: str) -> dict:
            task = suite[task_id]
            gold = suite.gold(task)
            run = play_entry(task, gold, self.make_responder(task), model_name=self.model_name,
                             temperature=self.temperature, max_steps=self.cfg.max_steps, edit_first_turn=edit)
            reward = compute_reward(run.executor.instances, run.executor.executed, gold,
                                    truncated=run.inference_error, reward=self.cfg.reward)
            v = run.verdict
            rec = _record(self.cfg, task, sample, seed + index, token, reward=reward.value, official_valid=v.valid,
                          official_error=None if v.valid else f"{v.error_type}: {v.error_message}",
                          truncated=run.inference_error, details=reward.details, num_turns=run.requests,
                          tool_errors=sum(o.startswith("Error") for step in run.observations for o in step),
                          generated_tokens=sum(t for turn in run.output_token_count for t in turn
                                               if isinstance(t, int)),
                          calls=_calls(run.result),
                          observations=run.observations,
                          extra={"messages": run.messages, "force_quit": run.force_quit,
                                 "bfcl_result": run.result_line(task_id)})
            on_done(rec)
            return rec

        jobs = [(i, t) for i, t in enumerate(task_ids) if only is None or t in only]
        if self.concurrency == 1:
            return [one(i, t) for i, t in jobs]
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(one, i, t) for i, t in jobs]
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in futures:  # the first failure (a dead endpoint) is raised here
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()
            return [f.result() for f in futures]

    def close(self) -> None:
        pass


def _calls(result: list | str) -> list[list[dict]]:
    """Per step, the calls a message wrote ({name, arguments} as sent), as episode records list them."""
    if not isinstance(result, list):
        return []
    return [[{"name": n, "arguments": a} for d in step if isinstance(d, dict) for n, a in d.items()]
            if isinstance(step, list) else [] for turn in result for step in turn]


# ---------------------------------------------------------------------- BFCL's scores and files
def bfcl_scores(records: list[dict], samples: int = 1) -> dict[str, Any]:
    """BFCL's accuracies in percent: per category (entries run), and "Multi Turn Overall Acc" over the four
    categories, a category not run counting 0. ``leaderboard``: whether this run is the leaderboard's (all 800
    entries, one sample each)."""
    by_cat: dict[str, list[float]] = {}
    for r in records:
        by_cat.setdefault(r["category"], []).append(float(r["success"]))
    per_cat = {c: 100.0 * statistics.fmean(by_cat[c]) if c in by_cat else 0.0 for c in CATEGORIES}
    counts = {c: len({r["task_id"] for r in records if r["category"] == c}) for c in CATEGORIES}
    complete = all(n == ENTRIES_PER_CATEGORY for n in counts.values()) and samples == 1
    note = None if complete else (
        f"not the leaderboard's overall: {sum(counts.values())} of {ENTRIES_PER_CATEGORY * len(CATEGORIES)} entries "
        f"({', '.join(f'{c} {n}' for c, n in counts.items())})" + (f", {samples} samples" if samples > 1 else "")
        + "; categories not run count 0, as BFCL counts them")
    return {"multi_turn_overall": statistics.fmean(per_cat.values()), "categories": per_cat, "entries": counts,
            "leaderboard": complete, **({"note": note} if note else {})}


def registry_name(cfg) -> str:
    """The folder (BFCL's registry name) the result files go under: ``bfcl_registry``, else the served model."""
    return cfg.bfcl_registry or cfg.endpoint.model or cfg.policy


def write_result_files(root: Path, registry: str, records: list[dict]) -> list[Path]:
    """BFCL's result folder: ``root/<registry with / as _>/multi_turn/BFCL_v4_multi_turn_<category>_result.json``,
    one JSON line per entry, sorted as BFCL sorts them (sample 0 only: BFCL runs one)."""
    lines: dict[str, list[dict]] = {}
    for r in records:
        if r.get("sample", 0) == 0 and "bfcl_result" in r:
            lines.setdefault(r["category"], []).append(r["bfcl_result"])
    folder = root / registry.replace("/", "_") / "multi_turn"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for category, rows in lines.items():
        path = folder / f"BFCL_v4_multi_turn_{category}_result.json"
        rows = sorted(rows, key=bfcl().sort_key)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        written.append(path)
    return written
