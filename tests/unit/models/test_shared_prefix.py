"""models/shared_prefix.py: the prefix-once passes give the unshared forward's logprobs, entropies and every
parameter's gradient (float64 to 1e-10, float32 to 1e-5 relative), on tiny Llama and Qwen2 shapes, both ways the
rest of the tree runs (one flat row behind a mask, or a row per branch and suffix), the root recomputed in the
backward pass or kept; a planted leak between suffixes, or suffix positions that restart at 0, fail."""

import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nemo_rcgrpo.data.prefix_tree import group_layout, padded_tokens
from nemo_rcgrpo.models import shared_prefix
from nemo_rcgrpo.models.shared_prefix import FLAT, ROWS
from nemo_rcgrpo.models.torch_policy import token_logprobs


def _group(seed, two_level=True):
    """An RC-GRPO-like micro-batch: a 9-token prompt whose 4th token is the reward token (two values), then
    rollouts of 3-7 tokens; two rows share their first generated tokens; right-padded [5, T] with its masks."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 900, (9,), generator=g).tolist()
    rows, masks = [], []
    for r, n in enumerate([5, 3, 7, 4, 6]):
        p = list(prompt)
        if two_level:
            p[3] = 950 + r % 2  # high / low
        gen = torch.randint(3, 900, (n,), generator=g).tolist()
        if r == 2:
            gen[:2] = rows[0][len(p) : len(p) + 2]  # shares two generated tokens with row 0 (same branch)
        rows.append(p + gen)
        masks.append([0] * len(p) + [1] * n)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return rows, ids, attention, loss_mask


def _float64(model):
    """``model`` in float64 throughout: transformers' RMSNorm computes in float32 whatever the model's dtype
    (its gradients then differ between any two graphs at 1e-7), so its norms here keep the input's dtype."""

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    model = model.double().eval()
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(norm, m)
    return model


def _both(model, rows, ids, attention, loss_mask):
    """(unshared, shared) logprobs, entropies and the flat gradient of sum(logprobs x weights)."""
    weights = torch.linspace(-1.0, 2.0, ids.numel()).reshape(ids.shape).to(next(model.parameters()).dtype)
    out = []
    for shared in (False, True):
        model.zero_grad(set_to_none=True)
        ent = []
        if shared:
            lp = token_logprobs(model, ids, attention, loss_mask, ent, layout=group_layout(rows))
        else:
            lp = token_logprobs(model, ids, attention, loss_mask, ent)
        (lp * weights).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        out.append((lp.detach(), ent[0], grads))
    return out


@pytest.fixture(params=[FLAT, ROWS])
def how(request, monkeypatch):
    """The way the rest of the tree runs, whatever this platform's `tree_pass` would choose."""
    monkeypatch.setattr(shared_prefix, "tree_pass", lambda device, attention, layout: request.param)
    return request.param


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("two_level", [True, False])
def test_float64_passes_equal_the_unshared_forward(name, two_level, how):
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = _float64(load_model(name))
    rows, ids, attention, loss_mask = _group(1, two_level)
    layout = group_layout(rows)
    assert layout.root == (3 if two_level else 9) and layout.shared_tokens > 0
    (lp, ent, grad), (lp_s, ent_s, grad_s) = _both(model, rows, ids, attention, loss_mask)
    assert (lp != 0).sum() == loss_mask[:, 1:].sum()  # every trained position, nothing else
    assert torch.allclose(lp_s, lp, rtol=0, atol=1e-10)
    assert torch.allclose(ent_s, ent, rtol=0, atol=1e-10)
    assert grad.abs().max() > 0 and torch.allclose(grad_s, grad, rtol=0, atol=1e-10)
    with torch.no_grad():  # the flat order `hidden_index` reads: [root | branch parts padded to Q | suffixes to S]
        hidden = shared_prefix.shared_hidden(model, ids, layout)
    assert hidden.shape == (padded_tokens(layout), model.config.hidden_size)


