"""Token-in, token-out HTTP client of a vLLM OpenAI-compatible server (no vLLM import).

The trainer of a disaggregated job may have no vLLM installed, only this
client: `httpx` (a dependency of `huggingface-hub`, hence of transformers).

- ``generate``: one ``/v1/completions`` request per prompt (token ids in,
  ``return_token_ids`` out, ``logprobs=0``: the sampled token's logprob), all
  in flight at once over one async connection pool; per-request seeds
  ``seed + i``; each request retried with exponential backoff on connection
  errors, timeouts and 5xx answers; a 4xx answer (a request the server refuses)
  is not retried.
- control plane (``/health``, ``/pause``, ``/resume``, ``/collective_rpc``,
  ``/update_weight_version``, ``/tokenize``): short synchronous calls.

Server answers are data: anything that is not the expected shape is a
``GeneratorError`` naming the server, never an index error three frames down.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable

import httpx

from nemo_rcgrpo.generation.base import Completion, SamplingParams


class GeneratorError(RuntimeError):
    """The generation server refused or garbled a request; the message says which and why."""


class GeneratorUnavailable(GeneratorError):
    """The generation server is gone (not answering after the retries, or its process exited)."""


class WeightSyncError(GeneratorError):
    """A weight update was refused or failed; the previous weights are still serving."""


class VLLMClient:
    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        request_timeout: float = 600.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        max_concurrency: int = 256,
        alive: Callable[[], str | None] | None = None,
    ):
        """``alive()`` (optional) returns None while the server can be waited for, else why not (its process
        exited): retries stop at once then."""
        self.url = url.rstrip("/")
        self.request_timeout, self.max_retries, self.backoff = request_timeout, max_retries, backoff
        self.max_concurrency = max_concurrency
        self.alive = alive
        self._model = model
        self._max_model_len: int | None = None

    # ------------------------------------------------------------------ control plane
    def _call(self, method: str, path: str, *, timeout: float = 30.0, retries: int | None = None, **kwargs) -> Any:
        retries = self.max_retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            try:
                r = httpx.request(method, f"{self.url}{path}", timeout=timeout, **kwargs)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code < 500:
                    if r.status_code >= 400:
                        raise GeneratorError(
                            f"vLLM server {self.url}{path} refused the request "
                            f"(HTTP {r.status_code}): {_server_message(r)}"
                        )
                    return r.json() if r.content else None
                last = f"HTTP {r.status_code}: {_server_message(r)}"
                if path != "/health":  # a 5xx control call is a server-side failure, not a connection problem
                    raise GeneratorError(f"vLLM server {self.url}{path} failed: {last}")
            self._wait_or_give_up(attempt, retries, last)
        raise self._gone(last, retries)

    def _wait_or_give_up(self, attempt: int, retries: int, last: str) -> None:
        if self.alive is not None and (why := self.alive()) is not None:
            raise GeneratorUnavailable(f"vLLM server {self.url} is gone: {why} (last error: {last})")
        if attempt < retries:
            time.sleep(self.backoff * 2**attempt)

    def _gone(self, last: str, retries: int) -> GeneratorUnavailable:
        return GeneratorUnavailable(
            f"vLLM server {self.url} is not answering after {retries + 1} tries "
            f"({last}); is it running? (start one with `rcgrpo serve`)"
        )

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self) -> tuple[str, int]:
        """(served model name, max_model_len) from ``/v1/models``."""
        if self._model is None or self._max_model_len is None:
            data = self._call("GET", "/v1/models")
            try:
                entry = data["data"][0]
                self._model = self._model or str(entry["id"])
                self._max_model_len = int(entry["max_model_len"])
            except (KeyError, IndexError, TypeError, ValueError):
                raise GeneratorError(f"vLLM server {self.url}/v1/models: unexpected answer {str(data)[:200]}") from None
        return self._model, self._max_model_len

    def tokenize(self, text: str) -> list[int]:
        data = self._call(
            "POST", "/tokenize", json={"model": self.model_info()[0], "prompt": text, "add_special_tokens": False}
        )
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise GeneratorError(f"vLLM server {self.url}/tokenize: unexpected answer {str(data)[:200]}")
        return tokens

    def pause(self) -> None:
        """Stop scheduling: in-flight requests finish first (``mode=wait``); KV and prefix caches are cleared."""
        self._call("POST", "/pause", params={"mode": "wait"}, timeout=self.request_timeout)

    def resume(self) -> None:
        self._call("POST", "/resume")

    def collective_rpc(self, method: str, kwargs: dict[str, Any], timeout: float) -> Any:
        return self._call(
            "POST",
            "/collective_rpc",
            json={"method": method, "kwargs": kwargs, "timeout": timeout},
            timeout=timeout + 30,
            retries=0,
        )

    def set_weight_version(self, version: int) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    def weight_version(self) -> str | None:
        data = self._call("GET", "/weight_info")
        return data.get("weight_version") if isinstance(data, dict) else None

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, indices: list[int] | None = None
    ) -> list[Completion]:
        """``indices``: each prompt's index in the caller's whole batch (its request seed is ``seed + index``; by
        default its position here), so that a batch split over engines samples as it would on one."""
        if not prompts:
            return []
        indices = list(range(len(prompts))) if indices is None else indices
        model, max_len = self.model_info()
        bodies = []
        for i, prompt in enumerate(prompts):
            room = max_len - len(prompt)
            if room < 1:
                raise GeneratorError(
                    f"a prompt of {len(prompt)} tokens leaves no room to generate within the "
                    f"server's max_model_len={max_len} (generation.vllm.max_model_len)"
                )
            body = {
                "model": model,
                "prompt": list(prompt),
                "max_tokens": min(params.max_new_tokens, room),
                "temperature": params.temperature,
                "top_p": params.top_p,
                "logprobs": 0,
                "return_token_ids": True,
                "skip_special_tokens": False,
            }
            if params.stop_token_ids:  # stop on these only, as the HF generator does (eos counts only if listed)
                body.update(stop_token_ids=list(params.stop_token_ids), ignore_eos=True)
            if params.seed is not None:
                body["seed"] = params.seed + indices[i]
            bodies.append(body)
        return asyncio.run(self._generate_all(bodies))

    async def _generate_all(self, bodies: list[dict]) -> list[Completion]:
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        timeout = httpx.Timeout(self.request_timeout, connect=10.0, pool=None)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
            tasks = [asyncio.ensure_future(self._complete(client, b)) for b in bodies]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _complete(self, client: httpx.AsyncClient, body: dict) -> Completion:
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return _completion(r, self.url)
                if r.status_code < 500:
                    raise GeneratorError(
                        f"vLLM server {self.url} refused a completion request "
                        f"(HTTP {r.status_code}): {_server_message(r)}"
                    )
                last = f"HTTP {r.status_code}: {_server_message(r)}"
            if self.alive is not None and (why := self.alive()) is not None:
                raise GeneratorUnavailable(f"vLLM server {self.url} is gone: {why} (last error: {last})")
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff * 2**attempt)
        raise self._gone(last, self.max_retries)


def _server_message(r: httpx.Response) -> str:
    try:
        data = r.json()
    except ValueError:
        return r.text[:300] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(data)[:300]


def _completion(r: httpx.Response, url: str) -> Completion:
    """Completion from a ``/v1/completions`` answer, checked: ids are ints, one finite logprob <= 0 per id."""
    try:
        choice = r.json()["choices"][0]
        ids = choice["token_ids"]
        logprobs = choice["logprobs"]["token_logprobs"]
        reason = choice["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise GeneratorError(f"vLLM server {url}: unexpected completion answer {r.text[:200]!r}") from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise GeneratorError(f"vLLM server {url}: token_ids is not a list of integers (is return_token_ids supported?)")
    if (
        not isinstance(logprobs, list)
        or len(logprobs) != len(ids)
        or not all(isinstance(x, (int, float)) and not math.isnan(x) and x <= 0 for x in logprobs)
    ):
        raise GeneratorError(
            f"vLLM server {url}: expected one logprob <= 0 per generated token, "
            f"got {str(logprobs)[:120]} for {len(ids)} tokens"
        )
    if reason not in ("stop", "length"):
        raise GeneratorError(
            f"vLLM server {url}: completion ended with finish_reason={reason!r} "
            f"(aborted? the server may be pausing or shutting down)"
        )
    return Completion(list(ids), [float(x) for x in logprobs], reason)
