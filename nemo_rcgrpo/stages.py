"""The stages (``stage=NAME``): registered entries of the kind ``stage``, not branches on a string.

A stage says which loop trains it and how it differs from its siblings in that loop:

- ``loop``: ``"stage1"`` (supervised, `algorithms/sft.py`) or ``"rl"`` (rollouts and group advantages,
  `algorithms/rcgrpo.py`);
- ``conditioned``: it trains on reward tokens (stage 1: the RCTP data; RL: each rollout's prompt gets a token
  drawn by ``rl.reward_token_sampling``). ``model.reward_tokens`` must not be ``none``, and the models it
  trains are recorded as reward-conditioned (``auto`` evaluation then conditions on the high token);
- ``data_file``: stage 1's prepared file (``data.file`` overrides it);
- ``keep_group``: RL only: ``fn(rewards of one group) -> bool``, the groups it trains on. ``None`` trains on every
  group. A group it refuses is never trained on, and a new task is rolled out in its place, for up to
  ``rl.dapo_max_rounds`` more rounds. After that the step trains on fewer groups (``rl.dapo_shortfall=train``)
  or stops with an error (``error``). This is DAPO's dynamic sampling when the rule is "has reward variance".

Shipped: ``sft``, ``rctp`` (stage 1); ``grpo``, ``rcgrpo``, ``dapo_filter`` (RL). A user's stage:

    from nemo_rcgrpo import register
    from nemo_rcgrpo.stages import Stage

    register("stage", "rcgrpo_filtered")(Stage("rl", conditioned=True, keep_group=lambda r: len(set(r)) > 1,
                                               description="RC-GRPO that never trains on a zero-variance group"))

then ``stage=rcgrpo_filtered plugins=[my_module]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from nemo_rcgrpo.registry import lookup, register

LOOPS = ("stage1", "rl")


@dataclass(frozen=True)
class Stage:
    loop: str
    conditioned: bool = False
    data_file: str | None = None
    keep_group: Callable[[Sequence[float]], bool] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.loop not in LOOPS:
            raise ValueError(f"Stage(loop={self.loop!r}): the loops are {list(LOOPS)}")
        if self.loop == "stage1" and (self.keep_group is not None or not self.data_file):
            raise ValueError("a stage-1 Stage names its data_file and has no keep_group")
        if self.loop == "rl" and self.data_file is not None:
            raise ValueError("an RL Stage reads the RL task pointers, not a data_file")


def has_variance(rewards: Sequence[float]) -> bool:
    """The group's rewards are not all equal (its advantages are not all 0)."""
    return len(set(rewards)) > 1


register("stage", "sft")(Stage("stage1", data_file="sft.jsonl", description="supervised fine-tuning on experts"))
register("stage", "rctp")(Stage("stage1", conditioned=True, data_file="rctp.jsonl",
                                description="RCTP-FT: experts and failures, each behind its reward token"))
register("stage", "grpo")(Stage("rl", description="GRPO"))
register("stage", "rcgrpo")(Stage("rl", conditioned=True,
                                  description="RC-GRPO: a reward token drawn for each rollout's prompt"))
register("stage", "dapo_filter")(Stage("rl", keep_group=has_variance,
                                       description="GRPO with DAPO's dynamic sampling (no zero-variance group)"))


def stage_of(name: str) -> Stage:
    """The registered stage ``name`` (a ValueError listing the registered names when there is none)."""
    stage = lookup("stage", name)
    if not isinstance(stage, Stage):
        raise ValueError(f"stage {name!r} is registered as a {type(stage).__name__}, not a Stage")
    return stage
