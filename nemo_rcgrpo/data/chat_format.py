"""Rendering OpenAI-format conversations as model text.

``hermes`` is the Qwen2.5 tool-calling format (ChatML; tools listed in the
system prompt inside ``<tools>``; calls as ``<tool_call>{"name", "arguments"}
</tool_call>``; tool results as ``<tool_response>`` blocks in a user turn). It is
also the format for ChatML models without a tool template, such as SmolLM2.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from nemo_rcgrpo.types import Message

HERMES_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _arguments(call: dict[str, Any]) -> Any:
    args = call["function"].get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args


def render_hermes(messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> str:
    """The whole conversation as hermes/ChatML text (no generation prompt)."""
    return "".join(render_hermes_segments(messages, tools))


def render_hermes_segments(messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """The rendering split into ChatML blocks (``<|im_start|>...<|im_end|>\n``).

    Blocks are separated by special tokens, so a tokenizer's counts add up over
    blocks: token lengths can be computed block by block with a cache.
    """
    out: list[str] = []
    msgs = list(messages)
    system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else None
    if system is not None:
        msgs = msgs[1:]
    if tools:
        body = (system + "\n\n" if system else "") + HERMES_TOOLS_PREAMBLE
        body += "".join("\n" + json.dumps(t) for t in tools) + HERMES_TOOLS_POSTAMBLE
        out.append(f"<|im_start|>system\n{body}<|im_end|>\n")
    elif system is not None:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] == "tool":
            block = []
            while i < len(msgs) and msgs[i]["role"] == "tool":
                block.append(f"<tool_response>\n{msgs[i]['content']}\n</tool_response>")
                i += 1
            out.append("<|im_start|>user\n" + "\n".join(block) + "<|im_end|>\n")
            continue
        text = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}) + "\n</tool_call>"
                for c in m["tool_calls"]
            ]
            text = (text + "\n" if text else "") + "\n".join(calls)
        out.append(f"<|im_start|>{m['role']}\n{text}<|im_end|>\n")
        i += 1
    return out


class TokenCounter:
    """Token lengths of rendered conversations, tokenising each distinct block once."""

    def __init__(self, tokenizer, batch_size: int = 256):
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.cache: dict[str, int] = {}

    def lengths(self, conversations: Sequence[tuple[Sequence[Message], Sequence[dict[str, Any]] | None]]) -> list[int]:
        rendered = [render_hermes_segments(m, t) for m, t in conversations]
        todo = sorted({seg for segs in rendered for seg in segs if seg not in self.cache})
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start : start + self.batch_size]
            ids = self.tokenizer(chunk, add_special_tokens=False)["input_ids"]
            self.cache.update(zip(chunk, map(len, ids)))
        return [sum(self.cache[seg] for seg in segs) for segs in rendered]
