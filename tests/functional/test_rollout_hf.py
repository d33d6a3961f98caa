"""The rollout engine with the in-process HF generator on a tiny random model."""

import math

from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl.config import BFCLEnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec


def test_hf_generator_rollouts_are_consistent_and_seeded(suite):
    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    add_reward_tokens(tok, model, ("<|high_reward|>", "<|low_reward|>"))
    renderer = ChatRenderer(tok, "hermes", tool_description="compact")
    engine = RolloutEngine(HFGenerator(model, tok.eos_token_id), renderer,
                           make_opener(BFCLEnvConfig(mode="merged"), suite),
                           SamplingParams(max_new_tokens=24, temperature=1.0), max_turns=2, max_total_tokens=2048)
    specs = [RolloutSpec(suite[t], g, tk) for g, t in enumerate(["multi_turn_base_0", "multi_turn_miss_func_2"])
             for tk in (True, False)]
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


def _with_passes(model, run):
    """(run's result, the [rows, tokens] of each forward pass the model got meanwhile)."""
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        return run(), shapes
    finally:
        hook.remove()


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
            x, widths = _with_passes(model, lambda: shared.generate(prompts, params))
            # one prefill of the 3 distinct prompts, then decoding from the copied cache: one token per row
            # (an ignored cache would prefill all 7 rows again); rows that stop leave the batch
            assert widths[0] == (3, 45) and widths[1] == (7, 1), widths[:3]
            assert all(w[1] == 1 and w[0] <= 7 for w in widths[1:]) and len(widths) <= 10, widths
            y, widths = _with_passes(model, lambda: alone.generate(prompts, params))
            assert widths[0] == (7, 45), widths[:2]
            assert [c.token_ids for c in x] == [c.token_ids for c in y], (name, temperature)
            assert max(abs(p - q) for c, d in zip(x, y) for p, q in zip(c.logprobs, d.logprobs)) <= 1e-5
            assert shared.prefilled == {"prompts": 7, "shared": 4} and alone.prefilled["shared"] == 0


def test_inverse_cdf_sampling_is_exact_on_a_hand_made_distribution():
    """Boundaries by hand, blocks of 2 over a vocabulary of 7 (one padded slot), zero-probability tokens never
    drawn, and the frequencies of 40,000 draws within 4 standard errors of the probabilities."""
    import torch

    from nemo_rcgrpo.generation.hf_local import sample_inverse_cdf

    p = torch.tensor([[0.5, 0.0, 0.25, 0.0, 0.0, 0.25, 0.0]])  # exact in binary, so the boundaries are too
    # cumulative: 0.5 | 0.5 0.75 | 0.75 0.75 | 1.0 1.0; the token is the first whose cumulative mass exceeds u
    for u, token in ((0.0, 0), (0.4999, 0), (0.5, 2), (0.7499, 2), (0.75, 5), (0.9999999, 5)):
        assert sample_inverse_cdf(p, torch.tensor([u]), block=2).item() == token, u
    unnormalised = p * 3.0  # the mass need not sum to 1
    assert sample_inverse_cdf(unnormalised, torch.tensor([0.6]), block=2).item() == 2  # 0.6 * 3 in [1.5, 2.25)
    g = torch.Generator().manual_seed(0)
    n = 40_000
    draws = sample_inverse_cdf(p.expand(n, -1), torch.rand(n, generator=g), block=2)
    freq = torch.bincount(draws, minlength=7).double() / n
    assert freq[[1, 3, 4, 6]].sum() == 0
    se = (p[0].double() * (1 - p[0].double()) / n).sqrt()
    assert ((freq - p[0].double()).abs() <= 4 * se + 1e-12).all(), freq


def test_sampling_follows_sampling_params_and_nothing_else():
    """Tokens are drawn from the whole tempered distribution: no top-k that transformers' generate would add
    (its default is 50). A random tiny model spreads its mass: the 50 likeliest tokens hold a fraction m of it,
    so about 1 - m of the draws must fall outside them."""
    import torch

    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama").eval()
    prompt = tok.encode("list the files in the current folder")
    n = 400
    out = HFGenerator(model, tok.eos_token_id).generate([prompt] * n, SamplingParams(max_new_tokens=1, seed=0))
    with torch.no_grad():
        probs = model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
    top = set(probs.topk(50).indices.tolist())
    outside = sum(c.token_ids[0] not in top for c in out) / n
    expected = 1 - probs.topk(50).values.sum().item()
    assert expected > 0.9 and abs(outside - expected) <= 4 * (expected * (1 - expected) / n) ** 0.5 + 0.01, \
        (outside, expected)
    # every recorded logprob is the token's own under the distribution it was drawn from
    drawn = torch.tensor([c.token_ids[0] for c in out])
    assert torch.allclose(torch.tensor([c.logprobs[0] for c in out]), probs[drawn].log(), atol=1e-5)


def test_rows_that_stop_leave_the_batch_and_the_rest_decode_as_before():
    """A stop token ends its row (kept, reason "stop"); the rows still decoding go on with their own cache rows
    and their own random numbers: the same tokens (greedy, and sampled with a seed) and logprobs as a run where
    nothing stops, cut at each row's first stop token."""
    import torch

    tok, model = load_tokenizer("tiny-qwen2"), load_model("tiny-qwen2").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (12, 30, 21, 5)]
    gen = HFGenerator(model, tok.eos_token_id)
    for temperature in (0.0, 1.0):
        free = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature, seed=3))
        stop = free[1].token_ids[2]  # row 1 stops after 3 tokens
        cut, passes = _with_passes(model, lambda: gen.generate(prompts, SamplingParams(
            max_new_tokens=12, temperature=temperature, seed=3, stop_token_ids=(stop,))))
        rows = [w[0] for w in passes]
        stopped = 0
        for f, c in zip(free, cut):
            n = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
            assert c.token_ids == f.token_ids[:n], temperature
            assert c.finish_reason == ("stop" if stop in f.token_ids else "length")
            assert max(abs(a - b) for a, b in zip(c.logprobs, f.logprobs[:n])) <= 1e-5
            stopped += stop in f.token_ids
        assert cut[1].finish_reason == "stop" and len(cut[1].token_ids) == 3
        assert rows[0] == 4 and min(rows) <= 4 - stopped  # the stopped rows were dropped from later passes


def test_unseeded_sampling_follows_torch_global_seed():
    import torch

    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    gen, prompt = HFGenerator(model, tok.eos_token_id), [tok.encode("make a folder")] * 3
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append([c.token_ids for c in gen.generate(prompt, SamplingParams(max_new_tokens=6))])
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) > 1  # reproducible, and the rows differ


def test_non_finite_scores_are_a_clear_error_not_a_token():
    import pytest
    import torch

    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    for temperature in (0.0, 1.0):
        with pytest.raises(RuntimeError, match="not finite"):
            HFGenerator(model, tok.eos_token_id).generate([[5, 6, 7]], SamplingParams(max_new_tokens=2,
                                                                                      temperature=temperature))