def test_float32_passes_equal_the_unshared_forward_to_1e_5_relative(how):
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = load_model("tiny-llama").eval()
    rows, ids, attention, loss_mask = _group(2)
    (lp, ent, grad), (lp_s, ent_s, grad_s) = _both(model, rows, ids, attention, loss_mask)
    assert torch.allclose(lp_s, lp, rtol=1e-5, atol=1e-6) and torch.allclose(ent_s, ent, rtol=1e-5, atol=1e-6)
    assert (grad_s - grad).norm() <= 1e-5 * grad.norm()


def test_rows_without_a_shared_prefix_still_give_the_unshared_forward(how):
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = _float64(load_model("tiny-llama"))
    rows = [[5, 6, 7, 8], [9, 10, 11]]  # nothing shared: no root, one branch per first token
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]])
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert group_layout(rows).root == 0
    (lp, _, grad), (lp_s, _, grad_s) = _both(model, rows, ids, attention, loss_mask)
    assert torch.allclose(lp_s, lp, rtol=0, atol=1e-10) and torch.allclose(grad_s, grad, rtol=0, atol=1e-10)


def test_eager_attention_takes_the_flat_mask_as_scores_to_add(how):
    """eager adds its mask to the scores (the flat pass's additive mask, the dtype's lowest where a slot may not look)
    as sdpa does; transformers' eager attention takes its softmax in float32 whatever the model's dtype, so float32's tolerance."""
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = _float64(load_model("tiny-llama"))
    model.set_attn_implementation("eager")
    rows, ids, attention, loss_mask = _group(5)
    (lp, ent, grad), (lp_s, ent_s, grad_s) = _both(model, rows, ids, attention, loss_mask)
    assert torch.allclose(lp_s, lp, rtol=1e-5, atol=1e-6) and (grad_s - grad).norm() <= 1e-5 * grad.norm()


def test_the_platform_and_the_tree_decide_how_the_rest_of_the_tree_runs():
    """FLAT on the CPU with sdpa / eager where its dense mask holds no more entries than the row passes compute
    scores (a group after its long prompt), ROWS elsewhere; an unknown way is refused before anything runs."""
    from nemo_rcgrpo.data.prefix_tree import Branch, GroupLayout, attention_scores

    # one group of 5 after a 5348-token prompt, two branches (the shipped BFCL task of scripts/bench/shared_prefix.py)
    group = GroupLayout(
        5348, (Branch((0, 2, 4), 753), Branch((1, 3), 151)), (6101 + 51, 5499 + 553, 6101 + 76, 5499 + 678, 6101 + 20)
    )
    # 8 rows of 2000 tokens after a 200-token system prompt, nothing else shared
    many = GroupLayout(200, tuple(Branch((r,), 0) for r in range(8)), (2000,) * 8)
    assert attention_scores(many) == (8 * 1800 * (200 + 8 * 1800), 8 * 1800 * (200 + 1800))
    assert attention_scores(group)[0] < attention_scores(group)[1]
    one = GroupLayout(4, (Branch((0,), 0),), (9,))  # one row: the same scores either way, and FLAT takes the tie
    assert attention_scores(one) == (5 * 9, 5 * 9) and shared_prefix.tree_pass("cpu", "sdpa", one) == FLAT
    for attention in ("sdpa", "eager"):
        assert shared_prefix.tree_pass("cpu", attention, group) == FLAT
        assert shared_prefix.tree_pass("cpu", attention, many) == ROWS  # 210M mask entries against 29M scores
    assert shared_prefix.tree_pass("cuda", "sdpa", group) == ROWS  # no dense mask on a GPU
    assert shared_prefix.tree_pass("cuda", "flash_attention_2", group) == ROWS
    assert shared_prefix.tree_pass("cpu", "flex_attention", group) == ROWS  # a mask it would not take as given
    from nemo_rcgrpo.models.hf import load_model

    model = load_model("tiny-llama")
    calls = []
    model.get_decoder().register_forward_pre_hook(lambda *a: calls.append(1))
    rows, ids, _, _ = _group(1)
    with pytest.raises(ValueError, match="'flat' or 'rows'"):
        shared_prefix.shared_hidden(model, ids, group_layout(rows), how="columns")
    assert not calls  # refused before the root runs


