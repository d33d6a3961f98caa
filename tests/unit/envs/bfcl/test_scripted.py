"""The scripted generator (generation=scripted) on BFCL's tasks: the ground truth or a verified failure of
`envs/bfcl/failures.py` per rollout (the plans BFCL's suite scripts itself, `scripted_messages`), chosen by a seeded
coin that follows the prompt's reward token; token-in, token-out through the real rollout engine. The generic
generator on other envs: tests/unit/generation/test_scripted.py."""

import pytest

from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.scripted import ScriptedGenerator
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec

TASKS = ("multi_turn_base_0", "multi_turn_base_20", "multi_turn_base_156")  # GorillaFileSystem; two two-class tasks


@pytest.fixture(scope="module")
def renderer():
    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    return ChatRenderer(tok, "hermes", tool_description="compact")


@pytest.fixture(scope="module")
def base_suite():
    from nemo_rcgrpo.envs.bfcl import BFCLSuite

    return BFCLSuite(["base"])


def _scripted(renderer, suite, **kw):
    config = EnvConfig(categories=("base",))
    return ScriptedGenerator(renderer, suite, make_opener(config, suite), settings=config.settings, **kw)


def _engine(renderer, suite, **kw):  # the suite the generator knows
    gen = _scripted(renderer, suite, **kw)
    engine = RolloutEngine(
        gen,
        renderer,
        make_opener(EnvConfig(categories=("base",)), suite),
        SamplingParams(max_new_tokens=2048),
        max_turns=12,
        max_total_tokens=8192,
        reward_goal=RewardGoal(),
    )
    return gen, engine


def test_the_token_decides_success(renderer, base_suite):
    suite = base_suite
    gen, engine = _engine(renderer, suite, success_high=1.0, success_low=0.0)
    specs = [RolloutSpec(suite[t], g, token) for g, t in enumerate(TASKS) for token in (True, False, True, False)]
    trajs = engine.rollout(specs, seed=3)
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0] * 3
    assert all(t.truncated is None and t.tool_errors == 0 for t in trajs if t.reward == 1.0)
    assert gen.played == {"success": 6, "failure": 6}
    # identical prompts in one group play their own scripts: both successes of a group are whole ground truths
    for t in trajs:
        assert t.calls[-1] == [{"name": "done", "arguments": {}}] or t.reward == 0.0
    # token-in, token-out: generated tokens are masked 1 and decode to the assistant messages
    t = trajs[0]
    generated = [i for i, m in zip(t.token_ids, t.loss_mask) if m]
    assert (
        len(generated) == t.generated_tokens and renderer.tokenizer.decode(generated).count("<|im_end|>") == t.num_turns
    )


def test_coins_are_seeded_and_follow_the_probability(renderer, base_suite):
    suite = base_suite
    specs = [RolloutSpec(suite[t], g, None) for g, t in enumerate(TASKS) for _ in range(8)]
    runs = []
    for _ in range(2):
        _, engine = _engine(renderer, suite, success_rate=0.5)
        runs.append([t.reward for t in engine.rollout(specs, seed=11)])
    assert runs[0] == runs[1] and 0 < sum(runs[0]) < len(specs)  # reproducible, mixed
    _, engine = _engine(renderer, suite, success_rate=0.5)
    assert [t.reward for t in engine.rollout(specs, seed=12)] != runs[0]  # another step, other coins
    for p, expected in ((0.0, 0.0), (1.0, 1.0)):
        _, engine = _engine(renderer, suite, success_rate=p)
        assert {t.reward for t in engine.rollout(specs[:8], seed=1)} == {expected}


def test_bad_settings_and_unknown_prompts(renderer, suite, base_suite):
    with pytest.raises(ValueError, match=r"success_high=1.5: must be in \[0, 1\]"):
        _scripted(renderer, suite, success_high=1.5)
    gen = _scripted(renderer, suite)
    with pytest.raises(ValueError, match="holds no known task's first user message"):
        gen.generate([renderer.tokenizer("hello")["input_ids"]], SamplingParams())
    # base_20, miss_func_20 and long_context_20 ask the same: with both categories a prompt cannot name its task
    _, engine = _engine(renderer, suite)
    with pytest.raises(
        ValueError,
        match=r"tasks \['multi_turn_base_20', 'multi_turn_miss_func_20', 'multi_turn_long_context_20'\] open with",
    ):
        engine.rollout([RolloutSpec(suite["multi_turn_base_20"], 0, True)], seed=0)


def test_twins_with_the_same_plan_are_played(renderer):
    """bfcl_micro tasks that differ only in files the request does not touch open with the same message and are
    played alike: each twin's rollouts score as its own ground truth and failure do, in its own environment."""
    from nemo_rcgrpo.envs.bfcl.env import merged_prompt
    from nemo_rcgrpo.envs.sources import make_suite

    micro = make_suite("bfcl_micro", ["base"])
    twins = [t for t in micro.tasks.values() if merged_prompt(t) == merged_prompt(micro["micro_0"])]
    assert len(twins) > 2 and len({repr(t.initial_config) for t in twins}) > 1  # other initial states
    gen, engine = _engine(renderer, micro, success_high=1.0, success_low=0.0)
    specs = [RolloutSpec(t, g, token) for g, t in enumerate(twins) for token in (True, False)]
    assert [t.reward for t in engine.rollout(specs, seed=5)] == [1.0, 0.0] * len(twins)
    assert gen.played == {"success": len(twins), "failure": len(twins)}


def test_two_callers_in_turns_continue_their_own_rollouts(renderer, base_suite):
    """Rollouts generated ahead: the rollout thread and the trainer's evaluation call one scripted generator in
    turns. Another thread playing whole rollouts between two calls of a collection changes neither's episodes."""
    import threading

    suite = base_suite
    specs = [RolloutSpec(suite[t], g, token) for g, t in enumerate(TASKS) for token in (True, False)]
    evals = [RolloutSpec(suite[t], g, True) for g, t in enumerate(TASKS[:2])]
    _, alone = _engine(renderer, suite, success_high=1.0, success_low=0.0)
    want, want_eval = alone.rollout(specs, seed=3), alone.rollout(evals, seed=5)
    gen, engine = _engine(renderer, suite, success_high=1.0, success_low=0.0)
    _, evaluation = _engine(renderer, suite)
    evaluation.generator = gen  # the same generator object for both callers
    got = {}

    class EvalBetweenCalls:
        """The collection's generator: after its first call, the evaluation plays on another thread."""

        def __init__(self):
            self.calls = 0

        @property
        def version(self):
            return gen.version

        def generate(self, prompts, params):
            out = gen.generate(prompts, params)
            self.calls += 1
            if self.calls == 1:
                t = threading.Thread(target=lambda: got.setdefault("eval", evaluation.rollout(evals, seed=5)))
                t.start()
                t.join()
            return out

    engine.generator = EvalBetweenCalls()
    trajs = engine.rollout(specs, seed=3)
    assert engine.generator.calls > 1 and max(t.num_turns for t in trajs) > 1  # the episodes continued after it
    assert [(t.token_ids, t.reward) for t in trajs] == [(t.token_ids, t.reward) for t in want]
    assert [(t.token_ids, t.reward) for t in got["eval"]] == [(t.token_ids, t.reward) for t in want_eval]
