"""`rcgrpo prepare-data`: every dataset a training run needs, reproducibly from a seed.

    rcgrpo prepare-data out_dir=data/bfcl_v4 seed=1234 mode=merged
    python nemo_rcgrpo/prepare_data.py --config-name prepare_data out_dir=... overwrite=true

Writes into ``out_dir`` (refuses an existing folder unless ``overwrite=true``;
the folder is assembled next to it and moved into place at the end):

  split.json       scenario-grouped 90/10 split with per-category counts
  sft.jsonl        800 expert trajectories (ground truth played through the env)
  failures.jsonl   800 failure trajectories (verified reward 0), typed
  rctp.jsonl       1600 = experts + failures with the reward-goal token, 50/50
  rl_train.jsonl   720 RL pointers {"task_id", "category", "env", "task_source", "mode"}
  rl_test.jsonl    80 RL pointers
  stats.json       counts, success rates, failure mix, token-length percentiles
  config.yaml      the resolved settings

Every line carries ``split``; trainers select ``split == "train"``. Load with
``datasets.load_dataset("json", data_files=...)``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import yaml

from nemo_rcgrpo.data.chat_format import TokenCounter
from nemo_rcgrpo.data.closing import ClosingTexts
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.rl_tasks import find_pointers
from nemo_rcgrpo.envs.interfaces import EPISODE_MODES, DataError
from nemo_rcgrpo.envs.sources import check_categories, make_suite
from nemo_rcgrpo.envs.splits import split_by_scenario
from nemo_rcgrpo.registry import load_plugins, lookup, names
from nemo_rcgrpo.utils.atomic import staged_folder
from nemo_rcgrpo.utils.cli_help import resolve
from nemo_rcgrpo.utils.config import ConfigError, check_fields, plain, reject_unknown
from nemo_rcgrpo.utils.dist import DistInfo, barrier
from nemo_rcgrpo.utils.run_command import run_command

if TYPE_CHECKING:
    from nemo_rcgrpo.config import TrainConfig


@dataclass(frozen=True)
class FailureConfig:
    types: dict[str, float] = field(  # mix of perturbation types (a registered failure: wrong_tool | ... | a plugin's)
        default_factory=lambda: {"wrong_tool": 1.0, "wrong_param": 1.0, "premature_termination": 1.0}
    )
    max_tries: int = 20  # perturbations tried per type before falling back to another type
    rollout_files: tuple[
        str, ...
    ] = ()  # JSONL of recorded rollouts {task_id, messages, reward, ...}; reward 0: failures
    rollout_fraction: float = 0.0  # share of failures taken from recorded rollouts where a task has one


@dataclass(frozen=True)
class PrepareDataConfig:
    out_dir: str = "data/bfcl_v4"
    overwrite: bool = False  # an existing out_dir is refused unless true
    seed: int = 1234  # split, failure types and perturbations; same seed -> byte-identical files
    plugins: tuple[str, ...] = ()  # modules imported before validation, e.g. with their own failure types
    # a registered task source: bfcl (the 800 BFCL v4 tasks) | bfcl_micro (1,320 short generated ones,
    # docs/experiments.md) | a plugin's (rcgrpo plugins)
    task_source: str = "bfcl"
    mode: str = "merged"  # merged (the paper's RL episode, ends with done()) | per_turn (BFCL's turns)
    categories: tuple[str, ...] = ()  # the task source's categories to build ([]: every one it declares)
    test_fraction: float = 0.1  # of the 200 scenarios (x4 categories): 720 train / 80 test
    calls_per_message: str = "turn"  # turn: a BFCL turn's calls in one assistant message | one: one call per message
    bfcl_data_dir: str | None = None  # null: the data of the installed bfcl-eval
    tokenizer: str | None = "smollm2"  # token-length statistics: smollm2, a local HF folder, or null to skip
    closing: ClosingTexts = ClosingTexts()  # per_turn: what the assistant says when it ends a turn without a call
    failures: FailureConfig = FailureConfig()
    reward_goal: RewardGoal = RewardGoal()  # the template that puts the reward token into the first user message
    progress: bool = True

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "PrepareDataConfig":
        load_plugins(cfg.get("plugins") or ())  # before validation: a plugin's failure types are valid choices
        reject_unknown("", cfg, {f.name for f in fields(cls)})
        values = check_fields(cls, dict(cfg))
        for key, sub in (("closing", ClosingTexts), ("failures", FailureConfig), ("reward_goal", RewardGoal)):
            section = values.get(key) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"{key} must be a section (mapping), got {section!r}")
            reject_unknown(key, section, {f.name for f in fields(sub)})
            section = check_fields(sub, section, f"{key}.")
            try:
                values[key] = sub(**section)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{key}: {e}") from None
        if "categories" in values:
            values["categories"] = tuple(values["categories"])
        if "failures" in values:
            values["failures"] = FailureConfig(
                **{**asdict(values["failures"]), "rollout_files": tuple(values["failures"].rollout_files)}
            )
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        lookup("task_source", self.task_source, setting="task_source")
        if self.mode not in EPISODE_MODES:
            raise ConfigError(f"mode={self.mode!r}: choose one of {list(EPISODE_MODES)}")
        object.__setattr__(self, "categories", check_categories(self.task_source, self.categories, "categories"))
        if self.calls_per_message not in ("turn", "one"):
            raise ConfigError(f"calls_per_message={self.calls_per_message!r}: choose 'turn' or 'one'")
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"test_fraction={self.test_fraction}: must be between 0 and 1")
        for name in self.failures.types:
            lookup("failure", name, setting="failures.types")
        if not 0.0 <= self.failures.rollout_fraction <= 1.0:
            raise ConfigError(f"failures.rollout_fraction={self.failures.rollout_fraction}: must be in [0, 1]")
        if self.failures.rollout_fraction > 0 and not self.failures.rollout_files:
            raise ConfigError("failures.rollout_fraction > 0 needs failures.rollout_files=[path.jsonl, ...]")


def _percentiles(values: list[int]) -> dict[str, int]:
    if not values:
        return {}
    xs = sorted(values)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": xs[-1]}


def build(cfg: PrepareDataConfig, out: Path) -> dict[str, Any]:
    """Build every file into ``out`` (an empty folder). Returns the stats."""
    load_plugins(cfg.plugins)  # a plugin's task source or failure types (a no-op for modules already imported)
    categories = check_categories(cfg.task_source, cfg.categories, "categories")  # []: the source's own
    suite = make_suite(cfg.task_source, categories, data_dir=cfg.bfcl_data_dir)
    if not len(suite.tasks):
        raise DataError(f"task_source={cfg.task_source} has no tasks of categories {list(categories)}")
    # the data builder of the task source's name, else the one its suite names (a suite built on BFCL's: bfcl)
    name = cfg.task_source if cfg.task_source in names("data_builder") else getattr(suite, "data_builder", None)
    if name not in names("data_builder"):
        raise ConfigError(
            f"task_source={cfg.task_source} has no data builder: register one under its name (kind "
            f"data_builder, docs/extending.md) or write its data with a script of its own"
        )
    builder = lookup("data_builder", name)
    # the suite's own split where it has one (BFCL's: by scenario); else by task, seeded (envs/splits.py)
    split = (
        suite.split(cfg.seed, cfg.test_fraction)
        if callable(getattr(suite, "split", None))
        else split_by_scenario(suite, cfg.seed, cfg.test_fraction)
    )
    rng = random.Random(cfg.seed)
    experts, failures, extra_stats = builder(cfg, suite, split, rng)

    goal = cfg.reward_goal
    rctp = []
    for expert, failure in zip(experts, failures):
        rctp.append(
            {
                **expert,
                "messages": goal.apply(expert["messages"], True),
                "reward": 1,
                "reward_goal": goal.token(True),
                "failure_type": None,
            }
        )
        rctp.append(
            {
                **{k: v for k, v in failure.items() if k not in ("failure_detail", "source")},
                "messages": goal.apply(failure["messages"], False),
                "reward": 0,
                "reward_goal": goal.token(False),
            }
        )
    for record in failures:
        record["reward"] = 0
    for record in experts:
        record["reward"] = 1

    env = getattr(builder, "env", cfg.task_source)
    pointers = {
        side: [
            {
                "task_id": r["task_id"],
                "category": r["category"],
                "env": env,
                "task_source": cfg.task_source,
                "mode": cfg.mode,
            }
            for r in experts
            if r["split"] == side
        ]
        for side in ("train", "test")
    }
    files = {
        "sft.jsonl": experts,
        "failures.jsonl": failures,
        "rctp.jsonl": rctp,
        "rl_train.jsonl": pointers["train"],
        "rl_test.jsonl": pointers["test"],
    }
    for name, records in files.items():
        with (out / name).open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    split_json = split.to_json(suite)
    (out / "split.json").write_text(json.dumps(split_json, indent=1) + "\n")

    stats = _stats(cfg, files, split_json, extra_stats)
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    (out / "config.yaml").write_text(yaml.safe_dump(plain(asdict(cfg)), sort_keys=False))
    return stats


def _stats(cfg: PrepareDataConfig, files: dict[str, list], split_json: dict, extra: dict) -> dict[str, Any]:
    counter = None
    if cfg.tokenizer:
        from nemo_rcgrpo.models.hf import load_tokenizer

        counter = TokenCounter(load_tokenizer(cfg.tokenizer))
    stats: dict[str, Any] = {"seed": cfg.seed, "mode": cfg.mode, "split": split_json["counts"], "files": {}}
    for name, records in files.items():
        entry: dict[str, Any] = {"lines": len(records)}
        for side in ("train", "test"):
            entry[side] = dict(
                sorted(
                    Counter(
                        r["category"]
                        for r in records
                        if r.get("split", side if name.endswith(f"{side}.jsonl") else None) == side
                    ).items()
                )
            )
        if records and "reward" in records[0]:
            entry["success_rate"] = sum(r["reward"] for r in records) / len(records)
        if records and "messages" in records[0] and counter is not None:
            entry["tokens"] = _percentiles(counter.lengths([(r["messages"], r["tools"]) for r in records]))
        stats["files"][name] = entry
    stats["failure_types"] = dict(sorted(Counter(r["failure_type"] for r in files["failures.jsonl"]).items()))
    stats["failure_sources"] = dict(sorted(Counter(r["source"] for r in files["failures.jsonl"]).items()))
    stats.update(extra)  # the builder's own (BFCL's: the recorded rollouts used, per file)
    stats["tokenizer"] = cfg.tokenizer
    stats["chat_format"] = "hermes"
    return stats


def summary_table(stats: dict[str, Any]) -> str:
    rows = ["| file | lines | train | test | success rate | tokens p50 / p90 / max |", "|---|---:|---:|---:|---:|---|"]
    for name, e in stats["files"].items():
        tokens = e.get("tokens")
        tok = f"{tokens['p50']} / {tokens['p90']} / {tokens['max']}" if tokens else "-"
        rate = f"{e['success_rate']:.2f}" if "success_rate" in e else "-"
        rows.append(
            f"| {name} | {e['lines']} | {sum(e['train'].values())} | {sum(e['test'].values())} | {rate} | {tok} |"
        )
    mix = ", ".join(f"{k} {v}" for k, v in stats["failure_types"].items())
    return "\n".join(rows) + f"\n\nfailure types: {mix}; tokenizer: {stats['tokenizer']} (hermes rendering)"


def run(cfg: PrepareDataConfig) -> dict[str, Any]:
    out = Path(cfg.out_dir)
    if out.exists() and not cfg.overwrite:
        raise FileExistsError(f"out_dir {out} already exists; pass overwrite=true or choose another out_dir")
    with staged_folder(out) as staging:
        stats = build(cfg, staging)
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def prepare() -> int:
        resolved = resolve("prepare-data", argv, PrepareDataConfig)
        if resolved is None:  # --help or --cfg job
            return 0
        cfg = resolved[1]
        if os.environ.get("PYTHONHASHSEED") != "0":
            # Some BFCL API messages print Python sets, whose order depends on the
            # per-process string hash seed; a fixed seed makes the files byte-identical.
            env = {**os.environ, "PYTHONHASHSEED": "0"}
            return subprocess.call([sys.executable, "-m", "nemo_rcgrpo.prepare_data", *argv], env=env)
        stats = run(cfg)
        print(summary_table(stats))
        print(f"wrote {cfg.out_dir}")
        return 0

    return run_command(prepare)


# ---------------------------------------------------------------------- what a training run reads
# Prepared first where it is missing (``data.prepare_if_missing``): stage 1's file or an RL stage's task pointers,
# by this command in a child process on rank 0, every rank waiting for it.
@dataclass(frozen=True)
class DataNeed:
    """What a training run reads of its config to find its data, or to prepare it where it is missing
    (``DataNeed.of(cfg)``)."""

    dir: Path  # data.dir
    file: str  # what the run reads there: the stage-1 data file, or an RL stage's task pointers rl_<split>
    rl_split: str | None  # an RL stage's split (rl.split); None in stage 1
    prepare_if_missing: bool
    mode: str  # data.mode
    seed: int
    task_source: str  # env.task_source
    plugins: tuple[str, ...]  # the modules that register a plugin's task source or failure types

    @classmethod
    def of(cls, cfg: TrainConfig) -> "DataNeed":
        split = cfg.rl.split if cfg.is_rl else None
        file = f"rl_{split}.jsonl" if cfg.is_rl else cfg.data_file  # what prepare-data writes: JSONL
        d = cfg.data
        return cls(
            Path(d.dir), file, split, d.prepare_if_missing, d.mode, cfg.seed, cfg.env.task_source, tuple(cfg.plugins)
        )

    def found(self) -> Path | None:
        """The file the run reads (an RL stage's pointers in any of their formats; its stage-1 lines are only compared
        with, `data/consistency.py`), or None where it is missing."""
        if self.rl_split is not None:
            return find_pointers(self.dir, self.rl_split)
        path = self.dir / self.file
        return path if path.exists() else None


def ensure_data(need: DataNeed, dist: DistInfo) -> Path:
    """The data file the run reads; where it is missing and ``data.prepare_if_missing``, rank 0 prepares the default
    data into a folder that does not exist yet (a `prepare-data` process) while the others wait."""
    if not isinstance(need, DataNeed):  # a whole TrainConfig is not what it takes
        raise TypeError(f"ensure_data takes DataNeed.of(cfg), not {type(need).__name__}")
    found = need.found()
    path = found or need.dir / need.file
    if found is None and need.prepare_if_missing and dist.is_main:
        if need.dir.exists():
            raise FileNotFoundError(
                f"{path} is missing but {need.dir} exists; prepare the data there "
                f"(rcgrpo prepare-data out_dir={need.dir} overwrite=true) or fix data.dir"
            )
        # the default data (shipped failure types): neither plugins nor --config-dir are needed, so none are passed
        cmd = [
            sys.executable,
            "-m",
            "nemo_rcgrpo.prepare_data",
            f"out_dir={need.dir}",
            f"mode={need.mode}",
            f"seed={need.seed}",
            f"task_source={need.task_source}",
            "tokenizer=null",
        ]
        if need.plugins:  # a plugin's task source (or failure types) is registered by its module
            cmd.append(f"plugins=[{','.join(need.plugins)}]")
        subprocess.run(cmd, check=True)
    barrier(dist)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist; run `rcgrpo prepare-data out_dir={need.dir}`")
    return path


if __name__ == "__main__":
    sys.exit(main())
