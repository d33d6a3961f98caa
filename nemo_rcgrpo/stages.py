"""The stages (``stage=NAME``): registered entries of the kind ``stage``, not branches on a string.

A stage says which loop trains it and how it differs from its siblings in that loop:

- ``loop``: a registered loop (kind ``loop``, ``fn(train config, recipe name) -> result``, `nemo_rcgrpo/loops.py`):
  ``"stage1"`` (supervised, `recipes/stage1.py`) or ``"rl"`` (rollouts and group advantages,
  `recipes/rl.py`); ``rcgrpo train`` runs the stage's loop;
- ``conditioned``: it trains on reward tokens (stage 1: the RCTP data; RL: each rollout's prompt gets a token
  drawn by ``rl.reward_token_sampling``). ``model.reward_tokens`` must not be ``none``, and the models it
  trains are recorded as reward-conditioned (``auto`` evaluation then conditions on the high token);
- ``data_file``: stage 1's prepared file (``data.file`` overrides it);
- ``dataset``: stage 1's registered dataset (kind ``stage1_dataset``: what a row becomes; ``data.dataset``
  overrides it; None: ``rctp`` for a conditioned stage, else ``sft``);
- ``keep_group``: RL only: the groups it trains on, a registered group filter's name (kind ``group_filter``:
  ``fn(rewards of one group) -> bool``) or such a function; ``None`` trains on every group. ``rl.group_filter``
  overrides it for a run (``stage=rcgrpo rl.group_filter=has_variance``). A group it refuses is never trained on,
  and a new task is rolled out in its place, for up to ``rl.group_filter_refills`` more rounds. After that the
  step trains on fewer groups (``rl.group_filter_shortfall=train``) or stops with an error (``error``). This is
  DAPO's dynamic sampling when the rule is "has reward variance".

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


@dataclass(frozen=True)
class Loop:
    """A training loop (kind ``loop``, registered in `nemo_rcgrpo/loops.py`): ``run(train config, recipe name) ->
    result dict``; ``rl``: it trains from rollouts of the RL task pointers (``rl.*`` validated, ``rl_<split>`` data),
    else from a stage-1 data file."""

    run: Callable[..., dict]
    rl: bool


def loop_of(stage: "Stage") -> Loop:
    """The registered loop a stage names."""
    return lookup("loop", stage.loop, of=Loop)


@dataclass(frozen=True)
class Stage:
    loop: str
    conditioned: bool = False
    data_file: str | None = None
    dataset: str | None = None  # stage 1: a registered stage1_dataset (None: rctp if conditioned, else sft)
    keep_group: str | Callable[[Sequence[float]], bool] | None = None  # a group_filter name, or the function
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.loop, str) or not self.loop:  # a registered loop's name (checked in config validation)
            raise ValueError(f"Stage(loop={self.loop!r}): name a registered loop, e.g. 'stage1' or 'rl'")
        if self.keep_group is not None and not isinstance(self.keep_group, str) and not callable(self.keep_group):
            raise ValueError(
                f"Stage(keep_group={self.keep_group!r}): give a group_filter's name or a function "
                "fn(rewards of one group) -> bool"
            )
        if self.loop == "stage1" and (self.keep_group is not None or not self.data_file):
            raise ValueError("a stage-1 Stage names its data_file and has no keep_group")
        if self.loop == "rl" and (self.data_file is not None or self.dataset is not None):
            raise ValueError("an RL Stage reads the RL task pointers, not a data_file or dataset")


@register("group_filter", "has_variance")
def has_variance(rewards: Sequence[float]) -> bool:
    """The group's rewards are not all equal (its advantages are not all 0)."""
    return len(set(rewards)) > 1


@register("group_filter", "not_all_failed")
def not_all_failed(rewards: Sequence[float]) -> bool:
    """Some rollout of the group succeeded (a group that all failed teaches nothing under a 0/1 reward; one that
    all succeeded is kept)."""
    return max(rewards) > 0


def group_filter(stage: Stage, override: str | None = None) -> Callable[[Sequence[float]], bool] | None:
    """The rule that picks the groups a step trains on: ``rl.group_filter`` when set, else the stage's
    ``keep_group`` (a name is looked up in the group_filter registry); None: every group."""
    rule = override if override is not None else stage.keep_group
    return lookup("group_filter", rule) if isinstance(rule, str) else rule


register("stage", "sft")(
    Stage("stage1", data_file="sft.jsonl", dataset="sft", description="supervised fine-tuning on experts")
)
register("stage", "rctp")(
    Stage(
        "stage1",
        conditioned=True,
        data_file="rctp.jsonl",
        dataset="rctp",
        description="RCTP-FT: experts and failures, each behind its reward token",
    )
)
register("stage", "grpo")(Stage("rl", description="GRPO"))
register("stage", "rcgrpo")(
    Stage("rl", conditioned=True, description="RC-GRPO: a reward token drawn for each rollout's prompt")
)
register("stage", "dapo_filter")(
    Stage("rl", keep_group=has_variance, description="GRPO with DAPO's dynamic sampling (no zero-variance group)")
)


def stage_of(name: str) -> Stage:
    """The registered stage ``name`` (a ValueError listing the registered names when there is none)."""
    return lookup("stage", name, Stage)
