"""Token ids and loss masks for conversations: the single path from messages to training tokens.

``ChatRenderer`` turns OpenAI-format messages into ids with a mask (1 on
assistant content and its end-of-turn token, 0 on system, user, reward token,
tool results and the assistant header) using one of two renderers:

- ``project``: the formats of `chat_format.py`, piece by piece;
- ``template``: the tokenizer's own chat template (when it supports tools),
  applied to growing prefixes of the conversation; each new message's text
  must extend the previous rendering, which is checked (a template that
  rewrites earlier text cannot be used for token-level rollouts).

``auto`` picks ``template`` when the tokenizer's template mentions tools and
the format is hermes, ``project`` otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence, get_args

from nemo_rcgrpo.data.chat_format import TOOL_DESCRIPTIONS, Piece, format_spec, formats, one_call_per_message
from nemo_rcgrpo.types import Message, valid_text

Renderer = Literal["auto", "project", "template"]  # chat.renderer
RENDERERS: tuple[str, ...] = get_args(Renderer)
REWARD_TOKENS = ("<|high_reward|>", "<|low_reward|>")


class ChatFormatError(ValueError):
    """The tokenizer and the chosen chat format do not fit together."""


@dataclass
class Tokenized:
    ids: list[int]
    mask: list[int]

    def __len__(self) -> int:
        return len(self.ids)


def ensure_format_tokens(tokenizer, fmt: str) -> list[str]:
    """Add the format's control tokens to a tokenizer that lacks them (tiny test models). Returns those added."""
    missing = [t for t in format_spec(fmt).special_tokens if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    return missing


def _shipped_template(template: str, fmt: str) -> bool:
    """``template`` is one the project writes into its exports for ``fmt`` (`data/served_template.py`): its
    rendering is the project's, byte for byte (tests/unit/data/test_served_template.py)."""
    from nemo_rcgrpo.data.served_template import OFFICIAL, served_template

    return fmt in OFFICIAL and template in {served_template(fmt, d) for d in TOOL_DESCRIPTIONS}


class ChatRenderer:
    def __init__(
        self,
        tokenizer,
        fmt: str = "hermes",
        *,
        tool_description: str = "full",
        renderer: str = "auto",
        reward_tokens: Sequence[str] = REWARD_TOKENS,
        literal_reward_tokens: bool = False,
    ):
        if fmt not in formats():
            raise ChatFormatError(f"chat.format={fmt!r}: choose one of {list(formats())}")
        if renderer not in RENDERERS:
            raise ChatFormatError(f"chat.renderer={renderer!r}: choose one of {list(RENDERERS)}")
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.spec = format_spec(fmt)
        self.tool_description = tool_description
        template = getattr(tokenizer, "chat_template", None) or ""
        if renderer == "auto":  # a template the project ships (its exports carry one) renders as the project does
            renderer = (
                "template"
                if ("tools" in template and self.spec.tokenizer_template and not _shipped_template(template, fmt))
                else "project"
            )
        if renderer == "template" and "tools" not in template:
            raise ChatFormatError(
                "chat.renderer=template needs a tokenizer chat template with tool support; use project"
            )
        self.renderer = renderer
        vocab = tokenizer.get_vocab()
        missing = [t for t in self.spec.special_tokens if t not in vocab]
        if missing:
            raise ChatFormatError(
                f"the tokenizer lacks the {fmt} control tokens {missing}; choose the model's own "
                f"format (chat.format) or add them with ensure_format_tokens"
            )
        self.special_ids = {t: vocab[t] for t in self.spec.special_tokens}
        self._generation_prompt_text = "".join(p.text for p in self.spec.generation_prompt())
        self.stop_ids = [vocab[t] for t in self.spec.stop_tokens]
        self.literal_reward_tokens = literal_reward_tokens
        self.reward_ids = {}
        if not literal_reward_tokens:
            self.reward_ids = {t: vocab[t] for t in reward_tokens if t in vocab}
        # the configured reward tokens (reward_tokens.high / .low), not the default names
        self.reward_pattern = (
            re.compile("(" + "|".join(map(re.escape, self.reward_ids)) + ")") if self.reward_ids else None
        )

    # ------------------------------------------------------------------ text -> ids
    def encode_text(self, text: str, user_text: bool = False) -> list[int]:
        """Plain text: special-token strings stay text, except reward tokens in user text."""
        if not text:
            return []
        text = valid_text(text)  # lone surrogates: their escape text, never a tokenizer exception
        if user_text and self.reward_pattern is not None:
            ids: list[int] = []
            for part in self.reward_pattern.split(text):
                if part in self.reward_ids:
                    ids.append(self.reward_ids[part])
                elif part:
                    ids += self.tokenizer(part, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            return ids
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _encode_pieces(self, pieces: Sequence[Piece], out: Tokenized) -> None:
        for p in pieces:
            ids = [self.special_ids[p.text]] if p.special else self.encode_text(p.text, p.user_text)
            out.ids += ids
            out.mask += [int(p.train)] * len(ids)

    # ------------------------------------------------------------------ public API
    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> Tokenized:
        out = Tokenized([], [])
        if self.spec.one_call_per_message and self.renderer == "project":
            messages = one_call_per_message(messages)  # the Llama 3.1 template's one call per assistant message
        self.render_into(out, messages, 0, tools)
        if add_generation_prompt:
            out.ids += self.generation_prompt_ids()
            out.mask += [0] * len(self.generation_prompt_ids())
        return out

    def render_into(
        self, out: Tokenized, messages: Sequence[Message], start: int, tools: Sequence[dict[str, Any]] | None = None
    ) -> Tokenized:
        """Append the tokens of ``messages[start:]`` (rendered in the context of all of them)."""
        if self.renderer == "template":
            self._template_into(out, messages, start, tools)
            return out
        for i in range(start, len(messages)):
            self._encode_pieces(self.spec.pieces(messages, i, tools, self.tool_description), out)
        return out

    def completion_ids(self, message: Message) -> list[int]:
        """The ids a model writes for an assistant message (content and end-of-turn token, no header)."""
        out = Tokenized([], [])
        self._encode_pieces(self.spec.pieces([message], 0, None, self.tool_description), out)
        return [i for i, m in zip(out.ids, out.mask) if m]

    def generation_prompt_ids(self) -> list[int]:
        out = Tokenized([], [])
        self._encode_pieces(self.spec.generation_prompt(), out)
        return out.ids

    def after_stop_ids(self) -> list[int]:
        """What follows a generated end-of-turn token before the next message ("\\n" in ChatML)."""
        return self.encode_text(self.spec.after_stop)

    # ------------------------------------------------------------------ template renderer
    def _template_text(self, messages: Sequence[Message], tools, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _template_into(self, out: Tokenized, messages: Sequence[Message], start: int, tools) -> None:
        # units: a run of consecutive tool messages is one unit (templates merge them)
        bounds = [
            i + 1
            for i in range(len(messages))
            if i + 1 == len(messages) or not (messages[i]["role"] == "tool" and messages[i + 1]["role"] == "tool")
        ]
        previous = self._template_text(messages[:start], tools) if start else ""
        eot = self.spec.stop_tokens[0]
        for end in (b for b in bounds if b > start):
            text = self._template_text(messages[:end], tools)
            if not text.startswith(previous):
                raise ChatFormatError(
                    "the tokenizer's chat template rewrites earlier text when a message is added; "
                    "use chat.renderer=project"
                )
            delta = text[len(previous) :]
            last = messages[end - 1]
            if last["role"] == "assistant":
                header = self._template_text(messages[: end - 1], tools, add_generation_prompt=True)[len(previous) :]
                if not delta.startswith(header):
                    raise ChatFormatError("the chat template's generation prompt does not start the assistant turn")
                if header != self._generation_prompt_text:
                    raise ChatFormatError(
                        f"the chat template's generation prompt {header!r} differs from the "
                        f"{self.fmt} format's {self._generation_prompt_text!r} that RL and "
                        "evaluation prompts end with; use chat.renderer=project"
                    )
                body, _, tail = delta[len(header) :].partition(eot)
                # the header and the tail are template text (special tokens as their ids, as in the generation
                # prompt); the body is what the model writes
                self._encode_template_text(header, out, user_text=False)
                self._encode_pieces([Piece(body, train=True), Piece(eot, train=True, special=True)], out)
                self._encode_template_text(tail, out, user_text=False)
            else:
                self._encode_template_text(delta, out, user_text=last["role"] == "user")
            previous = text

    def _encode_template_text(self, text: str, out: Tokenized, user_text: bool) -> None:
        pattern = "(" + "|".join(map(re.escape, self.special_ids)) + ")"
        for part in re.split(pattern, text):
            if part in self.special_ids:
                out.ids.append(self.special_ids[part])
                out.mask.append(0)
            elif part:
                ids = self.encode_text(part, user_text)
                out.ids += ids
                out.mask += [0] * len(ids)
