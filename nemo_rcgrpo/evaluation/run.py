"""`rcgrpo eval`: BFCL v4 multi-turn evaluation under the paper's or the official protocol.

    rcgrpo eval policy=oracle protocol=paper out_dir=runs/eval/oracle
    rcgrpo eval policy=checkpoint checkpoint.path=runs/rcgrpo_smollm_cpu protocol=bfcl limit=5 out_dir=...
    rcgrpo eval policy=endpoint endpoint.url=http://host:8000/v1 endpoint.model=NAME protocol=bfcl out_dir=...

Protocols:
- ``paper``: the held-out tasks of the scenario split (80 of 800), merged
  episodes, success = R_state x R_action = 1; checkpoints are conditioned on
  ``reward_token`` (auto: high when the model's training record says it was reward-conditioned, else none).
- ``bfcl``: all 800 entries (or ``categories`` / ``tasks`` / ``limit``),
  per-turn episodes, success = the official checker's verdict.

Outputs in ``out_dir``: results.json (config, model, accuracies in percent,
per-task outcomes with the failure reason), results.md (the table) and
trajectories.jsonl (every episode, for reading).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm import tqdm

from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite

from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask, category_order
from nemo_rcgrpo.evaluation.agents import NullAgent, OracleAgent, play_episode
from nemo_rcgrpo.evaluation.config import EvalConfig
from nemo_rcgrpo.utils.config import ConfigError

SAMPLE_SEED_STRIDE = 1_000_003


# ---------------------------------------------------------------------- tasks
def select_tasks(cfg: EvalConfig, suite: BFCLSuite) -> list[str]:
    """The protocol's task ids (paper: the held-out split; bfcl: every entry), filtered by categories and limit."""
    if cfg.tasks:
        missing = [t for t in cfg.tasks if t not in suite.tasks]
        if missing:
            raise ConfigError(f"tasks not in task_source={cfg.task_source}: {missing[:5]}")
        ids = list(cfg.tasks)
    elif cfg.protocol == "paper":
        ids = held_out_ids(cfg, suite)
    else:
        ids = [t.id for t in suite]
    # the held-out split names tasks of every category; the suite holds only the chosen ones
    ids = [t for t in ids if t in suite.tasks and suite[t].category in cfg.categories]
    if cfg.limit is not None:
        taken: dict[str, int] = defaultdict(int)
        kept = []
        for t in ids:
            cat = suite[t].category
            if taken[cat] < cfg.limit:
                kept.append(t)
                taken[cat] += 1
        ids = kept
    if not ids:
        raise ConfigError("no tasks to evaluate (check categories, tasks and limit)")
    return ids


