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


def test_torch_policy_on_cuda_takes_cpu_batches_and_trains_bf16_with_fp32_masters():
    """The RL path's device handling: batches stay on CPU between passes; the policy and its frozen reference
    compute on the GPU and hand CPU tensors back; a bf16 model's masters are fp32 on the GPU."""
    from nemo_rcgrpo.algorithms.losses import sft_loss
    from nemo_rcgrpo.config_schema import TrainerConfig
    from nemo_rcgrpo.data.batch import MicroBatch
    from nemo_rcgrpo.models.torch_policy import TorchPolicy
    from nemo_rcgrpo.utils.dist import DistInfo

    model = load_model("tiny-llama", "bfloat16")
    policy = TorchPolicy(
        model, TrainerConfig(lr=1e-5, schedule="constant"), DistInfo(device=torch.device("cuda", 0)), 4
    )
    reference = policy.frozen_reference()
    ids = torch.randint(0, 1000, (2, 12))
    batch = MicroBatch(ids, torch.ones_like(ids), torch.ones_like(ids))
    ref, cur = reference(batch), policy.logprobs(batch)
    assert ref.device.type == "cpu" and cur.device.type == "cpu" and torch.equal(ref, cur)
    before = [m.detach().clone() for m in policy.master_weights()]
    policy.train_step([batch], sft_loss, 24.0)
    after = policy.master_weights()
    assert all(m.device.type == "cuda" and m.dtype == torch.float32 for m in after)
    moved = sum(int((a != b).sum()) for a, b in zip(after, before)) / sum(b.numel() for b in before)
    assert moved > 0.95
