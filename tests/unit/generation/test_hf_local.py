"""generation/hf_local.py: the in-process HF generator on tiny random models. What is sampled is what
SamplingParams says (the tempered, top-p distribution, nothing else), each logprob is the sampled token's under it,
seeded draws repeat, identical prompts share one prefill, stopped rows leave the batch, and non-finite scores are
an error."""

from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.models.hf import load_model, load_tokenizer


def test_sampled_logprobs_match_the_processed_distribution():
    """The recorded logprob of each sampled token equals log softmax(logits / T) after top-p, recomputed."""
    import torch

    tok, model = load_tokenizer("tiny-qwen2"), load_model("tiny-qwen2").eval()
    gen = HFGenerator(model, tok.eos_token_id)
    prompts = [tok.encode("one two three"), tok.encode("a longer prompt here with words")]
    for temperature, top_p in ((0.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        out = gen.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p, seed=3))
        for prompt, c in zip(prompts, out):
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [N, V] predicting each new token
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
    """(run's result, the [rows, tokens] of each forward pass the model got meanwhile). Every pass's attention mask
    must cover exactly the cached tokens and the new ones (as transformers documents it), checked here."""
    shapes, masks = [], []

    def record(module, args, kw):
        rows, new = kw["input_ids"].shape
        shapes.append((rows, new))
        masks.append((kw["attention_mask"].shape, (rows, kw["past_key_values"].get_seq_length() + new)))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = run()
    finally:
        hook.remove()
    assert all(tuple(got) == want for got, want in masks), masks
    return out, shapes


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
            shared, alone = (
                HFGenerator(model, tok.eos_token_id),
                HFGenerator(model, tok.eos_token_id, share_prefixes=False),
            )
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


def test_inverse_cdf_sampling_with_padding_and_several_tokens_a_block():
    """Blocks of 4 over a vocabulary of 7 (the last block padded with one slot of mass 0), mass in the last
    block, two tokens with mass in each block: every boundary by hand. u = 1 (outside torch.rand's [0, 1); the
    clamps keep it inside the vocabulary) draws the last token, which has mass here."""
    import torch

    from nemo_rcgrpo.generation.hf_local import sample_inverse_cdf

    p = torch.tensor([[0.25, 0.0, 0.0, 0.25, 0.25, 0.0, 0.25]])
    # cumulative: 0.25 0.25 0.25 0.5 | 0.75 0.75 1.0 (pad)
    cases = ((0.0, 0), (0.2499, 0), (0.25, 3), (0.4999, 3), (0.5, 4), (0.7499, 4), (0.75, 6), (0.9999999, 6), (1.0, 6))
    for u, token in cases:
        assert sample_inverse_cdf(p, torch.tensor([u]), block=4).item() == token, u
    rows = sample_inverse_cdf(p.expand(len(cases), -1), torch.tensor([u for u, _ in cases]), block=4)
    assert rows.tolist() == [t for _, t in cases]  # row by row, in one call
    for vocab, block in ((3, 4), (9, 4), (5, 2)):  # padded by block - vocab % block; mass on the last token
        q = torch.zeros(1, vocab)
        q[0, 0] = q[0, -1] = 0.5
        assert [sample_inverse_cdf(q, torch.tensor([u]), block=block).item() for u in (0.1, 0.6)] == [0, vocab - 1]
    # mass in every block: each of 12 equally likely tokens (3 blocks of 4) owns [i/12, (i+1)/12)
    uniform = torch.full((1, 12), 1 / 12)
    us = torch.tensor([(i + f) / 12 for i in range(12) for f in (0.01, 0.5, 0.99)])
    assert sample_inverse_cdf(uniform.expand(len(us), -1), us, block=4).tolist() == [
        i for i in range(12) for _ in "abc"
    ]
    # the default block: a vocabulary of SmolLM2's size, mass on its last token
    big = torch.zeros(1, 49_152 + 5)
    big[0, 7] = big[0, -1] = 0.5
    assert [sample_inverse_cdf(big, torch.tensor([u])).item() for u in (0.49, 0.5)] == [7, 49_156]


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
    assert expected > 0.9 and abs(outside - expected) <= 4 * (expected * (1 - expected) / n) ** 0.5 + 0.01, (
        outside,
        expected,
    )
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
        cut, passes = _with_passes(
            model,
            lambda: gen.generate(
                prompts, SamplingParams(max_new_tokens=12, temperature=temperature, seed=3, stop_token_ids=(stop,))
            ),
        )
        rows = [w[0] for w in passes]
        stopped = 0
        for f, c in zip(free, cut):
            n = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
            assert c.token_ids == f.token_ids[:n], temperature
            assert c.finish_reason == ("stop" if stop in f.token_ids else "length")
            assert max(abs(a - b) for a, b in zip(c.logprobs, f.logprobs[:n])) <= 1e-5
            stopped += stop in f.token_ids
        assert cut[1].finish_reason == "stop" and len(cut[1].token_ids) == 3
        # a row that never stops ends after exactly max_new_tokens tokens
        assert all(len(c.token_ids) == 12 for c in [*free, *cut] if c.finish_reason == "length")
        assert sum(c.finish_reason == "length" for c in cut) >= 1
        assert rows[0] == 4 and min(rows) <= 4 - stopped  # the stopped rows were dropped from later passes


