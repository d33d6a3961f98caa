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
import sys
from pathlib import Path
from typing import Any, Callable

from nemo_rcgrpo.envs.bfcl.official import BFCL_TEMPERATURE, BFCL_VERSION, InferenceError, Respond, bfcl, play_entry
from nemo_rcgrpo.envs.bfcl.reward import compute_reward
from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, BFCLTask
from nemo_rcgrpo.evaluation.agents import EpisodeRefused
from nemo_rcgrpo.evaluation.records import episode_record, run_episodes

# the handler BFCL runs for an OpenAI-compatible FC endpoint of unknown family, and its name in BFCL's code
OPENAI_FC_HANDLER = "OpenAICompletionsHandler"
ENTRIES_PER_CATEGORY = 200


def request_temperature(cfg) -> float:
    """What BFCL sends: its default 0.001 where ``temperature`` is 0 (greedy is not a BFCL setting)."""
    return cfg.temperature if cfg.temperature > 0 else BFCL_TEMPERATURE


def _fatal() -> tuple[type, ...]:
    """What stops an evaluation instead of failing one entry: a server that does not answer at all, a generator
    that is gone or out of memory (every later entry would fail the same way)."""
    import torch

    from nemo_rcgrpo.evaluation.endpoint import EndpointUnavailable
    from nemo_rcgrpo.generation.vllm_client import GeneratorError

    return (EndpointUnavailable, GeneratorError, MemoryError, torch.cuda.OutOfMemoryError)


def _post(agent, body: dict) -> Any:
    """One request with the endpoint's retries. A refused request, or an answer later than ``endpoint.timeout``
    on every attempt, is the entry's inference error (BFCL's client raises out of the entry alike); a server that
    cannot be reached stops the run."""
    from nemo_rcgrpo.evaluation.endpoint import EndpointUnavailable

    try:
        return agent._post(body)
    except EpisodeRefused as e:
        raise InferenceError(str(e)) from None
    except EndpointUnavailable as e:
        if e.timed_out:
            raise InferenceError(str(e)) from None
        raise


def fc_policy(
    cfg,
    make_responder: Callable[[BFCLTask], Respond],
    concurrency: int,
    description: dict,
    model_name: str,
    reward_token: bool | None = None,
    goal=None,
) -> "LeaderboardPolicy":
    """oracle, null or an endpoint through BFCL's OpenAI-compatible FC handler."""

    def play(task, gold, edit):
        return play_entry(
            task,
            gold,
            make_responder(task),
            model_name=model_name,
            temperature=request_temperature(cfg),
            max_steps=cfg.max_steps,
            edit_first_turn=edit,
            fatal=_fatal(),
        )

    return LeaderboardPolicy(
        cfg,
        play,
        concurrency,
        description,
        handler=OPENAI_FC_HANDLER,
        pipeline="multi-turn FC",
        reward_token=reward_token,
        goal=goal,
    )


def _usage(message: dict) -> dict:
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0},
    }


def oracle_responder(task: BFCLTask, closing: Callable[[int], str]) -> Respond:
    """The ground truth: a turn's gold calls in one message, then a closing text."""
    from nemo_rcgrpo.envs.bfcl.executor import named_arguments
    from nemo_rcgrpo.envs.calls import parse_call_string

    def respond(body: dict, turn: int, step: int) -> dict:
        gold = task.ground_truth[turn] if turn < len(task.ground_truth) else ()
        if step == 0 and gold:
            calls = [parse_call_string(c) for c in gold]
            return _usage(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{turn}_{i}",
                            "type": "function",
                            "function": {
                                "name": c.name,
                                "arguments": json.dumps(named_arguments(task.tool(c.name), c)),
                            },
                        }
                        for i, c in enumerate(calls)
                    ],
                }
            )
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
        return _post(agent, body)

    return respond