def test_a_pass_cache_joins_writes_nothing_and_hands_its_keys_over_once_and_the_recompute_patch_is_undone():
    """A pass's cache hands back each layer's keys and values after those it continues from, stores none (a layer
    recomputed in backward gets the same again), reports the length it continues from for the masks, and keeps the
    first joined ones per layer until taken; `_recomputed` puts back what each layer's instance had (nothing, or
    its own forward), nested too, and on an exception."""
    from nemo_rcgrpo.models.hf import load_model

    model = load_model("tiny-llama")
    k, v = torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4)
    root = shared_prefix._PassCache(model.config, keep=True)
    assert root.get_seq_length(0) == 0 and root.get_mask_sizes(5, 0) == (5, 0)
    assert root.update(k, v, 1) == (k, v) and root.update(v, k, 0) == (v, k)
    assert root.update(k, k, 0) == (k, k)  # a recompute: handed back, the first kept
    kv = root.take()
    assert [(a is x, b is y) for (a, b), (x, y) in zip(kv, [(v, k), (k, v)])] == [(True, True)] * 2
    assert root.kv == {} and root.update(k, v, 0) == (k, v) and root.kv == {}  # nothing kept once taken
    rest = shared_prefix._PassCache(model.config, kv)
    joined = rest.update(2 * v[:, :, :1], 3 * v[:, :, :1], 1)
    assert [t.shape[-2] for t in joined] == [4, 4] and rest.kv == {}
    assert torch.equal(joined[0], torch.cat([k, 2 * v[:, :, :1]], dim=-2))
    assert torch.equal(joined[1], torch.cat([v, 3 * v[:, :, :1]], dim=-2))
    assert rest.get_seq_length(1) == 3 and rest.get_mask_sizes(2, 1) == (5, 0) and rest.get_query_offset(1) == 3
    layers = list(model.get_decoder().layers)
    own = lambda *a, **kw: None  # noqa: E731 - a forward set on the instance, as a hook would
    layers[0].forward = own
    with pytest.raises(RuntimeError):
        with shared_prefix._recomputed(layers):
            with shared_prefix._recomputed(layers[:1]):
                assert layers[0].forward.args[0].args[0] is own  # checkpoint(checkpoint(own))
            assert layers[0].forward.func is checkpoint and layers[0].forward.args[0] is own
            raise RuntimeError
    assert layers[0].__dict__["forward"] is own and all("forward" not in layer.__dict__ for layer in layers[1:])
    layers[0].gradient_checkpointing = True  # as gradient_checkpointing_enable sets it
    with pytest.raises(RuntimeError):  # transformers' setting is put back whatever happens inside
        with shared_prefix._own_checkpointing(layers[:1]):
            assert not layers[0].gradient_checkpointing
            raise RuntimeError
    assert layers[0].gradient_checkpointing


