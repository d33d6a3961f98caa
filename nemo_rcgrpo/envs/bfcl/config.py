"""Typed, validated settings of the BFCL environment: ``env.settings`` of a recipe with ``env.name=bfcl``
(``env.settings.mode=per_turn`` ...), registered as the ``bfcl`` env's settings (`envs/sources.py`); the defaults
are this dataclass's, written nowhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nemo_rcgrpo.envs.bfcl.env import BFCLEnv, EpisodeMode, ParseFailure
from nemo_rcgrpo.envs.bfcl.executor import ArgTypes
from nemo_rcgrpo.envs.bfcl.schemas import ResponseMode
from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask
from nemo_rcgrpo.types import Message
from nemo_rcgrpo.utils.config import ConfigError, check_choices


@dataclass(frozen=True)
class BFCLSettings:
    # merged: the paper's RL episode (every step in one prompt, done() ends it) | per_turn: the official BFCL
    # protocol (user turns one at a time)
    mode: EpisodeMode = "merged"
    max_steps: int = 20  # tool-calling steps per turn (per_turn) or per episode (merged); BFCL uses 20
    max_calls_per_step: int = 128  # calls beyond this in one assistant message get an error observation
    # bfcl: the API judges argument types (leaderboard behaviour) | strict: reject mismatches
    arg_types: ArgTypes = "bfcl"
    # observe: error observation | end_turn: end the turn (BFCL's inference loop)
    on_parse_failure: ParseFailure = "observe"
    tool_response: ResponseMode = "description"  # description: BFCL's "response" schema in the tool description | drop
    system_prompt: str | None = None  # null: the built-in prompt of the mode
    holdout_tools_in_message: bool = True  # miss_func: the held-out tools' schemas precede BFCL's holdout message
    max_observation_chars: int = 65_536  # longer tool results are truncated (longest gold result: ~32k characters)
    # a registered reward: state_x_action (the paper's R_state x R_action) | state | action | a plugin's
    reward: str = "state_x_action"

    def __post_init__(self) -> None:
        from nemo_rcgrpo.registry import lookup

        check_choices(self, "env.settings.")  # mode, arg_types, ...: also where the settings are built in code
        lookup("reward", self.reward, setting="env.settings.reward")
        for key in ("max_steps", "max_calls_per_step", "max_observation_chars"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"env.settings.{key}={value!r}: must be a positive integer")

    def data_mismatch(self, prepared: Mapping[str, Any], data_dir: str) -> str | None:
        """What of these settings disagrees with the data's (``prepared``: prepare-data's settings), in one line, or
        None (`data/consistency.py`)."""
        mode = prepared.get("mode")
        if mode and mode != self.mode:
            return (
                f"env.settings.mode={self.mode} but {data_dir} was prepared with mode={mode}: set "
                f"env.settings.mode={mode} or prepare the data with mode={self.mode}"
            )
        return None

    def prompt_mismatch(self, record: Mapping[str, Any], opening_tools: list[dict]) -> str:
        """The setting to check when a stage-1 line's rendering does not start with the RL prompt of its task."""
        system = next((m.get("content") for m in record["messages"] if m.get("role") == "system"), None)
        if system is not None and system != self.make_env().system_prompt:
            return "env.settings.system_prompt"
        if [t.get("function", {}).get("name") for t in record.get("tools") or []] != [
            t["function"]["name"] for t in opening_tools
        ]:
            return "the tools offered at the start (env settings)"
        return "the reward goal or the env's rendering of the first messages"

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

    def __init__(self, settings: BFCLSettings, suite: BFCLSuite):
        self.settings, self.suite = settings, suite

    def open(self, task: BFCLTask) -> tuple[BFCLEnv, list[Message]]:
        env = self.settings.make_env()
        return env, env.reset(task, gold=self.suite.gold(task))