class LeaderboardPolicy:
    """A policy through one of BFCL's pipelines, one entry per thread: ``play(task, gold, edit_first_turn)`` plays
    an entry (`play_entry` for the FC handler, `local.play_entry_local` for a local handler)."""

    def __init__(
        self,
        cfg,
        play: Callable,
        concurrency: int,
        description: dict,
        *,
        handler: str,
        pipeline: str,
        reward_token: bool | None = None,
        goal=None,
    ):
        self.cfg, self.play, self.concurrency = cfg, play, concurrency
        self.reward_token, self.goal = reward_token, goal
        differs = []
        if reward_token is not None:
            differs.append("the reward goal in the first user message")
        if cfg.max_steps != bfcl().max_steps:
            differs.append(f"max_steps={cfg.max_steps} (BFCL: {bfcl().max_steps})")
        self.description = {
            **description,
            "pipeline": f"bfcl-eval {BFCL_VERSION} {pipeline}",
            "handler": handler,
            "temperature": request_temperature(cfg),
            "requests_differ_from_bfcl": differs,
        }

    def run(
        self, suite, task_ids: list[str], sample: int, seed: int, on_done: Callable, only: set[str] | None = None
    ) -> list[dict]:

        for t in task_ids:
            suite.gold(t)  # memoised before the threads start
        token = None if self.reward_token is None else ("high" if self.reward_token else "low")
        edit = None if self.reward_token is None else (lambda msgs: self.goal.apply(list(msgs), self.reward_token))

        def one(index: int, task_id: str) -> dict:
            task = suite[task_id]
            gold = suite.gold(task)
            run = self.play(task, gold, edit)
            reward = compute_reward(
                run.executor.instances,
                run.executor.executed,
                gold,
                truncated=run.inference_error,
                reward=self.cfg.reward,
            )
            v = run.verdict
            rec = episode_record(
                self.cfg,
                task,
                sample,
                seed + index,
                token,
                reward=reward.value,
                official_valid=v.valid,
                official_error=None if v.valid else f"{v.error_type}: {v.error_message}",
                truncated=run.inference_error,
                details=reward.details,
                num_turns=run.requests,
                tool_errors=sum(o.startswith("Error") for step in run.observations for o in step),
                generated_tokens=sum(t for turn in run.output_token_count for t in turn if isinstance(t, int)),
                calls=_calls(run.result),
                observations=run.observations,
                extra={
                    "messages": run.messages,
                    "force_quit": run.force_quit,
                    "bfcl_result": run.result_line(task_id),
                    # BFCL's local handlers: the first prompt (later ones extend it)
                    **({"prompt": run.prompts[0]} if run.prompts else {}),
                },
            )
            on_done(rec)
            return rec

        return run_episodes(one, task_ids, only, self.concurrency)

    def close(self) -> None:
        pass


def _calls(result: list | str) -> list[list[dict]]:
    """Per step, the calls a message wrote ({name, arguments} as sent), as episode records list them."""
    if not isinstance(result, list):
        return []
    return [
        [{"name": n, "arguments": a} for d in step if isinstance(d, dict) for n, a in d.items()]
        if isinstance(step, list)
        else []
        for turn in result
        for step in turn
    ]


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
    note = (
        None
        if complete
        else (
            f"not the leaderboard's overall: {sum(counts.values())} of {ENTRIES_PER_CATEGORY * len(CATEGORIES)} entries "
            f"({', '.join(f'{c} {n}' for c, n in counts.items())})"
            + (f", {samples} samples" if samples > 1 else "")
            + "; categories not run count 0, as BFCL counts them"
        )
    )
    return {
        "multi_turn_overall": statistics.fmean(per_cat.values()),
        "categories": per_cat,
        "entries": counts,
        "leaderboard": complete,
        **({"note": note} if note else {}),
    }


def registry_name(cfg) -> str:
    """The folder (BFCL's registry name) the result files go under: ``bfcl_registry``; else, for a local handler,
    the name in BFCL's model table that uses that handler (so `bfcl evaluate --model` finds it), else the served
    model."""
    from nemo_rcgrpo.envs.bfcl.local import HANDLERS

    local = local_handler(cfg)
    return cfg.bfcl_registry or (HANDLERS[local][2] if local else None) or cfg.endpoint.model or cfg.policy


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


