"""Benchmark: prefixes computed once (trainer.share_prefix) against every row in full, counted and measured.

Counted (machine-independent): the forward FLOPs of one group per micro-batch, with and without the prefix-once
passes (`nemo_rcgrpo/data/prefix_tree.py`: 2 N per token plus the causal attention term; training is 3x
both, so the ratio is the training FLOPs' too):

- the shape the goal names: a prompt of P = 5400 tokens, suffixes of S = 300, G = 5, at Llama-3.1-8B's size;
- the shipped BFCL data's real lengths: one batch of RC-GRPO rollouts (stratified reward tokens, full tool
  documentation, SmolLM2's chat template) played by the scripted generator, each group's tree found from its
  token ids, counted at the 8B size and at SmolLM2-135M's.

Measured (CPU, this machine): the training part of an RC-GRPO step (the reference pass and the update, whose own
pass gives the ratio and the entropies) on those rollouts with SmolLM2-135M, one group per micro-batch, sharing
on and off, alternating, each from the same weights and optimizer state.

Usage: python scripts/bench/shared_prefix.py [--repeats 1] [--tasks 2] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_name, emit  # noqa: E402

from nemo_rcgrpo.data.prefix_tree import group_layout, layout_flops
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.recipes.rl import RLTrainer
from nemo_rcgrpo.utils.config import compose
from nemo_rcgrpo.utils.dist import init_distributed

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
    p.add_argument("--tasks", type=int, default=2, help="groups of G=5 in the measured batch")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured training parts per side (after a warm-up); 0: the counted part only")
    p.add_argument("--max-total-tokens", type=int, default=4096, help="a rollout's context budget")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    prepare(args.data)
    run_dir = tempfile.mkdtemp(prefix="shared_prefix_")
    overrides = [f"model.path={args.model}", "rl.stage1_recipe=null", f"data.dir={args.data}", f"run_dir={run_dir}",
                 "generation=scripted", "generation.scripted.success_high=0.8", "generation.scripted.success_low=0.2",
                 "chat.tool_description=full", f"rl.max_total_tokens={args.max_total_tokens}", "rl.max_turns=4",
                 "rl.sampling.max_new_tokens=256", f"rl.tasks_per_step={args.tasks}", "trainer.micro_batch_size=5",
                 "trainer.global_batch_size=10",
                 "logging.progress=false", "logging.tensorboard=false"]
    cfg = TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", overrides))
    trainer = RLTrainer(cfg, init_distributed())
    rollouts = trainer.collect(random.Random(0))
    groups, stats = rollouts.groups, rollouts.stats
    rewards, adv = trainer.advantages(groups)
    layouts = [group_layout([t.token_ids for t in g]) for g in groups]
    smol = trainer.flop_shape
    rows = counted(args, groups, layouts, smol)
    if args.repeats:
        rows += measured(args, cfg, trainer, groups, rewards, adv, stats)
    else:
        rows += ["", "The training part was not measured in this run (`--repeats 0`)."]
    rows.append(END)
    return emit(rows, args.out, START, END)


def counted(args, groups, layouts, smol) -> list[str]:
    goal_u, goal_s = counted_goal_shape()
    rows = [START, "## One prompt per group: prefixes computed once (`scripts/bench/shared_prefix.py`)", "",
            f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {torch.get_num_threads()} torch threads; "
            f"Python {platform.python_version()}, torch {torch.__version__}.", "",
            "Counted forward FLOPs of one group per micro-batch (2 N per token plus the causal attention term; "
            "training is 3x both):", "",
            "| micro-batch | shape | tokens in full | tokens computed | FLOPs in full | FLOPs shared | ratio |",
            "|---|---|---:|---:|---:|---:|---:|",
            f"| P = 5400, S = 300, G = 5 (the goal's) | Llama-3.1-8B | {5 * 5700} | {5400 + 5 * 300} | "
            f"{goal_u:.3e} | {goal_s:.3e} | {goal_u / goal_s:.2f}x |"]
    for i, (g, layout) in enumerate(zip(groups, layouts)):
        for name, shape in (("Llama-3.1-8B", LLAMA8B), (f"{args.model} ({smol[0] / 1e6:.0f}M)", smol)):
            u, s = layout_flops(layout, *shape)
            rows.append(f"| BFCL task {g[0].task_id}: root {layout.root}, branches "
                        f"{'/'.join(str(layout.root + b.length) for b in layout.branches)}, rows "
                        f"{min(layout.lengths)}-{max(layout.lengths)} tokens | {name} | {sum(layout.lengths)} | "
                        f"{layout.tokens} | {u:.3e} | {s:.3e} | {u / s:.2f}x |")
    rows += ["", f"Goal: at least {FLOPS_GOAL}x fewer at P = 5400, S = 300, G = 5: "
             f"{'met' if goal_u / goal_s >= FLOPS_GOAL else 'NOT met'} ({goal_u / goal_s:.2f}x)."]
    return rows


def measured(args, cfg, trainer, groups, rewards, adv, stats) -> list[str]:
    initial = copy.deepcopy(trainer.policy.state_dict())
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for rep in range(args.repeats + 1):  # the first round warms up both sides
        for share in (False, True) if rep % 2 == 0 else (True, False):
            trainer.policy.share_prefix = share
            trainer.policy.load_state_dict(initial["model"], initial["optimizer"], initial["scheduler"])
            metrics = trainer.train_step(groups, rewards, adv, dict(stats))
            if rep:
                runs[share].append(metrics)
    med = {share: {k: statistics.median(m[k] for m in rs) for k in ("logprob_seconds", "train_seconds", "loss",
                                                                   "entropy", "grad_norm")}
           for share, rs in runs.items()}
    for m in med.values():
        m["total"] = m["logprob_seconds"] + m["train_seconds"]
    ratio = med[True]["total"] / med[False]["total"]
    rows = ["", f"Measured: the training part of an RC-GRPO step (reference pass + update) on {len(groups)} groups of "
             f"G={cfg.rl.group_size} BFCL rollouts (full tool documentation, stratified reward tokens, scripted "
             f"generator, mean reward {statistics.mean(t.reward for g in groups for t in g):.2f}), {args.model} fp32, "
             f"one group per micro-batch, {args.repeats} measured step(s) per side after a warm-up each, alternating, "
             "each from the same weights and optimizer state.", "",
             "| side | reference pass (s) | update (s) | training part (s) | ratio |", "|---|---:|---:|---:|---:|"]
    for share, label in ((False, "every row in full (trainer.share_prefix=false)"),
                         (True, "prefixes once (trainer.share_prefix=true)")):
        m = med[share]
        rows.append(f"| {label} | {m['logprob_seconds']:.1f} | {m['train_seconds']:.1f} | {m['total']:.1f} | "
                    f"{m['total'] / med[False]['total']:.2f} |")
    same = abs(med[True]["loss"] - med[False]["loss"]) <= 1e-5 * max(1.0, abs(med[False]["loss"])) and \
        abs(med[True]["entropy"] - med[False]["entropy"]) <= 1e-4
    rows += ["", f"Same update on both sides: {'yes' if same else 'NO'} (loss {med[True]['loss']:.7f} vs "
             f"{med[False]['loss']:.7f}, entropy {med[True]['entropy']:.5f} vs {med[False]['entropy']:.5f}, grad norm "
             f"{med[True]['grad_norm']:.6f} vs {med[False]['grad_norm']:.6f}).", "",
             f"Goal: the training part at most {TIME_GOAL}x the unshared one: "
             f"{'met' if ratio <= TIME_GOAL else 'NOT met'} ({ratio:.2f}x). Peak memory is not measured here."]
    return rows


if __name__ == "__main__":
    sys.exit(main())
