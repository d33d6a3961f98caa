"""The rollout engine with the in-process HF generator on a tiny random model."""

import math

from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl.config import BFCLEnvConfig
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec


def test_hf_generator_rollouts_are_consistent_and_seeded(suite):
    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    add_reward_tokens(tok, model, ("<|high_reward|>", "<|low_reward|>"))
    renderer = ChatRenderer(tok, "hermes", tool_description="compact")
    engine = RolloutEngine(HFGenerator(model, tok.eos_token_id), renderer, suite, BFCLEnvConfig(mode="merged"),
                           SamplingParams(max_new_tokens=24, temperature=1.0), max_turns=2, max_total_tokens=2048)
    specs = [RolloutSpec(suite[t], g, tk) for g, t in enumerate(["multi_turn_base_0", "multi_turn_miss_func_2"])
             for tk in (True, False)]
    first = engine.rollout(specs, seed=5)
    again = engine.rollout(specs, seed=5)
    assert [t.token_ids for t in first] == [t.token_ids for t in again]
    for t in first:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.sampler_logprobs)
        assert sum(t.loss_mask) > 0 and t.num_turns >= 1
        gen = [lp for lp, m in zip(t.sampler_logprobs, t.loss_mask) if m]
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen)
        assert t.reward == 0.0  # a random model solves nothing
        assert t.record()["task_id"] == t.task_id
    assert engine.timings["generation"] > 0


def test_sampled_logprobs_match_the_processed_distribution():
    """The recorded logprob of each sampled token equals log softmax(logits / T) after top-p, recomputed."""
    import torch

    from nemo_rcgrpo.generation.base import SamplingParams

    tok, model = load_tokenizer("tiny-qwen2"), load_model("tiny-qwen2").eval()
    gen = HFGenerator(model, tok.eos_token_id)
    prompts = [tok.encode("one two three"), tok.encode("a longer prompt here with words")]
    for temperature, top_p in ((0.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        out = gen.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p, seed=3))
        for prompt, c in zip(prompts, out):
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()  # [N, V] predicting each new token
            if temperature > 0:
                logits = logits / temperature
            if top_p < 1.0:
                probs = logits.softmax(-1)
                sorted_p, order = probs.sort(-1)
                remove = sorted_p.cumsum(-1) <= 1 - top_p
                remove[..., -1:] = False
                logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
            expected = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            if temperature == 0:
                assert c.token_ids == logits.argmax(-1).tolist()
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), (temperature, top_p)


def test_group_prompts_prefilled_once_generate_what_unshared_prefills_do():
    """Identical prompts of one call share one prefill (their KV cache copied): the same tokens, greedy and
    sampled with a seed, and the same logprobs up to rounding, as when every prompt is prefilled."""
    import torch

    for name in ("tiny-llama", "tiny-qwen2"):
        tok, model = load_tokenizer(name), load_model(name).eval()
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randint(0, 1000, (n,), generator=g).tolist() for n in (30, 45))
        prompts = [a, a, b, a, b, b, [7]]  # two groups of three, and a prompt of one token
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_new_tokens=10, temperature=temperature, seed=5)
            shared, alone = HFGenerator(model, tok.eos_token_id), HFGenerator(model, tok.eos_token_id, share_prefixes=False)
            widths = []  # the [rows, tokens] each forward pass of the model gets
            hook = model.register_forward_pre_hook(lambda m, a, kw: widths.append(tuple(kw["input_ids"].shape)),
                                                   with_kwargs=True)
            try:
                x = shared.generate(prompts, params)
            finally:
                hook.remove()
            # one prefill of the 3 distinct prompts but their last token, then generate starts from the cache:
            # one token per row from its first pass on (an ignored cache would prefill all 7 rows again)
            assert widths[0] == (3, 44) and all(w == (7, 1) for w in widths[1:]), widths[:3]
            y = alone.generate(prompts, params)
            assert [c.token_ids for c in x] == [c.token_ids for c in y], (name, temperature)
            assert max(abs(p - q) for c, d in zip(x, y) for p, q in zip(c.logprobs, d.logprobs)) <= 1e-5
            assert shared.prefilled == {"prompts": 7, "shared": 4} and alone.prefilled["shared"] == 0
