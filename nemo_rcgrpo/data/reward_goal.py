"""The reward-goal token of RCTP-FT / RC-GRPO (the RC-GRPO paper, "Stage 1").

``[Reward Goal: <|high_reward|>]`` (success) or ``[Reward Goal: <|low_reward|>]``
(failure) goes into the FIRST user message only (appended by default; the
exact string is third party, so template, tokens and position are settings).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

from nemo_rcgrpo.types import Message


@dataclass(frozen=True)
class RewardGoal:
    high_token: str = "<|high_reward|>"
    low_token: str = "<|low_reward|>"
    template: str = "[Reward Goal: {token}]"
    position: str = "suffix"  # suffix | prefix of the first user message
    separator: str = " "

    def __post_init__(self) -> None:
        if "{token}" not in self.template:
            raise ValueError(f"reward goal template {self.template!r} must contain '{{token}}'")
        if self.position not in ("suffix", "prefix"):
            raise ValueError(f"reward goal position {self.position!r}: choose 'suffix' or 'prefix'")
        if not self.high_token or self.high_token == self.low_token:
            raise ValueError("reward goal tokens must be non-empty and different")

    def token(self, success: bool) -> str:
        return self.high_token if success else self.low_token

    def text(self, success: bool) -> str:
        return self.template.format(token=self.token(success))

    def apply(self, messages: Sequence[Message], success: bool) -> list[Message]:
        """A copy of ``messages`` with the goal in the first user message."""
        out = copy.deepcopy(list(messages))
        for m in out:
            if m.get("role") == "user":
                goal = self.text(success)
                content = m.get("content") or ""
                m["content"] = (
                    (content + self.separator + goal)
                    if self.position == "suffix"
                    else (goal + self.separator + content)
                )
                return out
        raise ValueError("conversation has no user message to carry the reward goal")
