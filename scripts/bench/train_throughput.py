"""Benchmark: stage-1 training throughput of the torch backend vs a bare loop, same batches, same run.

Bare loop: ``model(input_ids, attention_mask, labels)`` (HF's own shifted
cross-entropy over the full vocabulary), ``loss.backward()``, ``optimizer.step()``.
Backend: `TorchPolicy.train_step` with `sft_loss` (global valid-token
normalisation, logits only at trained positions, gradient clipping, LR
schedule). Both start from the same weights and see the same micro-batches,
interleaved step by step so machine load affects both alike.

``--dtype bfloat16``: both models in bf16; the bare loop's AdamW updates the
bf16 weights directly, the backend keeps fp32 master weights (the cost of
updates that do not round away). ``--device cuda`` runs both on the GPU
(``scripts/gpu_check.sh`` does, with ``--json``).

Usage: python -m scripts.bench.train_throughput [--model smollm2] [--steps 6] [--dtype float32|bfloat16]
       [--device cpu|cuda] [--json result.json] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

from nemo_rcgrpo.algorithms.losses import sft_loss
from nemo_rcgrpo.config_schema import TrainerConfig
from nemo_rcgrpo.data.sft_data import build_examples, collate, load_records
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.models.torch_policy import TorchPolicy
from nemo_rcgrpo.utils.dist import DistInfo
from scripts.bench._common import cpu_name, emit

START, END = "<!-- bench:train_throughput:start -->", "<!-- bench:train_throughput:end -->"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", type=Path, default=Path("data/bfcl_v4"))
    p.add_argument("--steps", type=int, default=6, help="measured steps per side (after one warm-up step each)")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch (right-padded)")
    p.add_argument("--max-length", type=int, default=1536)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, help="also write the raw result here")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokenizer, model = load_tokenizer(args.model), load_model(args.model, args.dtype)
    add_reward_tokens(tokenizer, model, ("<|high_reward|>", "<|low_reward|>"))
    renderer = ChatRenderer(tokenizer, "hermes", tool_description="compact")
    per_step = args.micro * args.batch
    examples, _ = build_examples(
        load_records(args.data / "rctp.jsonl", "train"), renderer, args.max_length, 0, (args.steps + 1) * per_step
    )
    if len(examples) < (args.steps + 1) * per_step:
        sys.exit(
            f"error: {len(examples)} training lines in {args.data / 'rctp.jsonl'}, "
            f"{(args.steps + 1) * per_step} needed for --steps {args.steps} x --micro {args.micro} x --batch {args.batch}"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    steps = [
        [
            collate(examples[s * per_step + m * args.batch : s * per_step + (m + 1) * args.batch], pad)
            for m in range(args.micro)
        ]
        for s in range(args.steps + 1)
    ]

    bare_model = copy.deepcopy(model).to(device).train()
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-5)
    # the same work as the bare loop: every row padded, in full (trainer.share_prefix would run shared prompts
    # once, trainer.pack_sequences the rows without padding)
    policy = TorchPolicy(
        model,
        TrainerConfig(lr=1e-5, warmup_steps=0, schedule="constant", share_prefix=False, pack_sequences=False),
        DistInfo(device=device),
        100,
    )

    def bare_step(mbs):
        bare_opt.zero_grad(set_to_none=True)
        for mb in mbs:
            mb = mb.to(device)
            labels = mb.input_ids.masked_fill(mb.loss_mask == 0, -100)
            out = bare_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, labels=labels)
            (out.loss / len(mbs)).backward()
        bare_opt.step()

    def backend_step(mbs):
        valid = float(sum(int(mb.loss_mask.sum()) for mb in mbs))
        policy.train_step(mbs, sft_loss, valid)

    times = {"bare": 0.0, "backend": 0.0}
    tokens = 0
    for i, mbs in enumerate(steps):
        for name, fn in (
            (("bare", bare_step), ("backend", backend_step))
            if i % 2
            else (("backend", backend_step), ("bare", bare_step))
        ):
            sync()
            t0 = time.perf_counter()
            fn(mbs)
            sync()
            if i > 0:
                times[name] += time.perf_counter() - t0
        if i > 0:
            tokens += sum(int(mb.attention_mask.sum()) for mb in mbs)
    bare_tps, backend_tps = tokens / times["bare"], tokens / times["backend"]
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": dt.date.today().isoformat(),
                    "model": args.model,
                    "dtype": args.dtype,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "steps": args.steps,
                    "micro_batches": args.micro,
                    "batch": args.batch,
                    "max_length": args.max_length,
                    "tokens": tokens,
                    "bare_tokens_per_s": bare_tps,
                    "backend_tokens_per_s": backend_tps,
                    "ratio": backend_tps / bare_tps,
                },
                indent=1,
            )
        )
    rows = [
        START,
        "## Stage-1 training throughput (`scripts/bench/train_throughput.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {torch.get_num_threads()} torch threads; "
        f"Python {platform.python_version()}, torch {torch.__version__}.",
        f"- {args.model}, {args.dtype} on {args.device}, AdamW; {args.steps} measured optimizer steps per side of "
        f"{args.micro} micro-batches x {args.batch} sequences "
        f"(RCTP-FT training lines, compact tools, <= {args.max_length} tokens; {tokens} tokens per side), "
        "interleaved, after one warm-up step each.",
        "",
        "| loop | tokens/s | ratio to bare |",
        "|---|---:|---:|",
        f"| bare HF loop (labels, full-vocabulary loss) | {bare_tps:.1f} | 1.00 |",
        f"| torch backend `train_step` | {backend_tps:.1f} | {backend_tps / bare_tps:.2f} |",
        "",
        "Target: the backend at least 0.9 of the bare loop.",
        END,
    ]
    return emit(rows, args.out, START, END)


if __name__ == "__main__":
    sys.exit(main())
