"""Does reward conditioning work? Log-likelihood of held-out trajectories under each reward token.

For held-out (test-split) expert and failure trajectories, with the reward-goal
token put into the first user message, the model's summed log-probability of
the assistant tokens is computed under <|high_reward|> and under
<|low_reward|>:

    expert_margin  = mean over experts  of log p(traj | high) - log p(traj | low)   (want > 0)
    failure_margin = mean over failures of log p(traj | low)  - log p(traj | high)  (want > 0)

Before RCTP-FT both tokens have the same (mean) embedding, so both margins are
exactly 0; a conditioned model makes them positive.

A positive mean over a few examples is not evidence: each margin gets a 95%
bootstrap confidence interval of its mean over the examples (percentile method,
--bootstrap resamples, seeded), and conditioning counts as shown only when the
interval of both margins of the trained model lies above 0. Exit status 0 when
shown, 1 when not (an interval that includes 0, or one below 0: reversed).

Usage: python -m scripts.check_conditioning --model RUN/hf --data data/bfcl_v4 [--pairs 40] [--out docs/benchmarks.md]
       [--json margins.json]   (per-example margins, to recompute the intervals later)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.sft_data import Example, collate
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.models.torch_policy import token_logprobs
from scripts.bench._common import cpu_name, emit

START, END = "<!-- bench:conditioning:start -->", "<!-- bench:conditioning:end -->"
CONFIDENCE = 0.95


def bootstrap_ci(values: list[float], resamples: int, seed: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (fewer than 2 values: unbounded, nothing is shown)."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return (float("-inf"), float("inf"))
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def verdict(m: dict) -> str:
    """'shown' (interval above 0), 'not shown' (includes 0) or 'reversed' (below 0) for one margin."""
    lo, hi = m["ci"]
    return "shown" if lo > 0 else ("reversed" if hi < 0 else "not shown")


def summed_logprob(model, renderer, messages, tools, pad_id) -> float:
    tok = renderer.render(messages, tools)
    batch = collate([Example(tok.ids, tok.mask, "")], pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    return float((lp * batch.loss_mask).sum())


def margins(
    model_path: str,
    data: Path,
    pairs: int,
    tool_description: str,
    max_length: int,
    resamples: int = 10000,
    seed: int = 0,
) -> dict:
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path).eval()
    goal = RewardGoal()
    add_reward_tokens(tokenizer, model, (goal.high_token, goal.low_token))
    renderer = ChatRenderer(tokenizer, "hermes", tool_description=tool_description, renderer="project")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = {}
    for name, file, good in (("expert", "sft.jsonl", True), ("failure", "failures.jsonl", False)):
        records = [json.loads(l) for l in (data / file).read_text().splitlines()]
        records = [r for r in records if r["split"] == "test"]
        values = []
        for r in records:
            if len(values) >= pairs:
                break
            if len(renderer.render(r["messages"], r["tools"])) > max_length:
                continue
            high = summed_logprob(model, renderer, goal.apply(r["messages"], True), r["tools"], pad)
            low = summed_logprob(model, renderer, goal.apply(r["messages"], False), r["tools"], pad)
            values.append(high - low if good else low - high)
        if not values:
            raise SystemExit(f"no {name} trajectories of the test split fit in {max_length} tokens in {data / file}")
        out[name] = {
            "n": len(values),
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "ci": bootstrap_ci(values, resamples, seed),
            "values": values,
            "positive_share": sum(v > 0 for v in values) / len(values),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the RCTP-FT export (RUN/hf)")
    p.add_argument("--base", default="smollm2", help="the model before RCTP-FT, for the baseline")
    p.add_argument("--data", type=Path, default=Path("data/bfcl_v4"))
    p.add_argument("--pairs", type=int, default=40, help="examples per kind (expert, failure) at most")
    p.add_argument("--tool-description", default="compact")
    p.add_argument("--max-length", type=int, default=1536)
    p.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples for the 95%% intervals")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    p.add_argument("--train-note", default="", help="how the RCTP-FT run was made (goes into the report)")
    p.add_argument("--json", type=Path, help="also write the per-example margins and intervals here")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    t0 = time.perf_counter()
    base = margins(args.base, args.data, args.pairs, args.tool_description, args.max_length, args.bootstrap, args.seed)
    trained = margins(
        args.model, args.data, args.pairs, args.tool_description, args.max_length, args.bootstrap, args.seed
    )
    verdicts = {k: verdict(trained[k]) for k in ("expert", "failure")}
    ok = all(v == "shown" for v in verdicts.values())

    def ci(m: dict) -> str:
        lo, hi = m["ci"]
        return f"[{lo:+.3f}, {hi:+.3f}]"

    pct = int(round(100 * CONFIDENCE))
    rows = [
        START,
        "## Reward conditioning after CPU RCTP-FT (`scripts/check_conditioning.py`)",
        "",
        f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}; {args.train_note}",
        f"- Held-out (test split) trajectories of at most {args.max_length} tokens ({args.tool_description} tool "
        f"list), summed log-probability of the assistant tokens (nats); {pct}% intervals: percentile bootstrap of "
        f"the mean over the examples ({args.bootstrap} resamples, seed {args.seed}); measured in "
        f"{time.perf_counter() - t0:.0f} s.",
        "",
        f"| model | expert: log p(.|high) - log p(.|low) | {pct}% CI | share > 0 "
        f"| failure: log p(.|low) - log p(.|high) | {pct}% CI | share > 0 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in (
        (f"before ({args.base} + mean-initialised tokens)", base),
        (f"after RCTP-FT ({args.model})", trained),
    ):
        e, f = m["expert"], m["failure"]
        rows.append(
            f"| {name} | {e['mean']:+.3f} (n={e['n']}) | {ci(e)} | {e['positive_share']:.2f} "
            f"| {f['mean']:+.3f} (n={f['n']}) | {ci(f)} | {f['positive_share']:.2f} |"
        )
    rows += [
        "",
        (
            f"Verdict: conditioning shown (both {pct}% intervals of the trained model lie above 0)."
            if ok
            else f"Verdict: conditioning NOT shown (expert margin: {verdicts['expert']}, failure margin: "
            f"{verdicts['failure']}; shown needs the {pct}% interval above 0)."
        ),
        END,
    ]
    emit(rows, args.out, START, END)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "base": base,
                    "trained": trained,
                    "verdicts": verdicts,
                    "shown": ok,
                    "confidence": CONFIDENCE,
                    "bootstrap": args.bootstrap,
                    "seed": args.seed,
                },
                indent=1,
            )
        )
    for k in ("expert", "failure"):
        print(f"{k} margin {trained[k]['mean']:+.4f}, {pct}% CI {ci(trained[k])}: {verdicts[k]}", file=sys.stderr)
    print(
        "conditioning shown" if ok else "conditioning NOT shown (a confidence interval includes or is below 0)",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
