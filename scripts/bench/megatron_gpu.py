"""Benchmark: Megatron-Core training throughput and MFU of a Llama-3.1-8B-shaped model on one GPU (bf16).

A randomly initialised GPTModel with Llama-3.1-8B's shape (hidden 4096, FFN
14336, 32 heads / 8 KV heads, vocabulary 128256, RoPE theta 5e5 with Llama-3
scaling, untied embeddings) and fewer layers by default (16: the full 32 need
about 128 GB of static state, more than one H200 holds with activations),
built by the backend's own builder with the flags ``flags.decide`` picks for
this machine (Transformer Engine spec where TE imports), wrapped in megatron
DDP with the distributed optimizer (bf16 parameters, fp32 master weights),
trained on random tokens at TP=1, sequence 4096, ``--micro-batches`` micro-batches of ``--micro-batch``
sequences accumulated per optimizer step. The forward+backward passes are timed apart from the optimizer
step, and the first step (where megatron's fused kernels compile) apart from the timed ones. Every result
names its setup ("local spec, no TE, torch AdamW" on a machine without Transformer Engine and apex): an MFU
without TE's fused attention and apex's fused Adam says little about a full NGC image.

Two FLOP counts per token, both printed:

- Megatron's own (``num_floating_point_operations`` in Megatron-LM's training
  loop): 6 x (QKV, attention output, SwiGLU and output-layer weights, padded
  vocabulary) + 6 L s h for attention scores and values, causal (half the
  score matrix);
- PaLM-style: the same weights + 12 L s h (no causal discount), about 7% more
  at this shape.

MFU against two ceilings: the device's dense bf16 peak from its name (H100 /
H200 SXM 989 TFLOP/s, H200 NVL and H100 NVL 835, H100 PCIe 756, A100 312;
``--peak-tflops`` otherwise), and a large bf16 matmul's achieved TFLOP/s,
measured in the same run (the practical ceiling). Public anchor:
Megatron-Core Llama-3-8B bf16 on H100 reaches about 41-47% MFU in its own
accounting; the target here is >= 45% with the TE spec.

Usage (one GPU; runs from a checkout, nemo_rcgrpo installed or not):
    python -m scripts.bench.megatron_gpu [--layers 16 --steps 20 --warmup 5 --seq 4096 --spec te] [--out docs/benchmarks.md]
Memory (bytes per parameter: bf16 weights 2 + bf16 gradients 2 + fp32 master 4 + Adam moments 8 = 16):
32 layers are 8.0e9 parameters, 128 GB before activations; 16 layers 4.5e9, about 73 GB plus about 1 GB
of activations per layer at sequence 4096. ``--recompute full`` lowers the activations.
Check of the CPU-side logic (tiny shape, CPU compatibility layer, 2 steps):
    python -m scripts.bench.megatron_gpu --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

START, END = "<!-- bench:megatron_gpu:start -->", "<!-- bench:megatron_gpu:end -->"
# dense bf16 TFLOP/s by device name, most specific first (NVIDIA data sheets; sparsity not counted)
PEAKS = (
    ("H200 NVL", 835.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
)

LLAMA31_8B = dict(
    num_hidden_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
TINY = dict(
    num_hidden_layers=2,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)


def _weights_per_token(shape: dict) -> float:
    """Multiply-accumulates per token of the weight matrices (QKV, attention output, SwiGLU, output layer)."""
    L, h, ffn, V = shape["num_hidden_layers"], shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    return L * (h * (h + 2 * kv * d) + h * h + 3 * h * ffn) + V * h


def flops_per_token(shape: dict, seq: int) -> float:
    """Training FLOPs per token, PaLM-style: 6 N + 12 L h s (no causal discount)."""
    return 6.0 * _weights_per_token(shape) + 12.0 * shape["num_hidden_layers"] * shape["hidden_size"] * seq


def megatron_flops_per_token(shape: dict, seq: int, tp: int = 1) -> float:
    """Training FLOPs per token as Megatron-LM counts them (causal attention: half the score matrix; the
    padded vocabulary)."""
    from nemo_rcgrpo.models.megatron.convert import padded_vocab_size

    padded = dict(shape, vocab_size=padded_vocab_size(shape["vocab_size"], tp))
    return 6.0 * _weights_per_token(padded) + 6.0 * shape["num_hidden_layers"] * shape["hidden_size"] * seq


def mfu(tokens_per_s_per_gpu: float, flops_per_token_: float, peak_tflops: float) -> float:
    return tokens_per_s_per_gpu * flops_per_token_ / (peak_tflops * 1e12)


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a device by its name, or None when it is not in the table."""
    return next((peak for key, peak in PEAKS if key in device_name), None)


