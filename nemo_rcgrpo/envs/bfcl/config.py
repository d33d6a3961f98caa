"""Typed, validated settings of the BFCL environment: the ``env`` section of a recipe (``env.mode=per_turn`` ...);
the defaults are this dataclass's, written nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from nemo_rcgrpo.envs.bfcl.env import EPISODE_MODES, PARSE_FAILURE_MODES, BFCLEnv
from nemo_rcgrpo.envs.bfcl.executor import ARG_TYPE_MODES
from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite
from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, BFCLTask
from nemo_rcgrpo.types import Message
from nemo_rcgrpo.utils.config import ConfigError, did_you_mean


@dataclass(frozen=True)
class BFCLEnvConfig:
    name: str = "bfcl"  # a registered env (nemo_rcgrpo.envs.sources: bfcl | a plugin's)
    task_source: str = "bfcl"  # a registered task source: bfcl (BFCL v4) | bfcl_micro (envs/bfcl/micro.py) | a plugin's
    mode: str = "merged"  # per_turn (official BFCL protocol) | merged (paper's RL episode)
    categories: tuple[str, ...] = CATEGORIES
    max_steps: int = 20  # tool-calling steps per turn (per_turn) or per episode (merged)
    max_calls_per_step: int = 128
    arg_types: str = "bfcl"  # bfcl | strict
    on_parse_failure: str = "observe"  # observe | end_turn
    tool_response: str = "description"  # description | drop
    system_prompt: str | None = None  # None: the built-in prompt of the mode
    holdout_tools_in_message: bool = True  # miss_func: list the new tools in the holdout user message
    max_observation_chars: int = 65_536  # longer tool results are truncated (longest gold result: ~32k)
    reward: str = "state_x_action"  # a registered reward: state_x_action (the paper) | state | action | a plugin's

    def __post_init__(self) -> None:
        from nemo_rcgrpo.registry import lookup

        lookup("env", self.name, setting="env.name")
        lookup("task_source", self.task_source, setting="env.task_source")
        _choice("env.mode", self.mode, EPISODE_MODES)
        lookup("reward", self.reward, setting="env.reward")
        _choice("env.arg_types", self.arg_types, ARG_TYPE_MODES)
        _choice("env.on_parse_failure", self.on_parse_failure, PARSE_FAILURE_MODES)
        _choice("env.tool_response", self.tool_response, ("description", "drop"))
        bad = [c for c in self.categories if c not in CATEGORIES]
        if bad or not self.categories:
            raise ConfigError(f"env.categories={list(self.categories)}: use a non-empty subset of {list(CATEGORIES)}")
        for key in ("max_steps", "max_calls_per_step", "max_observation_chars"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"env.{key}={value!r}: must be a positive integer")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "BFCLEnvConfig":
        from nemo_rcgrpo.utils.config import check_fields, reject_unknown

        reject_unknown("env", dict(cfg), {f.name for f in fields(cls)})
        values = check_fields(cls, dict(cfg), "env.")
        if "categories" in values:
            values["categories"] = tuple(values["categories"])
        return cls(**values)

    def make_env(self) -> BFCLEnv:
        """A new environment for one rollout."""
        return BFCLEnv(
            mode=self.mode,
            max_steps=self.max_steps,
            max_calls_per_step=self.max_calls_per_step,
            system_prompt=self.system_prompt,
            tool_response=self.tool_response,
            arg_types=self.arg_types,
            on_parse_failure=self.on_parse_failure,
            holdout_tools_in_message=self.holdout_tools_in_message,
            max_observation_chars=self.max_observation_chars,
            reward=self.reward,
        )


class BFCLOpener:
    """``open(task)``: a new `BFCLEnv` of these settings, reset on ``task`` with the suite's memoised gold replay."""

    def __init__(self, config: BFCLEnvConfig, suite: BFCLSuite):
        self.config, self.suite = config, suite

    def open(self, task: BFCLTask) -> tuple[BFCLEnv, list[Message]]:
        env = self.config.make_env()
        return env, env.reset(task, gold=self.suite.gold(task))


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: choose one of {list(allowed)}{did_you_mean(value, list(allowed))}")
