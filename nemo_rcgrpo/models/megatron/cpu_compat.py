"""Run the real megatron-core code on CPU (tests only; never active when CUDA is present).

megatron-core assumes CUDA in a few places outside the model math (FACTS.md,
"Megatron-Core on CPU"): ``torch.cuda.current_device()`` and literal
``device='cuda'`` in buffers of DDP, the optimizers and gradient clipping;
``torch.cuda`` streams; the CUDA RNG state behind its model-parallel RNG
tracker; ``Tensor.cuda()``; and asserts on type strings such as
``'torch.cuda.FloatTensor'``. ``enable()`` maps exactly these to CPU:

- a ``TorchFunctionMode`` rewrites a CUDA ``device=`` argument of tensor
  factories and ``.to()`` to CPU, makes ``Tensor.cuda()`` the identity and
  reports CPU tensors' ``type()`` with the ``torch.cuda.`` prefix (CPU and
  "CUDA" then share one type namespace, which is what those asserts check);
- ``torch.cuda`` stream, synchronize and memory helpers become no-ops;
- the "CUDA" RNG of the tracker is a separate CPU ``torch.Generator``, so
  ``model_parallel_cuda_manual_seed`` does not disturb the CPU RNG;
- the unfused softmax's default causal mask is built on CPU (activation
  recomputation runs it inside an ``autograd.Function``, where function
  modes are off).

The layer is process-wide by nature (megatron reads these as globals); it is
installed once, only when ``torch.cuda.is_available()`` is false, and
``enable()`` is idempotent.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_STATE: dict[str, object] = {}  # the installed mode (process-wide by nature; see the module docstring)

_FACTORIES = {
    torch.tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.randn,
    torch.rand,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.as_tensor,
    torch.randint,
    torch.randperm,
    torch.eye,
    torch.linspace,
}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int device means a GPU index


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.to:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            args = tuple("cpu" if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


class _Stream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs):
        return None


def enable() -> bool:
    """Install the CPU mapping when CUDA is absent; returns whether it is active."""
    if torch.cuda.is_available():
        return False
    if "mode" in _STATE:
        return True
    import megatron.core.tensor_parallel.random as mrandom

    rng = torch.Generator()
    rng.manual_seed(0)
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.Stream = _Stream
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.manual_seed = lambda seed: rng.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: rng.manual_seed(int(seed))
    cuda.get_rng_state = lambda *a, **k: rng.get_state()
    cuda.set_rng_state = lambda state, *a, **k: rng.set_state(state)
    mrandom._get_cuda_rng_state = lambda *a, **k: rng.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: rng.set_state(state)
    # recomputed modules run inside an autograd.Function, where function modes are off: the one CUDA literal
    # reached there (the default causal mask of the unfused softmax) is built on CPU directly
    import megatron.core.fusions.fused_softmax as fused_softmax

    fused_softmax.get_default_causal_mask = functools.lru_cache(maxsize=None)(
        lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    )
    mode = _CudaToCpu()
    mode.__enter__()
    _STATE["mode"] = mode
    return True
