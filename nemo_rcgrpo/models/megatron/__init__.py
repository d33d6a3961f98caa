"""Megatron-Core policy backend (``policy.backend=megatron``).

- ``convert``: HF <-> Megatron state dicts (pure functions, any TP size);
- ``builder``: GPTModel for Llama / Qwen2 and megatron's parallel groups;
- ``logprobs``: per-token logprobs and entropies from vocab-parallel logits;
- ``policy``: MegatronPolicy, the trainer-facing backend (same interface as TorchPolicy);
- ``cpu_compat``: the test-only layer that lets megatron-core run on CPU with gloo.

Importing this package does not import megatron-core.
"""
