"""models/torch_policy.py: logprobs and entropies at the trained positions equal the full forward pass's."""

import pytest
import torch

from nemo_rcgrpo.data.batch import MicroBatch


def test_entropies_of_the_training_pass_equal_the_no_grad_pass(monkeypatch):
    """token_logprobs(..., entropy_out) (chunked over positions) gives the entropies logprobs_and_entropy gives."""
    from nemo_rcgrpo.models import torch_policy
    from nemo_rcgrpo.models.hf import load_model

    monkeypatch.setattr(torch_policy, "ENTROPY_CHUNK", 3)  # several chunks, the last one short
    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    ids = torch.randint(0, 1000, (2, 12))
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[0, 4:12], mask[1, 2:9] = 1, 1
    out = []
    lp = torch_policy.token_logprobs(model, ids, attn, mask, out)
    ref_lp, ref_ent = torch_policy.logprobs_and_entropy(model, ids, attn, mask)
    assert torch.allclose(lp.detach(), ref_lp, atol=1e-5) and torch.allclose(out[0], ref_ent, atol=1e-5)
    assert (out[0] * mask).sum() > 0


@pytest.mark.parametrize("path", ["gathered", "head", "union"])
def test_trained_position_logprobs_equal_the_full_forward(monkeypatch, path):
    """Logprobs, entropies and gradients at the trained positions are the full forward pass's, whether the
    output layer runs on each row's own positions (`position_logits`, bare or as the `PositionHead` DDP
    wraps) or on the union of positions (`logits_to_keep`); positions nobody trains are 0."""
    from nemo_rcgrpo.models import torch_policy
    from nemo_rcgrpo.models.hf import load_model

    monkeypatch.setattr(torch_policy, "ENTROPY_CHUNK", 4)
    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    ids = torch.randint(0, 1000, (3, 14))
    attn = torch.ones_like(ids)
    attn[2, 10:] = 0  # a right-padded row
    mask = torch.zeros_like(ids)
    mask[0, 5:14], mask[1, 2:6], mask[2, 7:10] = 1, 1, 1
    full = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float().log_softmax(-1)  # [B, T-1, V]
    want_lp = torch.cat([torch.zeros(3, 1), full.gather(-1, ids[:, 1:, None]).squeeze(-1)], 1) * mask
    want_ent = torch.cat([torch.zeros(3, 1), -(full.exp() * full).sum(-1)], 1) * mask
    (want_lp.sum()).backward()
    want_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    if path == "union":
        monkeypatch.setattr(torch_policy, "GATHERED_MODEL_TYPES", frozenset())
    assert torch_policy.gathers(model) == (path != "union")
    runner = torch_policy.PositionHead(model) if path == "head" else model
    out: list = []
    lp = torch_policy.token_logprobs(runner, ids, attn, mask, out)
    assert torch.allclose(lp * mask, want_lp, atol=1e-5) and torch.allclose(out[0] * mask, want_ent, atol=1e-5)
    if path != "union":  # each row's own positions only: the rest are exactly 0 (the union fills other rows' too)
        assert (lp[mask == 0] == 0).all() and (out[0][mask == 0] == 0).all()
    (lp * mask).sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), want_grad):
        assert torch.allclose(got, want, atol=1e-5)


def test_position_head_without_a_mask_and_a_micro_batch_with_nothing_trained():
    """Through the PositionHead with loss_mask=None every position is computed (the full forward's logprobs); a
    micro-batch whose mask trains nothing gives all-zero logprobs and a zero loss whose backward runs."""
    from nemo_rcgrpo.algorithms.losses import sft_loss
    from nemo_rcgrpo.models import torch_policy
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    ids = torch.randint(0, 1000, (2, 9))
    attn = torch.ones_like(ids)
    full = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float().log_softmax(-1)
    want = torch.cat([torch.zeros(2, 1), full.gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)
    got = torch_policy.token_logprobs(torch_policy.PositionHead(model), ids, attn, None)
    assert torch.allclose(got, want, atol=1e-5)
    for runner in (model, torch_policy.PositionHead(model)):
        nothing = torch.zeros_like(ids)
        lp = torch_policy.token_logprobs(runner, ids, attn, nothing)
        assert lp.shape == ids.shape and (lp == 0).all()
        loss, m = sft_loss(lp, MicroBatch(ids, attn, nothing), 0.0)
        assert loss.item() == 0.0 and m.tokens == 0.0
        loss.backward()  # no position in the graph: nothing to propagate, and no error
