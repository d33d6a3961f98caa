"""Benchmark: Megatron-Core training throughput and MFU of a Llama-3.1-8B-shaped model on one GPU (bf16).

A randomly initialised GPTModel with Llama-3.1-8B's shape (32 layers, hidden
4096, FFN 14336, 32 heads / 8 KV heads, vocabulary 128256, RoPE theta 5e5 with
Llama-3 scaling, untied embeddings) built by the backend's own builder
(``nemo_rcgrpo.models.megatron.builder``), wrapped in megatron DDP with the
distributed optimizer (bf16 parameters, fp32 master weights), trained on random tokens at TP=1, sequence 4096, micro-batch 1.

Reported: tokens/s/GPU and MFU = model FLOPs per second / peak, with the
PaLM-style count of training FLOPs per token (no causal discount, no
recomputation counted):

    flops/token = 6 * N + 12 * L * h * s
    N = L * (h * (h + 2 * kv_heads * head_dim)   # QKV
             + h * h                              # attention output
             + 3 * h * ffn)                       # SwiGLU
        + V * h                                   # output layer (the input embedding is a lookup)

against 989 TFLOP/s dense bf16 (H100/H200 SXM). Public anchor: Megatron-Core
Llama-3-8B reaches about 41-47% MFU in bf16 on H100; the target here is >= 45%.

Usage (GPU container, one GPU):
    python scripts/bench/megatron_gpu.py [--steps 20 --warmup 5 --seq 4096 --spec te] [--out docs/benchmarks.md]
    torchrun --nproc-per-node 1 scripts/bench/megatron_gpu.py ...
Memory on one GPU (not yet measured): bf16 weights 16 GB + bf16 gradients 16 GB + fp32 master weights
32 GB + Adam moments 64 GB = 128 GB before activations (about 1 GB per layer at sequence 4096 without
recomputation), so a 141 GB H200 is at its limit; ``--recompute full`` or ``--layers 24`` (same width,
fewer layers; MFU per layer is what the shape sets) are the ways down. ``--grad-fp32`` reduces gradients
in fp32 (16 GB more).
Check of the CPU-side logic (tiny shape, CPU compatibility layer, 2 steps):
    python scripts/bench/megatron_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

START, END = "<!-- bench:megatron_gpu:start -->", "<!-- bench:megatron_gpu:end -->"
PEAK_BF16_TFLOPS = 989.0

LLAMA31_8B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
                  tie_word_embeddings=False, rms_norm_eps=1e-5)
TINY = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
            rms_norm_eps=1e-5)


def flops_per_token(shape: dict, seq: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), PaLM-style (see the module docstring)."""
    L, h, ffn, V = shape["num_hidden_layers"], shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    n = L * (h * (h + 2 * kv * d) + h * h + 3 * h * ffn) + V * h
    return 6.0 * n + 12.0 * L * h * seq


def mfu(tokens_per_s_per_gpu: float, shape: dict, seq: int, peak_tflops: float = PEAK_BF16_TFLOPS) -> float:
    return tokens_per_s_per_gpu * flops_per_token(shape, seq) / (peak_tflops * 1e12)


def build(shape: dict, args):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import LlamaConfig

    from nemo_rcgrpo.config import MegatronConfig
    from nemo_rcgrpo.models.megatron.builder import build_gpt, init_parallel

    par = init_parallel(args.tp, 1, 1, seed=1234)
    mcfg = MegatronConfig(tp=args.tp, recompute=args.recompute, fp8=args.fp8, distributed_optimizer=True)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model, _, config = build_gpt(LlamaConfig(**shape), mcfg, params_dtype=dtype, spec=args.spec)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.grad_fp32, overlap_grad_reduce=False, use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=dtype == torch.bfloat16,
                                                 params_dtype=dtype, use_distributed_optimizer=True, clip_grad=1.0),
                                 [ddp])
    return par, ddp, opt