def matmul_tflops(n: int = 8192, repeats: int = 20) -> float:
    """Achieved bf16 TFLOP/s of an n x n x n matmul on this GPU (the practical ceiling)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


def build(shape: dict, args):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import LlamaConfig

    from nemo_rcgrpo.config_schema import MegatronConfig
    from nemo_rcgrpo.models.megatron.builder import build_gpt, init_parallel, platform_flags

    par = init_parallel(args.tp, 1, 1, seed=1234)
    mcfg = MegatronConfig(
        tp=args.tp,
        recompute=args.recompute,
        fp8=args.fp8,
        spec=args.spec,
        distributed_optimizer=True,
        grad_reduce_in_fp32=args.grad_fp32,
    )
    dtype = torch.float32 if args.tiny else torch.bfloat16
    flags = platform_flags(mcfg, dtype, par.dp)  # the training backend's own choices for this machine
    model, _, config = build_gpt(LlamaConfig(**shape), mcfg, params_dtype=dtype, flags=flags)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**flags.ddp), model)
    if flags.ddp["overlap_grad_reduce"]:
        config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-5,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [ddp],
        **flags.optimizer,
    )
    return par, ddp, opt, flags


def run(args) -> dict:
    from megatron.core.distributed import finalize_model_grads

    shape = dict(TINY) if args.tiny else dict(LLAMA31_8B, num_hidden_layers=args.layers)
    seq = 64 if args.tiny else args.seq
    par, ddp, opt, flags = build(shape, args)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.micro_batch, seq + 1), generator=g).to(device)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    pos = torch.arange(seq, device=device).unsqueeze(0).expand_as(inputs)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    n_micro = args.micro_batches
    times, fwd_bwd, opt_times, losses, first = [], [], [], [], None
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss_sum = 0.0
        for i in range(n_micro):  # gradient accumulation: the DP reduction once, after the last micro-batch
            sync_ctx = ddp.no_sync() if i < n_micro - 1 else contextlib.nullcontext()
            with sync_ctx:
                loss = ddp(inputs, pos, None, labels=labels).float().mean() / n_micro  # [b, s] -> mean
                loss.backward()
            loss_sum += float(loss.detach())
        finalize_model_grads([ddp])  # DP reduction and, with sequence parallel, the norms' TP all-reduce
        sync()
        t1 = time.perf_counter()
        ok, grad_norm, _ = opt.step()
        sync()
        t2 = time.perf_counter()
        if step == 0:
            first = t2 - t0  # compiles (megatron's jit_fuser is torch.compile) and allocator warm-up
        if step >= args.warmup:
            times.append(t2 - t0)
            fwd_bwd.append(t1 - t0)
            opt_times.append(t2 - t1)
        losses.append(loss_sum)
    tokens = args.micro_batch * n_micro * seq * par.dp  # per step, all GPUs
    world = par.dp * par.tp
    tps_gpu = tokens * len(times) / sum(times) / world
    tps_fwd_bwd = tokens * len(fwd_bwd) / sum(fwd_bwd) / world
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak = args.peak_tflops or peak_tflops(device)
    ceiling = matmul_tflops() if cuda else None
    try:
        import apex  # noqa: F401

        optimizer = "apex FusedAdam"
    except ImportError:
        optimizer = "torch AdamW"
    te = "TE" if flags.spec == "te" else "no TE"
    setup = f"{flags.spec} spec, {te}, {optimizer}" + (f", fp8 {args.fp8}" if args.fp8 else "")
    f_megatron, f_palm = megatron_flops_per_token(shape, seq, args.tp), flops_per_token(shape, seq)
    out = {
        "date": dt.date.today().isoformat(),
        "shape": "tiny" if args.tiny else "llama-3.1-8b",
        "layers": shape["num_hidden_layers"],
        "seq": seq,
        "micro_batch": args.micro_batch,
        "micro_batches": n_micro,
        "tp": args.tp,
        "setup": setup,
        "dp": par.dp,
        "spec": flags.spec,
        "fp8": args.fp8,
        "recompute": args.recompute,
        "steps": len(times),
        "step_seconds": sum(times) / len(times),
        "forward_backward_seconds": sum(fwd_bwd) / len(fwd_bwd),
        "optimizer_seconds": sum(opt_times) / len(opt_times),
        "first_step_seconds": first,
        "tokens_per_s_per_gpu": tps_gpu,
        "tokens_per_s_per_gpu_forward_backward": tps_fwd_bwd,
        "flops_per_token_megatron": f_megatron,
        "flops_per_token_palm": f_palm,
        "peak_tflops": peak,
        "matmul_tflops": ceiling,
        "mfu_megatron": mfu(tps_gpu, f_megatron, peak) if peak else None,
        "mfu_palm": mfu(tps_gpu, f_palm, peak) if peak else None,
        "mfu_vs_matmul": mfu(tps_gpu, f_megatron, ceiling) if ceiling else None,
        "mfu_megatron_forward_backward": mfu(tps_fwd_bwd, f_megatron, peak) if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import megatron.core

        out["megatron_core"] = megatron.core.__version__
    except AttributeError:
        pass
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step (accumulated)")
    p.add_argument(
        "--fallback-layers",
        type=int,
        default=None,
        help="layers to retry with when --layers runs out of GPU memory (reported as oom_at_layers)",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--layers", type=int, default=16, help="layers of the 8B shape (32 = Llama-3.1-8B, too big for one GPU)"
    )
    p.add_argument("--grad-fp32", action="store_true", help="reduce gradients in fp32 (more memory)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument(
        "--spec",
        choices=("auto", "te", "local"),
        default="auto",
        help="layer spec (auto: te where transformer_engine imports on a GPU, else local)",
    )
    p.add_argument("--fp8", choices=("hybrid", "e4m3"), default=None)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: from the device name)")
    p.add_argument("--tiny", action="store_true", help="tiny shape, 2+1 steps, runs on CPU (checks the script)")
    p.add_argument("--json", type=Path, help="also write the raw result here")
    p.add_argument("--out", type=Path, help="Markdown file to update (docs/benchmarks.md)")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup = 2, 1
    elif not torch.cuda.is_available():
        sys.exit("error: the 8B benchmark needs a GPU; use --tiny to check the script on CPU")
    oom_at = None
    try:
        r = run(args)
    except torch.cuda.OutOfMemoryError:
        if not args.fallback_layers or args.fallback_layers >= args.layers:
            raise
        oom_at = args.layers
    if oom_at is not None:  # outside the except block: the failed run's frames (and tensors) are gone
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        args.layers = args.fallback_layers
        r = dict(run(args), oom_at_layers=oom_at)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if not rank0:
        return 0
    print(json.dumps(r, indent=1), file=sys.stderr)
    if args.tiny:  # the script's logic ran; a tiny CPU shape says nothing about GPU speed
        print(
            f"tiny check: {r['steps']} steps, loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, "
            f"{r['tokens_per_s_per_gpu']:.0f} tokens/s, {r['flops_per_token_megatron']:.3e} FLOPs/token (Megatron)"
        )
        return 0
    from scripts.bench._common import emit

    def pct(value, fmt: str = ".1%") -> str:
        return "n/a" if value is None else format(value, fmt)

    rows = [
        START,
        "## Megatron-Core on GPU: Llama-3.1-8B shape, bf16 (`scripts/bench/megatron_gpu.py`)",
        "",
        f"- Date: {r['date']}; {r['device']}; torch {r['torch']}, megatron-core {r.get('megatron_core', '?')}; "
        f"spec {r['spec']}, fp8 {r['fp8']}, recompute {r['recompute']}.",
        f"- Random init, TP={r['tp']} DP={r['dp']}, sequence {r['seq']}, {r['micro_batches']} micro-batch(es) of "
        f"{r['micro_batch']} per step (accumulated), distributed optimizer; {r['steps']} timed steps after "
        f"{args.warmup} warm-up steps (the first, compiles included: {r['first_step_seconds']:.1f} s); "
        f"{r['layers']} layers"
        + (f" ({r['oom_at_layers']} ran out of memory)" if r.get("oom_at_layers") else "")
        + f". Setup: {r['setup']}.",
        "",
        f"| setup | tokens/s/GPU | step s | forward+backward s | optimizer s | MFU, Megatron count (vs "
        f"{pct(r['peak_tflops'], '.0f')} TFLOP/s) | MFU, PaLM count | vs measured matmul "
        f"({pct(r['matmul_tflops'], '.0f')} TFLOP/s) | MFU of forward+backward alone | peak memory GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['setup']} | {r['tokens_per_s_per_gpu']:.0f} | {r['step_seconds']:.3f} "
        f"| {r['forward_backward_seconds']:.3f} | {r['optimizer_seconds']:.3f} | {pct(r['mfu_megatron'])} "
        f"| {pct(r['mfu_palm'])} | {pct(r['mfu_vs_matmul'])} | {pct(r['mfu_megatron_forward_backward'])} "
        f"| {pct(r['peak_memory_gib'], '.1f')} |",
        "",
        "FLOPs per token: Megatron's count 6N + 6 L h s (causal), PaLM's 6N + 12 L h s. Anchor: "
        "Megatron-Core Llama-3-8B bf16 on H100, about 41-47% MFU.",
        END,
    ]
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
