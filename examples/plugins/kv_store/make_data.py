"""Stage-1 and RL data of the kv_store environment, in the schema `rcgrpo prepare-data` writes for BFCL.

    python examples/plugins/kv_store/make_data.py OUT_DIR [--seed 0]

Every trajectory is played through the environment itself (`kv_store.KVOpener`), so its tool results are the
environment's own and its reward is checked: experts score 1, failures 0. OUT_DIR gets

    config.yaml            task_source: kv_store, the episode mode and the reward goal (read by training)
    sft.jsonl              expert trajectories (stage 1 SFT)
    failures.jsonl         one failure per task: a wrong value, a wrong key or a premature done()
    rctp.jsonl             experts under the high reward token, failures under the low one, 50/50 (RCTP-FT)
    rl_train.jsonl         the training tasks of stage 2 (task ids); rl_test.jsonl the held-out ones

A line of sft.jsonl / rctp.jsonl: {"task_id", "category", "split", "mode", "messages" (OpenAI chat messages,
assistant tool_calls with JSON-string arguments), "tools" (OpenAI schemas)}, and in rctp.jsonl "reward" (1 / 0)
and "reward_goal" (the token its first user message carries).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_store import TOOLS, KVOpener, KVTask, make_tasks  # noqa: E402

from nemo_rcgrpo.data.reward_goal import RewardGoal  # noqa: E402
from nemo_rcgrpo.types import ToolCall  # noqa: E402


def play(task: KVTask, plan: list[tuple[str, dict[str, str]]]) -> tuple[list[dict], float]:
    """The conversation of ``plan`` (calls, one assistant message each, then done()) and the reward it earns."""
    env, messages = KVOpener(max_steps=8).open(task)
    for n, (name, kwargs) in enumerate([*plan, ("done", {})]):
        call_id = f"call_{n}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(kwargs)}}
                ],
            }
        )
        result = env.step([ToolCall(name, dict(kwargs), id=call_id)])
        messages += result.messages
        if env.done:
            break
    return messages, env.reward().value


def failure_plan(task: KVTask, rng: random.Random) -> tuple[str, list[tuple[str, dict[str, str]]]]:
    gold = [(name, dict(args)) for name, args in task.gold]
    kind = rng.choice(("wrong_param", "wrong_key", "premature_termination"))
    if kind == "premature_termination":
        return kind, gold[:-1]
    name, args = gold[-1]
    if kind == "wrong_param" and "value" in args:
        args = {**args, "value": args["value"] + "s"}
    else:
        kind, args = "wrong_key", {**args, "key": args["key"] + "_2"}
    return kind, [*gold[:-1], (name, args)]


def split_of(task_id: str, seed: int) -> str:
    return "test" if int(hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest(), 16) % 10 == 0 else "train"


def records(suite, split, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(experts, failures) of every task of ``suite``: the records `rcgrpo prepare-data` writes (its data builder,
    registered in kv_store.py); ``split``: prepare-data's (``split.side_of(task)``)."""
    experts, failures = [], []
    for task in suite.tasks.values():
        base = {
            "task_id": task.id,
            "category": task.category,
            "split": split.side_of(task),
            "mode": "merged",
            "tools": TOOLS,
        }
        messages, reward = play(task, [(name, dict(args)) for name, args in task.gold])
        if reward != 1.0:
            raise ValueError(f"the ground truth of {task.id} scores {reward}, not 1")
        kind, plan = failure_plan(task, rng)
        bad, bad_reward = play(task, plan)
        if bad_reward != 0.0:
            raise ValueError(f"the {kind} failure of {task.id} scores {bad_reward}, not 0")
        experts.append({**base, "messages": messages})
        failures.append(
            {
                **base,
                "messages": bad,
                "failure_type": kind,
                "failure_detail": f"{kind} of the gold plan",
                "source": "perturbation",
            }
        )
    return experts, failures


def build(out: Path, seed: int = 0) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    goal, rng = RewardGoal(), random.Random(seed)
    files: dict[str, list[dict]] = {k: [] for k in ("sft", "failures", "rctp", "rl_train", "rl_test")}
    for task in make_tasks().values():
        split = split_of(task.id, seed)
        base = {"task_id": task.id, "category": task.category, "split": split, "mode": "merged", "tools": TOOLS}
        messages, reward = play(task, [(name, dict(args)) for name, args in task.gold])
        assert reward == 1.0, (task.id, reward)  # the ground truth solves its task
        kind, plan = failure_plan(task, rng)
        bad, bad_reward = play(task, plan)
        assert bad_reward == 0.0, (task.id, kind, bad_reward)  # a failure is verified, not assumed
        files["sft"].append({**base, "messages": messages})
        files["failures"].append({**base, "messages": bad, "failure_type": kind})
        files["rctp"] += [
            {**base, "messages": goal.apply(messages, True), "reward": 1, "reward_goal": goal.token(True)},
            {
                **base,
                "messages": goal.apply(bad, False),
                "reward": 0,
                "reward_goal": goal.token(False),
                "failure_type": kind,
            },
        ]
        files[f"rl_{split}"].append(
            {
                "task_id": task.id,
                "category": task.category,
                "env": "kv_store",
                "task_source": "kv_store",
                "mode": "merged",
            }
        )
    for name, lines in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    settings = {"task_source": "kv_store", "mode": "merged", "seed": seed, "reward_goal": dataclasses.asdict(goal)}
    (out / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return {name: len(lines) for name, lines in files.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(build(args.out_dir, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
