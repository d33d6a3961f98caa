"""The rollout engine with the in-process HF generator on a tiny random model."""

import math

from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec


def test_hf_generator_rollouts_are_consistent_and_seeded(suite):
    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    add_reward_tokens(tok, model, ("<|high_reward|>", "<|low_reward|>"))
    renderer = ChatRenderer(tok, "hermes", tool_description="compact")
    engine = RolloutEngine(
        HFGenerator(model, tok.eos_token_id),
        renderer,
        make_opener(EnvConfig(settings=BFCLSettings(mode="merged")), suite),
        SamplingParams(max_new_tokens=24, temperature=1.0),
        max_turns=2,
        max_total_tokens=2048,
    )
    specs = [
        RolloutSpec(suite[t], g, tk)
        for g, t in enumerate(["multi_turn_base_0", "multi_turn_miss_func_2"])
        for tk in (True, False)
    ]
    first, timings = engine.rollout_timed(specs, seed=5)
    again = engine.rollout(specs, seed=5)
    assert [t.token_ids for t in first] == [t.token_ids for t in again]
    for t in first:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.sampler_logprobs)
        assert sum(t.loss_mask) > 0 and t.num_turns >= 1
        gen = [lp for lp, m in zip(t.sampler_logprobs, t.loss_mask) if m]
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen)
        assert t.reward == 0.0  # a random model solves nothing
        assert t.record()["task_id"] == t.task_id
    assert timings["generation"] > 0 and set(timings) == {"generation", "env", "reward"}
