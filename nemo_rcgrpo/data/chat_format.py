"""Chat and tool-call formats: OpenAI-format conversations -> text -> token ids with loss masks.

Two formats (``chat.format``):
- ``hermes`` (Qwen2.5 style, ChatML): tools listed in the system prompt inside
  ``<tools>``; calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
  each tool result as its own ``<|im_start|>user\\n<tool_response>...`` block.
  Also the format of ChatML models without a tool template, such as SmolLM2.
- ``llama3_json`` (Llama-3.1 style): tools in the first user message, calls as
  JSON objects with a ``parameters`` key (several separated by ``; ``),
  results in ``ipython`` turns.

A conversation renders as a concatenation of per-message *pieces*; each piece
is a special token, untrained text, or trained text (assistant content and its
end-of-turn token). Tokens are produced piece by piece, so the ids of a
conversation prefix are a prefix of the ids of any longer conversation (the
rollout engine builds trajectories token by token and relies on it).

Text pieces are tokenised with ``split_special_tokens=True``: a tool result or
file content that contains ``<|im_end|>`` stays text and cannot inject control
tokens. Only the reward tokens (``<|high_reward|>``, ``<|low_reward|>``) are
recognised inside user text, where the RCTP data puts them (the configured ``reward_tokens.high`` / ``.low``;
`tokenize.ChatRenderer` builds the pattern from them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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
LLAMA3_TOOLS_PREAMBLE = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n'
)
LLAMA3_SYSTEM_HEADER = "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"

FORMATS = ("hermes", "llama3_json")
TOOL_DESCRIPTIONS = ("full", "compact")


@dataclass(frozen=True)
class Piece:
    text: str
    train: bool = False  # counted in the loss (assistant content and end-of-turn token)
    special: bool = False  # a single special token, given by its string
    user_text: bool = False  # user-written text: the only place reward tokens are recognised


def _arguments(call: dict[str, Any]) -> Any:
    args = call["function"].get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args


def compact_tool(tool: dict[str, Any]) -> str:
    """``name(param: type, optional?: type)``: names and parameter names only (short prompts on CPU)."""
    fn = tool["function"]
    params = fn.get("parameters", {}) or {}
    required = set(params.get("required", []))
    args = [
        f"{name}{'' if name in required else '?'}: {spec.get('type', 'any')}"
        for name, spec in (params.get("properties") or {}).items()
    ]
    return f"{fn['name']}({', '.join(args)})"


def _tool_lines(tools: Sequence[dict[str, Any]], description: str) -> list[str]:
    return [compact_tool(t) if description == "compact" else json.dumps(t) for t in tools]


# --------------------------------------------------------------------------- hermes


def _hermes_pieces(messages: Sequence[Message], index: int, tools: Sequence[dict] | None, description: str) -> list[Piece]:
    m = messages[index]
    role = m["role"]
    out: list[Piece] = []
    if index == 0 and role != "system" and tools:  # tools need a system block
        out += _hermes_system("", tools, description)
    if role == "system":
        return out + _hermes_system(m.get("content") or "", tools, description)
    if role == "tool":
        body = f"user\n<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        return out + [Piece("<|im_start|>", special=True), Piece(body), Piece("<|im_end|>", special=True), Piece("\n")]
    if role == "assistant":
        text = m.get("content") or ""
        calls = [
            "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}) + "\n</tool_call>"
            for c in m.get("tool_calls") or []
        ]
        if calls:
            text = (text + "\n" if text else "") + "\n".join(calls)
        return out + [
            Piece("<|im_start|>", special=True),
            Piece("assistant\n"),
            Piece(text, train=True),
            Piece("<|im_end|>", train=True, special=True),
            Piece("\n"),
        ]
    return out + [Piece("<|im_start|>", special=True), Piece(f"{role}\n"),
                  Piece(m.get("content") or "", user_text=role == "user"), Piece("<|im_end|>", special=True), Piece("\n")]


def _hermes_system(system: str, tools: Sequence[dict] | None, description: str) -> list[Piece]:
    body = system
    if tools:
        lines = _tool_lines(tools, description)
        body = (system + "\n\n" if system else "") + HERMES_TOOLS_PREAMBLE + "".join("\n" + l for l in lines)
        body += HERMES_TOOLS_POSTAMBLE
    return [Piece("<|im_start|>", special=True), Piece("system\n" + body), Piece("<|im_end|>", special=True), Piece("\n")]


def _hermes_generation_prompt() -> list[Piece]:
    return [Piece("<|im_start|>", special=True), Piece("assistant\n")]


# --------------------------------------------------------------------------- llama3_json


def _llama3_header(role: str) -> list[Piece]:
    return [Piece("<|start_header_id|>", special=True), Piece(role), Piece("<|end_header_id|>", special=True),
            Piece("\n\n")]


def _llama3_pieces(messages: Sequence[Message], index: int, tools: Sequence[dict] | None, description: str) -> list[Piece]:
    m = messages[index]
    role = m["role"]
    out: list[Piece] = [Piece("<|begin_of_text|>", special=True)] if index == 0 else []
    if index == 0 and role != "system":
        out += _llama3_header("system") + [Piece(LLAMA3_SYSTEM_HEADER), Piece("<|eot_id|>", special=True)]
    if role == "system":
        return out + _llama3_header("system") + [Piece(LLAMA3_SYSTEM_HEADER + (m.get("content") or "")),
                                                 Piece("<|eot_id|>", special=True)]
    if role == "tool":
        return out + _llama3_header("ipython") + [Piece(m.get("content") or ""), Piece("<|eot_id|>", special=True)]
    if role == "assistant":
        calls = [json.dumps({"name": c["function"]["name"], "parameters": _arguments(c)}) for c in m.get("tool_calls") or []]
        text = "; ".join(calls) if calls else (m.get("content") or "")
        return out + _llama3_header("assistant") + [Piece(text, train=True), Piece("<|eot_id|>", train=True, special=True)]
    content = m.get("content") or ""
    first_user = role == "user" and not any(x["role"] == "user" for x in messages[:index])
    if first_user and tools:
        content = LLAMA3_TOOLS_PREAMBLE + "\n\n".join(_tool_lines(tools, description)) + "\n\n" + content
    return out + _llama3_header(role) + [Piece(content, user_text=role == "user"), Piece("<|eot_id|>", special=True)]


def _llama3_generation_prompt() -> list[Piece]:
    return _llama3_header("assistant")


@dataclass(frozen=True)
class FormatSpec:
    pieces: Callable[[Sequence[Message], int, Sequence[dict] | None, str], list[Piece]]
    generation_prompt: Callable[[], list[Piece]]
    special_tokens: tuple[str, ...]
    stop_tokens: tuple[str, ...]  # generation ends at any of these (they are part of the assistant turn)
    after_stop: str  # text the format puts after the stop token, before the next message


FORMAT_SPECS: dict[str, FormatSpec] = {
    "hermes": FormatSpec(_hermes_pieces, _hermes_generation_prompt, ("<|im_start|>", "<|im_end|>"),
                         ("<|im_end|>",), "\n"),
    "llama3_json": FormatSpec(
        _llama3_pieces, _llama3_generation_prompt,
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
        ("<|eot_id|>", "<|eom_id|>"), "",
    ),
}


def render_pieces(messages: Sequence[Message], tools: Sequence[dict] | None = None, fmt: str = "hermes",
                  tool_description: str = "full") -> list[Piece]:
    spec = FORMAT_SPECS[fmt]
    return [p for i in range(len(messages)) for p in spec.pieces(messages, i, tools, tool_description)]


def render_text(messages: Sequence[Message], tools: Sequence[dict] | None = None, fmt: str = "hermes",
                tool_description: str = "full") -> str:
    """The conversation as text (no generation prompt)."""
    return "".join(p.text for p in render_pieces(messages, tools, fmt, tool_description))


def render_hermes(messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> str:
    return render_text(messages, tools, "hermes")


def render_hermes_segments(messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """The hermes rendering split after every special token (token counts add up over segments)."""
    segments, current = [], ""
    for p in render_pieces(messages, tools, "hermes"):
        current += p.text
        if p.special:
            segments.append(current)
            current = ""
    if current:
        segments.append(current)
    return segments


class TokenCounter:
    """Token lengths of rendered conversations, tokenising each distinct segment once."""

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

