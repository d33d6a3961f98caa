"""models/packed.py: a micro-batch's rows packed as one sequence give the padded forward's logprobs, entropies
and every parameter's gradient (float64 to 1e-10, float32 to 1e-5 relative) on tiny Llama and Qwen2 shapes;
which platforms pack; where a policy packs."""

import pytest
import torch

from nemo_rcgrpo.data.packing import Packed
from nemo_rcgrpo.models.packed import packs
from nemo_rcgrpo.models.torch_policy import token_logprobs
from tests.unit.models.test_shared_prefix import _assert_same_step, _float64, _group, _grpo_step, _policy


def _both(model, ids, attention, loss_mask, packed):
    """(padded, packed) logprobs, entropies and the flat gradient of sum(logprobs x weights)."""
    weights = torch.linspace(-1.0, 2.0, ids.numel()).reshape(ids.shape).to(next(model.parameters()).dtype)
    out = []
    for layout in (None, packed):
        model.zero_grad(set_to_none=True)
        ent = []
        lp = token_logprobs(model, ids, attention, loss_mask, ent, layout=layout)
        (lp * weights).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        out.append((lp.detach(), ent[0], grads))
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_float64_packed_rows_equal_the_padded_forward(name):
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = _float64(load_model(name))
    rows, ids, attention, loss_mask = _group(1)
    packed = Packed(tuple(len(r) for r in rows))
    (lp, ent, grad), (lp_p, ent_p, grad_p) = _both(model, ids, attention, loss_mask, packed)
    assert (lp != 0).sum() == loss_mask[:, 1:].sum()
    assert torch.allclose(lp_p, lp, rtol=0, atol=1e-10) and torch.allclose(ent_p, ent, rtol=0, atol=1e-10)
    assert grad.abs().max() > 0 and torch.allclose(grad_p, grad, rtol=0, atol=1e-10)


def test_float32_packed_rows_equal_the_padded_forward_to_1e_5_relative():
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    rows, ids, attention, loss_mask = _group(2, two_level=False)
    (lp, ent, grad), (lp_p, ent_p, grad_p) = _both(
        model, ids, attention, loss_mask, Packed(tuple(len(r) for r in rows))
    )
    assert torch.allclose(lp_p, lp, rtol=1e-5, atol=1e-6) and torch.allclose(ent_p, ent, rtol=1e-5, atol=1e-6)
    assert (grad_p - grad).norm() <= 1e-5 * grad.norm()


def test_a_pack_that_lets_rows_see_each_other_fails_the_comparison(monkeypatch):
    """Planted: positions that run on across rows (one long causal sequence, each row seeing the rows before it)
    and a cache that turns transformers' boundary detection off must each change the logprobs."""
    import nemo_rcgrpo.models.packed as packed_mod
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = _float64(load_model("tiny-llama"))
    rows, ids, attention, loss_mask = _group(1)
    packed = Packed(tuple(len(r) for r in rows))
    good = token_logprobs(model, ids, attention, loss_mask, layout=packed).detach()
    monkeypatch.setattr(packed_mod, "packed_positions", lambda p: torch.arange(p.tokens))
    running_on = token_logprobs(model, ids, attention, loss_mask, layout=packed).detach()
    monkeypatch.undo()
    decoder = model.get_decoder()
    real = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda **kw: real(**{**kw, "use_cache": True}))
    cached = token_logprobs(model, ids, attention, loss_mask, layout=packed).detach()
    rest = loss_mask[1:, 1:].bool()  # the rows after the first, which see rows before them when boundaries are lost
    assert (running_on - good)[1:, 1:][rest].abs().max() > 1e-3
    assert (cached - good)[1:, 1:][rest].abs().max() > 1e-3


@pytest.mark.parametrize(
    "device, attention, expected",
    [
        ("cpu", "sdpa", "dense"),
        ("cpu", "eager", "dense"),
        ("cpu", "flash_attention_2", "varlen"),
        ("cuda", "flash_attention_2", "varlen"),
        ("cuda", "flash_attention_3", "varlen"),
        ("cuda", "flex_attention", "varlen"),
        ("cuda", "sdpa", None),
        ("cuda", "eager", None),  # a dense N x N mask: not on a GPU
        ("cpu", None, None),
        ("cpu", "paged|sdpa", None),  # unknown: rows stay padded
    ],
)
def test_which_platforms_pack(device, attention, expected):
    assert packs(device, attention) is expected