# ---------------------------------------------------------------------- BFCL's local handlers
def _context(model_dir, tokenizer) -> int:
    """BFCL's max_context_length: the config's max_position_embeddings, else the tokenizer's model_max_length."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if getattr(config, "max_position_embeddings", None) is not None:
        return int(config.max_position_embeddings)
    if tokenizer.model_max_length is not None:
        return int(tokenizer.model_max_length)
    raise ValueError(
        f"{model_dir}: neither max_position_embeddings nor a tokenizer model_max_length says the "
        "model's context (BFCL needs one)"
    )


def _local_policy(
    cfg, complete, tokenizer, context: int, concurrency: int, description: dict, reward_token, goal
) -> LeaderboardPolicy:
    from nemo_rcgrpo.envs.bfcl.local import BFCL_MODEL_NAMES, HANDLERS, play_entry_local

    name = local_handler(cfg)

    def play(task, gold, edit):
        return play_entry_local(
            task,
            gold,
            complete,
            handler_name=name,
            model_name=BFCL_MODEL_NAMES[name],
            count_tokens=lambda text: len(tokenizer.tokenize(text)),
            context=context,
            max_steps=cfg.max_steps,
            edit_first_turn=edit,
            fatal=_fatal(),
        )

    return LeaderboardPolicy(
        cfg,
        play,
        concurrency,
        description,
        handler=HANDLERS[name][1],
        pipeline="multi-turn prompting (local model, /v1/completions)",
        reward_token=reward_token,
        goal=goal,
    )


def endpoint_local_policy(cfg, folder, description: dict, reward_token, goal) -> LeaderboardPolicy:
    """A served checkpoint as BFCL runs a local model: its handler's prompt text to ``/v1/completions``."""
    from nemo_rcgrpo.evaluation.endpoint import EndpointAgent
    from nemo_rcgrpo.models.hf import load_tokenizer

    if folder is None:
        raise FileNotFoundError(
            f"bfcl_handler={local_handler(cfg)} counts prompt tokens with the served model's "
            "tokenizer: set endpoint.model_path to its folder"
        )
    tokenizer = load_tokenizer(str(folder))
    context = _context(folder, tokenizer)
    agent = EndpointAgent(cfg.endpoint, temperature=BFCL_TEMPERATURE, top_p=1.0, max_new_tokens=1)
    agent.url = cfg.endpoint.url.rstrip("/") + "/completions"

    def complete(prompt: str, max_tokens: int, turn: int, step: int) -> tuple:
        body = {
            "model": cfg.endpoint.model,
            "temperature": request_temperature(cfg),
            "prompt": prompt,
            "max_tokens": max_tokens,
        }
        reply = _post(agent, body)
        try:
            usage = reply["usage"]
            return reply["choices"][0]["text"], usage["prompt_tokens"], usage["completion_tokens"]
        except (KeyError, IndexError, TypeError) as e:
            raise InferenceError(f"the reply has no choices[0].text or usage ({type(e).__name__}: {e})") from None

    return _local_policy(cfg, complete, tokenizer, context, cfg.endpoint.concurrency, description, reward_token, goal)


