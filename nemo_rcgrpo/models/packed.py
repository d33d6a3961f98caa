"""The packed forward of an HF decoder (`data/packing.py: Packed`): a micro-batch's rows as one sequence.

The rows run one after another in a single row of the batch, without padding, each at positions restarting at
0. Given position ids and no attention mask or cache, transformers finds the row boundaries from the positions
(``masking_utils.find_packed_sequence_indices``) and lets no token attend across one: a block-diagonal causal
mask for ``sdpa`` / ``eager`` (dense, N x N), the varlen kernels for FlashAttention (no mask at all).

``packed_position_logits`` gives the logits at chosen positions of the right-padded [B, T] grid, so
``torch_policy.token_logprobs(..., layout=Packed(...))`` returns the grid it returns unpacked.
"""

from __future__ import annotations

import torch

from nemo_rcgrpo.data.packing import DENSE, VARLEN, Packed, packed_index, packed_positions

# attention implementations that take packed rows without a dense mask (cumulative sequence lengths / block masks)
VARLEN_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3", "flex_attention"})


def packs(device_type: str, attn_implementation: str | None) -> str | None:
    """How a model on ``device_type`` with ``attn_implementation`` runs packed rows: VARLEN with a varlen kernel,
    anywhere; DENSE with sdpa / eager on CPU, which build a dense N x N block mask (`data/packing.py:
    choose_layout` packs those only where they compute no more scores than padded rows); None on a GPU without a
    varlen kernel (a 16k-token pack's mask: 256M entries per layer call) or with another attention."""
    if attn_implementation in VARLEN_ATTENTION:
        return VARLEN
    return DENSE if device_type == "cpu" and attn_implementation in ("sdpa", "eager") else None


def packed_position_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, packed: Packed, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """[N, V] logits (the model's dtype) at the positions (rows[i], cols[i]) of ``input_ids`` [B, T] (right-padded,
    ``packed.lengths`` real tokens each), from one packed pass over its rows: what `torch_policy.position_logits`
    gives unpacked."""
    device = input_ids.device
    flat = torch.cat([input_ids[r, :n] for r, n in enumerate(packed.lengths)])[None]  # [1, N]
    pos = packed_positions(packed).to(device)[None]  # [1, N]
    # no mask and no cache: the boundaries come from the positions (a cache would turn that detection off)
    hidden = model.get_decoder()(
        input_ids=flat, position_ids=pos, attention_mask=None, use_cache=False
    ).last_hidden_state[0]  # [N, H]
    index = packed_index(packed, input_ids.shape[1]).to(device)  # [B, T]
    return model.get_output_embeddings()(hidden[index[rows, cols]])