def run(args) -> dict:
    shape = dict(TINY) if args.tiny else dict(LLAMA31_8B, num_hidden_layers=args.layers)
    seq = 64 if args.tiny else args.seq
    par, ddp, opt = build(shape, args)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.micro_batch, seq + 1), generator=g).to(device)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    pos = torch.arange(seq, device=device).unsqueeze(0).expand_as(inputs)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(inputs, pos, None, labels=labels).float().mean()  # [b, s] per-token losses -> mean
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    tokens = args.micro_batch * seq * par.dp  # per step, all GPUs
    world = par.dp * par.tp
    tps_gpu = tokens * len(times) / sum(times) / world
    out = {"date": dt.date.today().isoformat(), "shape": "tiny" if args.tiny else "llama-3.1-8b",
           "layers": shape["num_hidden_layers"], "seq": seq,
           "micro_batch": args.micro_batch, "tp": args.tp, "dp": par.dp, "spec": args.spec or "local",
           "fp8": args.fp8, "recompute": args.recompute, "steps": len(times),
           "step_seconds": sum(times) / len(times), "tokens_per_s_per_gpu": tps_gpu,
           "flops_per_token": flops_per_token(shape, seq), "peak_tflops": args.peak_tflops,
           "mfu": mfu(tps_gpu, shape, seq, args.peak_tflops), "first_loss": losses[0], "last_loss": losses[-1],
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "python": platform.python_version()}
    try:
        import megatron.core

        out["megatron_core"] = megatron.core.__version__
    except AttributeError:
        pass
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=32, help="layers of the 8B shape (32 = Llama-3.1-8B)")
    p.add_argument("--grad-fp32", action="store_true", help="reduce gradients in fp32 (more memory)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--spec", choices=("te", "local"), default=None,
                   help="layer spec (default: te when transformer_engine is installed, else local)")
    p.add_argument("--fp8", choices=("hybrid", "e4m3"), default=None)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--peak-tflops", type=float, default=PEAK_BF16_TFLOPS)
    p.add_argument("--tiny", action="store_true", help="tiny shape, 2+1 steps, runs on CPU (checks the script)")
    p.add_argument("--json", type=Path, help="also write the raw result here")
    p.add_argument("--out", type=Path, help="Markdown file to update (docs/benchmarks.md)")
    args = p.parse_args()
    if args.spec is None:
        from nemo_rcgrpo.models.megatron.builder import transformer_engine_available

        args.spec = "te" if transformer_engine_available() and torch.cuda.is_available() else "local"
    if args.tiny:
        args.steps, args.warmup = 2, 1
    elif not torch.cuda.is_available():
        sys.exit("error: the 8B benchmark needs a GPU; use --tiny to check the script on CPU")
    r = run(args)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if not rank0:
        return 0
    print(json.dumps(r, indent=1), file=sys.stderr)
    if args.tiny:  # the script's logic ran; a tiny CPU shape says nothing about GPU speed
        print(f"tiny check: {r['steps']} steps, loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, "
              f"{r['tokens_per_s_per_gpu']:.0f} tokens/s, MFU formula {r['mfu']:.2e} (vs {r['peak_tflops']} TFLOP/s)")
        return 0
    from env_replay import emit

    rows = [START, "## Megatron-Core on GPU: Llama-3.1-8B shape, bf16 (`scripts/bench/megatron_gpu.py`)", "",
            f"- Date: {r['date']}; {r['device']}; torch {r['torch']}, megatron-core {r.get('megatron_core', '?')}; "
            f"spec {r['spec']}, fp8 {r['fp8']}, recompute {r['recompute']}.",
            f"- Random init, TP={r['tp']} DP={r['dp']}, sequence {r['seq']}, micro-batch {r['micro_batch']}, distributed "
            f"optimizer; {r['steps']} timed steps after {args.warmup} warm-up steps; {r['layers']} layers.", "",
            "| tokens/s/GPU | step seconds | MFU (vs 989 TFLOP/s bf16) | target |", "|---:|---:|---:|---:|",
            f"| {r['tokens_per_s_per_gpu']:.0f} | {r['step_seconds']:.3f} | {100 * r['mfu']:.1f}% | >= 45% |", "",
            "FLOPs per token: 6N + 12 L h s (PaLM-style). Anchor: Megatron-Core Llama-3-8B bf16 on H100, "
            "about 41-47% MFU.", END]
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
