"""What an export carries so that a server renders, tokenises and stops as training did (`models/setup.py:
export_hf`): the chat template of its format and tool description, its bos and eos, and a generation config
whose stop ids are the format's stop tokens (the format's special tokens, those the server's tool parser needs
among them, are in every vocabulary since loading).

The template is the official one where the settings are the official ones (``tool_description=full``: Qwen2.5's
for ``hermes``, Llama-3.1's for ``llama3_json``, shipped in ``data/templates``), and otherwise the official one
with its tool line replaced by the compact form `chat_format.compact_tool` writes. Rendered with transformers'
Jinja (the one vLLM uses) it is byte-identical to the project's rendering (tests/unit/data/test_served_template.py).
A plugin format brings its own template (``served_template`` refuses one it does not know).
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
OFFICIAL = {"hermes": "Qwen2.5-7B-Instruct.jinja", "llama3_json": "Llama-3.1-8B-Instruct.jinja"}
# the bos each format's rendering starts with (None: it writes none; Qwen's template writes no bos_token)
BOS = {"hermes": None, "llama3_json": "<|begin_of_text|>"}
# chat_format.compact_tool in Jinja: name(param: type, optional?: type)
_COMPACT_MACRO = """{%- macro compact_tool(tool) -%}
{%- set fn = tool.function -%}
{%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} -%}
{%- set required = params.required if params.required is defined and params.required else [] -%}
{%- set properties = params.properties if params.properties is defined and params.properties else {} -%}
{{- fn.name ~ "(" -}}
{%- for name, spec in properties.items() -%}
{{- (", " if not loop.first else "") ~ name ~ ("" if name in required else "?") ~ ": " ~ (spec.type if spec.type is defined else "any") -}}
{%- endfor -%}
{{- ")" -}}
{%- endmacro -%}
"""
# the line of each official template that writes one tool, and what the compact form writes instead
_TOOL_LINE = {
    "hermes": ("{{- tool | tojson }}", "{{- compact_tool(tool) }}"),
    "llama3_json": ("{{- t | tojson(indent=4) }}", "{{- compact_tool(t) }}"),
}


class ServedTemplateError(ValueError):
    """No template renders this format and tool description as training does."""


def official_template(fmt: str) -> str:
    if fmt not in OFFICIAL:
        raise ServedTemplateError(
            f"chat.format={fmt}: no shipped chat template (shipped: {sorted(OFFICIAL)}); a plugin "
            "format's export keeps its tokenizer's own"
        )
    return (TEMPLATES / OFFICIAL[fmt]).read_text()


def served_template(fmt: str, tool_description: str) -> str:
    """The Jinja chat template that renders exactly what training rendered for ``fmt`` and ``tool_description``."""
    template = official_template(fmt)
    if tool_description == "full":
        return template
    if tool_description != "compact":
        raise ServedTemplateError(f"chat.tool_description={tool_description}: no served template for it")
    old, new = _TOOL_LINE[fmt]
    if template.count(old) < 1:
        raise ServedTemplateError(f"{OFFICIAL[fmt]}: its tool line {old!r} is not there to replace")
    return _COMPACT_MACRO + template.replace(old, new)


def prepare_export(tokenizer, generation_config, fmt: str, tool_description: str) -> None:
    """Set ``tokenizer`` and ``generation_config`` (a transformers GenerationConfig, or None) up to be served as
    trained: the template, the bos, the eos and the stop ids. The format's tokens (the tool parser's among them,
    such as llama3_json's ``<|python_tag|>``) are in the vocabulary since loading (`tokenize.ensure_format_tokens`)."""
    from nemo_rcgrpo.data.chat_format import format_spec

    spec = format_spec(fmt)
    missing = [t for t in spec.special_tokens if t not in tokenizer.get_vocab()]
    if missing:
        raise ServedTemplateError(
            f"the tokenizer lacks the {fmt} tokens {missing} (load it through "
            "models/setup.py: load_tokenizer_and_model)"
        )
    tokenizer.chat_template = served_template(fmt, tool_description)
    if BOS.get(fmt):
        tokenizer.bos_token = BOS[fmt]
    tokenizer.eos_token = spec.stop_tokens[0]
    stops = [tokenizer.convert_tokens_to_ids(t) for t in spec.stop_tokens]
    if generation_config is not None:
        generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
        if tokenizer.bos_token_id is not None:
            generation_config.bos_token_id = tokenizer.bos_token_id
