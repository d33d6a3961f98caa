"""The HF generator as it was before its own decoding loop, kept as the baseline of `scripts/bench/rl_step.py`'s whole step.

It decodes with ``model.generate`` and transformers' dynamic KV cache (every step concatenates each layer's
cache) and samples with ``torch.multinomial`` from transformers' defaults, top-k 50 among them. Only the
benchmark uses it; the package's generator is ``nemo_rcgrpo.generation.hf_local.HFGenerator``.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from nemo_rcgrpo.generation.base import Completion, SamplingParams


class _SampledLogprobs:
    """Logits processor (last in the chain): log p of each sampled token under the processed scores."""

    def __init__(self, prompt_width: int):
        self.prompt_width = prompt_width
        self.previous: torch.Tensor | None = None  # [B, V] log-probs of the last step
        self.picked: list[torch.Tensor] = []  # per step [B]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_width:
            self._take(input_ids[:, -1])
        self.previous = scores.float().log_softmax(-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.picked.append(self.previous.gather(1, tokens.unsqueeze(1)).squeeze(1).cpu())

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, N] logprobs of the N generated tokens."""
        if sequences.shape[1] - self.prompt_width > len(self.picked):
            self._take(sequences[:, -1])
        return torch.stack(self.picked, dim=1) if self.picked else torch.zeros(sequences.shape[0], 0)


class LegacyHFGenerator:
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
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            attn[row, width - len(p) :] = 1
        greedy = params.temperature == 0
        recorder = _SampledLogprobs(width)
        # temperature and top-p are applied here, ahead of the recorder, so it sees the sampling distribution
        # (transformers runs user processors before its own warpers)
        chain = [] if greedy else [TemperatureLogitsWarper(params.temperature)]
        if not greedy and params.top_p < 1.0:
            chain.append(TopPLogitsWarper(params.top_p))
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            pad_token_id=self.pad_token_id,
            eos_token_id=list(params.stop_token_ids) or None,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList(chain + [recorder]),
            temperature=1.0,
            top_p=1.0,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            cache = self._shared_prefill(prompts, ids.to(device), attn.to(device))
            if cache is not None:
                kwargs["past_key_values"] = cache
            if seed is not None:
                torch.manual_seed(seed)
            result = self.model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), **kwargs)
        finally:
            self.model.train(was_training)
        new = result.sequences[:, width:].cpu()  # [B, N]
        token_logprobs = recorder.finish(result.sequences)  # [B, N]
        stops = set(params.stop_token_ids)
        completions = []
        for row in range(len(prompts)):
            tokens, logprobs, reason = [], [], "length"
            for t, token in enumerate(new[row].tolist()):
                tokens.append(token)
                logprobs.append(float(token_logprobs[row, t]))
                if token in stops:
                    reason = "stop"
                    break
            completions.append(Completion(tokens, logprobs, reason))
        return completions

    def _shared_prefill(self, prompts: list[list[int]], ids: torch.Tensor, attn: torch.Tensor):
        """The KV cache of every row's prompt but its last token, computed once per distinct prompt; None when
        no prompt repeats (or sharing is off): ``generate`` then prefills as usual."""
        self.prefilled["prompts"] += len(prompts)
        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(p), i) for i, p in enumerate(prompts)]
        if not self.share_prefixes or len(first) == len(prompts) or ids.shape[1] < 2:
            return None
        unique = sorted(first.values())
        where = {row: k for k, row in enumerate(unique)}
        u_ids, u_attn = ids[unique, :-1], attn[unique, :-1]
        positions = (u_attn.long().cumsum(-1) - 1).masked_fill(u_attn == 0, 0)  # as generate numbers left padding
        out = self.model(
            input_ids=u_ids, attention_mask=u_attn, position_ids=positions, use_cache=True, logits_to_keep=1
        )  # the cache is what is needed, not [U, W, V] logits
        cache = out.past_key_values
        cache.reorder_cache(torch.tensor([where[r] for r in rows], device=ids.device))  # one row per prompt
        self.prefilled["shared"] += len(prompts) - len(unique)
        return cache