def checkpoint_local_policy(cfg, checkpoint) -> LeaderboardPolicy:
    """A checkpoint (`policies.CheckpointPolicy`'s model and generator) as BFCL runs a local model: its handler's
    prompt text, tokenized as vLLM's completions endpoint tokenizes it (special tokens added), sampled at BFCL's
    temperature up to BFCL's max_tokens, the text decoded as vLLM returns it (special tokens skipped)."""
    from nemo_rcgrpo.generation.base import SamplingParams

    tokenizer, generator = checkpoint.tokenizer, checkpoint.generator
    context = _context(checkpoint.model_path, tokenizer)
    served = cfg.generation.vllm.max_model_len  # set only for a server that holds less than the model's context
    if served and served < context:  # BFCL's own server would hold the model's whole context
        context = served
        checkpoint.description["context_below_the_models"] = served
    stops = _eos_ids(checkpoint.model_path, tokenizer)
    seed = [cfg.seed]

    def complete(prompt: str, max_tokens: int, turn: int, step: int) -> tuple:
        ids = tokenizer(prompt).input_ids
        if max_tokens < 1 or len(ids) + max_tokens > context:  # vLLM refuses it (HTTP 400): an inference error
            raise InferenceError(
                f"the prompt is {len(ids)} tokens and max_tokens {max_tokens}; the model's context is {context}"
            )
        seed[0] += 1
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=request_temperature(cfg), stop_token_ids=stops, seed=seed[0]
        )
        [done] = generator.generate([ids], params)
        text = tokenizer.decode(done.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text, len(ids), len(done.token_ids)

    local = _local_policy(
        cfg, complete, tokenizer, context, 1, checkpoint.description, checkpoint.reward_token, checkpoint.goal
    )
    local.close = checkpoint.close
    return local


def _eos_ids(model_dir, tokenizer) -> tuple[int, ...]:
    """The ids a vLLM server stops at: the generation config's eos_token_id(s) and the tokenizer's."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True).eos_token_id
    except OSError:
        eos = None
    ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))


# ---------------------------------------------------------------------- the pipeline, as `rcgrpo eval` sees it
def local_handler(cfg) -> str | None:
    """The BFCL local handler that plays this policy under protocol=bfcl (llama3_1 | qwen_fc), or None: BFCL's
    OpenAI-compatible FC handler (endpoints, oracle, null) or the project's episodes (bfcl_handler=project)."""
    from nemo_rcgrpo.envs.bfcl.local import CHAT_FORMAT_HANDLERS, HANDLERS

    if cfg.policy not in ("checkpoint", "endpoint"):
        return None  # oracle and null (and a plugin's policy) speak whole messages
    if cfg.bfcl_handler in HANDLERS:
        return cfg.bfcl_handler
    if cfg.bfcl_handler == "auto" and cfg.policy == "checkpoint":
        return CHAT_FORMAT_HANDLERS.get(cfg.chat.format)
    return None


def bfcl_table(scores: dict[str, Any]) -> str:
    """BFCL's own numbers: accuracy per category and Multi Turn Overall Acc (a category not run counts 0)."""
    lines = ["", "BFCL's scores (its definitions):", "", "| category | entries | accuracy (%) |", "|---|---:|---:|"]
    lines += [f"| {c} | {scores['entries'][c]} | {a:.2f} |" for c, a in scores["categories"].items()]
    lines.append(
        f"| **Multi Turn Overall Acc** | {sum(scores['entries'].values())} | **{scores['multi_turn_overall']:.2f}** |"
    )
    if scores.get("note"):
        lines += ["", f"Note: {scores['note']}."]
    return "\n".join(lines) + "\n"


class BFCLPipeline:
    """BFCL's own multi-turn pipelines under ``protocol=bfcl`` on BFCL's entries (kind ``official_pipeline``,
    `evaluation/policies.py: OfficialPipeline`): the FC handler for whole-message policies, a local handler for a
    checkpoint or a served export of a known family; the project's per-turn episodes otherwise."""

    def policy(self, name: str, cfg, suite, context: dict[str, Any]):
        if name == "oracle":
            from nemo_rcgrpo.data.closing import ClosingTexts

            closing = ClosingTexts()
            return fc_policy(
                cfg,
                lambda task: oracle_responder(
                    task, lambda turn: closing.for_turn(task, turn, len(task.ground_truth[turn]))
                ),
                1,
                {"policy": "oracle"},
                model_name="oracle",
            )
        if name == "null":
            return fc_policy(cfg, null_responder, 1, {"policy": "null"}, model_name="null")
        if name == "endpoint":
            if local_handler(cfg) is not None:
                return endpoint_local_policy(
                    cfg, context["folder"], context["description"], context["reward_token"], context["goal"]
                )
            respond = endpoint_responder(cfg)
            return fc_policy(
                cfg,
                lambda task: respond,
                cfg.endpoint.concurrency,
                context["description"],
                model_name=cfg.endpoint.model,
                reward_token=context["reward_token"],
                goal=context["goal"],
            )
        if name == "checkpoint":
            if local_handler(cfg) is not None:
                return checkpoint_local_policy(cfg, context["build"]())
            if cfg.bfcl_handler == "auto":
                print(
                    f"warning: chat.format={cfg.chat.format} has no BFCL local handler: the checkpoint plays the "
                    "project's per-turn episodes, not BFCL's pipeline (its number is not the leaderboard's); "
                    "bfcl_handler=llama3_1 or qwen_fc picks one",
                    file=sys.stderr,
                )
        return None

    def finish(self, records: list[dict], cfg, out_dir: Path) -> tuple[str, dict, str] | None:
        """BFCL's scores and its result files (which `bfcl evaluate` scores the same), when its pipeline ran."""
        if not any("bfcl_result" in r for r in records):
            return None
        scores = bfcl_scores(records, cfg.samples)
        files = write_result_files(out_dir / "bfcl_result", registry_name(cfg), records)
        scores["result_files"] = [str(f.relative_to(out_dir)) for f in files]
        return (
            "bfcl",
            scores,
            bfcl_table(scores)
            + ("\nBFCL's result files: bfcl_result/ (`bfcl evaluate` scores them)\n" if files else ""),
        )
