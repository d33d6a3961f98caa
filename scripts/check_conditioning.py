"""Does reward conditioning work? Log-likelihood of held-out trajectories under each reward token.

For held-out (test-split) expert and failure trajectories, with the reward-goal
token put into the first user message, the model's summed log-probability of
the assistant tokens is computed under <|high_reward|> and under
<|low_reward|>:

    expert_margin  = mean over experts  of log p(traj | high) - log p(traj | low)   (want > 0)
    failure_margin = mean over failures of log p(traj | low)  - log p(traj | high)  (want > 0)

Before RCTP-FT both tokens have the same (mean) embedding, so both margins are
exactly 0; a conditioned model makes them positive.

Usage: python scripts/check_conditioning.py --model RUN/hf --data data/bfcl_v4 [--pairs 40] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from env_replay import cpu_name, emit  # noqa: E402

from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.sft_data import collate, Example
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.models.torch_policy import token_logprobs

START, END = "<!-- bench:conditioning:start -->", "<!-- bench:conditioning:end -->"


def summed_logprob(model, renderer, messages, tools, pad_id) -> float:
    tok = renderer.render(messages, tools)
    batch = collate([Example(tok.ids, tok.mask, "")], pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    return float((lp * batch["loss_mask"]).sum())


def margins(model_path: str, data: Path, pairs: int, tool_description: str, max_length: int) -> dict:
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
        out[name] = {"n": len(values), "mean": sum(values) / len(values),
                     "positive_share": sum(v > 0 for v in values) / len(values)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the RCTP-FT export (RUN/hf)")
    p.add_argument("--base", default="smollm2", help="the model before RCTP-FT, for the baseline")
    p.add_argument("--data", type=Path, default=Path("data/bfcl_v4"))
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--tool-description", default="compact")
    p.add_argument("--max-length", type=int, default=1536)
    p.add_argument("--train-note", default="", help="how the RCTP-FT run was made (goes into the report)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    t0 = time.perf_counter()
    base = margins(args.base, args.data, args.pairs, args.tool_description, args.max_length)
    trained = margins(args.model, args.data, args.pairs, args.tool_description, args.max_length)
    rows = [START, "## Reward conditioning after CPU RCTP-FT (`scripts/check_conditioning.py`)", "",
            f"- Date: {dt.date.today().isoformat()}; machine: {cpu_name()}; {args.train_note}",
            f"- Held-out (test split) trajectories of at most {args.max_length} tokens (compact tool list), "
            f"summed log-probability of the assistant tokens; measured in {time.perf_counter() - t0:.0f} s.", "",
            "| model | expert: log p(.|high) - log p(.|low) | share > 0 | failure: log p(.|low) - log p(.|high) | share > 0 |",
            "|---|---:|---:|---:|---:|"]
    for name, m in (("before (SmolLM2 + mean-initialised tokens)", base), ("after RCTP-FT", trained)):
        rows.append(f"| {name} | {m['expert']['mean']:+.3f} (n={m['expert']['n']}) | {m['expert']['positive_share']:.2f} "
                    f"| {m['failure']['mean']:+.3f} (n={m['failure']['n']}) | {m['failure']['positive_share']:.2f} |")
    rows.append(END)
    emit(rows, args.out, START, END)
    ok = trained["expert"]["mean"] > 0 and trained["failure"]["mean"] > 0
    print("conditioning works" if ok else "conditioning NOT established", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
