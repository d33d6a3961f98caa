"""Benchmark: the project's GRPO step against TRL's ``GRPOTrainer`` (trl==1.16.0) on the same multi-turn BFCL work,
each side in its own process, alternating.

The same work on both sides:

- the same model folder: a stage-1 export of ``sft_smollm_cpu`` trained until its rollouts call tools (48 steps at
  lr 5e-5 on 192 expert trajectories: SmolLM2-135M-Instruct with the project's hermes chat template and compact tool
  list; produced into ``outputs/bench/sft_smollm_cpu_tools`` where missing,
  ``--model`` points at another), fp32, HF generation (TRL: ``use_vllm=False``);
- the same BFCL multi-turn tasks in the same order (the project's per-epoch shuffle of its training tasks, the
  ``rcgrpo_smollm_cpu`` recipe's data and env: merged episodes, base category), played in the project's own BFCL
  env on both sides: TRL drives it through its ``environment_factory`` interface, one adapter class per task
  whose methods are the task's tools (``done`` included) and call the project's ``env.step``;
- the same G, tasks per step, new tokens per assistant message, assistant messages per rollout, temperature
  (top_p 1, no top-k), reward (the env's R = R_state x R_action, 0 for a truncated rollout), advantages over the
  group scaled by its std, the clipped surrogate (0.2) with token-level aggregation (TRL: ``loss_type="dapo"``),
  the k3 KL to the initial model with beta 0.1, lr 1e-6 constant, one optimizer step per batch (TRL:
  ``num_iterations=1``, ``per_device_train_batch_size x gradient_accumulation_steps`` = tasks x G), GRPO without
  reward tokens on the project's side (``stage=grpo``).

Two configurations: ``equal`` (one rollout per forward/backward on both sides: the project's
``trainer.micro_batch_size=1 trainer.micro_batch_tokens=null``, TRL's ``per_device_train_batch_size=1``) and ``fastest`` (each side's fastest
documented CPU setting: the project's defaults, whose ``trainer.micro_batch_tokens=auto`` puts a whole group in
one micro-batch, so that it computes its prompt once; TRL's group in one micro-batch (``--trl-fast-rows``, G by
default: tasks x G rows in one pass need more memory than this machine has once its KV cache is held) and generation
by transformers' continuous batching, ``use_transformers_continuous_batching``, TRL's documented speed-up for
generation without vLLM; its other documented ones, vLLM, Liger kernels and FlashAttention, need a GPU). A run that
fails (the kernel's OOM killer, an exception) is a row of the section with its peak RSS and the benchmark goes on;
only a side of ``equal`` (the row the ratio stands on) with no completed run stops it.

Every run is a child process (``--side project|trl``) that plays one warm-up step and ``--steps`` measured steps;
the parent alternates the sides (project, TRL, TRL, project, ...), records the machine's load before each run and
the child's peak RSS (``os.wait4``), checks that both sides played the same work and writes the section.

TRL is installed by this script into ``.bench/trl-1.16.0`` (``pip install --target``, git-ignored, never a
dependency of the project) with only the requirements the interpreter lacks, and runs on the same interpreter (the
same torch and transformers) with that folder on ``PYTHONPATH``.

Usage: python -m scripts.bench.peer_trl [--runs 2] [--steps 2] [--tasks 2] [--group-size 5] [--max-new-tokens 128]
       [--max-turns 4] [--model DIR] [--data DIR] [--configs equal,fastest] [--trl-fast-rows G] [--trl-kv-memory 0.2]
       [--record outputs/bench/peer_trl_runs.json] [--out docs/benchmarks.md]
       python -m scripts.bench.peer_trl --render outputs/bench/peer_trl_runs.json [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from scripts.bench._common import REPO, command_line, cpu_name, dist_version, emit

START, END = "<!-- bench:peer_trl:start -->", "<!-- bench:peer_trl:end -->"
TRL_VERSION = "1.16.0"
RECIPE = "rcgrpo_smollm_cpu"  # the CPU demo's RL recipe: its data, env, chat settings, lr
# stage 1 of the benchmark's model: the CPU SFT recipe, trained until its rollouts call tools (the CPU demo's
# rctp_smollm_cpu export, 8 steps at lr 1e-5, left SmolLM2 answering in prose: no tool call in 40 rollouts, so each
# step was single-turn GRPO; after these 48 steps, 15 of the 20 rollouts of two steps call tools, in up to 4
# messages and 7 calls); about 20 minutes
STAGE1 = "sft_smollm_cpu"
STAGE1_OVERRIDES = ("trainer.max_steps=48", "trainer.lr=5e-5", "data.max_examples=192", "trainer.save_every=48")
# what a done() call answers on TRL's side: the rollouts whose last tool result it is generate no further message
DONE_MARKER = "[episode over: done() was called]"
COMPARABLE_TOKENS = (2 / 3, 3 / 2)  # generated tokens per rollout, TRL over project, taken as comparable work
CONFIGS = ("equal", "fastest")
# the settings a record keeps: what the section states
RECORDED = (
    "model", "tasks", "group_size", "max_new_tokens", "max_turns", "temperature", "steps", "runs", "fast_tokens",
    "trl_fast_rows", "trl_kv_memory",
)  # fmt: skip
SIDES = ("project", "trl")


# --------------------------------------------------------------------------- the TRL side's env adapter (no TRL)


class EpisodeAdapter:
    """One rollout's BFCL episode as TRL's ``environment_factory`` wants it: ``reset(**row)`` opens the project's env
    on the class's task, and every public method (made by `adapter_class`) is one of the task's tools, run as one
    ``env.step`` call. TRL never ends an episode itself: a ``done()`` call marks it over (``finished``), after which
    calls run nothing and answer `DONE_MARKER`."""

    task_id: str = ""
    _open: Callable[[str], tuple[Any, list]] | None = None  # task id -> (env, opening messages)

    def reset(self, **row: Any) -> None:
        self.env, _ = type(self)._open(self.task_id)
        # the project's rollout engine ends an episode at rl.max_turns assistant messages, well before the env's
        # max_steps: TRL's calls come one at a time, so the env's own step count (per message) must not end it first
        self.env.max_steps = 1 << 30
        self.finished = False
        self.calls = 0
        return None  # the prompt is the dataset's: the env's opening messages

    def _call(self, name: str, kwargs: dict[str, Any]) -> str:
        from nemo_rcgrpo.types import ToolCall

        if self.finished or self.env.done:
            return DONE_MARKER
        self.calls += 1
        result = self.env.step([ToolCall(name, dict(kwargs))])
        if name == "done":
            self.finished = True
            return DONE_MARKER
        return result.observations[0].content if result.observations else ""


def _tool_method(name: str, schema: dict[str, Any]) -> Callable:
    def tool(self, **kwargs: Any) -> str:
        return self._call(name, kwargs)

    tool.__name__ = tool.__qualname__ = name  # what TRL dispatches a call by
    tool.__doc__ = schema["function"].get("description") or name
    tool.__tool_schema__ = schema  # the schema the project renders (`schema_of` hands it to transformers)
    return tool


def adapter_class(task_id: str, tools: Sequence[dict[str, Any]], opener: Callable[[str], tuple[Any, list]]) -> type:
    """An `EpisodeAdapter` subclass for one task whose methods are ``tools`` (OpenAI schemas, the env's order).
    TRL lists an env's methods by attribute name, alphabetically: the attributes are named ``t000, t001, ...`` in
    the env's order (each method's ``__name__`` is its tool's), so the tool list renders in the project's order."""
    ns: dict[str, Any] = {"task_id": task_id, "_open": staticmethod(opener)}
    for i, schema in enumerate(tools):
        ns[f"t{i:03d}"] = _tool_method(schema["function"]["name"], schema)
    safe = "".join(c if c.isalnum() else "_" for c in task_id)
    return type(f"BFCL_{safe}", (EpisodeAdapter,), ns)


def schema_of(original: Callable) -> Callable:
    """transformers' ``get_json_schema`` that returns an adapter method's own schema (TRL would derive one from the
    method's type hints and docstring) and defers to ``original`` for any other function."""

    def get_json_schema(func: Callable) -> dict:
        schema = getattr(func, "__tool_schema__", None)
        return schema if schema is not None else original(func)

    return get_json_schema


def rollout_reward(adapter: EpisodeAdapter, messages: Sequence[dict], stopped: bool) -> tuple[float, str | None]:
    """(reward, why truncated) of a TRL rollout under the project's engine's rules: an episode ended by ``done()`` or
    by a message without tool calls pays the env's reward; one whose last message was cut at max_new_tokens
    (``stopped`` false) or still asked for tools when it ran out of turns or room pays 0."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if not adapter.finished:
        if not stopped and not (last or {}).get("tool_calls"):
            return 0.0, "max_new_tokens without a stop token"
        if (last or {}).get("tool_calls"):
            return 0.0, "turn cap or context budget"
    return float(adapter.env.reward().value), None


def cut_at_done(calls: list[dict]) -> list[dict]:
    """The calls a message runs: those up to and including its first ``done()`` (the project runs no call after it)."""
    for i, c in enumerate(calls):
        if (c.get("function") or {}).get("name") == "done":
            return calls[: i + 1]
    return calls


# --------------------------------------------------------------------------- checks and summary (pure)


def rollout_stats(steps: list[dict]) -> dict[str, float]:
    rollouts = [r for s in steps for r in s["rollouts"]]
    n = max(1, len(rollouts))
    return {
        "rollouts": len(rollouts),
        "turns": sum(r["turns"] for r in rollouts) / n,
        "tokens": sum(r["tokens"] for r in rollouts) / n,
        "calls": sum(r["calls"] for r in rollouts) / n,
        "reward": sum(r["reward"] for r in rollouts) / n,
        "truncated": sum(bool(r["truncated"]) for r in rollouts),
        "max_turns": max((r["turns"] for r in rollouts), default=0),
    }


def equal_work(project: list[dict], trl: list[dict], tasks: int, group: int, max_turns: int) -> tuple[list[str], bool]:
    """Lines saying whether both sides played the same work (``project`` / ``trl``: every run's result, measured and
    warm-up steps alike), and whether the hard checks held: the same tasks in every step, tasks x G rollouts per
    step, no rollout over the turn cap. Tokens per rollout and prompt ids are compared and reported."""
    if not project or not trl:
        return ["- Not checked: a side has not run yet (a record saved part way)."], False
    project, trl = completed(project), completed(trl)
    if not project or not trl:
        none = " and ".join(name for name, runs in (("the project", project), ("TRL", trl)) if not runs)
        return [f"- Not checked: no run of {none} completed (see the runs above)."], False
    ok, lines = True, []
    p_tasks = {tuple(s["tasks"]) for run in project for s in run["steps"]}
    t_tasks = {tuple(s["tasks"]) for run in trl for s in run["steps"]}
    by_step = lambda runs: [tuple(tuple(s["tasks"]) for s in run["steps"]) for run in runs]  # noqa: E731
    same_tasks = len(set(by_step(project) + by_step(trl))) == 1
    ok &= same_tasks
    lines.append(
        f"- Same tasks in every step on both sides: {'yes' if same_tasks else 'NO'} "
        f"({len(p_tasks)} task sets over {len(project[0]['steps']) if project else 0} steps per run; TRL "
        f"{len(t_tasks)})."
    )
    counts = {len(s["rollouts"]) for run in project + trl for s in run["steps"]}
    ok &= counts == {tasks * group}
    lines.append(f"- Rollouts per step: {sorted(counts)} on both sides (asked: {tasks} x {group} = {tasks * group}).")
    ps = rollout_stats([s for run in project for s in run["steps"]])
    ts = rollout_stats([s for run in trl for s in run["steps"]])
    within = ps["max_turns"] <= max_turns and ts["max_turns"] <= max_turns
    ok &= within
    lines.append(
        f"- Assistant messages per rollout: at most {max_turns} on both sides ({'held' if within else 'NOT held'}: "
        f"longest {ps['max_turns']} / {ts['max_turns']}); mean {ps['turns']:.2f} (project) vs {ts['turns']:.2f} "
        f"(TRL); tool calls per rollout {ps['calls']:.2f} vs {ts['calls']:.2f}."
    )
    ratio = ts["tokens"] / ps["tokens"] if ps["tokens"] else float("nan")
    comparable = COMPARABLE_TOKENS[0] <= ratio <= COMPARABLE_TOKENS[1]
    lines.append(
        f"- Generated tokens per rollout: {ps['tokens']:.1f} (project) vs {ts['tokens']:.1f} (TRL), ratio "
        f"{ratio:.2f}: {'comparable' if comparable else 'NOT comparable'} (within "
        f"{COMPARABLE_TOKENS[0]:.2f}-{COMPARABLE_TOKENS[1]:.2f}; the sides sample with different random streams, "
        "so the tokens differ, the caps do not)."
    )
    lines.append(
        f"- Mean reward {ps['reward']:.3f} (project) vs {ts['reward']:.3f} (TRL); truncated rollouts (reward 0) "
        f"{ps['truncated']} vs {ts['truncated']} of {ps['rollouts']} / {ts['rollouts']}."
    )
    prompts_p = {(r["task"], r["prompt_sha"]) for run in project for s in run["steps"] for r in s["rollouts"]}
    prompts_t = {(r["task"], r["prompt_sha"]) for run in trl for s in run["steps"] for r in s["rollouts"]}
    same_prompts = prompts_p == prompts_t
    lines.append(
        f"- Prompt token ids (system prompt, compact tool list, request) identical on both sides: "
        f"{'yes' if same_prompts else 'NO'} ({len({t for t, _ in prompts_p})} tasks)."
    )
    for name, runs in (("project", project), ("TRL", trl)):
        silent = sum(1 for run in runs for s in run["steps"][1:] if not any(r["calls"] for r in s["rollouts"]))
        total = sum(len(run["steps"][1:]) for run in runs)
        if silent:
            lines.append(
                f"- {name}: {silent} of {total} measured steps had no rollout that called a tool: those steps "
                "measure single-turn GRPO, not the multi-turn loop."
            )
    return lines, ok


def failure(code: int, tail: Sequence[str]) -> str:
    """How a child run ended without a result, in a few words: its signal or exit code and its last line."""
    if code < 0:
        how = f"killed by signal {-code}" + (" (SIGKILL: the kernel's OOM killer, as a rule)" if code == -9 else "")
    else:
        how = f"exit code {code}"
    last = next((line.strip() for line in reversed(tail) if line.strip()), "")[:160].replace("|", "\\|")
    return f"{how}; last line: {last}" if last else how


def completed(runs: list[dict]) -> list[dict]:
    """The runs that returned a result (a failed run is reported, never summarized)."""
    return [run for run in runs if not run.get("failed")]


def summarize(runs: list[dict]) -> dict[str, Any] | None:
    """Medians over the measured steps of the runs that completed (the first step of every run warms up and is left
    out); None when none did."""
    runs = completed(runs)
    if not runs:
        return None
    steps = [s for run in runs for s in run["steps"][1:]]
    out = {k: statistics.median(s[k] for s in steps) for k in ("wall", "rollout", "generation", "train", "tokens")}
    out["min"], out["max"] = min(s["wall"] for s in steps), max(s["wall"] for s in steps)
    out["rss"] = max(run["rss_kib"] for run in runs) / 2**20
    out["n"] = len(steps)
    return out


# --------------------------------------------------------------------------- parent


def ensure_trl(folder: Path) -> Path:
    """trl==1.16.0 in ``folder`` (pip's ``--target``), with only the requirements this interpreter lacks."""
    if not (folder / "trl" / "__init__.py").exists():
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(folder)]
        subprocess.run([*pip, "--no-deps", f"trl=={TRL_VERSION}"], check=True)
        from importlib.metadata import PackageNotFoundError, version

        meta = next(folder.glob(f"trl-{TRL_VERSION}.dist-info")) / "METADATA"
        missing = []
        for line in meta.read_text().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = line.split(":", 1)[1].strip().split(";")[0].strip()
                name = req.split("(")[0].split(">")[0].split("<")[0].split("=")[0].split("!")[0].split("~")[0].strip()
                try:
                    version(name)
                except PackageNotFoundError:
                    missing.append(req)
        if missing:
            print(f"installing TRL's requirements missing here into {folder}: {missing}", file=sys.stderr)
            subprocess.run([*pip, *missing], check=True)
    return folder


def ensure_model(model: Path, data: Path) -> Path:
    """The stage-1 export (`STAGE1` with `STAGE1_OVERRIDES`) at ``model`` (``RUN/hf``), trained into RUN where
    missing."""
    if (model / "config.json").exists():
        return model
    run_dir = model.parent
    print(f"no export at {model}: training {STAGE1} into {run_dir} (about 20 minutes)", file=sys.stderr)
    cmd = [sys.executable, "-m", "nemo_rcgrpo.cli", "train", f"--config-name={STAGE1}", f"run_dir={run_dir}"]
    cmd += [*STAGE1_OVERRIDES, f"data.dir={data}", "logging.progress=false", "logging.tensorboard=false"]
    subprocess.run(cmd, check=True)
    if not (model / "config.json").exists():
        raise SystemExit(f"{STAGE1} ran but wrote no export at {model}")
    return model


def child_env(trl_dir: Path) -> dict[str, str]:
    path = [str(REPO), str(trl_dir), os.environ.get("PYTHONPATH", "")]
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        TRL_EXPERIMENTAL_SILENCE="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )


def run_child(side: str, config: str, args, work: Path, rep: int, trl_dir: Path) -> dict:
    result = work / f"{config}_{side}_{rep}.json"
    logfile = work / f"{config}_{side}_{rep}.log"
    cmd = [sys.executable, "-m", "scripts.bench.peer_trl", "--side", side, "--config", config]
    cmd += ["--result", str(result), *shared_flags(args)]
    load = os.getloadavg()
    t0 = time.perf_counter()
    with logfile.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(trl_dir), stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if code != 0 or not result.exists():
        # a run that fails is a row of the section (how, after how long, at what peak), and the benchmark goes on
        tail = logfile.read_text(errors="replace").strip().splitlines()[-25:]
        print(f"{config} {side} run {rep} failed ({code}); the end of {logfile}:", *tail, sep="\n", file=sys.stderr)
        return {
            "side": side,
            "config": config,
            "steps": [],
            "failed": failure(code, tail),
            "load": load,
            "rss_kib": usage.ru_maxrss,
            "seconds": seconds,
            "rep": rep,
        }
    out = json.loads(result.read_text())
    out.update(load=load, rss_kib=usage.ru_maxrss, seconds=seconds, rep=rep)
    print(
        f"{config} {side} run {rep}: {out['seconds']:.0f} s, load {load[0]:.2f}, peak RSS "
        f"{usage.ru_maxrss / 2**20:.2f} GiB, steps {[round(s['wall'], 1) for s in out['steps']]}",
        file=sys.stderr,
    )
    return out


def shared_flags(args) -> list[str]:
    return [
        f"--model={args.model}",
        f"--data={args.data}",
        f"--tasks={args.tasks}",
        f"--group-size={args.group_size}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--max-turns={args.max_turns}",
        f"--steps={args.steps}",
        f"--temperature={args.temperature}",
        f"--fast-tokens={args.fast_tokens}",
        f"--trl-fast-rows={args.trl_fast_rows}",
        f"--trl-kv-memory={args.trl_kv_memory}",
    ]


WHY = [
    "Generation. Without vLLM, `_generate_single_turn` calls `model.generate` on every rollout of the step at once, "
    "left-padded to the longest prompt, and a finished row stays in the batch until the last one ends (with "
    "`use_transformers_continuous_batching`: `generate_batch`, paged, no padding). `_tool_call_loop` then calls it "
    "again for the rollouts whose message called tools, each conversation prefilled whole. The project's generator "
    "(`generation/hf_local.py`) prefills a group's one first prompt once and copies its KV cache to the G rows, "
    "drops a finished row from the batch at once, and samples by inverse CDF (one uniform number per row and step) "
    "where `generate` draws with `torch.multinomial` over the 49,152-token vocabulary; later turns are prefilled "
    "whole on both sides.",
    "Training. `_generate_and_score_completions` pads every rollout of the step to the longest prompt (left) and "
    "the longest completion (right) of the whole batch, and the reference pass and the update run on those rows "
    "(`_get_per_token_logps_and_entropies`, in chunks of `per_device_train_batch_size`): a task with a shorter "
    "prompt than the other task of its step carries the difference as padding in every pass. The project pads "
    "within a micro-batch only, and where a micro-batch holds a whole group (`fastest`: "
    "`trainer.micro_batch_tokens=auto`) computes the group's prompt once for its G rows (`models/shared_prefix.py`) "
    "in the reference pass and the update. With one update per batch neither side runs an old-logprob pass: both "
    "take the ratio against the detached logprobs of the training pass.",
    "Env, tools and reward: the same env on both sides (TRL through the adapter); what differs is the bookkeeping "
    "around it (TRL re-renders the tool results through the chat template, `_get_tool_suffix_ids`, per rollout and "
    "turn).",
]

DIFFERENCES = [
    "Tool documentation: TRL derives a tool's schema from its method's type hints and docstring; the adapter's "
    "methods carry BFCL's schema and transformers' `get_json_schema` returns it for them (patched in the TRL "
    "process), so both sides render the same compact tool list (checked above: the same prompt ids).",
    "Ending an episode: TRL has no episode end but a message without tool calls. In the TRL process a message that "
    "calls `done()` runs its calls up to `done()` and generates no next message (TRL's per-turn generation is "
    "skipped for those rollouts), as the project does; TRL still appends the `done()` result and the next "
    "generation prompt to the rollout, masked out of the loss (a few more forward positions on TRL's side). The "
    "same holds at the turn cap: `max_tool_calling_iterations` = max turns, the last message's calls run (as in "
    "the project) and no further message is generated.",
    "A message cut at max_new_tokens without a stop token: the project ends the rollout there (reward 0); TRL "
    "would run the calls parsed from it and go on. The TRL process drops the calls of such a message (TRL's "
    "`parse_response` wrapped), so it ends the rollout too, and its reward is 0 on both sides.",
    "Unparseable tool calls: the project answers each with an error observation and the rollout goes on; TRL's "
    "parser falls back to plain text, which ends the rollout (fewer turns and tokens on TRL's side where the model "
    "writes malformed calls). A call of an unknown tool gets an error result on both sides, worded differently.",
    "Argument types: TRL's parser casts string arguments to the schema's integer / number / boolean types; the "
    "project passes them to the env as written (the env judges them as BFCL does).",
    "Context budget: the project caps prompt + rollout at `rl.max_total_tokens` (a rollout that reaches it pays 0); "
    "TRL caps the rollout after the prompt at `max_completion_length`, set to `rl.max_total_tokens` less the "
    "longest prompt of the run (a tool result that would pass it is dropped and the rollout ends; it pays 0 here "
    "as on the project's side).",
    "Tool calls per message: the project runs at most 128 per message (`env.settings.max_calls_per_step`) and the "
    "rest get an error; TRL runs all of them.",
    "Sampling: both sample at the same temperature from the whole distribution, with different random streams "
    "(the project's inverse-CDF sampler, TRL's `model.generate`): the rollouts and their lengths differ between "
    "sides, their caps do not.",
    "Advantages: (r - mean) / (std + eps) on both sides; eps is 1e-6 in the project and 1e-4 in TRL.",
]


def display(path: Path) -> str:
    """``path`` as the section shows it: relative to the repository where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def section(args, results: dict[str, dict[str, list[dict]]], versions: dict[str, str]) -> list[str]:
    import torch

    rows = [
        START,
        "## Against TRL's GRPOTrainer on the same multi-turn work (`scripts/bench/peer_trl.py`)",
        "",
        f"- Date: {args.date}; machine: {cpu_name()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads per process; Python {platform.python_version()}, torch "
        f"{torch.__version__}, transformers {dist_version('transformers')}, TRL {versions.get('trl', '?')} "
        f"(installed by the script into .bench/, same interpreter).",
        f"- Work per step: {args.tasks} BFCL tasks x G={args.group_size} rollouts (merged episodes, the "
        f"`{RECIPE}` recipe's data and env), up to {args.max_turns} assistant messages x {args.max_new_tokens} "
        f"new tokens, temperature {args.temperature:g}, the stage-1 export `{display(args.model)}` "
        f"(SmolLM2-135M-Instruct, fp32; by default `{STAGE1}` with {', '.join(f'`{o}`' for o in STAGE1_OVERRIDES)}, "
        "so that its rollouts call tools), HF generation, beta 0.1 with the initial model as reference, one optimizer "
        "step per batch. "
        f"{args.runs} runs per side and configuration, each its own process, alternating; each run one warm-up step "
        f"and {args.steps} measured steps; medians over the measured steps.",
        "",
        "| configuration | side | step (s), median [min, max] | rollouts (s) | of which generation (s) | "
        "training (s) | tokens generated / step | peak RSS (GiB) | project / TRL |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = {
        ("equal", "project"): "`trainer.micro_batch_size=1`",
        ("equal", "trl"): "`per_device_train_batch_size=1`, `gradient_accumulation_steps`=tasks x G",
        ("fastest", "project"): f"`trainer.micro_batch_tokens={args.fast_tokens}` (the default: whole groups per "
        "micro-batch)",
        (
            "fastest",
            "trl",
        ): f"`per_device_train_batch_size={args.trl_fast_rows}`, `use_transformers_continuous_batching=True` (KV "
        f"cache: {args.trl_kv_memory:.0%} of free RAM)",
    }
    for config, sides in results.items():
        med = {side: summarize(runs) for side, runs in sides.items()}
        for side in SIDES:
            m, name = med[side], "project" if side == "project" else "TRL"
            if not sides[side]:  # a record saved part way: this side has not run yet
                rows.append(f"| {config}: {labels[config, side]} | {name} | not run | - | - | - | - | - | - |")
                continue
            if m is None:  # no run of this side completed: how they ended, at what peak
                worst = max(sides[side], key=lambda run: run["rss_kib"])
                rows.append(
                    f"| {config}: {labels[config, side]} | {name} | failed in {len(sides[side])} of "
                    f"{len(sides[side])} runs: {worst['failed']} | - | - | - | - | {worst['rss_kib'] / 2**20:.2f} | - |"
                )
                continue
            both = med["project"] is not None and med["trl"] is not None
            ratio = f"{med['project']['wall'] / med['trl']['wall']:.2f}" if side == "project" and both else ""
            done = len(completed(sides[side]))
            if done < len(sides[side]):  # the medians are the completed runs'
                name += f" ({done} of {len(sides[side])} runs completed)"
            rows.append(
                f"| {config}: {labels[config, side]} | {name} | "
                f"{m['wall']:.1f} [{m['min']:.1f}, {m['max']:.1f}] | {m['rollout']:.1f} | {m['generation']:.1f} | "
                f"{m['train']:.1f} | {m['tokens']:.0f} | {m['rss']:.2f} | {ratio} |"
            )
    rows += [
        "",
        "Rollouts: generation, env steps and rewards (TRL: its `_generate`, tool loop included, and the reward "
        "function). Generation: the seconds in the generator's calls (TRL: `_generate_single_turn`). Training: the "
        "rest of the step (the reference model's logprobs, the update's forward and backward passes, the optimizer "
        "step). Peak RSS: the child process's (`wait4`), model loading included.",
        "",
        "Runs (load: the 1-minute load average before the run):",
        "",
        "| configuration | side | run | load | steps (s) | peak RSS (GiB) |",
        "|---|---|---:|---:|---|---:|",
    ]
    for config, sides in results.items():
        for side, runs in sides.items():
            for run in runs:
                walls = ", ".join(format(s["wall"], ".1f") for s in run["steps"])
                steps = f"failed after {run['seconds']:.0f} s: {run['failed']}" if run.get("failed") else walls
                rows.append(
                    f"| {config} | {side} | {run['rep']} | {run['load'][0]:.2f} | "
                    f"{steps}{'' if run.get('failed') else ' (first: warm-up)'} | {run['rss_kib'] / 2**20:.2f} |"
                )
    rows += ["", "Equal work, checked:", ""]
    for config, sides in results.items():
        lines, ok = equal_work(sides["project"], sides["trl"], args.tasks, args.group_size, args.max_turns)
        rows += [f"`{config}` ({'checks held' if ok else 'CHECKS FAILED'}):", "", *lines, ""]
    rows += ["Each part, project / TRL (medians; above 1: TRL faster there):", ""]
    rows += [*part_lines(results), ""]
    rows += [f"Why the parts differ (read in TRL {versions.get('trl', TRL_VERSION)}'s `GRPOTrainer` source):", ""]
    rows += [f"- {w}" for w in WHY]
    rows += ["", "Differences between the sides that the benchmark does not remove:", ""]
    rows += [f"- {d}" for d in DIFFERENCES]
    rows.append(END)
    return rows


PARTS = (
    ("step", "wall"),
    ("generation", "generation"),
    ("env, tools and reward", "env"),
    ("training", "train"),
)


def part_lines(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Per configuration, each part's median ratio project / TRL (the env's share: rollouts less generation), and
    the parts where TRL is faster; a configuration with a side that never completed is said to be unmeasured."""
    lines = []
    for config, sides in results.items():
        med = {side: summarize(runs) for side, runs in sides.items()}
        if med["project"] is None or med["trl"] is None:
            lines.append(f"- `{config}`: not measured on both sides (a side's runs failed or have not run).")
            continue
        for m in med.values():
            m["env"] = m["rollout"] - m["generation"]
        ratios = {name: med["project"][k] / med["trl"][k] if med["trl"][k] > 0 else float("nan") for name, k in PARTS}
        slower = [name for name, r in ratios.items() if r > 1]
        said = ", ".join(f"{name} {r:.2f}" for name, r in ratios.items())
        said += f" ({med['project']['env']:.2f} s against {med['trl']['env']:.2f} s of env, tools and reward)"
        # the sides sample different rollouts: generation per token generated says what their lengths do not
        per_token = {side: m["generation"] / m["tokens"] if m["tokens"] else float("nan") for side, m in med.items()}
        lines.append(
            f"- `{config}`: {said}; TRL faster: {', '.join(slower) if slower else 'on no part'}. Generation per "
            f"token generated: {per_token['project'] * 1e3:.1f} ms against {per_token['trl'] * 1e3:.1f} ms "
            f"({per_token['project'] / per_token['trl']:.2f})."
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("outputs/bench/sft_smollm_cpu_tools/hf"), help="stage-1 export")
    p.add_argument("--data", type=Path, default=Path("data/bfcl_v4"), help="the recipe's data (prepared if missing)")
    p.add_argument("--tasks", type=int, default=2, help="tasks per step")
    p.add_argument("--group-size", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per assistant message")
    p.add_argument("--max-turns", type=int, default=4, help="assistant messages per rollout")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=2, help="measured steps per run (after one warm-up step)")
    p.add_argument("--runs", type=int, default=2, help="runs per side and configuration, alternating")
    p.add_argument("--configs", default=",".join(CONFIGS), help="equal, fastest or both")
    p.add_argument("--fast-tokens", default="auto", help="the project's micro_batch_tokens when fastest (its default)")
    p.add_argument(
        "--trl-fast-rows", type=int, help="TRL's per_device_train_batch_size when fastest (default: G, a group a pass)"
    )
    p.add_argument(
        "--trl-kv-memory", type=float, default=0.2, help="the share of free RAM for TRL's KV cache when fastest"
    )
    p.add_argument("--trl-dir", type=Path, default=REPO / ".bench" / f"trl-{TRL_VERSION}")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--record", type=Path, default=Path("outputs/bench/peer_trl_runs.json"), help="every run kept here as it ends"
    )
    p.add_argument("--render", type=Path, help="write the section from a --record file, running nothing")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child: one run of one side
    p.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.render:
        return render(args.render, args.out)
    args.date = dt.date.today().isoformat()
    args.record = (REPO / args.record).resolve() if not args.record.is_absolute() else args.record
    args.trl_fast_rows = args.trl_fast_rows or args.group_size
    if (args.tasks * args.group_size) % args.trl_fast_rows:
        raise SystemExit(f"--trl-fast-rows must divide tasks x G = {args.tasks * args.group_size}")
    args.model = (REPO / args.model).resolve() if not args.model.is_absolute() else args.model
    args.data = (REPO / args.data).resolve() if not args.data.is_absolute() else args.data
    if args.side:
        out = run_project(args) if args.side == "project" else run_trl(args)
        args.result.write_text(json.dumps(out))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    if not configs or set(configs) - set(CONFIGS) or args.runs < 1 or args.steps < 1:
        raise SystemExit(f"--configs from {CONFIGS}, --runs and --steps >= 1")
    trl_dir = ensure_trl(args.trl_dir)
    ensure_model(args.model, args.data)
    work = Path(tempfile.mkdtemp(prefix="peer_trl_"))
    results: dict[str, dict[str, list[dict]]] = {c: {s: [] for s in SIDES} for c in configs}
    versions: dict[str, str] = {}
    for rep in range(args.runs):
        for config in configs:
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                out = run_child(side, config, args, work, rep, trl_dir)
                versions.update(out.get("versions", {}))
                results[config][side].append(out)
                save_record(args.record, args, results, versions)  # every run kept as it ends
    return finish(args, results, versions, work)


def save_record(path: Path, args, results: dict, versions: dict) -> None:
    """The runs so far with the settings the section states (``--render`` writes the section from it again)."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k in RECORDED}
    settings["date"] = args.date
    # the command as it ran, with the environment variables that change a measurement (not the render's)
    record = {"settings": settings, "command": command_line(), "results": results, "versions": versions}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def render(path: Path, out: Path | None) -> int:
    """The section from a record of `save_record` (no run)."""
    saved = json.loads(path.read_text())
    args = argparse.Namespace(**saved["settings"], out=out, record=path)
    return finish(args, saved["results"], saved["versions"], None, command=saved["command"])


def finish(args, results: dict, versions: dict, work: Path | None, command: str | None = None) -> int:
    """Checks that both sides played the same work, and writes the section."""
    failed = []
    for config, sides in results.items():
        lines, ok = equal_work(sides["project"], sides["trl"], args.tasks, args.group_size, args.max_turns)
        print(f"equal work, {config}:", *lines, sep="\n", file=sys.stderr)
        ran = all(completed(sides[side]) for side in SIDES)
        started = all(sides[side] for side in SIDES)  # a record saved part way may hold a side not run yet
        if not ok and started and (ran or config == "equal"):  # a `fastest` side that failed is a row
            failed.append(config)
    if failed:
        raise SystemExit(
            f"the sides did not play the same work ({failed}): see the lines above; {work or args.record} has the runs"
        )
    code = emit(section(args, results, versions), args.out, START, END, command=command)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return code


# --------------------------------------------------------------------------- children


def recipe_config(args, run_dir: str):
    """The recipe both sides take their data, env, chat and optimizer settings from; the project's trainer config."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    overrides = [
        "stage=grpo",
        f"model.path={args.model}",
        "rl.stage1_recipe=null",
        f"data.dir={args.data}",
        f"run_dir={run_dir}",
        f"rl.tasks_per_step={args.tasks}",
        f"rl.group_size={args.group_size}",
        f"rl.max_turns={args.max_turns}",
        f"rl.sampling.max_new_tokens={args.max_new_tokens}",
        f"rl.sampling.temperature={args.temperature}",
        "rl.sampling.top_p=1.0",
        "rl.loss.kl_beta=0.1",
        "rl.ppo_epochs=1",
        "rl.mini_batches=1",
        "env.settings.mode=merged",
        f"trainer.max_steps={args.steps + 1}",
        "trainer.save_every=1000",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    if args.config == "fastest":  # the project's default (auto: a whole group per micro-batch on CPU) or a budget
        overrides.append(f"trainer.micro_batch_tokens={args.fast_tokens}")
    else:
        overrides += ["trainer.micro_batch_size=1", "trainer.micro_batch_tokens=null"]
    cfg = TrainConfig.from_dict(compose(RECIPE, overrides))
    if cfg.rl.max_turns > cfg.env.settings.max_steps:
        raise SystemExit("--max-turns must be at most env.settings.max_steps (the env would end episodes first)")
    return cfg


def _sha(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def plan(cfg, steps: int) -> tuple[Any, list[list[str]]]:
    """The tasks (and their env opener) and the task ids of each step, as the project's loop draws them."""
    from nemo_rcgrpo.algorithms.rl_collect import shuffled_tasks
    from nemo_rcgrpo.prepare_data import DataNeed
    from nemo_rcgrpo.recipes.rl_parts import build_tasks
    from nemo_rcgrpo.utils.dist import init_distributed

    tasks = build_tasks(DataNeed.of(cfg), cfg.rl, cfg.env, cfg.reward_tokens, init_distributed())
    per_step = [
        shuffled_tasks(tasks.train, i * cfg.rl.tasks_per_step, cfg.rl.tasks_per_step, cfg.seed) for i in range(steps)
    ]
    return tasks, per_step


def run_project(args) -> dict:
    import torch

    from nemo_rcgrpo.recipes.rl import RLTrainer
    from nemo_rcgrpo.utils.dist import init_distributed

    run_dir = tempfile.mkdtemp(prefix="peer_trl_project_")
    cfg = recipe_config(args, run_dir)
    trainer = RLTrainer.from_config(cfg, init_distributed())
    steps = []
    for step in range(1, args.steps + 2):
        t0 = time.perf_counter()
        rollouts = trainer.collect(step, trainer.task_cursor)
        rollout_s = time.perf_counter() - t0
        trainer.task_cursor = rollouts.cursor
        groups = rollouts.groups
        rewards, adv = trainer.advantages(groups)
        metrics = trainer.update(groups, rewards, adv, dict(rollouts.stats))
        trainer.step = step
        wall = time.perf_counter() - t0
        trajs = [t for g in groups for t in g]
        steps.append(
            {
                "wall": wall,
                "rollout": rollout_s,
                "generation": metrics["generation_seconds"],
                "train": wall - rollout_s,
                "tokens": sum(t.generated_tokens for t in trajs),
                "loss": metrics["loss"],
                "tasks": [g[0].task_id for g in groups],
                "rollouts": [
                    {
                        "task": t.task_id,
                        "turns": t.num_turns,
                        "tokens": t.generated_tokens,
                        "calls": sum(len(c) for c in t.calls),
                        "reward": t.reward,
                        "truncated": t.truncated,
                        "prompt_len": t.prompt_length,
                        "prompt_sha": _sha(t.token_ids[: t.prompt_length]),
                    }
                    for t in trajs
                ],
            }
        )
        print(f"project step {step}: {wall:.1f} s", file=sys.stderr)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"side": "project", "config": args.config, "steps": steps, "threads": torch.get_num_threads()}


def run_trl(args) -> dict:
    """One run of TRL's GRPOTrainer on the plan's tasks, its BFCL env driven through ``environment_factory``."""
    import datasets
    import torch
    import transformers
    import transformers.utils.chat_template_utils as ctu
    import trl
    import trl.trainer.grpo_trainer as grpo_module
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils.chat_parsing import response_parser
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    if trl.__version__ != TRL_VERSION:
        raise SystemExit(
            f"TRL {trl.__version__} imported, {TRL_VERSION} wanted (PYTHONPATH: {os.environ.get('PYTHONPATH')})"
        )
    work = tempfile.mkdtemp(prefix="peer_trl_trl_")
    cfg = recipe_config(args, work)
    tasks, per_step = plan(cfg, args.steps + 1)

    def open_task(task_id: str):
        return tasks.opener.open(tasks.suite[task_id])

    # the schemas the project renders for each task (the env's tools, done() included) and its opening messages
    rows, factories, longest = [], {}, 0
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    for task_id in [t for step in per_step for t in step]:
        env, messages = open_task(task_id)
        factories[task_id] = adapter_class(task_id, env.tools, open_task)
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
        rows.append({"prompt": prompt, "environment": task_id, "task_id": task_id})
        ids = tokenizer.apply_chat_template(prompt, tools=env.tools, add_generation_prompt=True, tokenize=True)
        longest = max(longest, len(ids["input_ids"] if isinstance(ids, dict) else ids))
    dataset = datasets.Dataset.from_list(rows)

    # tool documentation: the adapter's methods carry BFCL's schemas (module docstring)
    ctu.get_json_schema = schema_of(ctu.get_json_schema)
    response_parser.get_json_schema = schema_of(response_parser.get_json_schema)
    tokenizer.response_template = qwen3_template  # hermes tool calls; add_response_schema refuses this template
    eos: set[int] = set()
    original_parse = grpo_module.parse_response

    def parse_response(tok, ids, prefix=None, tools=None):
        parsed = original_parse(tok, ids, prefix=prefix, tools=tools)
        if parsed.get("tool_calls"):
            if not ids or ids[-1] not in eos:  # cut at max_new_tokens: the project ends the rollout here
                parsed = {k: v for k, v in parsed.items() if k != "tool_calls"}
            else:
                parsed["tool_calls"] = cut_at_done(parsed["tool_calls"])
        return parsed

    grpo_module.parse_response = parse_response
    timing = {"generate": 0.0, "generation": 0.0, "reward": 0.0}
    record: list[dict] = []

    def bfcl_reward(prompts, completions, completion_ids, environments, **kwargs):
        t0 = time.perf_counter()
        out, got = [], record[-1]
        for i, (messages, ids, env) in enumerate(zip(completions, completion_ids, environments)):
            stopped = bool(ids) and ids[-1] in eos
            value, why = rollout_reward(env, messages, stopped)
            out.append(value)
            assistant = [m for m in messages if m.get("role") == "assistant"]
            got["rollouts"].append(
                {
                    "task": env.task_id,
                    "turns": len(assistant),
                    "tokens": sum(got["tool_mask"][i]),
                    "calls": sum(len(m.get("tool_calls") or []) for m in assistant),
                    "reward": value,
                    "truncated": why,
                    "prompt_len": len(got["prompt_ids"][i]),
                    "prompt_sha": _sha(got["prompt_ids"][i]),
                }
            )
        timing["reward"] += time.perf_counter() - t0
        return out

    class Trainer(GRPOTrainer):
        in_loop, loop_calls = False, 0

        def _tool_call_loop(self, *a, **kw):
            self.in_loop, self.loop_calls = True, 0
            try:
                return super()._tool_call_loop(*a, **kw)
            finally:
                self.in_loop = False

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            t0 = time.perf_counter()
            try:
                if not self.in_loop:
                    return super()._generate_single_turn(
                        prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                    )
                self.loop_calls += 1  # the n-th call of the loop would write message n + 1
                keep = [
                    i
                    for i, ids in enumerate(prompt_ids)
                    if self.loop_calls < args.max_turns and DONE_MARKER not in self._tokenizer.decode(ids[-64:])
                ]
                ids_out: list[list[int]] = [[] for _ in prompt_ids]
                logprobs = None
                if keep:
                    sub = [prompt_ids[i] for i in keep]
                    got, lps = super()._generate_single_turn(sub, None, multimodal_fields, 1, has_tool_images)
                    for j, i in enumerate(keep):
                        ids_out[i] = list(got[j])
                    if lps is not None:
                        logprobs = [[] for _ in prompt_ids]
                        for j, i in enumerate(keep):
                            logprobs[i] = lps[j]
                return ids_out, logprobs
            finally:
                timing["generation"] += time.perf_counter() - t0

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            timing["generate"] += time.perf_counter() - t0
            prompt_ids, _, tool_mask = out[:3]
            record.append({"prompt_ids": prompt_ids, "tool_mask": tool_mask, "rollouts": []})
            return out

    class Steps(TrainerCallback):
        def __init__(self):
            self.t0, self.walls = 0.0, []

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()
            for k in timing:
                timing[k] = 0.0

        def on_step_end(self, a, state, control, **kw):
            self.walls.append((time.perf_counter() - self.t0, dict(timing)))

    fast = args.config == "fastest"
    n = args.tasks * args.group_size
    config = GRPOConfig(
        output_dir=work,
        max_steps=args.steps + 1,
        learning_rate=cfg.trainer.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.trainer.weight_decay,
        adam_beta1=cfg.trainer.betas[0],
        adam_beta2=cfg.trainer.betas[1],
        max_grad_norm=cfg.trainer.grad_clip,
        per_device_train_batch_size=args.trl_fast_rows if fast else 1,
        gradient_accumulation_steps=n // args.trl_fast_rows if fast else n,
        num_generations=args.group_size,
        max_completion_length=cfg.rl.max_total_tokens - longest,
        generation_kwargs={"max_new_tokens": args.max_new_tokens},
        max_tool_calling_iterations=args.max_turns,  # the loop stops itself after the last message's calls
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=cfg.rl.loss.kl_beta,
        epsilon=cfg.rl.loss.clip_low,
        epsilon_high=cfg.rl.loss.clip_high,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        shuffle_dataset=False,
        remove_unused_columns=False,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        use_transformers_continuous_batching=fast,
        # on a CPU its KV cache would take 80-90% of the free memory, which the update then lacks; 20% holds the
        # step's cache many times over (SmolLM2: about 46 KB a token)
        transformers_continuous_batching_config={"max_memory_percent": args.trl_kv_memory} if fast else None,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=cfg.seed,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    steps_cb = Steps()
    trainer = Trainer(
        model=model,
        reward_funcs=[bfcl_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=factories,
        callbacks=[steps_cb],
    )
    eos.update(trainer.eos_token_ids)
    trainer.train()
    if len(steps_cb.walls) != args.steps + 1 or len(record) != args.steps + 1:
        raise SystemExit(f"TRL ran {len(steps_cb.walls)} steps and {len(record)} generations, {args.steps + 1} wanted")
    steps = []
    for (wall, t), r in zip(steps_cb.walls, record):
        rollouts = r["rollouts"]
        task_order = [x["task"] for x in rollouts[:: args.group_size]]
        rollout_s = t["generate"] + t["reward"]
        steps.append(
            {
                "wall": wall,
                "rollout": rollout_s,
                "generation": t["generation"],
                "train": wall - rollout_s,
                "tokens": sum(x["tokens"] for x in rollouts),
                "tasks": task_order,
                "rollouts": rollouts,
            }
        )
    shutil.rmtree(work, ignore_errors=True)
    return {
        "side": "trl",
        "config": args.config,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
    }


if __name__ == "__main__":
    sys.exit(main())
