"""Plugin parts that miss what their kind asks, one fault each, loaded by name (plugins=[contract_faults_example]):

    generator no_flag_example                 a generator without the shares_policy_weights declaration
    env reset_only_example                    an opener written against an older interface: reset(task), no open(task)
    policy_backend no_export_example          a policy without export_weights() (and the capabilities it declares)
    advantage_baseline not_callable_example   a number where a function goes
    stage dict_stage_example                  a dict where a Stage goes
    failure name_only_example                 a failure type's name where its function goes (prepare-data)
    eval_policy describe_only_example         an eval policy that describes itself by a method and has no close()
"""

from __future__ import annotations

from nemo_rcgrpo import register
from nemo_rcgrpo.envs.bfcl.config import BFCLOpener, BFCLSettings


class NoFlag:
    """Everything a generator has but ``shares_policy_weights``."""

    version = 0

    def generate(self, prompts, params):
        return []

    def update_weights(self, weights, version):
        self.version = version

    def close(self):
        pass


@register("generator", "no_flag_example")
def no_flag(setup, model, tokenizer):
    return NoFlag()


class ResetOnly:
    """BFCL's opener behind ``reset`` (the method's name before openers opened)."""

    def __init__(self, settings, suite):
        self.opener = BFCLOpener(settings, suite)

    def reset(self, task):
        return self.opener.open(task)


@register("env", "reset_only_example")
def reset_only(settings, suite):
    return ResetOnly(settings, suite)


register("env_settings", "reset_only_example")(BFCLSettings)


class HalfPolicy:
    """A policy that logs and steps, but cannot hand its weights to a generator or declare what it can do."""

    def __init__(self, model):
        self.module = model

    def logprobs(self, batch, with_entropy=False):
        raise NotImplementedError

    def train_step(self, micro_batches, loss_fn, num_valid_tokens, with_entropy=False):
        raise NotImplementedError


@register("policy_backend", "no_export_example")
def no_export(build, model, dist, total_steps):
    return HalfPolicy(model)


class DescribeOnly:
    """An eval policy that plays episodes but says what it is through ``describe()``, not ``description``, and has
    nothing to end with."""

    def describe(self):
        return {"policy": "describe_only_example"}

    def run(self, suite, task_ids, sample, seed, on_done, only=None):
        return []


@register("eval_policy", "describe_only_example")
def describe_only(cfg, suite):
    return DescribeOnly()


register("advantage_baseline", "not_callable_example")(0.5)
register("stage", "dict_stage_example")({"loop": "rl", "conditioned": True})
register("failure", "name_only_example")("wrong_tool")
