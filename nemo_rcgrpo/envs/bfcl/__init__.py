"""BFCL v4 multi-turn environment: tasks, safe executor, per-rollout env, reward."""

from nemo_rcgrpo.envs.bfcl.env import EPISODE_MODES, BFCLEnv, StepResult, merged_prompt
from nemo_rcgrpo.envs.bfcl.executor import Toolbox
from nemo_rcgrpo.envs.bfcl.reward import GoldReplay, compute_reward, replay_gold
from nemo_rcgrpo.envs.bfcl.schemas import to_openai_tool
from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite
from nemo_rcgrpo.envs.bfcl.tasks import CATEGORIES, BFCLTask
from nemo_rcgrpo.envs.calls import CallRejected, parse_call_string, to_tool_call

__all__ = [
    "BFCLEnv",
    "BFCLSuite",
    "BFCLTask",
    "CATEGORIES",
    "CallRejected",
    "EPISODE_MODES",
    "GoldReplay",
    "StepResult",
    "Toolbox",
    "compute_reward",
    "merged_prompt",
    "parse_call_string",
    "replay_gold",
    "to_openai_tool",
    "to_tool_call",
]
