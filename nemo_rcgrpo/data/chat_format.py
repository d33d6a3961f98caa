"""Chat and tool-call formats: OpenAI-format conversations -> text -> token ids with loss masks.

Two formats (``chat.format``), each rendering text byte-identical to the official
chat template of its model family (kept as test data in ``tests/data/chat_templates``,
checked by ``tests/unit/data/test_official_templates.py``):
- ``hermes``: Qwen2.5-7B-Instruct's template (ChatML): tools listed in the system
  prompt inside ``<tools>``; calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
  consecutive tool results merged into one ``<|im_start|>user`` block of
  ``<tool_response>`` entries. Also the format of ChatML models without a tool
  template, such as SmolLM2.
- ``llama3_json``: Llama-3.1-8B-Instruct's template: tools in the first user
  message (``tojson(indent=4)``), one JSON call with a ``parameters`` key per
  assistant message (``render`` splits a parallel turn into call/result pairs,
  as that template refuses more than one call), tool results in ``ipython``
  turns as that template writes them (JSON-encoded), message text trimmed.

JSON is written as the templates' ``tojson`` writes it (``ensure_ascii=False``).
Deliberate differences, each an option that no 7B/8B recipe uses: the compact
tool list (``chat.tool_description=compact``, CPU recipes), and a conversation
with no system message (``env.settings.system_prompt=''``), for which the Qwen template
writes its own identity line and the project writes no system block.

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
from typing import Any, Callable, Collection, Literal, Sequence, get_args

from nemo_rcgrpo.data.tool_parsers import ParsedMessage, parse_hermes, parse_llama3_json
from nemo_rcgrpo.registry import lookup, names, register
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
LLAMA3_ENVIRONMENT = "Environment: ipython\n"  # written only when the conversation has tools
LLAMA3_DATE_HEADER = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
LLAMA3_SYSTEM_HEADER = LLAMA3_ENVIRONMENT + LLAMA3_DATE_HEADER

ToolDescription = Literal["full", "compact"]  # chat.tool_description
TOOL_DESCRIPTIONS: tuple[str, ...] = get_args(ToolDescription)


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


def tojson(value: Any, indent: int | None = None) -> str:
    """JSON as the chat templates' ``tojson`` filter writes it (transformers: ``ensure_ascii=False``)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _tool_lines(tools: Sequence[dict[str, Any]], description: str, indent: int | None = None) -> list[str]:
    return [compact_tool(t) if description == "compact" else tojson(t, indent) for t in tools]


class OneCallPerMessageError(ValueError):
    """A llama3_json assistant message with several tool calls that cannot be split into call/result pairs."""


def one_call_per_message(messages: Sequence[Message]) -> list[Message]:
    """Split each assistant message with k > 1 tool calls into k single-call messages, each followed by its result.

    The Llama 3.1 template renders exactly one call per assistant message; BFCL's parallel calls of a turn
    become call, result, call, result (the order BFCL executes them in). Results are matched to calls by
    ``tool_call_id`` when both carry ids (a call without a result, such as ``done()``, stays a message of its
    own; a result that answers no call, such as a parse error's, follows the last pair), else by position
    when there is one result per call.
    """
    out: list[Message] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = (m.get("tool_calls") or []) if m["role"] == "assistant" else []
        if len(calls) <= 1:
            out.append(m)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        results = list(messages[i + 1 : j])
        ids = [c.get("id") for c in calls]
        by_id = {r.get("tool_call_id"): r for r in results}
        if all(ids) and len(set(ids)) == len(ids) and any(x in by_id for x in ids):
            for call in calls:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if call["id"] in by_id:
                    out.append(by_id.pop(call["id"]))
            out += [r for r in results if r.get("tool_call_id") in by_id]  # answers to no call, in order
        elif len(results) == len(calls):
            for call, result in zip(calls, results):
                out += [{"role": "assistant", "content": None, "tool_calls": [call]}, result]
        else:
            raise OneCallPerMessageError(
                f"message {i}: {len(calls)} tool calls in one assistant message and {len(results)} results that "
                "cannot be matched to them (no tool_call_id); the llama3_json format (Llama 3.1 template) "
                "renders one call per assistant message"
            )
        i = j
    return out


