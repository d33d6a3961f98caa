import json

import pytest

from nemo_rcgrpo.data.tokenize import ChatRenderer, ensure_format_tokens
from nemo_rcgrpo.data.tool_parsers import parse_hermes, parse_llama3_json
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.types import ToolCall, ToolCallError

CALLS = [
    ToolCall("cd", {"folder": "document"}),
    ToolCall("mv", {"source": "a b.txt", "destination": "x/y"}),
    ToolCall("post_tweet", {"content": 'Hi "there" <tool_call>', "tags": ["#a", "#b"], "mentions": []}),
    ToolCall("ls", {}),
]


def _assistant(calls):
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.kwargs)}}
            for i, c in enumerate(calls)
        ],
    }


@pytest.mark.parametrize(
    "fmt, parser, eot", [("hermes", parse_hermes, "<|im_end|>"), ("llama3_json", parse_llama3_json, "<|eot_id|>")]
)
def test_round_trip_through_tokens(fmt, parser, eot):
    tok = load_tokenizer("smollm2")
    ensure_format_tokens(tok, fmt)
    renderer = ChatRenderer(tok, fmt)
    for n in (1, 2, 4):
        # what a model writes for n calls (llama3_json: `; `-separated; in history, render() splits them)
        text = tok.decode(renderer.completion_ids(_assistant(CALLS[:n])))
        assert text.endswith(eot)
        parsed = parser(text[: -len(eot)])
        assert parsed.calls == CALLS[:n] and parsed.content == ""


def test_hermes_tolerance():
    text = (
        'Sure!\n  <tool_call> {"name": "cd", "arguments": {"folder": "a"}} </tool_call>\n'
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call> Done.\n<tool_call>{"name": "pwd", "arguments": {}}'
    )
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("cd", {"folder": "a"}), ToolCall("ls", {}), ToolCall("pwd", {})]  # last unclosed
    assert parsed.content == "Sure!\n  \n Done."  # text around the blocks kept
    # no <tool_call> tag: plain content, as vLLM's hermes parser reads it (no bare-JSON fallback)
    assert parse_hermes('{"name": "ls", "arguments": {}}').calls == []
    assert parse_hermes("I cannot do that.").calls == []
    ok = parse_hermes('<tool_call>{"name": "ls", "arguments": {"a": true}}</tool_call>', known_tools={"ls"})
    assert ok.calls[0].kwargs == {"a": True}


@pytest.mark.parametrize(
    "text, message",
    [
        ("<tool_call>{name: cd}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "non-empty string 'name'"),
        (
            '<tool_call>{"name": "cd", "arguments": "folder=a"}</tool_call>',
            "'arguments' of 'cd' must be a JSON object, got str",
        ),
        ('<tool_call>{"name": "ls", "parameters": {}}</tool_call>', "tool call 'ls' has no 'arguments' object"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
    ],
)
def test_hermes_rejections_become_errors(text, message):
    parsed = parse_hermes(text, known_tools={"cd", "ls"})
    assert len(parsed.calls) == 1 and isinstance(parsed.calls[0], ToolCallError)
    assert message in parsed.calls[0].message


def test_llama3_tolerance_and_rejections():
    ok = parse_llama3_json(
        '<|python_tag|>{"name": "cd", "parameters": {"folder": "a"}};\n {"name": "ls", "parameters": {}}'
    )
    assert ok.calls == [ToolCall("cd", {"folder": "a"}), ToolCall("ls", {})]
    assert parse_llama3_json("The answer is 4.").calls == []
    trailing = parse_llama3_json('{"name": "ls", "parameters": {}} and that is all')
    assert trailing.calls == [ToolCall("ls", {})] and trailing.content == "and that is all"
    bad = parse_llama3_json('{"name": "cd", "parameters": {"folder": "a"')
    assert isinstance(bad.calls[0], ToolCallError) and "not valid JSON" in bad.calls[0].message
    unknown = parse_llama3_json('{"name": "format_disk", "parameters": {}}', known_tools={"ls"})
    assert isinstance(unknown.calls[0], ToolCallError)