@pytest.mark.parametrize(
    "setting, expected",
    [
        (dict(pack_sequences=True), "dense"),
        (dict(pack_sequences=False), None),
        (dict(pack_sequences=True, gradient_checkpointing=True), "dense"),  # no cache needed: packing still runs
    ],
)
def test_where_a_policy_packs(setting, expected):
    from nemo_rcgrpo.data.batch import MicroBatch
    from nemo_rcgrpo.models.hf import load_model

    policy = _policy(load_model("tiny-llama"), share_prefix=False, **setting)
    assert policy.packs is expected
    # 4 + 1 tokens: 25 scores packed against 2 x 16 padded (CPU sdpa's dense mask)
    apart = MicroBatch(
        torch.tensor([[1, 2, 3, 4], [5, 0, 0, 0]]),
        torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]),
        torch.ones(2, 4, dtype=torch.long),
    )
    assert policy.layout(apart) == (Packed((4, 1)) if expected else None)
    full = MicroBatch(
        torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long)
    )
    assert policy.layout(full) is None  # no padding to drop


def test_a_policy_update_is_the_same_with_packing_on_and_off():
    """TorchPolicy with trainer.pack_sequences (and no prefix tree): the reference, old logprobs, entropies, loss
    records and the gradient of a GRPO step equal the padded policy's (float32, 1e-5 relative)."""
    import copy

    from nemo_rcgrpo.data.batch import MicroBatch
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    base = load_model("tiny-qwen2")
    rows, ids, attention, loss_mask = _group(3, two_level=False)
    tokens = MicroBatch(ids, attention, loss_mask)
    results = []
    for pack in (True, False):
        policy = _policy(copy.deepcopy(base), share_prefix=False, pack_sequences=pack)
        assert policy.packs == ("dense" if pack else None)
        # five rows of 12-16 tokens: CPU sdpa's dense mask would compute more scores packed (70^2 > 5 x 16^2), so the
        # policy would keep them padded; as a varlen attention would, pack them to run the packed update here
        policy.packs = "varlen" if pack else None
        assert isinstance(policy.layout(tokens), Packed) is pack
        results.append(_grpo_step(policy, tokens))
    _assert_same_step(*results)


@pytest.mark.parametrize("kind", ["tree", "packed", "tree-checkpointed"])
def test_a_ddp_wrapped_head_runs_the_layout_inside_ddps_forward(kind, tmp_path, monkeypatch):
    """Under torchrun the policy's model is DDP(PositionHead(model)): the layout's passes run inside DDP's forward
    (so its gradient hooks fire), and the logprobs and gradients equal the padded forward's (float64, 1e-10); with
    gradient checkpointing too (the tree's passes recompute their layers in DDP's backward)."""
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nemo_rcgrpo.models.torch_policy as tp
    from nemo_rcgrpo.data.prefix_tree import group_layout
    from nemo_rcgrpo.models.hf import load_model

    assert not tdist.is_initialized()
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _float64(load_model("tiny-llama"))
        if kind == "tree-checkpointed":
            model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        rows, ids, attention, loss_mask = _group(1)
        layout = group_layout(rows) if kind.startswith("tree") else Packed(tuple(len(r) for r in rows))
        ran = []
        for name in ("shared_position_logits", "packed_position_logits"):
            real = getattr(tp, name)
            monkeypatch.setattr(tp, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
        ddp = DDP(tp.PositionHead(model))
        out = []
        for wrapped, lay in ((ddp, layout), (model, None)):
            model.zero_grad(set_to_none=True)
            lp = token_logprobs(wrapped, ids, attention, loss_mask, layout=lay)
            (lp * torch.linspace(-1.0, 2.0, lp.numel(), dtype=lp.dtype).reshape(lp.shape)).sum().backward()
            out.append((lp.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
        assert ran == ["shared_position_logits" if kind.startswith("tree") else "packed_position_logits"]
        (lp_d, g_d), (lp, g) = out
        assert torch.allclose(lp_d, lp, rtol=0, atol=1e-10) and torch.allclose(g_d, g, rtol=0, atol=1e-10)
    finally:
        tdist.destroy_process_group()
