"""In-process HF generator: batched decoding with a KV cache, temperature / top-p sampling, seeded.

Prompts are left-padded into one batch and decoded together by the model's own forward pass with a KV cache
(a loop here, not ``model.generate``). What is sampled is exactly what ``SamplingParams`` says: the logits
divided by the temperature, the top-p nucleus, nothing else. (``model.generate`` adds transformers' own
defaults, among them top-k 50: the old generator sampled from the 50 likeliest tokens while it recorded, and
the trainer computed, logprobs of the whole distribution.) Each logprob is that of the sampled token under the
distribution it was drawn from; greedy decoding (temperature 0) records the model's own log-softmax.

Sampling is by the inverse CDF: one uniform number (float64) per row and step, looked up in the cumulative sum of the
probabilities. ``torch.multinomial`` draws one exponential number per vocabulary entry and row (49,152 for
SmolLM2's vocabulary), and on a CPU that draw was about two thirds of a decoding step of the tiny models. Row r
takes the r-th number of each step's draw, so its tokens do not depend on when the other rows finish.

A row stops at its first stop token (kept, finish reason "stop") or after ``max_new_tokens`` ("length").
Finished rows leave the batch: their cache rows are dropped, and later steps run on the rows still decoding.

Identical prompts in one call (the G rollouts of a group start from one prompt) are prefilled once
(``share_prefixes``): the distinct prompts run through the model, and their KV cache and last logits are copied
to every row that shares them. The cached keys and values equal the unshared ones up to rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from transformers import DynamicCache, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicLayer

from nemo_rcgrpo.generation.base import Completion, SamplingParams


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor, block: int = 256) -> torch.Tensor:
    """[B] token ids drawn from the rows of ``probs`` ([B, V], 0 where excluded) with one uniform number u in
    [0, 1) per row: the first token whose cumulative probability exceeds u times the row's total mass.

    In two levels, so that no row is summed sequentially end to end: the vocabulary is cut into blocks of
    ``block`` tokens, the block holding the target is found from the cumulative block sums, then the
    token inside it. A token of probability 0 is never drawn (rounding between the two levels falls back to the
    block's last token of non-zero probability at or before the one found)."""
    rows, vocab = probs.shape
    probs = probs.float()
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, block - vocab % block))  # padding has probability 0
    blocks = probs.view(rows, -1, block)  # [B, K, block]
    cdf = blocks.sum(-1).double().cumsum(-1)  # [B, K]: float32 sums of one block, float64 across blocks
    target = uniform.double() * cdf[:, -1]
    k = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(k > 0, cdf.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), k]  # [B, block]
    j = torch.searchsorted(inner.double().cumsum(-1), (target - before).unsqueeze(1), right=True).squeeze(1)
    slot = torch.arange(block, device=probs.device)
    j = torch.where((inner > 0) & (slot <= j.clamp(max=block - 1).unsqueeze(1)), slot, -1).amax(-1)
    return k * block + j


def call_seed(seed: int | None) -> int:
    """The seed of a sampled call: the given one, else one of 2**62 drawn from torch's global generator (so
    ``torch.manual_seed`` still governs unseeded calls, and they do not repeat each other)."""
    return seed if seed is not None else int(torch.randint(2**62, (1,)).item())


