"""Benchmark: rollout-engine overhead over the bare generator, same prompts and lengths, same run.

The engine's generator is wrapped to record every call (prompts, sampling
parameters with their seeds) and its time during an unmeasured warm-up rollout;
the same calls are then replayed directly on the generator (seeded, so the same
tokens and lengths come out). Baseline and engine runs alternate, --repeats
times each (baseline, engine, baseline, engine, ...), so drifting machine load
hits both alike; the report gives the spread (median, min, max, mean +- std) of
both and of the per-repeat ratio engine / baseline (overhead = ratio - 1:
rendering, parsing, environment steps, bookkeeping). A ratio below 1 within the
spread is noise, not an engine faster than generation. Optionally also tabulates
the per-stage seconds of an RL run directory (``--run``).

Usage: python -m scripts.bench.rollout_overhead [--model smollm2] [--repeats 3] [--run runs/x]
           [--out docs/benchmarks.md]
Cheap check of the script (seconds, not a measurement):
    python -m scripts.bench.rollout_overhead --tasks multi_turn_base_0 --group-size 2 --max-new-tokens 8 \
        --max-turns 1 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl import BFCLSuite
from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec
from nemo_rcgrpo.utils.logging import read_metrics
from scripts.bench._common import cpu_name, emit

START, END = "<!-- bench:rollout_overhead:start -->", "<!-- bench:rollout_overhead:end -->"
STAGES = (
    "generation_seconds",
    "env_seconds",
    "logprob_seconds",
    "train_seconds",
    "weight_sync_seconds",
    "step_seconds",
)


class Recording:
    def __init__(self, inner):
        self.inner, self.calls, self.seconds = inner, [], 0.0

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        out = self.inner.generate(prompts, params)
        self.seconds += time.perf_counter() - t0
        self.calls.append(([list(p) for p in prompts], params, [len(c.token_ids) for c in out]))
        return out

    def update_weights(self, weights, version):
        self.inner.update_weights(weights, version)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", nargs="+", default=["multi_turn_base_0", "multi_turn_base_5"])
    p.add_argument("--group-size", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="baseline and engine runs each, alternating")
    p.add_argument("--run", type=Path, help="an RL run directory whose per-stage seconds to tabulate")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    tokenizer, model = load_tokenizer(args.model), load_model(args.model).eval()
    add_reward_tokens(tokenizer, model, ("<|high_reward|>", "<|low_reward|>"))
    renderer = ChatRenderer(tokenizer, "hermes", tool_description="compact")
    suite = BFCLSuite(["base"])
    gen = Recording(HFGenerator(model, tokenizer.pad_token_id or tokenizer.eos_token_id))
    engine = RolloutEngine(
        gen,
        renderer,
        make_opener(EnvConfig(settings=BFCLSettings(mode="merged")), suite),
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0),
        max_turns=args.max_turns,
        max_total_tokens=4096,
    )
    specs = [RolloutSpec(suite[t], g, j % 2 == 0) for g, t in enumerate(args.tasks) for j in range(args.group_size)]
    engine.rollout(specs, seed=1)  # warm-up: first-call allocations and the gold replays are not measured
    reference = gen.calls  # the calls the baseline replays (the measured engine runs must make the same ones)
    bare, eng, inside, same = [], [], [], True
    for _ in range(args.repeats):  # alternate: baseline, engine, baseline, engine, ...
        t0 = time.perf_counter()
        for prompts, params, lengths in reference:
            out = gen.inner.generate(prompts, params)
            same &= [len(c.token_ids) for c in out] == lengths
        bare.append(time.perf_counter() - t0)
        gen.calls, gen.seconds = [], 0.0
        t0 = time.perf_counter()
        trajs = engine.rollout(specs, seed=1)
        eng.append(time.perf_counter() - t0)
        inside.append(gen.seconds)
        same &= [c[2] for c in gen.calls] == [c[2] for c in reference]
    ratios = [e / b for e, b in zip(eng, bare)]
    inside_ratios = [g / b for g, b in zip(inside, bare)]
    generated = sum(t.generated_tokens for t in trajs)

    def spread(xs: list[float], fmt: str) -> str:
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return (
            f"{statistics.median(xs):{fmt}} | {min(xs):{fmt}} | {max(xs):{fmt}} | "
            f"{statistics.fmean(xs):{fmt}} +- {sd:{fmt}}"
        )

    if max(ratios) <= 1.10:
        verdict = "met in every repeat"
    elif statistics.median(ratios) <= 1.10:
        verdict = "met at the median, not in every repeat"
    else:
        verdict = "NOT met"
    if min(ratios) <= 1.0 <= max(ratios):
        noise = (
            " The ratios straddle 1.00: the engine's overhead is not distinguishable from zero at this "
            "machine's run-to-run noise."
        )
    elif max(ratios) < 1.0:
        noise = (
            " Every ratio is below 1.00: a measurement artefact (the engine makes the same generator calls "
            "plus its own work, so it cannot be faster), not a speed-up."
        )
    else:
        noise = ""
    rows = [
        START,
        "## Rollout engine overhead (`scripts/bench/rollout_overhead.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {torch.get_num_threads()} torch threads; "
        f"Python {platform.python_version()}; 1-min load average {os.getloadavg()[0]:.1f} at the end.",
        f"- {args.model} (fp32, HF generator, after one warm-up rollout), {len(specs)} RC-GRPO rollouts ({len(args.tasks)} base tasks x G="
        f"{args.group_size}), merged episodes, compact tools, <= {args.max_new_tokens} new tokens per message, "
        f"<= {args.max_turns} messages; {len(reference)} generator calls, {generated} generated tokens per run"
        f"{'' if same else ' (replay lengths differed: the runs did not generate the same tokens)'}.",
        f"- {args.repeats} repeats, baseline and engine alternating (baseline, engine, baseline, ...); ratio = "
        "engine / baseline of the same repeat.",
        "",
        "| | median | min | max | mean +- std |",
        "|---|---:|---:|---:|---:|",
        f"| bare generator calls, s (same prompts, seeds, lengths) | {spread(bare, '.2f')} |",
        f"| rollout engine, s (generation + render + parse + env) | {spread(eng, '.2f')} |",
        f"| of which inside generator calls, s | {spread(inside, '.2f')} |",
        f"| ratio engine / bare | {spread(ratios, '.3f')} |",
        f"| ratio inside generator calls / bare | {spread(inside_ratios, '.3f')} |",
        "",
        "Per repeat (bare / engine, s): " + ", ".join(f"{b:.2f} / {e:.2f}" for b, e in zip(bare, eng)) + ".",
        f"Target: engine overhead at most 10% (ratio <= 1.10): {verdict}.{noise}",
    ]
    if args.run:
        import yaml

        metrics = read_metrics(args.run)
        rc = yaml.safe_load((args.run / "config.yaml").read_text())
        rl = rc["rl"]
        setup = (
            f"{rc['stage']} from `{rc['model']['path']}`, {rl['tasks_per_step']} tasks x G={rl['group_size']} "
            f"({rl['reward_token_sampling']} tokens), <= {rl['sampling']['max_new_tokens']} new tokens per message, "
            f"<= {rl['max_turns']} messages, context {rl['max_total_tokens']}, categories {rc['env']['categories']}"
        )
        rows += [
            "",
            f"Per-stage seconds of `{args.run}` ({setup}; mean over its {len(metrics)} steps):",
            "",
            "| " + " | ".join(s.replace("_seconds", "") for s in STAGES) + " |",
            "|" + "---:|" * len(STAGES),
            "| " + " | ".join(f"{statistics.fmean(m.get(s, 0.0) for m in metrics):.1f}" for s in STAGES) + " |",
        ]
    rows.append(END)
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
