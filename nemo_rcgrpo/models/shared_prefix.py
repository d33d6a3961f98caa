"""The prefix-once forward of an HF decoder over a micro-batch's prefix tree (`data/prefix_tree.py`).

The root runs once (one row), each branch part once with the root's keys and values repeated to the branches,
and every row's suffix once with its branch's keys and values: three forward passes in which every token attends
to exactly its own root -> branch -> suffix path, causally, at the positions it has in the unshared row. The
keys and values are the passes' own tensors (transformers' ``DynamicCache``, repeated and selected by row), so
the backward pass carries every suffix's gradient into its branch and the root, which are computed once.

``shared_position_logits`` gives the logits at chosen positions of the unshared, right-padded micro-batch's
[B, T] grid, so ``torch_policy.token_logprobs(..., layout=...)`` returns the grid it returns without sharing
and the loss and its normaliser are unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from nemo_rcgrpo.data.packing import Layout, choose_layout
from nemo_rcgrpo.data.prefix_tree import GroupLayout, hidden_index


def supports(model: torch.nn.Module) -> bool:
    """Whether ``model``'s KV cache keeps every key and value (transformers' plain ``DynamicLayer`` in every layer):
    a sliding-window or recurrent layer drops or folds the prefix the next pass must attend to."""
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        return False
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def _segment(decoder, ids: torch.Tensor, past_mask: torch.Tensor | None, mask: torch.Tensor,
             positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """[N, L, H] hidden states of ``ids`` [N, L] after the cached context (``past_mask`` [N, C], None without one),
    ``mask`` [N, L] marking the real tokens, at ``positions`` [N, L]; ``cache`` grows by the segment."""
    attention = mask if past_mask is None else torch.cat([past_mask, mask], dim=1)
    out = decoder(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                  use_cache=True)
    return out.last_hidden_state


def shared_hidden(model: torch.nn.Module, input_ids: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """The flat hidden states [R + n_branches * Q + B * S, H] of the tree's three passes (`hidden_index` says
    which row of it holds each (row, position)); ``input_ids`` [B, T] right-padded, rows as ``layout`` says."""
    decoder = model.get_decoder()
    device = input_ids.device
    R, B, Q, S = layout.root, len(layout.lengths), layout.branch_width, layout.suffix_width
    starts = [layout.suffix_start(r) for r in range(B)]
    cache = DynamicCache(config=model.config)
    parts = []
    past: torch.Tensor | None = None  # [rows of the cache, C]: which cached slots are real tokens
    if R:
        ones = torch.ones(1, R, dtype=torch.long, device=device)
        parts.append(_segment(decoder, input_ids[:1, :R], None, ones, torch.arange(R, device=device)[None],
                              cache).reshape(R, -1))
        past = ones
    nb = len(layout.branches)
    if Q:
        ids = torch.zeros(nb, Q, dtype=input_ids.dtype, device=device)
        mask = torch.zeros(nb, Q, dtype=torch.long, device=device)
        for i, b in enumerate(layout.branches):
            ids[i, :b.length] = input_ids[b.rows[0], R:R + b.length]
            mask[i, :b.length] = 1
        if past is not None:
            cache.batch_repeat_interleave(nb)
            past = past.expand(nb, -1)
        positions = (R + torch.arange(Q, device=device))[None].expand(nb, -1)
        parts.append(_segment(decoder, ids, past, mask, positions, cache).reshape(nb * Q, -1))
        past = mask if past is None else torch.cat([past, mask], dim=1)
    ids = torch.zeros(B, S, dtype=input_ids.dtype, device=device)
    mask = torch.zeros(B, S, dtype=torch.long, device=device)
    for r, (n, s) in enumerate(zip(layout.lengths, starts)):
        ids[r, :n - s] = input_ids[r, s:n]
        mask[r, :n - s] = 1
    if past is not None:
        branch = torch.tensor([layout.branch_of(r) for r in range(B)], device=device)
        rows = branch if Q else torch.zeros(B, dtype=torch.long, device=device)
        cache.reorder_cache(rows)  # each row continues from its branch's (or the root's) keys and values
        past = past[rows]
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(S, device=device)[None]
    parts.append(_segment(decoder, ids, past, mask, positions, cache).reshape(B * S, -1))
    return torch.cat(parts, dim=0)


def shared_position_logits(model: torch.nn.Module, input_ids: torch.Tensor, layout: GroupLayout,
                           rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[N, V] logits (the model's dtype) at the positions (rows[i], cols[i]) of the right-padded [B, T] micro-batch,
    through the prefix-once passes: what `torch_policy.position_logits` gives unshared. A position the tree shares
    is computed once and read by each of its rows."""
    flat = shared_hidden(model, input_ids, layout)  # [N_flat, H]
    index = hidden_index(layout, input_ids.shape[1]).to(input_ids.device)  # [B, T]
    return model.get_output_embeddings()(flat[index[rows, cols]])



def share_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, share: bool = True,
                 pack: str | None = None) -> Layout:
    """How a right-padded micro-batch ([B, T] ids and attention mask) runs: `data/packing.py: choose_layout` over
    its rows (the prefix tree with ``share``, packed rows with ``pack``, whichever runs the fewest positions), or
    None where its rows are not right-padded or neither runs fewer positions than the B x T of the padded forward."""
    lengths = attention_mask.sum(1)
    if not (share or pack) or not torch.equal(attention_mask.bool(), torch.arange(
            input_ids.shape[1], device=lengths.device)[None] < lengths[:, None]) or bool((lengths == 0).any()):
        return None
    return choose_layout([row[:n].tolist() for row, n in zip(input_ids, lengths.tolist())], share, pack)
