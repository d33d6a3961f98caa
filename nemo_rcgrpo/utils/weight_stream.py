"""HF-named weights on their way from a policy to a generator, streamed in flat buckets.

A ``WeightStream`` is what a policy hands a generator's ``update_weights``: the names, shapes and dtypes of
every tensor up front (``meta``, in the order they come), then the tensors themselves, produced while they are
read. A consumer that must read them again (a transfer that failed and is redone through a folder) iterates it
again and gets a fresh export. Each pass is checked against ``meta``. A pass left unfinished is finished
before the next one starts and by ``close``, so an export that is a collective (Megatron: the other ranks
send while rank 0 reads) never leaves the other ranks waiting, whatever the consumer does.

``plan_buckets`` cuts a list of tensors into runs of one dtype up to a byte size; the Megatron export, its
point-to-point transfer between pipeline stages and the collective transfer into vLLM all use it, so sender
and receiver derive the same buckets from the same ``meta``.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

import torch

Meta = list[tuple[str, tuple[int, ...], torch.dtype]]


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()


def plan_buckets(sizes: list[tuple[int, object]], bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges over ``sizes`` ([(bytes, key)] in order): consecutive items of one key (a dtype),
    up to ``bucket_bytes`` together (a larger item is a bucket of its own)."""
    out, start, size = [], 0, 0
    for i, (n, key) in enumerate(sizes):
        if i > start and (key != sizes[start][1] or size + n > bucket_bytes):
            out.append((start, i))
            start, size = i, 0
        size += n
    if sizes:
        out.append((start, len(sizes)))
    return out


class WeightStream:
    """The module docstring. ``export``: a new pass over the tensors each call. ``on_pass(k)``: called before
    pass k (k >= 1) starts and with ``k = -1`` by ``close``, to tell the ranks that take part in the export."""

    def __init__(
        self,
        meta: Meta,
        export: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        on_pass: Callable[[int], None] | None = None,
    ):
        self.meta, self.export, self.on_pass = list(meta), export, on_pass
        self.passes = 0
        self._source: Iterator | None = None  # the current pass's export (drained by _finish)

    @classmethod
    def of(cls, tensors) -> "WeightStream":
        """A stream over tensors already held (a dict, or (name, tensor) pairs)."""
        items = list(tensors.items() if isinstance(tensors, dict) else tensors)
        return cls([(n, tuple(t.shape), t.dtype) for n, t in items], lambda: iter(items))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._finish()
        if self.passes and self.on_pass is not None:
            self.on_pass(self.passes)
        self.passes += 1
        self._source = iter(self.export())
        return self._checked(self._source)

    def _checked(self, tensors: Iterator) -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape, _ in self.meta:
            item = next(tensors, None)
            if item is None or item[0] != name or tuple(item[1].shape) != tuple(shape):
                got = "nothing" if item is None else f"{item[0]} {tuple(item[1].shape)}"
                raise ValueError(f"weight export gave {got} where {name} {tuple(shape)} was announced")
            yield item
        extra = next(tensors, None)
        if extra is not None:
            raise ValueError(f"weight export gave {extra[0]} after the {len(self.meta)} announced tensors")

    def _finish(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            for _ in source:
                pass

    def close(self) -> None:
        """Finish the export, then tell the other ranks it is over. With other ranks (``on_pass``), a pass that
        was never started is run: they are sending it."""
        try:
            if self.passes == 0 and self.on_pass is not None:
                iter(self)
            self._finish()
        finally:
            if self.on_pass is not None:
                self.on_pass(-1)
