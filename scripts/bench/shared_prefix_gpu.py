"""Benchmark: one group's training forward+backward with its prompt computed once against every row in full, at
the Llama-3.1-8B layer shape on one GPU (bf16): time, peak memory and the logprobs of both.

A randomly initialised Llama with Llama-3.1-8B's shape (hidden 4096, FFN 14336, 32 heads / 8 KV heads,
vocabulary 128256) and ``--layers`` layers (4 by default: the step's time and memory per layer are what the ratio
is about; the full 32 with five 5.7k-token rows would not fit one GPU without recomputation), bf16, sdpa. One group
of G = ``--group`` rows: a prompt of P = ``--prompt`` random tokens and suffixes of S = ``--suffix`` tokens, the
suffixes trained. Each side runs ``torch_policy.token_logprobs`` and a backward pass of their weighted sum, as the
update does: every row padded in full (the unshared path), and the prefix tree's three passes
(`models/shared_prefix.py`: the prompt once); both again with gradient checkpointing (transformers' own for the
padded rows, the passes' own for the tree: the 7B/8B recipes run with it). Timed after ``--warmup`` rounds, the
sides alternating, the median of ``--repeats``; peak memory per side (``torch.cuda.max_memory_allocated``). Each
pair's trained logprobs are compared (bf16: equal up to rounding, the largest difference printed), and the counted
forward FLOPs of the same layout (`data/prefix_tree.py: layout_flops`) are printed beside the measured ratios.

Usage (one GPU):   python -m scripts.bench.shared_prefix_gpu [--layers 4 --prompt 5400 --suffix 300 --group 5]
                   [--json FILE] [--out docs/benchmarks.md]
Check of the logic (CPU, tiny shape): python -m scripts.bench.shared_prefix_gpu --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from nemo_rcgrpo.data.prefix_tree import group_layout, layout_flops
from nemo_rcgrpo.models.torch_policy import token_logprobs
from scripts.bench._common import emit

START, END = "<!-- bench:shared_prefix_gpu:start -->", "<!-- bench:shared_prefix_gpu:end -->"
LLAMA8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
)


def build(layers: int, tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, **(TINY if tiny else LLAMA8B))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.train()


def group(prompt: int, suffix: int, rows: int, vocab: int, device: torch.device):
    """Token ids [G, P + S] (one prompt, random suffixes), the attention mask and the loss mask (the suffixes)."""
    g = torch.Generator().manual_seed(1)
    head = torch.randint(10, vocab, (prompt,), generator=g)
    ids = torch.stack([torch.cat([head, torch.randint(10, vocab, (suffix,), generator=g)]) for _ in range(rows)])
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt:] = 1
    return ids.to(device), torch.ones_like(ids).to(device), loss_mask.to(device)


def one_pass(model, ids, attention, loss_mask, layout) -> torch.Tensor:
    """token_logprobs and the backward of their sum, as an update runs them; returns the trained logprobs."""
    lp = token_logprobs(model, ids, attention, loss_mask, layout=layout)
    lp.sum().backward()
    model.zero_grad(set_to_none=True)
    return lp.detach()[loss_mask.bool()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=5400)
    p.add_argument("--suffix", type=int, default=300)
    p.add_argument("--group", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU check of the logic: a tiny Llama, short rows, float32")
    p.add_argument("--json", type=Path)
    p.add_argument("--out", type=Path, help="Markdown file to update (docs/benchmarks.md)")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        args.layers, args.prompt, args.suffix = 2, 96, 16
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.layers, args.tiny, device, dtype)
    ids, attention, loss_mask = group(args.prompt, args.suffix, args.group, model.config.vocab_size, device)
    layout = group_layout([row.tolist() for row in ids.cpu()])
    # name: (layout, gradient checkpointing)
    sides = {
        "padded": (None, False),
        "prefix_once": (layout, False),
        "padded_checkpointed": (None, True),
        "prefix_once_checkpointed": (layout, True),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    peak: dict[str, float] = {}
    out: dict[str, torch.Tensor] = {}
    for rep in range(args.warmup + args.repeats):
        for name in sides if rep % 2 == 0 else reversed(list(sides)):
            lay, checkpointed = sides[name]
            if checkpointed:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out[name] = one_pass(model, ids, attention, loss_mask, lay)
            if cuda:
                torch.cuda.synchronize()
                peak[name] = torch.cuda.max_memory_allocated() / 2**30
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    unshared, shared = layout_flops(
        layout, sum(p.numel() for p in model.parameters()), args.layers, model.config.hidden_size
    )
    diff = (out["prefix_once"].float() - out["padded"].float()).abs()
    diff_c = (out["prefix_once_checkpointed"].float() - out["padded_checkpointed"].float()).abs()
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "layers": args.layers,
        "prompt": args.prompt,
        "suffix": args.suffix,
        "group": args.group,
        "root": layout.root,
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "time_ratio": round(med["prefix_once"] / med["padded"], 3),
        "time_ratio_checkpointed": round(med["prefix_once_checkpointed"] / med["padded_checkpointed"], 3),
        "counted_flops_ratio": round(shared / unshared, 3),
        "peak_gib": {k: round(v, 2) for k, v in peak.items()} or None,
        "logprob_max_abs_diff": float(diff.max()),
        "logprob_mean_abs_diff": float(diff.mean()),
        "logprob_max_abs_diff_checkpointed": float(diff_c.max()),
    }
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.out:
        emit(report(result), args.out, START, END)
    tolerance = 0.1 if dtype == torch.bfloat16 else 1e-4  # bf16 logprobs of two graphs agree to about 1e-2
    worst = max(result["logprob_max_abs_diff"], result["logprob_max_abs_diff_checkpointed"])
    return 0 if worst <= tolerance else 1


def report(r: dict) -> list[str]:
    peak = r["peak_gib"] or {}
    rows = [
        START,
        "## One prompt per group on GPU: the training pass at the Llama-3.1-8B layer shape "
        "(`scripts/bench/shared_prefix_gpu.py`)",
        "",
        f"- {time.strftime('%Y-%m-%d')}; {r['device']}, {r['dtype']}, {r['layers']} layers, torch "
        f"{torch.__version__}; one group of G = {r['group']}, P = {r['prompt']}, S = {r['suffix']} "
        f"(root {r['root']}).",
        "",
        "| side | forward+backward (s) | peak memory (GiB) |",
        "|---|---:|---:|",
    ]
    for side, label in (
        ("padded", "every row padded, in full"),
        ("prefix_once", "the prompt once (prefix tree)"),
        ("padded_checkpointed", "every row padded, in full, gradient checkpointing"),
        ("prefix_once_checkpointed", "the prompt once, gradient checkpointing"),
    ):
        rows.append(f"| {label} | {r['seconds'][side]:.3f} | {peak.get(side, float('nan')):.1f} |")
    rows += [
        "",
        f"Time ratio {r['time_ratio']:.2f} ({r['time_ratio_checkpointed']:.2f} with gradient checkpointing) "
        f"against {r['counted_flops_ratio']:.2f} in counted forward FLOPs; the largest trained-logprob difference "
        f"{r['logprob_max_abs_diff']:.2e} ({r['logprob_max_abs_diff_checkpointed']:.2e}).",
        END,
    ]
    return rows


if __name__ == "__main__":
    sys.exit(main())
