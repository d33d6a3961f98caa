"""Benchmark: prefixes computed once (trainer.share_prefix) against every row in full, counted and measured.

Counted (machine-independent): the forward FLOPs of one group per micro-batch, with and without the prefix-once
passes (`nemo_rcgrpo/data/prefix_tree.py`: 2 N per token plus the causal attention term; training is 3x
both, so the ratio is the training FLOPs' too):

- the shape the goal names: a prompt of P = 5400 tokens, suffixes of S = 300, G = 5, at Llama-3.1-8B's size;
- the shipped BFCL data's real lengths: one batch of RC-GRPO rollouts (stratified reward tokens, full tool
  documentation, SmolLM2's chat template) played by the scripted generator, each group's tree found from its
  token ids, counted at the 8B size and at SmolLM2-135M's.

Measured (CPU, this machine): the training part of an RC-GRPO step (the reference pass and the update, whose own
pass gives the ratio and the entropies) on those rollouts with SmolLM2-135M, each side in a process of its own
(its peak memory, ru_maxrss, is its own), from the same weights and optimizer state: the prompt once (one group
per micro-batch, the prefix tree) against every row in full, one rollout per micro-batch (the unshared path at
the group's micro-batch, five 5.7k-token rows padded, does not fit this machine's 24 GB: it ran out of memory).

Usage: python -m scripts.bench.shared_prefix [--repeats 1] [--tasks 1] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.prefix_tree import group_layout, layout_flops
from nemo_rcgrpo.models.shared_prefix import tree_pass
from nemo_rcgrpo.recipes.rl import RLTrainer
from nemo_rcgrpo.utils.config import compose
from nemo_rcgrpo.utils.dist import init_distributed
from scripts.bench._common import REPO, cpu_name, emit

START, END = "<!-- bench:shared_prefix:start -->", "<!-- bench:shared_prefix:end -->"
LLAMA8B = (8_030_261_248, 32, 4096)  # parameters, layers, hidden size
FLOPS_GOAL = 3.9  # counted forward FLOPs at least this much lower at P = 5400, S = 300, G = 5
TIME_GOAL = 0.4  # the measured training part at most this share of the unshared one


def counted_goal_shape() -> tuple[float, float]:
    prompt = list(range(5400))
    group = [prompt + [100_000 + g] * 300 for g in range(5)]
    return layout_flops(group_layout(group), *LLAMA8B)


def prepare(data: Path) -> None:
    if (data / "rl_train.jsonl").exists() or any(data.glob("rl_train*")):
        return
    from nemo_rcgrpo.prepare_data import PrepareDataConfig, run

    run(PrepareDataConfig(out_dir=str(data), categories=("base",), tokenizer=None, progress=False))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", type=Path, default=Path("outputs/bench/data_shared_prefix"))
    p.add_argument("--tasks", type=int, default=1, help="groups of G=5 in the measured batch")
    p.add_argument("--side", choices=("full", "shared"), help=argparse.SUPPRESS)  # one measured side (a subprocess)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measured training parts per side (after a warm-up); 0: the counted part only",
    )
    p.add_argument("--max-total-tokens", type=int, default=4096, help="a rollout's context budget")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    prepare(args.data)
    run_dir = tempfile.mkdtemp(prefix="shared_prefix_")
    # rl.max_turns=8: room for a task's whole ground truth, so the scripted successes score 1 and the measured
    # update has mixed rewards (a nonzero gradient to compare); at the recipe's 4 every rollout here scored 0
    overrides = [
        f"model.path={args.model}",
        "rl.stage1_recipe=null",
        f"data.dir={args.data}",
        f"run_dir={run_dir}",
        "generation=scripted",
        "generation.scripted.success_high=0.8",
        "generation.scripted.success_low=0.2",
        "chat.tool_description=full",
        f"rl.max_total_tokens={args.max_total_tokens}",
        "rl.max_turns=8",
        "rl.sampling.max_new_tokens=256",
        f"rl.tasks_per_step={args.tasks}",
        "trainer.micro_batch_size=5",
        "trainer.global_batch_size=10",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    if args.side:
        overrides.append("trainer.micro_batch_size=1" if args.side == "full" else "trainer.micro_batch_size=5")
    cfg = TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", overrides))
    trainer = RLTrainer.from_config(cfg, init_distributed())
    rollouts = trainer.collect(1, 0)
    groups, stats = rollouts.groups, rollouts.stats
    rewards, adv = trainer.advantages(groups)
    if args.side:
        return measure_side(args, trainer, groups, rewards, adv, stats)
    layouts = [group_layout([t.token_ids for t in g]) for g in groups]
    smol = trainer.parts.model.flop_shape
    rows = counted(args, groups, layouts, smol)
    attention = getattr(trainer.policy.model.config, "_attn_implementation", None)
    hows = sorted({tree_pass("cpu", attention, layout) for layout in layouts})  # how the rest of each tree runs
    if args.repeats:
        rows += measured(args, cfg, groups, hows)
    else:
        rows += ["", "The training part was not measured in this run (`--repeats 0`)."]
    rows.append(END)
    return emit(rows, args.out, START, END)


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def measure_side(args, trainer, groups, rewards, adv, stats) -> int:
    """One side's training parts (``--repeats`` of them, each from the same state): seconds, metrics, peak memory
    before and after, printed as one JSON line."""
    policy = trainer.policy
    policy.share_prefix, policy.packs = args.side == "shared", None  # the tree against padded rows
    state = copy.deepcopy(policy.state_dict())  # each repeat starts from it (the live tensors change)
    before = peak_gib()
    runs = []
    for _ in range(args.repeats):
        policy.load_state_dict(state["model"], state["optimizer"], state["scheduler"])
        runs.append(trainer.update(groups, rewards, adv, dict(stats)))
    keys = ("logprob_seconds", "train_seconds", "loss", "entropy", "grad_norm", "micro_batches", "forward_flops_saved")
    out = {k: statistics.median(m[k] for m in runs) for k in keys}
    out.update(
        side=args.side,
        micro_batch_size=trainer.updater.settings.micro_batch_size,
        peak_before_gib=before,
        peak_gib=peak_gib(),
    )
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def counted(args, groups, layouts, smol) -> list[str]:
    goal_u, goal_s = counted_goal_shape()
    rows = [
        START,
        "## One prompt per group: prefixes computed once (`scripts/bench/shared_prefix.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {torch.get_num_threads()} torch threads; "
        f"Python {platform.python_version()}, torch {torch.__version__}.",
        "",
        "Counted forward FLOPs of one group per micro-batch (2 N per token plus the causal attention term; "
        "training is 3x both):",
        "",
        "| micro-batch | shape | tokens in full | tokens computed | FLOPs in full | FLOPs shared | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
        f"| P = 5400, S = 300, G = 5 (the goal's) | Llama-3.1-8B | {5 * 5700} | {5400 + 5 * 300} | "
        f"{goal_u:.3e} | {goal_s:.3e} | {goal_u / goal_s:.2f}x |",
    ]
    for i, (g, layout) in enumerate(zip(groups, layouts)):
        for name, shape in (("Llama-3.1-8B", LLAMA8B), (f"{args.model} ({smol[0] / 1e6:.0f}M)", smol)):
            u, s = layout_flops(layout, *shape)
            rows.append(
                f"| BFCL task {g[0].task_id}: root {layout.root}, branches "
                f"{'/'.join(str(layout.root + b.length) for b in layout.branches)}, rows "
                f"{min(layout.lengths)}-{max(layout.lengths)} tokens | {name} | {sum(layout.lengths)} | "
                f"{layout.tokens} | {u:.3e} | {s:.3e} | {u / s:.2f}x |"
            )
    rows += [
        "",
        f"Goal: at least {FLOPS_GOAL}x fewer at P = 5400, S = 300, G = 5: "
        f"{'met' if goal_u / goal_s >= FLOPS_GOAL else 'NOT met'} ({goal_u / goal_s:.2f}x).",
    ]
    return rows


def measured(args, cfg, groups, hows) -> list[str]:
    """Each side in a process of its own (alternating order over ``--repeats`` is not needed: one process each)."""
    med = {}
    for side in ("full", "shared"):
        argv = [
            sys.executable,
            "-m",
            "scripts.bench.shared_prefix",
            "--side",
            side,
            "--model",
            args.model,
            "--data",
            str(args.data),
            "--tasks",
            str(args.tasks),
            "--repeats",
            str(args.repeats),
            "--max-total-tokens",
            str(args.max_total_tokens),
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return ["", f"Measured: the {side} side failed (exit {proc.returncode}): {' / '.join(tail)}"]
        med[side] = json.loads(lines[-1][len("RESULT ") :])
    for m in med.values():
        m["total"] = m["logprob_seconds"] + m["train_seconds"]
    ratio = med["shared"]["total"] / med["full"]["total"]
    rows = [
        "",
        f"Measured: the training part of an RC-GRPO step (reference pass + update) on {len(groups)} group(s) of "
        f"G={cfg.rl.group_size} BFCL rollouts (full tool documentation, stratified reward tokens, scripted "
        f"generator, mean reward {statistics.mean(t.reward for g in groups for t in g):.2f}), {args.model} fp32, "
        f"the median of {args.repeats} step(s) per side, each side in its own process from the same weights and "
        "optimizer state; peak memory: the process's peak resident set (ru_maxrss) after the training parts, "
        "and before them (model, rollouts).",
        "",
        "| side | micro-batches | reference pass (s) | update (s) | training part (s) | ratio | peak before (GiB) "
        "| peak (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, label in (
        ("full", "every row in full, one rollout per micro-batch (trainer.share_prefix=false)"),
        (
            "shared",
            "the prompt once, one group per micro-batch (trainer.share_prefix=true; the "
            f"rest of the tree {' / '.join(hows)}, `tree_pass`)",
        ),
    ):
        m = med[side]
        rows.append(
            f"| {label} | {m['micro_batches']:.0f} | {m['logprob_seconds']:.1f} | {m['train_seconds']:.1f} | "
            f"{m['total']:.1f} | {m['total'] / med['full']['total']:.2f} | {m['peak_before_gib']:.1f} | "
            f"{m['peak_gib']:.1f} |"
        )
    a, b = med["shared"], med["full"]
    same = abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"])) and abs(a["entropy"] - b["entropy"]) <= 1e-4
    rows += [
        "",
        f"Same update on both sides: {'yes' if same else 'NO'} (loss {a['loss']:.7f} vs {b['loss']:.7f}, "
        f"entropy {a['entropy']:.5f} vs {b['entropy']:.5f}, grad norm {a['grad_norm']:.6f} vs "
        f"{b['grad_norm']:.6f})"
        + (
            ": every advantage was 0, so both losses and gradients are 0 and only the entropies compare (more "
            "groups, --tasks, give mixed rewards)."
            if a["grad_norm"] == b["grad_norm"] == 0
            else "."
        ),
        "",
        f"Goal: the training part at most {TIME_GOAL}x the unshared one: "
        f"{'met' if ratio <= TIME_GOAL else 'NOT met'} ({ratio:.2f}x); peak memory "
        f"{'lower' if a['peak_gib'] < b['peak_gib'] else 'NOT lower'} ({a['peak_gib']:.1f} against "
        f"{b['peak_gib']:.1f} GiB).",
    ]
    return rows


if __name__ == "__main__":
    sys.exit(main())
