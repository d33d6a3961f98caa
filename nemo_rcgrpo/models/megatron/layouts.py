"""RoPE at chosen positions in megatron-core's GPTModel, for a prefix tree or packed rows run as one flat row.

The local layer spec's attention takes an explicit mask ([1, 1, N, N], True where a query may not look) in place
of its causal default, but megatron-core's rotary embedding numbers the positions 0..N-1 along the sequence. The
flat row itself (`data/packing.py: flat_row`: the flat sequence, each token's position in its unshared row, the mask
in which every token sees exactly its own root -> branch -> suffix path, or its own packed row, causally, and the
index back to the right-padded [B, T] grid) is pure and shared with the torch backend; this module supplies what
megatron-core lacks: ``rotary_at``, RoPE at those positions while a forward runs (megatron's own frequencies,
gathered per token).

Pure torch: nothing here imports megatron-core at import time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return [m for m in model.modules() if type(m) is RotaryEmbedding]


@contextmanager
def rotary_at(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """While inside, every RoPE module of ``model`` gives the frequencies of ``positions`` [N] (one flat row) in
    place of 0..N-1: megatron's ``RotaryEmbedding.get_emb`` up to the largest position, gathered per token
    ([N, 1, 1, dim], what its forward returns for a sequence of N). Refused for a model without plain RoPE
    (YaRN, multimodal RoPE, learned positions), whose positions this does not set."""
    modules = _rotary_modules(model)
    if not modules:
        raise NotImplementedError("flat rows need a model with megatron's RotaryEmbedding (plain RoPE)")
    top = int(positions.max()) + 1

    def at_positions(module):
        def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
            return module.get_emb(top, 0)[positions.to(module.inv_freq.device)]

        return forward

    for m in modules:
        m.forward = at_positions(m)  # an instance attribute: nn.Module.__call__ runs it in place of the method
    try:
        yield
    finally:
        for m in modules:
            del m.forward
