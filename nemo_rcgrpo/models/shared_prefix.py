"""The prefix-once forward of an HF decoder over a micro-batch's prefix tree (`data/prefix_tree.py`).

The root runs once (one row); then the rest of the tree runs with the root's keys and values, every token attending
to exactly its own root -> branch -> suffix path, causally, at the positions it has in the unshared row. How the
rest runs is ``tree_pass``'s pure choice for the platform and the tree:

- FLAT (sdpa / eager on the CPU, where its mask holds no more entries than ROWS computes scores,
  `data/prefix_tree.py: attention_scores`): every branch part and suffix, without padding, as one row after the
  root's cache, behind an explicit mask of what each slot sees (`data/packing.py: flat_row`, the Megatron
  backend's flat row; [M, R + M] entries for the M tokens after the root, dense); the root's keys and values are
  held once, never copied per row;
- ROWS (elsewhere: no dense mask on a GPU, and FlashAttention takes none; on the CPU, many rows after a short
  root): each branch part once, with the root's keys and values repeated to the branches, then every row's suffix
  with its branch's, selected by row (causal masks over padded rows, no mask of the tree's size).

The keys and values are the passes' own tensors, so the backward pass carries every suffix's gradient into its
branch and the root, which are computed once. Under autograd the root's decoder layers are recomputed in the
backward pass, one layer at a time (``torch.utils.checkpoint``, non-reentrant): only each layer's input and its
keys and values are kept, so a micro-batch holding a whole group keeps the activations of its suffixes, not of
its prompt (a 5.4k-token prompt's would be most of them), for one more forward of the root. With transformers'
gradient checkpointing on (the 7B/8B recipes), every pass's layers are recomputed so, in its place: it would drop
the cache a pass continues from, as its layers write to one and a replay would write twice; the passes' caches
(`_PassCache`) write nothing, they join the keys and values a pass continues from to its own and hand them back.

``shared_position_logits`` gives the logits at chosen positions of the unshared, right-padded micro-batch's
[B, T] grid, so ``torch_policy.token_logprobs(..., layout=...)`` returns the grid it returns without sharing
and the loss and its normaliser are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from nemo_rcgrpo.data.packing import Layout, choose_layout, flat_row
from nemo_rcgrpo.data.prefix_tree import GroupLayout, attention_scores, hidden_index

FLAT, ROWS = "flat", "rows"  # how the tree's branch parts and suffixes run after the root (`tree_pass`)


def supports(model: torch.nn.Module) -> bool:
    """Whether ``model``'s KV cache keeps every key and value (transformers' plain ``DynamicLayer`` in every layer):
    a sliding-window or recurrent layer drops or folds the prefix the next pass must attend to."""
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        return False
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def tree_pass(device_type: str, attn_implementation: str | None, layout: GroupLayout) -> str:
    """How a model on ``device_type`` with ``attn_implementation`` runs ``layout`` after its root: FLAT with sdpa /
    eager on the CPU (one row behind a dense [M, R + M] mask; CPU sdpa runs it in its flash kernel) where that mask
    has no more entries than the row passes compute scores (`attention_scores`: a group after its long prompt, not
    many rows after a short one), ROWS anywhere else (a 2k-token rest of a tree beside an 8k-token root: 16M mask
    entries per layer call on a GPU, where sdpa would leave its flash kernel; FlashAttention takes no mask)."""
    if device_type != "cpu" or attn_implementation not in ("sdpa", "eager"):
        return ROWS
    flat, rows = attention_scores(layout)
    return FLAT if flat <= rows else ROWS


class _PassCache(DynamicCache):
    """One pass's cache: each layer's keys and values joined after those of what the pass continues (``before``:
    per layer, [n, heads, C, dim], or None; ``rows``: which of its n each of the pass's rows continues, None: row
    for row) and handed back, stored nowhere, so a layer recomputed in the backward pass gets the same joined keys
    and values again and any pass may be checkpointed (a checkpointed pass holds ``before`` until then, never one
    copy per row; ``before``'s list is taken over and emptied, so nothing else holds them). With ``keep``, the
    joined keys and values a later pass continues from are kept (the first per layer: the forward's, never a
    recompute's) until ``take``n."""

    def __init__(self, config, before: list | None = None, keep: bool = False, rows: torch.Tensor | None = None):
        super().__init__(config=config)
        self.before, self.keep, self.rows = None if before is None else list(before), keep, rows
        if before is not None:
            before.clear()
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.before is not None:
            k, v = self.before[layer_idx]
            if self.rows is not None:
                k, v = k[self.rows], v[self.rows]
            key_states, value_states = torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2)
        if self.keep:
            self.kv.setdefault(layer_idx, (key_states, value_states))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.before is None else self.before[layer_idx][0].shape[-2]

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's joined keys and values, in layer order, handed over once: the cache lets go of them and
        keeps none from here on (a recompute's)."""
        kv, self.kv, self.keep = [self.kv[i] for i in sorted(self.kv)], {}, False
        return kv


@contextlib.contextmanager
def _own_checkpointing(on) -> Iterator[None]:
    """While inside, transformers' own checkpointing of the layers ``on`` (``gradient_checkpointing_enable``) is off:
    it drops the cache a pass continues from (its layers write to a cache, and a replay would write twice). The
    passes here checkpoint those layers themselves (`_recomputed`), with caches that write nothing (`_PassCache`)."""
    for layer in on:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in on:
            layer.gradient_checkpointing = True


@contextlib.contextmanager
def _recomputed(layers) -> Iterator[None]:
    """While inside, each of ``layers`` runs under non-reentrant activation checkpointing: its forward keeps only
    its inputs and outputs, and runs again in the backward pass when its gradient is needed."""
    kept = [layer.__dict__.get("forward") for layer in layers]  # a forward set on the instance (a hook's, or ours)
    for layer in layers:
        # an instance attribute: nn.Module.__call__ runs it in place of the method
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer, forward in zip(layers, kept):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward


def _root(model, ids: torch.Tensor, recompute: bool) -> tuple[torch.Tensor, list]:
    """[R, H] hidden states of the root ``ids`` [1, R] and each layer's (keys, values); with ``recompute``, its
    decoder layers recomputed in the backward pass (`_recomputed`)."""
    cache = _PassCache(model.config, keep=True)
    R = ids.shape[1]
    with _recomputed(_layers(model) if recompute else []):
        out = model.get_decoder()(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(R, device=ids.device)[None],
            past_key_values=cache,
        )
    return out.last_hidden_state.reshape(R, -1), cache.take()


def _layers(model) -> list:
    return list(getattr(model.get_decoder(), "layers", []))


def _segment(
    decoder,
    ids: torch.Tensor,
    past_mask: torch.Tensor | None,
    mask: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
) -> torch.Tensor:
    """[N, L, H] hidden states of ``ids`` [N, L] after the cached context (``past_mask`` [N, C], None without one),
    ``mask`` [N, L] marking the keys that may be seen, at ``positions`` [N, L], through ``cache`` (a `_PassCache`,
    called whatever ``use_cache`` says)."""
    attention = mask if past_mask is None else torch.cat([past_mask, mask], dim=1)
    out = decoder(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache)
    return out.last_hidden_state


def _rows_rest(model, input_ids: torch.Tensor, layout: GroupLayout, kv: list | None) -> list[torch.Tensor]:
    """ROWS: the branch pass ([nb x Q, H]) and the suffix pass ([B x S, H]) after the root's ``kv`` (None: no root)."""
    decoder = model.get_decoder()
    device = input_ids.device
    R, B, Q, S = layout.root, len(layout.lengths), layout.branch_width, layout.suffix_width
    starts = [layout.suffix_start(r) for r in range(B)]
    past = torch.ones(1, R, dtype=torch.bool, device=device) if kv is not None else None
    parts = []
    nb = len(layout.branches)
    if Q:
        ids = torch.zeros(nb, Q, dtype=input_ids.dtype, device=device)
        mask = torch.zeros(nb, Q, dtype=torch.bool, device=device)  # the suffixes must not see a branch's padding
        for i, b in enumerate(layout.branches):
            ids[i, : b.length] = input_ids[b.rows[0], R : R + b.length]
            mask[i, : b.length] = True
        if past is not None:  # every branch continues from the root's keys and values
            root, kv = kv, [(k.expand(nb, -1, -1, -1), v.expand(nb, -1, -1, -1)) for k, v in kv]
            root.clear()
            past = past.expand(nb, -1)
        cache = _PassCache(model.config, kv, keep=True)
        positions = (R + torch.arange(Q, device=device))[None].expand(nb, -1)
        parts.append(_segment(decoder, ids, past, mask, positions, cache).reshape(nb * Q, -1))
        kv = cache.take()  # [nb, heads, R + Q, dim] per layer
        past = mask if past is None else torch.cat([past, mask], dim=1)
    ids = torch.zeros(B, S, dtype=input_ids.dtype, device=device)
    for r, (n, s) in enumerate(zip(layout.lengths, starts)):
        ids[r, : n - s] = input_ids[r, s:n]
    # a suffix's padding comes after its every token, which causal attention never shows them: no mask needed
    mask = torch.ones(B, S, dtype=torch.bool, device=device)
    rows = None  # nothing before the suffixes (no root, no branch parts)
    if past is not None:
        branch = torch.tensor([layout.branch_of(r) for r in range(B)], device=device)
        rows = branch if Q else torch.zeros(B, dtype=torch.long, device=device)
        past = past[rows]
    cache = _PassCache(model.config, kv, rows=rows)  # each row continues from its branch's (or the root's)
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(S, device=device)[None]
    parts.append(_segment(decoder, ids, past, mask, positions, cache).reshape(B * S, -1))
    return parts


def _flat_rest(model, input_ids: torch.Tensor, layout: GroupLayout, kv: list | None) -> torch.Tensor:
    """FLAT: [N - R, H] hidden states of the flat row's slots after the root (`data/packing.py: flat_row`: branch
    parts padded to Q, then suffixes padded to S; a padding slot's state is 0, never read) from one row of the
    real slots after the root's ``kv`` (None: no root), each slot seeing exactly the slots of its own path."""
    device, R = input_ids.device, layout.root
    flat = flat_row(layout, input_ids.cpu())
    used = torch.zeros(flat.length, dtype=torch.bool)
    used[torch.cat([flat.index[r, :n] for r, n in enumerate(layout.lengths)])] = True
    rest = used[R:].nonzero(as_tuple=True)[0] + R  # the real slots after the root (padding runs nowhere)
    keys = torch.cat([torch.arange(R), rest])
    visible = ~flat.blocked[rest][:, keys]  # [M, R + M]
    # one additive mask in the model's dtype (0 where a slot may look): every layer's attention keeps this same
    # tensor for its backward pass (a boolean one, sdpa's CPU kernel would convert and keep per layer)
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min).to(device)
    cache = _PassCache(model.config, kv) if kv is not None else None
    out = model.get_decoder()(
        input_ids=flat.ids[rest].to(device)[None],
        attention_mask=mask[None, None],
        position_ids=flat.positions[rest].to(device)[None],
        past_key_values=cache,
        use_cache=False,
    )  # without a root, no cache to make
    hidden = out.last_hidden_state[0]  # [M, H]
    return hidden.new_zeros((flat.length - R,) + hidden.shape[1:]).index_copy(0, (rest - R).to(device), hidden)


def shared_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    layout: GroupLayout,
    how: str | None = None,
    recompute: bool | None = None,
) -> torch.Tensor:
    """The flat hidden states [R + n_branches * Q + B * S, H] of the tree (`hidden_index` says which row of it
    holds each (row, position)); ``input_ids`` [B, T] right-padded, rows as ``layout`` says. ``how``: FLAT or ROWS
    (None: `tree_pass` for the model's device and attention and the tree); ``recompute`` (None: where autograd
    records, `torch.is_grad_enabled()`): the root's layers recomputed in the backward pass, and where transformers'
    gradient checkpointing would run (``gradient_checkpointing_enable``, in training) the layers it covers in every
    pass, in its place (`_own_checkpointing`); without ``recompute`` nothing is recomputed."""
    if how is None:
        how = tree_pass(input_ids.device.type, getattr(model.config, "_attn_implementation", None), layout)
    if how not in (FLAT, ROWS):
        raise ValueError(f"how={how!r}: {FLAT!r} or {ROWS!r}")
    if recompute is None:
        recompute = torch.is_grad_enabled()
    layers = _layers(model)
    # transformers' own checkpointing, where it would run (in training)
    on = [layer for layer in layers if getattr(layer, "gradient_checkpointing", False) and layer.training]
    parts, kv = [], None
    with _own_checkpointing(on):
        if layout.root:
            hidden, kv = _root(model, input_ids[:1, : layout.root], recompute)
            parts.append(hidden)
        with _recomputed(on if recompute else []):
            if how == FLAT:
                parts.append(_flat_rest(model, input_ids, layout, kv))
            else:
                parts += _rows_rest(model, input_ids, layout, kv)
    return torch.cat(parts, dim=0)


