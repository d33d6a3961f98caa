"""Deliberately misbehaving environments, loaded by name (plugins=[misbehaving_env_example]): BFCL's env and tasks
(so the scripted generator can play them) with one rule of the contract broken each.

    env always_paid_example   reward() pays 1.0 whatever happened, a truncated episode included
    env step_raises_example   step() raises on every call
"""

from __future__ import annotations

from nemo_rcgrpo import register
from nemo_rcgrpo.envs.bfcl.config import BFCLOpener, BFCLSettings
from nemo_rcgrpo.types import RewardInfo


class AlwaysPaid:
    """BFCL's env, but its reward ignores truncation (and everything else): 1.0."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    @property
    def done(self):
        return self.env.done

    @property
    def truncated(self):
        return self.env.truncated

    @property
    def tools(self):
        return self.env.tools

    def step(self, calls):
        return self.env.step(calls)

    def truncate(self, reason):
        self.env.truncate(reason)

    def reward(self):
        return RewardInfo(1.0, True, True, {"paid": "always"})

    def official_verdict(self):
        return None


class StepRaises(AlwaysPaid):
    def step(self, calls):
        raise KeyError("function")


class _Wrapping:
    def __init__(self, config, suite, wrapper):
        self.opener, self.wrapper = BFCLOpener(config, suite), wrapper

    def open(self, task):
        env, messages = self.opener.open(task)
        return self.wrapper(env), messages


@register("env", "always_paid_example")
def always_paid(config, suite):
    return _Wrapping(config, suite, AlwaysPaid)


@register("env", "step_raises_example")
def step_raises(config, suite):
    return _Wrapping(config, suite, StepRaises)


# BFCL's settings for both: env.settings is built as BFCLSettings (mode, max_steps, ...) and given to BFCLOpener
register("env_settings", "always_paid_example")(BFCLSettings)
register("env_settings", "step_raises_example")(BFCLSettings)