def _saved_bytes_and_layer_calls(model, ids, layout, how, recompute):
    """(bytes autograd keeps for the backward pass outside checkpointed layers, decoder-layer forward runs: each
    layer's MLP entered: a recompute runs the layer's own forward, and stops once it has what the backward pass
    needs) of one shared forward and backward."""
    saved, calls = [0], [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    hooks = [
        layer.mlp.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        for layer in model.get_decoder().layers
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = shared_prefix.shared_hidden(model, ids, layout, how=how, recompute=recompute)
        hidden.pow(2).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    return saved[0], calls[0]


@pytest.mark.parametrize("kind", [FLAT, ROWS])
def test_the_root_is_recomputed_in_backward_and_its_activations_are_not_kept(kind):
    """A long root and short suffixes: with the recompute, each root layer runs once more (in the backward pass),
    and what autograd keeps is less by at least 90% of what the root's forward alone keeps (the rest: its final
    norm, kept either way); the gradients are the same (float64)."""
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = _float64(load_model("tiny-llama")).train()
    prompt = torch.randint(3, 900, (96,)).tolist()
    rows = [prompt + [950 + r % 2] + torch.randint(3, 900, (2 + r,)).tolist() for r in range(4)]
    ids = torch.tensor([r + [0] * (max(map(len, rows)) - len(r)) for r in rows])
    layout = group_layout(rows)
    assert layout.root == 96
    layers = len(model.get_decoder().layers)
    out = {}
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        out[recompute] = _saved_bytes_and_layer_calls(model, ids, layout, kind, recompute) + (
            torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]),
        )
    root_alone = [0]

    def pack(t):
        root_alone[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_decoder()(input_ids=ids[:1, :96])
    (kept, calls, grad), (kept_r, calls_r, grad_r) = out[False], out[True]
    passes = 2 if kind == FLAT else 3  # root + rest, or root + branches + suffixes
    assert calls == passes * layers and calls_r == calls + layers  # the root's layers once more
    assert kept - kept_r >= 0.9 * root_alone[0], (kept, kept_r, root_alone)
    assert torch.allclose(grad_r, grad, rtol=0, atol=1e-10)


def _no_branch_group():
    """Rows that share a 9-token prompt and nothing after it (no branch parts: each suffix continues the root)."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 900, (9,), generator=g).tolist()
    rows = [prompt + [10 + r] + torch.randint(3, 900, (n,), generator=g).tolist() for r, n in enumerate([3, 5, 2])]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.tensor([[0] * 9 + [1] * (len(r) - 9) + [0] * (width - len(r)) for r in rows])
    return rows, ids, attention, loss_mask


@pytest.mark.parametrize("kind", [FLAT, ROWS])
@pytest.mark.parametrize(
    "name, shape", [("tiny-llama", "two-level"), ("tiny-qwen2", "one-level"), ("tiny-llama", "no-branch")]
)
def test_with_gradient_checkpointing_every_pass_is_recomputed_and_the_result_is_the_same(
    kind, name, shape, monkeypatch
):
    """transformers' gradient checkpointing drops the cache a pass continues from; the passes turn it off while
    they run and checkpoint every layer of every pass themselves: each layer runs once more per pass (in the
    backward pass), the logprobs, entropies and gradients equal the unshared forward's under transformers' own
    checkpointing (float64, 1e-10; branch parts of equal and of padded lengths, and none), and its setting is back
    on afterwards. In eval mode (where transformers' would not run) only the root is recomputed."""
    from nemo_rcgrpo.models.hf import load_model

    monkeypatch.setattr(shared_prefix, "tree_pass", lambda device, attention, layout: kind)
    torch.manual_seed(0)
    model = _float64(load_model(name)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.get_decoder().layers
    assert all(layer.gradient_checkpointing for layer in layers)
    rows, ids, attention, loss_mask = _no_branch_group() if shape == "no-branch" else _group(2, shape == "two-level")
    layout = group_layout(rows)
    widths = sorted({b.length for b in layout.branches})
    assert (
        layout.root
        and {"two-level": widths[0] > 0, "one-level": widths[0] == 0 < widths[-1], "no-branch": widths == [0]}[shape]
    )
    calls = [0]
    hooks = [layer.mlp.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1)) for layer in layers]
    try:
        (lp, ent, grad), (lp_s, ent_s, grad_s) = _both(model, rows, ids, attention, loss_mask)
        passes = 2 if kind == FLAT or shape == "no-branch" else 3  # root + rest, or root + branch parts + suffixes
        assert calls[0] == 2 * len(layers) + 2 * passes * len(layers)  # unshared, then every shared pass, twice
        assert all(layer.gradient_checkpointing for layer in layers)
        assert torch.allclose(lp_s, lp, rtol=0, atol=1e-10) and torch.allclose(ent_s, ent, rtol=0, atol=1e-10)
        assert grad.abs().max() > 0 and torch.allclose(grad_s, grad, rtol=0, atol=1e-10)
        model.eval()
        calls[0] = 0
        shared_prefix.shared_hidden(model, ids, layout).sum().backward()
        assert calls[0] == passes * len(layers) + len(layers)  # the root's layers once more, nothing else
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("plant", ["leak", "restart"])
def test_a_suffix_that_sees_another_or_restarts_its_positions_fails(plant, monkeypatch):
    """The flat pass's mask and positions are `flat_row`'s: planting a suffix that sees another row's suffix, or
    a suffix whose positions restart at 0, changes the logprobs (the parity tests above would fail)."""
    from nemo_rcgrpo.data.packing import FlatRow, flat_row
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    model = _float64(load_model("tiny-llama"))
    rows, ids, attention, loss_mask = _group(6)
    layout = group_layout(rows)
    monkeypatch.setattr(shared_prefix, "tree_pass", lambda device, attention, layout: FLAT)
    lp = token_logprobs(model, ids, attention, loss_mask, layout=layout).detach()
    assert torch.allclose(lp, token_logprobs(model, ids, attention, loss_mask).detach(), rtol=0, atol=1e-10)

    def planted(lay, input_ids):
        f = flat_row(lay, input_ids)
        # row 0's second-to-last slot (it predicts row 0's last token) and row 1's last slot, both suffix slots
        a, b = f.index[0, len(rows[0]) - 2], f.index[1, len(rows[1]) - 1]
        blocked, positions = f.blocked.clone(), f.positions.clone()
        if plant == "leak":
            blocked[a, b] = False  # it sees row 1's last token
        else:
            slots = f.index[0, layout.suffix_start(0) : len(rows[0])]
            positions[slots] = torch.arange(len(slots))  # row 0's suffix at 0, 1, ...
        return FlatRow(f.ids, positions, blocked, f.index)

    monkeypatch.setattr(shared_prefix, "flat_row", planted)
    lp_planted = token_logprobs(model, ids, attention, loss_mask, layout=layout).detach()
    changed = (lp_planted - lp).abs()
    assert changed[0].max() > 1e-3  # row 0 is wrong
    assert changed[1:].max() < 1e-10  # the rows the plant does not touch are not


def _policy(model, **trainer):
    from nemo_rcgrpo.config_schema import TrainerConfig
    from nemo_rcgrpo.models.torch_policy import TorchPolicy
    from nemo_rcgrpo.utils.dist import DistInfo

    gc = trainer.pop("gradient_checkpointing", False)
    return TorchPolicy(
        model,
        TrainerConfig(lr=1e-2, warmup_steps=0, schedule="constant", **trainer),
        DistInfo(),
        total_steps=2,
        gradient_checkpointing=gc,
    )


def _gradients_at_the_step(policy) -> list:
    """A list that receives the flat (clipped) gradient of every optimizer step ``policy`` takes."""
    seen, step = [], policy.optimizer.step

    def record(*args, **kwargs):
        seen.append(torch.cat([p.grad.detach().reshape(-1).clone() for p in policy.master]))
        return step(*args, **kwargs)

    policy.optimizer.step = record
    return seen


def _grpo_step(policy, tokens) -> tuple:
    """A GRPO step of ``policy`` on the micro-batch ``tokens`` (5 rows, mixed advantages): the reference, old
    logprobs and entropies, the step's result and the gradient the optimizer was given."""
    from nemo_rcgrpo.algorithms.losses import GRPOLoss
    from nemo_rcgrpo.data.batch import RLMicroBatch

    ref = policy.frozen_reference()(tokens)
    old, ent = policy.logprobs(tokens, with_entropy=True)
    batch = RLMicroBatch(
        tokens.input_ids,
        tokens.attention_mask,
        tokens.loss_mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0]),
        ref_logprobs=ref,
        sampler_logprobs=old.clone(),
        old_logprobs=old,
        first=0,
    )
    grads = _gradients_at_the_step(policy)
    out = policy.train_step(
        [batch], GRPOLoss(kl_beta=0.1, num_sequences=5.0, ratio="old"), float(tokens.loss_mask.sum()), with_entropy=True
    )
    return ref, old, ent, out, grads[0]


