"""The generator interface shared by the in-process HF generator and the vLLM server client.

Token-in, token-out: prompts are token ids rendered by the rollout engine;
completions are the sampled token ids (ending with a stop token unless the
length limit was hit) and the log-probability of each under the sampling
distribution (after temperature and top-p).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("max_new_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    extra: dict = field(default_factory=dict)
    # the weight version that produced it, where the caller knows it for certain (`generation/gated.py`); None:
    # the generator's version when the call started
    version: int | None = None


@runtime_checkable
class Generator(Protocol):
    """What the rollout engine and the loops call (kind ``generator``: a registered factory returns one).

    version: the policy version (RL steps whose updates its weights hold) it samples from; 0 before the first.
    shares_policy_weights: it samples from the policy's own HF module (the in-process generator): a weight update
    hands it no tensor, only the version (`models/factory.py: sync_generator`); otherwise it is sent the weights.
    places_groups (optional, False where not declared; read by ``places_groups(generator)``): ``generate`` takes a
    third argument, ``groups``, one key per prompt (a group's rollouts, every turn, share it), and keeps a group on
    one engine (`vllm_engines.py`); without it a generator is called with prompts and params only.
    """

    version: int
    shares_policy_weights: bool

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """prompts: B lists of token ids -> B completions (token ids ending with a stop id unless the length limit
        was hit, and each token's logprob under the sampling distribution), in order."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        """Sample from these weights from now on: HF-named full tensors (or a folder of them); ``version`` after."""
        ...

    def close(self) -> None:
        """Release what it holds (a started server, a process group); idempotent."""
        ...


def places_groups(generator: Any) -> bool:
    """The Generator's optional ``places_groups`` capability, False where a generator does not declare it (the one
    place it is read: a plugin written before it keeps working)."""
    return bool(getattr(generator, "places_groups", False))


@runtime_checkable
class WeightSync(Protocol):
    """How a served generator's weights are replaced (vLLM's ``FolderSync``: a folder every worker reloads;
    ``CollectiveSync``: broadcast buckets into the workers' in-place reload). It owns the version: the generator's
    ``version`` is its sync's, set only once a push has finished."""

    version: int

    def push(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        """Serve these weights (HF-named full tensors, a ``WeightStream`` or a folder) as ``version``."""
        ...

    def close(self) -> None:
        """Release what it holds (a process group); idempotent."""
        ...