def shared_position_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, layout: GroupLayout, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """[N, V] logits (the model's dtype) at the positions (rows[i], cols[i]) of the right-padded [B, T] micro-batch,
    through the prefix-once passes: what `torch_policy.position_logits` gives unshared. A position the tree shares
    is computed once and read by each of its rows."""
    flat = shared_hidden(model, input_ids, layout)  # [N_flat, H]
    index = hidden_index(layout, input_ids.shape[1]).to(input_ids.device)  # [B, T]
    return model.get_output_embeddings()(flat[index[rows, cols]])


def share_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, share: bool = True, pack: str | None = None
) -> Layout:
    """How a right-padded micro-batch ([B, T] ids and attention mask) runs: `data/packing.py: choose_layout` over
    its rows (the prefix tree with ``share``, packed rows with ``pack``, whichever runs the fewest positions), or
    None where its rows are not right-padded or neither runs fewer positions than the B x T of the padded forward."""
    lengths = attention_mask.sum(1)
    if (
        not (share or pack)
        or not torch.equal(
            attention_mask.bool(), torch.arange(input_ids.shape[1], device=lengths.device)[None] < lengths[:, None]
        )
        or bool((lengths == 0).any())
    ):
        return None
    return choose_layout([row[:n].tolist() for row, n in zip(input_ids, lengths.tolist())], share, pack)
