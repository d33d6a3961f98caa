"""An OpenAI-compatible chat endpoint with tool calling, as an evaluation agent.

Standard library HTTP only (one blocking request per episode thread), so the
harness can score any served model (vLLM's OpenAI server, a hosted API) on
exactly the episodes and checker used for checkpoints.

Failures are sorted by whose fault they are:
- the server is unreachable or overloaded (connection errors, timeouts, 408,
  429, 5xx): retried with exponential backoff, then `EndpointUnavailable`,
  which stops the evaluation with a clear message (results so far are kept);
- the request is refused for this episode (other 4xx, e.g. the context is too
  long): the episode ends, scored 0, with the server's message as the reason;
- the reply is malformed (not JSON, tool-call arguments that are not a JSON
  object): the model's fault; it becomes an error observation like any bad call.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from nemo_rcgrpo.evaluation.agents import AgentReply, EpisodeRefused
from nemo_rcgrpo.types import Message, ToolCall, ToolCallError

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class EndpointUnavailable(RuntimeError):
    """The endpoint did not answer after all retries. ``timed_out``: the last attempt reached the server and
    waited past ``endpoint.timeout`` for its answer (a slow generation, not a dead server)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def parse_tool_calls(raw_calls: Any) -> list[ToolCall | ToolCallError]:
    """OpenAI ``message.tool_calls`` -> calls; anything malformed becomes a `ToolCallError`."""
    if not raw_calls:
        return []
    if not isinstance(raw_calls, list):
        return [ToolCallError(str(raw_calls)[:200], "tool_calls is not a list")]
    out: list[ToolCall | ToolCallError] = []
    for i, raw in enumerate(raw_calls):
        fn = raw.get("function") if isinstance(raw, dict) else None
        call_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            out.append(
                ToolCallError(json.dumps(raw, default=str)[:200], f"tool call {i} has no function name", call_id)
            )
            continue
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                out.append(ToolCallError(args[:200], f"arguments of {fn['name']} are not JSON: {e.msg}", call_id))
                continue
        if not isinstance(args, dict):
            out.append(ToolCallError(str(args)[:200], f"arguments of {fn['name']} are not a JSON object", call_id))
            continue
        out.append(ToolCall(fn["name"], args, id=call_id))
    return out


class EndpointAgent:
    """Chat completions with ``tools``; one request per assistant message."""

    def __init__(self, cfg, *, temperature: float, top_p: float, max_new_tokens: int):
        self.cfg = cfg
        self.url = cfg.url.rstrip("/") + "/chat/completions"
        self.sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens}
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(f"endpoint.api_key_env={cfg.api_key_env}: that environment variable is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self.requests = 0
        self.retries = 0

    def start(self, task, mode: str, seed: int) -> None:
        self.seed = seed

    def act(self, messages: list[Message], tools: list[dict], turn: int) -> AgentReply:
        body = {
            "model": self.cfg.model,
            "messages": messages,
            "tools": tools,
            "tool_choice": self.cfg.tool_choice,
            "seed": self.seed,
            **self.sampling,
            **dict(self.cfg.extra_body),
        }
        reply = self._post(body)
        try:
            choice = reply["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise EpisodeRefused(f"endpoint reply has no choices[0].message: {json.dumps(reply)[:300]}") from None
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = json.dumps(content)
        calls = parse_tool_calls(message.get("tool_calls"))
        truncated = choice.get("finish_reason") == "length" and not calls
        echoed = {"role": "assistant", "content": content}
        if message.get("tool_calls"):
            echoed["tool_calls"] = message["tool_calls"]
        return AgentReply(
            content=content,
            calls=calls,
            message=echoed,
            truncated="max_new_tokens without a stop (finish_reason=length)" if truncated else None,
            tokens=int((reply.get("usage") or {}).get("completion_tokens") or 0),
        )

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        delay = self.cfg.backoff
        last, timed_out = "", False
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                self.retries += 1
                time.sleep(delay)
                delay *= 2
            self.requests += 1
            request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.cfg.timeout) as response:
                    text = response.read().decode("utf-8", errors="replace")
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", errors="replace")[:300]
                if e.code in RETRY_STATUS:
                    last, timed_out = f"HTTP {e.code}: {detail}", False
                    continue
                raise EpisodeRefused(f"endpoint refused the request (HTTP {e.code}): {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                timed_out = isinstance(e, TimeoutError)  # the answer was late (a refused connection is not)
                continue
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise EpisodeRefused(f"endpoint answered with non-JSON: {text[:200]!r}") from None
        raise EndpointUnavailable(
            f"endpoint {self.url} did not answer after {self.cfg.max_retries + 1} attempts "
            f"(last: {last}); is the server running?",
            timed_out=timed_out,
        )