def _assert_same_step(first: tuple, second: tuple) -> None:
    """Two `_grpo_step` results agree (float32, 1e-5 relative)."""
    (ref, old, ent, out, g), (ref0, old0, ent0, out0, g0) = first, second
    for a, b in ((ref, ref0), (old, old0), (ent, ent0), (out.entropy_sums[0], out0.entropy_sums[0])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert out.stats[0].loss == pytest.approx(out0.stats[0].loss, rel=1e-5, abs=1e-7)
    assert out.grad_norm == pytest.approx(out0.grad_norm, rel=1e-5)
    # the gradient AdamW is given (its first step is about lr x sign(g): weights would magnify rounding where g ~ 0)
    assert g0.norm() > 0 and (g - g0).norm() <= 1e-5 * g0.norm()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_policy_update_is_the_same_with_sharing_on_and_off(checkpointing):
    """TorchPolicy with trainer.share_prefix: the reference, old logprobs, entropies, loss records and the
    gradient of a GRPO step on a mixed-reward group equal the unshared policy's (float32, 1e-5 relative), with
    and without gradient checkpointing (the 7B/8B recipes')."""
    import copy

    from nemo_rcgrpo.data.batch import MicroBatch
    from nemo_rcgrpo.models.hf import load_model

    torch.manual_seed(0)
    base = load_model("tiny-llama")
    rows, ids, attention, loss_mask = _group(3)
    tokens = MicroBatch(ids, attention, loss_mask)
    results = []
    for share in (True, False):
        policy = _policy(
            copy.deepcopy(base), share_prefix=share, pack_sequences=False, gradient_checkpointing=checkpointing
        )
        assert (policy.layout(tokens) is not None) is share
        results.append(_grpo_step(policy, tokens))
    _assert_same_step(*results)


def test_only_a_cache_that_keeps_every_key_is_shared():
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_rcgrpo.models.hf import load_model
    from nemo_rcgrpo.models.shared_prefix import supports

    assert supports(load_model("tiny-llama")) and supports(load_model("tiny-qwen2"))
    config = AutoConfig.for_model(
        "mistral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        sliding_window=8,
    )
    assert not supports(AutoModelForCausalLM.from_config(config))  # its cache keeps only the last 8 keys
    assert not supports(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "setting, expected",
    [
        (dict(share_prefix=True), True),
        (dict(share_prefix=False), False),
        (dict(share_prefix=True, gradient_checkpointing=True), True),  # the passes checkpoint their layers themselves
    ],
)
def test_where_a_policy_shares(setting, expected):
    from nemo_rcgrpo.data.batch import MicroBatch
    from nemo_rcgrpo.models.hf import load_model

    policy = _policy(load_model("tiny-llama"), pack_sequences=False, **setting)
    rows, ids, attention, loss_mask = _group(4)
    assert policy.share_prefix is expected
    assert (policy.layout(MicroBatch(ids, attention, loss_mask)) is not None) is expected
    if expected:  # rows that share nothing, or left padding, run in full
        apart = MicroBatch(
            torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
        )
        left = MicroBatch(
            torch.tensor([[0, 1, 2], [1, 1, 3]]),
            torch.tensor([[0, 1, 1], [1, 1, 1]]),
            torch.ones(2, 3, dtype=torch.long),
        )
        assert policy.layout(apart) is None and policy.layout(left) is None