def held_out_ids(cfg: EvalConfig, suite: BFCLSuite) -> list[str]:
    if cfg.data_dir:
        path = Path(cfg.data_dir) / "split.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; prepare the data (rcgrpo prepare-data out_dir={cfg.data_dir}) "
                                    f"or drop data_dir to recompute the split from split_seed")
        try:
            return list(json.loads(path.read_text())["test"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{path} is not a split written by prepare-data: {e}") from None
    return suite.split(cfg.split_seed, cfg.test_fraction).to_json(suite)["test"]


# ---------------------------------------------------------------------- scoring
def failure_reason(protocol: str, *, success: bool, truncated: str | None, official_error: str | None,
                   details: dict[str, Any]) -> str | None:
    if success:
        return None
    if protocol == "bfcl" and official_error:
        return official_error
    if truncated:
        return f"truncated: {truncated}"
    parts = []
    diffs = details.get("state_differences") or {}
    if diffs:
        parts.append(f"final state differs ({', '.join(sorted(diffs))})")
    missing = details.get("missing_actions") or []
    if missing:
        parts.append(f"{len(missing)} gold action(s) missing, first: {missing[0]}")
    return "; ".join(parts) or "reward 0"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(records: Sequence[dict[str, Any]], samples: int = 1) -> dict[str, Any]:
    """Accuracies in percent: overall (over tasks), per category, mean over categories; pass@k with samples > 1."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r)
    task_acc = {t: statistics.fmean(r["success"] for r in rs) for t, rs in by_task.items()}
    category = {t: rs[0]["category"] for t, rs in by_task.items()}
    cats: dict[str, list[float]] = defaultdict(list)
    for t, acc in task_acc.items():
        cats[category[t]].append(acc)
    out: dict[str, Any] = {
        "overall": 100.0 * statistics.fmean(task_acc.values()) if task_acc else 0.0,
        "categories": {c: {"accuracy": 100.0 * statistics.fmean(v), "tasks": len(v)}
                       for c, v in sorted(cats.items(), key=lambda kv: category_order(kv[0]))},
        "tasks": len(task_acc), "episodes": len(records),
    }
    out["category_mean"] = statistics.fmean(c["accuracy"] for c in out["categories"].values()) if cats else 0.0
    if samples > 1:
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, samples) if k <= samples})
        out["pass_at_k"] = {str(k): 100.0 * statistics.fmean(
            pass_at_k(len(rs), sum(r["success"] for r in rs), k) for rs in by_task.values()) for k in ks}
    return out


def markdown_table(summary: dict[str, Any], title: str) -> str:
    lines = [f"### {title}", "", "| category | tasks | accuracy (%) |", "|---|---:|---:|"]
    for cat, v in summary["categories"].items():
        lines.append(f"| {cat} | {v['tasks']} | {v['accuracy']:.1f} |")
    lines.append(f"| **overall** | {summary['tasks']} | **{summary['overall']:.1f}** |")
    for k, v in summary.get("pass_at_k", {}).items():
        lines.append(f"| pass@{k} | {summary['tasks']} | {v:.1f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- policies
def _record(cfg: EvalConfig, task: BFCLTask, sample: int, seed: int, reward_token: str | None, *, reward,
            official_valid, official_error, truncated, details, num_turns, tool_errors, generated_tokens,
            calls, observations, extra: dict[str, Any]) -> dict[str, Any]:
    success = bool(official_valid) if cfg.protocol == "bfcl" else reward == 1.0
    return {
        "task_id": task.id, "category": task.category, "sample": sample, "seed": seed, "reward_token": reward_token,
        "success": success, "reward": reward, "official_valid": official_valid,
        "failure_reason": failure_reason(cfg.protocol, success=success, truncated=truncated,
                                         official_error=official_error, details=details),
        "truncated": truncated, "num_turns": num_turns, "tool_errors": tool_errors,
        "generated_tokens": generated_tokens, "calls": calls, "observations": observations, **extra,
    }


class MessagePolicy:
    """oracle, null and endpoint: whole messages in and out, episodes run in a thread pool."""

    def __init__(self, cfg: EvalConfig, make_agent: Callable[[], Any], concurrency: int, description: dict):
        self.cfg, self.make_agent, self.concurrency, self.description = cfg, make_agent, concurrency, description

    def run(self, suite: BFCLSuite, task_ids: list[str], sample: int, seed: int, on_done: Callable,
            only: set[str] | None = None) -> list[dict]:
        """Episodes of ``task_ids`` (those in ``only``); episode seeds follow the position in ``task_ids``."""
        env_cfg = self.cfg.env_config()
        for t in task_ids:
            suite.gold(t)  # memoised before the threads start

        def one(index: int, task_id: str) -> dict:
            task = suite[task_id]
            env = env_cfg.make_env()
            opening = env.reset(task, gold=suite.gold(task))
            agent = self.make_agent()
            episode_seed = seed + index
            agent.start(task, self.cfg.mode, episode_seed)
            ep = play_episode(agent, env, opening, max_turns=self.cfg.max_turns)
            reward = env.reward()
            verdict = env.official_verdict()
            rec = _record(self.cfg, task, sample, episode_seed, None, reward=reward.value,
                          official_valid=None if verdict is None else verdict.valid,
                          official_error=None if verdict is None or verdict.valid else
                          f"{verdict.error_type}: {verdict.error_message}",
                          truncated=env.truncated, details=reward.details, num_turns=ep.num_turns,
                          tool_errors=ep.tool_errors, generated_tokens=ep.generated_tokens, calls=ep.calls,
                          observations=ep.observations, extra={"messages": ep.messages})
            on_done(rec)
            return rec

        jobs = [(i, t) for i, t in enumerate(task_ids) if only is None or t in only]
        if self.concurrency == 1:
            return [one(i, t) for i, t in jobs]
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(one, i, t) for i, t in jobs]
            finished, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in futures:  # the first failure (e.g. a dead endpoint) is raised here
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()
            return [f.result() for f in futures]

    def close(self) -> None:
        pass


class CheckpointPolicy:
    """A trained model through the generator named by ``generation.backend`` (hf or vllm), token in / token out."""

    def __init__(self, cfg: EvalConfig, suite: BFCLSuite):
        import torch

        from nemo_rcgrpo.models.setup import load_tokenizer_and_model, make_renderer, seed_everything
        from nemo_rcgrpo.data.reward_goal import RewardGoal
        from nemo_rcgrpo.generation import make_generator
        from nemo_rcgrpo.generation.base import SamplingParams
        from nemo_rcgrpo.models.hf import load_tokenizer
        from nemo_rcgrpo.envs.sources import make_opener
        from nemo_rcgrpo.rollout.multi_turn import RolloutEngine
        from nemo_rcgrpo.utils.provenance import RECORD_FILE, auto_reward_token, read_record

        self.cfg = cfg
        model_path, state, source = resolve_checkpoint(cfg.checkpoint.path, cfg.checkpoint.step)
        has_tokens = cfg.reward_tokens.high in load_tokenizer(model_path).get_vocab()
        record = read_record(model_path)
        token = cfg.reward_token
        if token == "auto":  # as the model was trained (its training record), as in-training evaluation does
            token = auto_reward_token(record)
            if record is None and has_tokens:
                print(f"warning: {source} has reward tokens but no training record ({RECORD_FILE}); reward_token=auto "
                      "evaluates it without a token: set reward_token=high for an RCTP-FT / RC-GRPO model",
                      file=sys.stderr)
        if token != "none" and cfg.model.reward_tokens == "special" and not has_tokens:
            print(f"warning: {source} was not trained with reward tokens; reward_token={token} adds untrained "
                  f"tokens (use reward_token=none for SFT/GRPO models)", file=sys.stderr)
        self.reward_token = {"high": True, "low": False, "none": None}[token]
        # the reward goal the model was trained with (template, position, separator), from its training record
        saved = (record or {}).get("reward_goal") or {}
        fields = {"template", "position", "separator"}  # the tokens are the run's (checked against the vocabulary)
        goal = RewardGoal(high_token=cfg.reward_tokens.high, low_token=cfg.reward_tokens.low,
                          **{k: v for k, v in saved.items() if k in fields})
        setup = cfg.policy_setup(str(model_path))
        seed_everything(cfg.seed)
        self.tokenizer, model = load_tokenizer_and_model(setup)
        if state is not None:
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if "lm_head" not in k]:
                raise ValueError(f"checkpoint weights do not fit {model_path}: missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}")
        model.eval().requires_grad_(False)
        if torch.cuda.is_available():
            model = model.cuda()
        self.generator = make_generator(setup, model, self.tokenizer)
        if cfg.generation.backend != "hf":  # a started server serves these weights; an attached one receives them
            self.generator.update_weights(model.state_dict().items(), 0)
        self.engine = RolloutEngine(
            self.generator, make_renderer(setup, self.tokenizer), make_opener(setup.env, suite),
            SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p),
            max_turns=cfg.max_turns, max_total_tokens=cfg.max_total_tokens,
            reward_goal=goal)
        self.description = {"policy": "checkpoint", "source": source, "model_path": str(model_path),
                            "generator": cfg.generation.backend, "reward_token": token,
                            "chat_format": cfg.chat.format}

    def run(self, suite: BFCLSuite, task_ids: list[str], sample: int, seed: int, on_done: Callable,
            only: set[str] | None = None) -> list[dict]:
        from nemo_rcgrpo.rollout.multi_turn import RolloutSpec

        task_ids = [t for t in task_ids if only is None or t in only]
        out = []
        chunk = self.cfg.generation.max_batch_size
        for start in range(0, len(task_ids), chunk):
            part = task_ids[start:start + chunk]
            specs = [RolloutSpec(suite[t], start + i, self.reward_token) for i, t in enumerate(part)]
            for t in self.engine.rollout(specs, seed=seed + start):
                rec = _record(self.cfg, suite[t.task_id], sample, seed + start, t.reward_token, reward=t.reward,
                              official_valid=t.official_valid, official_error=t.official_error,
                              truncated=t.truncated, details=t.reward_details, num_turns=t.num_turns,
                              tool_errors=t.tool_errors, generated_tokens=t.generated_tokens, calls=t.calls,
                              observations=t.observations,
                              extra={"text": t.texts, "reward_details": t.reward_details, "messages": t.messages(),
                                     "prompt": self.engine.tokenizer.decode(t.token_ids[: t.prompt_length])})
                on_done(rec)
                out.append(rec)
        return out

    def close(self) -> None:
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()


def resolve_checkpoint(path: str, step: int | None = None):
    """(HF folder of the architecture, weights to load on top or None, description) for checkpoint.path."""
    from nemo_rcgrpo.models.hf import resolve_model_path
    from nemo_rcgrpo.utils.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint

    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p, None, str(p)
    if (p / "hf" / "config.json").is_file() and step is None:
        return p / "hf", None, str(p / "hf")
    if (p / "checkpoints").is_dir() or (p / "trainer_state.json").is_file():
        run_dir = p if (p / "checkpoints").is_dir() else p.parent.parent
        ckpt = (checkpoint_dir(run_dir) / f"step_{step}") if step is not None else (
            p if (p / "trainer_state.json").is_file() else latest_checkpoint(run_dir))
        if ckpt is None or not ckpt.is_dir():
            raise FileNotFoundError(f"no checkpoint {'step_' + str(step) if step else ''} in {run_dir}/checkpoints")
        state = load_checkpoint(ckpt)
        base = state["trainer_state"].get("model_path")
        tokenizer_dir = ckpt / "tokenizer"
        if not base:
            raise FileNotFoundError(f"{ckpt} does not say which model it was trained from")
        base_path = resolve_model_path(base)
        if tokenizer_dir.is_dir():  # the checkpoint's tokenizer (with reward tokens) over the base model's files
            import atexit
            import shutil
            import tempfile

            merged = Path(tempfile.mkdtemp(prefix="rcgrpo-eval-model-"))
            atexit.register(shutil.rmtree, merged, ignore_errors=True)
            for f in base_path.iterdir():
                if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                    (merged / f.name).symlink_to(f.resolve())
            for f in tokenizer_dir.iterdir():
                target = merged / f.name
                if target.is_symlink():  # never write through a link into the base model's folder
                    target.unlink()
                shutil.copy(f, target)
            base_path = merged
        return base_path, state["model"], str(ckpt)
    return resolve_model_path(path), None, path


def make_policy(cfg: EvalConfig, suite: BFCLSuite):
    if cfg.policy == "oracle":
        return MessagePolicy(cfg, OracleAgent, 1, {"policy": "oracle"})
    if cfg.policy == "null":
        return MessagePolicy(cfg, NullAgent, 1, {"policy": "null"})
    if cfg.policy == "endpoint":
        from nemo_rcgrpo.evaluation.endpoint import EndpointAgent

        EndpointAgent(cfg.endpoint, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)
        return MessagePolicy(cfg, lambda: EndpointAgent(cfg.endpoint, temperature=cfg.temperature, top_p=cfg.top_p,
                                                        max_new_tokens=cfg.max_new_tokens),
                             cfg.endpoint.concurrency, {"policy": "endpoint", "url": cfg.endpoint.url,
                                                        "model": cfg.endpoint.model})
    return CheckpointPolicy(cfg, suite)


# ---------------------------------------------------------------------- run
def _load_done(path: Path) -> list[dict]:
    """Episodes already in a trajectories.jsonl (a torn last line is dropped)."""
    if not path.is_file():
        return []
    done = []
    for line in path.read_text().splitlines():
        try:
            done.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return done


def evaluate(cfg: EvalConfig, suite: BFCLSuite | None = None) -> dict[str, Any]:
    out_dir = Path(cfg.out_dir)
    if (out_dir / "results.json").exists() and not (cfg.overwrite or cfg.resume):
        raise FileExistsError(f"{out_dir}/results.json exists; choose another out_dir, set overwrite=true, "
                              f"or resume=true to finish an incomplete evaluation")
    if cfg.data_dir:  # a model trained on one task source is evaluated on that source's held-out tasks
        from nemo_rcgrpo.data.consistency import DataMismatchError, check_task_source

        try:
            check_task_source(cfg.data_dir, cfg.task_source, setting="task_source")
        except DataMismatchError as e:
            raise ConfigError(str(e)) from None
    if suite is None:
        from nemo_rcgrpo.envs.sources import make_suite

        suite = make_suite(cfg.task_source, cfg.categories)
    task_ids = select_tasks(cfg, suite)
    out_dir.mkdir(parents=True, exist_ok=True)
    traj_path = out_dir / "trajectories.jsonl"
    records = _load_done(traj_path) if cfg.resume else []
    wanted = set(task_ids)
    records = [r for r in records if r["task_id"] in wanted and r["sample"] < cfg.samples]
    done = {(r["task_id"], r["sample"]) for r in records}
    if cfg.resume:  # rewrite the kept episodes (drops a torn line), then append
        traj_path.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
    random.seed(cfg.seed)
    policy = make_policy(cfg, suite)
    token = getattr(policy, "description", {}).get("reward_token", cfg.reward_token)  # `auto` resolved
    print(f"eval    policy {cfg.policy}" + (f" ({cfg.checkpoint.path}, reward token {token})"
                                           if cfg.policy == "checkpoint" else "")
          + f", {cfg.protocol} protocol: {len(task_ids)} tasks x {cfg.samples} sample(s) of {list(cfg.categories)}"
          + (f", {len(done)} episodes kept from the incomplete run" if cfg.resume else "")
          + f"; results in {out_dir}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    bar = tqdm(total=len(task_ids) * cfg.samples, initial=len(done), desc=f"eval {cfg.policy}/{cfg.protocol}",
               unit="episode", disable=not cfg.progress, file=sys.stderr)
    error = None
    try:
        lock = threading.Lock()
        with traj_path.open("a" if cfg.resume else "w") as traj_file:
            def on_done(rec: dict) -> None:
                with lock:
                    traj_file.write(json.dumps(rec, default=str) + "\n")
                    traj_file.flush()
                    bar.update(1)

            for sample in range(cfg.samples):
                todo = [t for t in task_ids if (t, sample) not in done]
                if todo:
                    records += policy.run(suite, task_ids, sample, cfg.seed + SAMPLE_SEED_STRIDE * sample, on_done,
                                          only=set(todo))
    except (RuntimeError, OSError) as e:  # a dead endpoint or server: keep what was scored, then report
        error = f"{type(e).__name__}: {e}"
        records = _load_done(traj_path)
    finally:
        bar.close()
        policy.close()
    seconds = time.perf_counter() - started
    summary = summarize(records, cfg.samples)
    result = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "protocol": cfg.protocol, "policy": policy.description, "config": cfg.to_dict(),
        "complete": error is None, **({"error": error} if error else {}),
        **summary,
        "mean_accuracy": 100.0 * statistics.fmean(r["success"] for r in records) if records else 0.0,
        "seconds": seconds, "episodes_per_minute": 60.0 * len(records) / seconds if seconds > 0 else None,
        "per_task": _per_task(records),
    }
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    title = f"{describe(result)} — {cfg.protocol} protocol"
    (out_dir / "results.md").write_text(markdown_table(summary, title))
    if error:
        raise EvaluationIncomplete(f"{error} (scored {len(records)} of {len(task_ids) * cfg.samples} episodes; "
                                   f"partial results in {out_dir})")
    return result


class EvaluationIncomplete(RuntimeError):
    pass


def describe(result: dict[str, Any]) -> str:
    p = result["policy"]
    if p["policy"] == "checkpoint":
        return f"{p['source']} ({p['generator']}, token {p['reward_token']})"
    if p["policy"] == "endpoint":
        return f"{p['model']} @ {p['url']}"
    return p["policy"]


def _per_task(records: list[dict]) -> list[dict]:
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r)
    return [{"task_id": t, "category": rs[0]["category"], "successes": sum(r["success"] for r in rs),
             "samples": len(rs),
             "outcomes": [{"sample": r["sample"], "seed": r["seed"], "success": r["success"], "reward": r["reward"],
                           "official_valid": r["official_valid"], "failure_reason": r["failure_reason"]}
                          for r in sorted(rs, key=lambda r: r["sample"])]}
            for t, rs in by_task.items()]


def main(argv: Sequence[str] | None = None) -> int:
    from nemo_rcgrpo.envs.bfcl.tasks import BFCLDataError
    from nemo_rcgrpo.models.hf import ModelFilesError
    from nemo_rcgrpo.utils.checkpoint import CheckpointError
    from nemo_rcgrpo.utils.cli_help import resolve

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        resolved = resolve("eval", argv, EvalConfig)
        if resolved is None:  # --help or --cfg job
            return 0
        cfg = resolved[1]
        result = evaluate(cfg)
    except (ConfigError, ModelFilesError, CheckpointError, BFCLDataError, FileNotFoundError, FileExistsError,
            ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EvaluationIncomplete as e:
        print(f"error: evaluation stopped: {e}", file=sys.stderr)
        return 3
    print(markdown_table(result, f"{describe(result)} — {cfg.protocol} protocol"))
    print(f"results: {cfg.out_dir}/results.json, results.md, trajectories.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
