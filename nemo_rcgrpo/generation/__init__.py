"""Generators: token ids in, token ids and sampling logprobs out (in-process HF; vLLM server)."""
