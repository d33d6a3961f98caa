"""On a CUDA device (marker gpu; skipped with the reason shown elsewhere): the torch backend's token logprobs equal
the CPU's for a tiny model in float32, and the HF generator decodes on the model's device."""

import pytest
import torch

from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.models.hf import load_model, load_tokenizer
from nemo_rcgrpo.models.torch_policy import token_logprobs

pytestmark = pytest.mark.gpu


def test_logprobs_and_greedy_tokens_match_the_cpu():
    tok = load_tokenizer("tiny-llama")
    cpu = load_model("tiny-llama").eval()
    gpu = load_model("tiny-llama").eval().to("cuda")
    ids = torch.tensor([tok("The capital of France is a city with many tools")["input_ids"]])
    attn, mask = torch.ones_like(ids), torch.ones_like(ids)
    with torch.no_grad():
        a = token_logprobs(cpu, ids, attn, mask)
        b = token_logprobs(gpu, ids.cuda(), attn.cuda(), mask.cuda()).cpu()
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    # a random model's logits are nearly flat, so greedy tokens may differ by rounding: only the mechanics here
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = HFGenerator(gpu, pad).generate([ids[0].tolist()], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert len(out.token_ids) == len(out.logprobs) > 0 and all(lp <= 0 for lp in out.logprobs)