def test_a_call_larger_than_max_batch_size_draws_each_chunk_afresh():
    """Prompts beyond max_batch_size are decoded in chunks: a seeded call repeats as a whole, and a chunk does not
    repeat the draws of the chunk before it (identical prompts, different tokens)."""
    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    prompt = tok.encode("make a folder")
    params = SamplingParams(max_new_tokens=6, seed=11)
    chunked = HFGenerator(model, tok.eos_token_id, max_batch_size=2)
    out = [c.token_ids for c in chunked.generate([prompt] * 4, params)]
    assert out == [c.token_ids for c in chunked.generate([prompt] * 4, params)]
    assert out[:2] != out[2:]
    # the first chunk draws what the same rows draw alone
    assert out[:2] == [c.token_ids for c in HFGenerator(model, tok.eos_token_id).generate([prompt] * 2, params)]


def test_unseeded_sampling_follows_torch_global_seed():
    import torch

    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    gen, prompt = HFGenerator(model, tok.eos_token_id), [tok.encode("make a folder")] * 3
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append([c.token_ids for c in gen.generate(prompt, SamplingParams(max_new_tokens=6))])
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) > 1  # reproducible, and the rows differ


def test_unseeded_calls_draw_distinct_seeds_from_the_global_generator():
    import torch

    from nemo_rcgrpo.generation.hf_local import call_seed

    torch.manual_seed(0)
    seeds = [call_seed(None) for _ in range(500)]
    torch.manual_seed(0)
    assert [call_seed(None) for _ in range(500)] == seeds and len(set(seeds)) == 500
    assert max(seeds) > 2**40 and call_seed(7) == 7 and call_seed(0) == 0


def test_weights_from_a_folder_are_loaded_and_the_version_recorded(tmp_path):
    """update_weights with an HF folder (what a checkpoint export writes; tied embeddings saved once) loads every
    tensor in it; with tensors, it copies them; the version is the one given."""
    import torch

    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    other = load_model("tiny-llama")
    with torch.no_grad():
        for t in other.parameters():
            t.add_(0.5)
    other.save_pretrained(tmp_path / "hf")
    gen = HFGenerator(model, tok.eos_token_id)
    gen.update_weights(tmp_path / "hf", 4)
    assert gen.version == 4
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    gen.update_weights([("model.norm.weight", torch.zeros_like(model.model.norm.weight))], 5)
    assert gen.version == 5 and float(model.model.norm.weight.detach().abs().sum()) == 0.0


def test_greedy_decoding_records_the_models_own_distribution_whatever_top_p_says():
    """Temperature 0 takes the argmax and records its log-softmax over the whole vocabulary: top_p does not apply
    (it would renormalise the recorded logprob over the nucleus)."""
    import torch

    tok, model = load_tokenizer("tiny-qwen2"), load_model("tiny-qwen2").eval()
    prompt = tok.encode("one two three")
    gen = HFGenerator(model, tok.eos_token_id)
    out = [gen.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.0, top_p=p))[0] for p in (1.0, 0.3)]
    assert out[0].token_ids == out[1].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[0].token_ids])).logits[0, len(prompt) - 1 : -1].float()
    own = logits.log_softmax(-1).gather(1, torch.tensor(out[0].token_ids)[:, None]).squeeze(1)
    for c in out:
        assert torch.allclose(torch.tensor(c.logprobs), own, atol=1e-4)
    assert float(own.max()) < -1.0  # a random model's argmax holds little mass: a nucleus would change the value


def test_an_empty_prompt_anywhere_in_a_call_is_refused():
    import pytest

    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    gen = HFGenerator(model, tok.eos_token_id)
    for prompts in ([[]], [[5, 6], []], [[], [5, 6]]):
        with pytest.raises(ValueError, match="every prompt needs at least one token"):
            gen.generate(prompts, SamplingParams(max_new_tokens=2))
    assert gen.generate([], SamplingParams(max_new_tokens=2)) == []


def test_non_finite_scores_are_a_clear_error_not_a_token():
    import pytest
    import torch

    tok, model = load_tokenizer("tiny-llama"), load_model("tiny-llama")
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    for temperature in (0.0, 1.0):
        with pytest.raises(RuntimeError, match="not finite"):
            HFGenerator(model, tok.eos_token_id).generate(
                [[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=temperature)
            )