class _RoomyLayer(DynamicLayer):
    """A KV cache layer that writes each step's keys and values into room reserved at the prefill, where
    transformers' ``DynamicLayer`` concatenates: a copy of the whole cache per layer and step, which was 38% of a
    SmolLM2 decoding step on a CPU at 700 cached tokens. ``keys`` / ``values`` are views of the filled part, so
    attention sees exactly the tokens it sees with ``DynamicLayer``. After a reorder or a row selection (new
    tensors, not views of the room) the next update reserves room again."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        have, new = self.get_seq_length(), key_states.shape[-2]
        inside = (
            self._k is not None
            and have > 0
            and self.keys.data_ptr() == self._k.data_ptr()
            and self.keys.shape[0] == self._k.shape[0]
            and have + new <= self._k.shape[-2]
        )
        if not inside:
            rows, heads, _, dim = key_states.shape
            self._k = key_states.new_empty(rows, heads, have + new + self.room, dim)
            self._v = value_states.new_empty(
                rows, value_states.shape[1], have + new + self.room, value_states.shape[-1]
            )
            if have:
                self._k[:, :, :have] = self.keys
                self._v[:, :, :have] = self.values
        self._k[:, :, have : have + new] = key_states
        self._v[:, :, have : have + new] = value_states
        self.keys, self.values = self._k[:, :, : have + new], self._v[:, :, : have + new]
        return self.keys, self.values


def _roomy_cache(config, room: int) -> DynamicCache:
    """transformers' dynamic cache for ``config``, its full-attention layers replaced by ``_RoomyLayer``s."""
    cache = DynamicCache(config=config)
    cache.layers = [_RoomyLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class HFGenerator:
    shares_policy_weights = True  # its model is the policy's module (megatron: rank 0's HF copy, kept current)

    def __init__(
        self, model: torch.nn.Module, pad_token_id: int, *, max_batch_size: int = 64, share_prefixes: bool = True
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.share_prefixes = share_prefixes
        self.version = 0
        self.prefilled = {"prompts": 0, "shared": 0}  # prompts in generate calls, and those whose prefill was shared

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            seed = None if params.seed is None else params.seed + start
            out += self._generate_batch(prompts[start : start + self.max_batch_size], params, seed)
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> list[Completion]:
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = next(self.model.parameters()).device
        rows, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            attn[row, width - len(p) :] = 1
        ids, attn = ids.to(device), attn.to(device)
        greedy = params.temperature == 0
        warpers = [] if greedy else [TemperatureLogitsWarper(params.temperature)]
        if not greedy and params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        rng = None
        if not greedy:
            rng = torch.Generator(device=device)
            rng.manual_seed(call_seed(seed))
        stops = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=device)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        reasons = ["length"] * rows
        was_training = self.model.training
        self.model.eval()
        try:
            logits, cache = self._prefill(prompts, ids, attn, room=params.max_new_tokens)
            live = torch.arange(rows, device=device)  # the batch rows still decoding, in cache order
            positions = attn.sum(-1, keepdim=True)  # each row's next position (left padding is not counted)
            for step in range(params.max_new_tokens):
                scores = logits.float()
                for warp in warpers:
                    scores = warp(None, scores)
                probs = scores.softmax(-1)
                if not bool(torch.isfinite(probs).all()):  # torch.multinomial raised here; say why instead
                    raise RuntimeError(
                        "the model's next-token scores are not finite (NaN or inf logits): the "
                        "weights have diverged, or the dtype overflows"
                    )
                if greedy:
                    picked = probs.argmax(-1)
                else:
                    picked = sample_inverse_cdf(
                        probs, torch.rand(rows, generator=rng, device=device, dtype=torch.float64)[live]
                    )
                picked_lp = probs.gather(1, picked.unsqueeze(1)).squeeze(1).log()  # > 0: drawn tokens have mass
                done = torch.isin(picked, stops)
                for row, token, lp, stop in zip(live.tolist(), picked.tolist(), picked_lp.tolist(), done.tolist()):
                    tokens[row].append(token)
                    logprobs[row].append(lp)
                    if stop:
                        reasons[row] = "stop"
                if step == params.max_new_tokens - 1 or bool(done.all()):
                    break
                if bool(done.any()):
                    keep = (~done).nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    live, picked, attn, positions = live[keep], picked[keep], attn[keep], positions[keep]
                attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
                out = self.model(
                    input_ids=picked.unsqueeze(1),
                    attention_mask=attn,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
                cache, logits = out.past_key_values, out.logits[:, -1]
                positions = positions + 1
        finally:
            self.model.train(was_training)
        return [Completion(t, lp, reason) for t, lp, reason in zip(tokens, logprobs, reasons)]

    def _prefill(self, prompts: list[list[int]], ids: torch.Tensor, attn: torch.Tensor, room: int):
        """[B, V] logits of each row's next token and the KV cache of every row's prompt. With ``share_prefixes``
        the distinct prompts are run once and their cache rows and logits copied to the rows that repeat them."""
        self.prefilled["prompts"] += len(prompts)
        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(p), i) for i, p in enumerate(prompts)]
        share = self.share_prefixes and len(first) < len(prompts)
        run = sorted(first.values()) if share else list(range(len(prompts)))
        sel = torch.tensor(run, device=ids.device)
        u_ids, u_attn = ids[sel], attn[sel]
        positions = (u_attn.cumsum(-1) - 1).masked_fill(u_attn == 0, 1)  # left padding numbered as generate does
        out = self.model(
            input_ids=u_ids,
            attention_mask=u_attn,
            position_ids=positions,
            use_cache=True,
            past_key_values=_roomy_cache(self.model.config, room),
            logits_to_keep=1,
        )  # the cache and the last logits are what is needed, not [U, W, V]
        cache, logits = out.past_key_values, out.logits[:, -1]
        if share:
            where = {row: k for k, row in enumerate(run)}
            index = torch.tensor([where[r] for r in rows], device=ids.device)
            cache.reorder_cache(index)  # one row per prompt
            logits = logits[index]
            self.prefilled["shared"] += len(prompts) - len(run)
        return logits, cache

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        """In-process: load the given tensors (or an HF folder's safetensors) into the model."""
        if isinstance(weights, (str, Path)):
            from safetensors.torch import load_file

            state = {}
            for f in sorted(Path(weights).glob("*.safetensors")):
                state.update(load_file(str(f)))
            self.model.load_state_dict(state, strict=False)
        else:
            own = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in weights:
                    own[name].copy_(tensor)
        self.version = version

    def close(self) -> None:
        """Nothing to release: the model is the policy's."""