# --------------------------------------------------------------------------- hermes


def _hermes_pieces(
    messages: Sequence[Message], index: int, tools: Sequence[dict] | None, description: str
) -> list[Piece]:
    m = messages[index]
    role = m["role"]
    out: list[Piece] = []
    if index == 0 and role != "system" and tools:  # tools need a system block
        out += _hermes_system("", tools, description)
    if role == "system":
        return out + _hermes_system(m.get("content") or "", tools, description)
    if role == "tool":  # consecutive results share one user block, as Qwen2.5's template writes them
        opens = index == 0 or messages[index - 1]["role"] != "tool"
        closes = index == len(messages) - 1 or messages[index + 1]["role"] != "tool"
        body = f"\n<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        pieces = [Piece("<|im_start|>", special=True), Piece("user" + body)] if opens else [Piece(body)]
        if closes:
            pieces += [Piece("<|im_end|>", special=True), Piece("\n")]
        return out + pieces
    if role == "assistant":
        text = m.get("content") or ""
        calls = [
            "<tool_call>\n" + tojson({"name": c["function"]["name"], "arguments": _arguments(c)}) + "\n</tool_call>"
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
    return out + [
        Piece("<|im_start|>", special=True),
        Piece(f"{role}\n"),
        Piece(m.get("content") or "", user_text=role == "user"),
        Piece("<|im_end|>", special=True),
        Piece("\n"),
    ]


def _hermes_system(system: str, tools: Sequence[dict] | None, description: str) -> list[Piece]:
    body = system
    if tools:
        lines = _tool_lines(tools, description)
        body = (system + "\n\n" if system else "") + HERMES_TOOLS_PREAMBLE + "".join("\n" + l for l in lines)
        body += HERMES_TOOLS_POSTAMBLE
    return [
        Piece("<|im_start|>", special=True),
        Piece("system\n" + body),
        Piece("<|im_end|>", special=True),
        Piece("\n"),
    ]


def _hermes_generation_prompt() -> list[Piece]:
    return [Piece("<|im_start|>", special=True), Piece("assistant\n")]


# --------------------------------------------------------------------------- llama3_json


def _llama3_header(role: str, separate: bool = True) -> list[Piece]:
    """The role header. ``separate=False`` leaves its ``\\n\\n`` to the text that follows, which is then
    tokenised as one run, as a server tokenises the template's text (the assistant header keeps it: the
    generation prompt ends there)."""
    return [Piece("<|start_header_id|>", special=True), Piece(role), Piece("<|end_header_id|>", special=True)] + (
        [Piece("\n\n")] if separate else []
    )


def _llama3_pieces(
    messages: Sequence[Message], index: int, tools: Sequence[dict] | None, description: str
) -> list[Piece]:
    m = messages[index]
    role = m["role"]
    header = (LLAMA3_ENVIRONMENT if tools else "") + LLAMA3_DATE_HEADER
    out: list[Piece] = [Piece("<|begin_of_text|>", special=True)] if index == 0 else []
    if index == 0 and role != "system":
        out += _llama3_header("system", False) + [Piece("\n\n" + header), Piece("<|eot_id|>", special=True)]
    content = m.get("content") or ""
    if role == "system" and index == 0:
        return (
            out
            + _llama3_header("system", False)
            + [Piece("\n\n" + header + content.strip()), Piece("<|eot_id|>", special=True)]
        )
    if role == "tool":  # the template writes a string result through tojson (a string is iterable)
        return (
            out
            + _llama3_header("ipython", False)
            + [Piece("\n\n" + tojson(content)), Piece("<|eot_id|>", special=True)]
        )
    if role == "assistant":
        calls = m.get("tool_calls") or []
        if len(calls) > 1:  # one call per message; render() splits parallel turns
            text = "; ".join(tojson({"name": c["function"]["name"], "parameters": _arguments(c)}) for c in calls)
        elif calls:
            c = calls[0]["function"]
            text = '{"name": "' + c["name"] + '", "parameters": ' + tojson(_arguments(calls[0])) + "}"
        else:
            text = content.strip()
        return (
            out + _llama3_header("assistant") + [Piece(text, train=True), Piece("<|eot_id|>", train=True, special=True)]
        )
    first = index == (1 if messages[0]["role"] == "system" else 0)  # the template's first message after system
    if first and tools:
        content = (
            LLAMA3_TOOLS_PREAMBLE
            + "".join(l + "\n\n" for l in _tool_lines(tools, description, indent=4))
            + content.strip()
        )
    else:
        content = content.strip()
    return (
        out
        + _llama3_header(role, False)
        + [Piece("\n\n" + content, user_text=role == "user"), Piece("<|eot_id|>", special=True)]
    )


def _llama3_generation_prompt() -> list[Piece]:
    return _llama3_header("assistant")


@dataclass(frozen=True)
class FormatSpec:
    """A chat format (kind ``chat_format``, chosen by ``chat.format``): how a conversation renders and how the
    server that will serve the trained model reads the model's tool calls back. Training rewards only calls that
    ``parse`` accepts, and ``parse`` accepts only what ``vllm serve --tool-call-parser {vllm_tool_parser}`` serves
    the same way (tests/unit/data/test_parser_agreement.py)."""

    pieces: Callable[[Sequence[Message], int, Sequence[dict] | None, str], list[Piece]]
    generation_prompt: Callable[[], list[Piece]]
    special_tokens: tuple[str, ...]
    stop_tokens: tuple[str, ...]  # generation ends at any of these (they are part of the assistant turn)
    after_stop: str  # text the format puts after the stop token, before the next message
    parse: Callable[[str, Collection[str] | None], ParsedMessage]  # (text, known tools) -> calls
    vllm_tool_parser: str  # vLLM's name of the parser that serves this format
    one_call_per_message: bool = False  # the template allows one tool call per assistant message
    tokenizer_template: bool = False  # chat.renderer=auto may use a tokenizer's own tool-aware template


register("chat_format", "hermes")(
    FormatSpec(
        _hermes_pieces,
        _hermes_generation_prompt,
        ("<|im_start|>", "<|im_end|>"),
        ("<|im_end|>",),
        "\n",
        parse=parse_hermes,
        vllm_tool_parser="hermes",
        tokenizer_template=True,
    )
)
register("chat_format", "llama3_json")(
    FormatSpec(
        _llama3_pieces,
        _llama3_generation_prompt,
        # <|python_tag|>: vLLM's llama3_json tool parser refuses to start without it in the vocabulary
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
        ("<|eot_id|>", "<|eom_id|>"),
        "",
        parse=parse_llama3_json,
        vllm_tool_parser="llama3_json",
        one_call_per_message=True,
    )
)


def format_spec(fmt: str) -> FormatSpec:
    """The registered chat format ``fmt`` (a ValueError listing the registered names when there is none)."""
    return lookup("chat_format", fmt, FormatSpec)


def formats() -> tuple[str, ...]:
    return names("chat_format")


def render_pieces(
    messages: Sequence[Message],
    tools: Sequence[dict] | None = None,
    fmt: str = "hermes",
    tool_description: str = "full",
) -> list[Piece]:
    spec = format_spec(fmt)
    if spec.one_call_per_message:
        messages = one_call_per_message(messages)
    return [p for i in range(len(messages)) for p in spec.pieces(messages, i, tools, tool_description)]


def render_text(
    messages: Sequence[Message],
    tools: Sequence[dict] | None = None,
    fmt: str = "hermes",
    tool_description: str = "full",
) -> str:
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
