"""The vLLM server generator against the HF generator on SmolLM2 with reward tokens (one server per module).

Greedy tokens equal; sampled logprobs are those of the processed distribution; a weight update through the
collective transfer (the worker extension in the server, a gloo group with this process: the code the GPU runs
with NCCL) delivers the tensors sent and makes the server's greedy output equal HF's with the new weights, and
advances the version; refused and failed updates leave the old weights serving, through either path.
"""

import copy

import pytest
import torch

from nemo_rcgrpo.config_schema import VLLMConfig
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.generation.vllm_client import WeightSyncError
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer

pytestmark = pytest.mark.vllm
REWARD_TOKENS = ("<|high_reward|>", "<|low_reward|>")
PROMPTS = [
    "<|im_start|>user\nList the files in the current folder. [Reward Goal: <|high_reward|>]<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou call tools.<|im_end|>\n<|im_start|>user\nWhat is 2+2? [Reward Goal: <|low_reward|>]"
    "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smol():
    tok, model = load_tokenizer("smollm2"), load_model("smollm2").eval()
    add_reward_tokens(tok, model, REWARD_TOKENS)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert all(any(t in p for t in tok.convert_tokens_to_ids(list(REWARD_TOKENS))) for p in prompts[:2])
    return tok, model, prompts


@pytest.fixture(scope="module")
def gen(smol, tmp_path_factory):
    from nemo_rcgrpo.generation.vllm_generator import VLLMGenerator

    tok, model, _ = smol
    g = VLLMGenerator(
        VLLMConfig(enforce_eager=True, kv_cache_gib=1, max_model_len=2048),
        model=model,
        tokenizer=tok,
        weight_dir=tmp_path_factory.mktemp("gen"),
        dtype="float32",
        reward_tokens=REWARD_TOKENS,
    )
    g.start()
    g.sync.verify = True  # every worker returns the sums of what it received
    g.sync.bucket_bytes = 64 << 20  # several buckets for SmolLM2's 0.5 GB
    yield g
    g.close()
    assert g.server is None


def _greedy(tok, n=16):
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))


def _assert_same(vllm_out, hf_out):
    for v, h in zip(vllm_out, hf_out):
        assert v.token_ids == h.token_ids and v.finish_reason == h.finish_reason
        assert torch.allclose(torch.tensor(v.logprobs), torch.tensor(h.logprobs), atol=2e-3)


def test_greedy_tokens_equal_hf_and_reward_tokens_are_served(gen, smol):
    tok, model, prompts = smol
    assert gen.client.tokenize("<|high_reward|> <|low_reward|>")[0::2] == tok.convert_tokens_to_ids(list(REWARD_TOKENS))
    out = gen.generate(prompts, _greedy(tok))
    _assert_same(out, HFGenerator(model, tok.pad_token_id or 0).generate(prompts, _greedy(tok)))
    assert {c.finish_reason for c in out} <= {"stop", "length"} and all(len(c.token_ids) <= 16 for c in out)
    assert gen.version == 0 and gen.client.weight_version() == "0"


def test_sampled_logprobs_are_of_the_processed_distribution(gen, smol):
    tok, model, prompts = smol
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=11)
    out = gen.generate(prompts[:2], params)
    assert [c.token_ids for c in gen.generate(prompts[:2], params)] == [c.token_ids for c in out]  # seeded
    for prompt, c in zip(prompts, out):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float() / 0.7
        probs = logits.softmax(-1)
        sorted_p, order = probs.sort(-1)
        remove = sorted_p.cumsum(-1) <= 1 - 0.9  # top-p: drop the low tail holding <= 10% of the mass
        remove[..., -1:] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        expected = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=2e-3)


@pytest.fixture(scope="module")
def updated(gen, smol):
    """Version 1: every weight perturbed (seeded); the server serves it."""
    tok, model, prompts = smol
    new = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    before = gen.generate(prompts, _greedy(tok))
    gen.update_weights(new.state_dict().items(), 1)
    return new, before


def test_weight_update_serves_the_new_weights(gen, smol, updated):
    tok, _, prompts = smol
    new, before = updated
    out = gen.generate(prompts, _greedy(tok))
    _assert_same(out, HFGenerator(new, tok.pad_token_id or 0).generate(prompts, _greedy(tok)))
    assert [c.token_ids for c in out] != [c.token_ids for c in before]
    assert gen.version == 1 and gen.client.weight_version() == "1"
    # through the process group, in several buckets, every tensor checked by its sum on the worker; no folder
    stats = gen.sync.stats
    assert (stats["syncs"], stats["fallbacks"]) == (1, 0) and stats["broadcasts"] > 4, stats
    from nemo_rcgrpo.generation.vllm_sync import _with_lm_head

    assert stats["bytes"] == sum(t.numel() * 4 for t in _with_lm_head(new.state_dict().items(), gen.tied).values())
    assert sorted(p.name for p in gen.weight_dir.glob("v*")) == ["v0"]  # the folder the server started from


def test_refused_and_failed_updates_keep_the_old_weights(gen, smol, updated, monkeypatch):
    from nemo_rcgrpo.generation import vllm_sync

    tok, model, prompts = smol
    new, _ = updated
    # the folder path (weight_sync=folder, and the collective path's fallback) on the same server: version 1 again
    gen.sync.fallback.push(vllm_sync._with_lm_head(new.state_dict().items(), gen.tied).items(), 1)
    serving = [c.token_ids for c in gen.generate(prompts, _greedy(tok))]
    bad = dict(model.state_dict())
    bad["model.layers.3.mlp.down_proj.weight"] = torch.zeros(5, 7)
    with pytest.raises(WeightSyncError, match=r"wrong shape .*down_proj.*nothing was sent"):
        gen.update_weights(bad.items(), 2)
    missing = {k: v for k, v in model.state_dict().items() if "layers.0." not in k}
    with pytest.raises(WeightSyncError, match=r"missing \['model.layers.0"):
        gen.update_weights(missing.items(), 2)
    # a folder reload that fails on the server (here: a folder without weights) is rolled back
    with monkeypatch.context() as m:
        m.setattr(vllm_sync, "_save", lambda tensors, folder, dtypes=None: None)
        with pytest.raises(WeightSyncError, match=r"failed on the server .*still serving"):
            gen.sync.fallback.push(vllm_sync._with_lm_head(model.state_dict().items(), gen.tied).items(), 2)
    assert [c.token_ids for c in gen.generate(prompts, _greedy(tok))] == serving
    assert gen.version == 1 and gen.client.weight_version() == "1"
    # a collective transfer that fails is redone through a folder with the same tensors: version 2 serves
    from nemo_rcgrpo.generation import weight_transfer

    def fails_after_two_tensors(self, stream):
        tensors = iter(stream)
        next(tensors), next(tensors)
        raise vllm_sync.GeneratorError("a worker refused")

    from nemo_rcgrpo.utils.weight_stream import WeightStream

    passes = []
    state = model.state_dict()
    stream = WeightStream(
        [(n, tuple(t.shape), t.dtype) for n, t in state.items()], lambda: passes.append(1) or iter(state.items())
    )
    with monkeypatch.context() as m:
        m.setattr(weight_transfer.CollectiveSync, "_send", fails_after_two_tensors)
        gen.update_weights(stream, 2)
    assert len(passes) == 2  # the folder got a second, whole pass of the export
    assert gen.sync.stats["fallbacks"] == 1 and gen.version == 2 and gen.client.weight_version() == "2"
    _, original = updated  # the original weights' greedy output, from before version 1
    assert [c.token_ids for c in gen.generate(prompts, _greedy(tok))] == [c.token_ids for c in original]
