"""The generator interface shared by the in-process HF generator and the vLLM server client.

Token-in, token-out: prompts are token ids rendered by the rollout engine;
completions are the sampled token ids (ending with a stop token unless the
length limit was hit) and the log-probability of each under the sampling
distribution (after temperature and top-p).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Protocol

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


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None: ...
