import json

import pytest

from nemo_rcgrpo.envs.bfcl.apis import build_instances
from nemo_rcgrpo.envs.bfcl.calls import CallRejected, parse_call_string, parse_json_call, to_tool_call
from nemo_rcgrpo.envs.bfcl.executor import Toolbox, format_result
from nemo_rcgrpo.types import ToolCall, ToolCallError


def test_parse_call_string_keywords_positional_and_literals():
    c = parse_call_string("mv(source='a', destination='b')")
    assert c == ToolCall(name="mv", kwargs={"source": "a", "destination": "b"})
    c = parse_call_string("  sort('final_report.pdf')  ")
    assert c.name == "sort" and c.args == ("final_report.pdf",) and c.kwargs == {}
    c = parse_call_string("f(x=-3.5, y=[1, (2, 3)], z={'k': None}, w=True)")
    assert c.kwargs == {"x": -3.5, "y": [1, (2, 3)], "z": {"k": None}, "w": True}


def test_parse_json_call_forms():
    assert parse_json_call({"name": "ls", "arguments": '{"a": true}'}).kwargs == {"a": True}
    assert parse_json_call({"name": "ls", "arguments": {"a": True}}).kwargs == {"a": True}
    assert parse_json_call({"name": "ls", "arguments": ""}).kwargs == {}
    openai = {"id": "call_7", "type": "function", "function": {"name": "cd", "arguments": '{"folder": "x"}'}}
    assert parse_json_call(openai) == ToolCall(name="cd", kwargs={"folder": "x"}, id="call_7")
    assert parse_json_call({"name": "cd", "parameters": {"folder": "x"}}).kwargs == {"folder": "x"}  # llama3 style


@pytest.mark.parametrize(
    "raw, message",
    [
        ("mv(", "not a valid function call"),
        ("1 + 2", "single function call"),
        ("os.system('x')", "plain tool name"),
        ("f(*a)", "unpacking"),
        ("f(**{'a': 1})", "unpacking"),
        ("f(a=1, a=2)", "given twice"),
        ("f(x=g())", "not a literal"),
        ({"name": "", "arguments": {}}, "non-empty string 'name'"),
        ({"name": "ls", "arguments": "{not json"}, "not valid JSON"),
        ({"name": "ls", "arguments": "[1, 2]"}, "must be a JSON object"),
        (42, "must be a string or an object"),
    ],
)
def test_malformed_calls_become_tool_call_errors(raw, message):
    err = to_tool_call(raw)
    assert isinstance(err, ToolCallError)
    assert message in err.message


def test_format_result_matches_bfcl_rules():
    assert format_result("plain") == "plain"
    assert format_result({"a": 1}) == '{"a": 1}'
    assert format_result({"a": {1, 2}}) == "{'a': {1, 2}}"  # not JSON-serialisable -> str
    assert format_result([1, 2]) == "[1, 2]"
    assert format_result(None) == "None"


@pytest.fixture()
def fs_toolbox(suite):
    task = suite["multi_turn_base_0"]
    return Toolbox(build_instances(task), task.tools)


def test_positional_arguments_are_bound_to_names(fs_toolbox):
    fs_toolbox.execute(parse_call_string("cd(folder='document')"))
    executed = fs_toolbox.execute(parse_call_string("sort('final_report.pdf')"))
    assert executed.ok and executed.arguments == {"file_name": "final_report.pdf"}
    assert json.loads(executed.result)["sorted_content"].startswith("Year2024")
    ls = fs_toolbox.execute(ToolCall("ls"))
    assert ls.arguments == {} and ls.full_arguments == {"a": False}  # defaults applied separately


def test_dispatch_refusals(fs_toolbox):
    with pytest.raises(CallRejected, match="unknown tool 'send_message'"):  # a method of a class not involved
        fs_toolbox.execute(ToolCall("send_message", {"receiver_id": "U1", "message": "hi"}))
    with pytest.raises(CallRejected, match="not available at this point"):
        fs_toolbox.execute(ToolCall("sort", {"file_name": "x"}), offered=frozenset({"ls"}))
    with pytest.raises(CallRejected, match="invalid arguments for mv"):
        fs_toolbox.execute(ToolCall("mv", {"source": "a"}))
    with pytest.raises(CallRejected, match="invalid arguments for ls"):
        fs_toolbox.execute(ToolCall("ls", {"b": 1}))


def test_api_errors_are_observations_not_exceptions(fs_toolbox):
    executed = fs_toolbox.execute(ToolCall("cd", {"folder": 5}))  # BFCL mode: the API judges the type
    # BFCL's own formatting of the API's exception (GorillaFileSystem.cd calls folder.rstrip)
    assert not executed.ok and executed.result == "Error during execution: 'int' object has no attribute 'rstrip'"


def test_strict_argument_types(suite):
    task = suite["multi_turn_base_0"]
    strict = Toolbox(build_instances(task), task.tools, arg_types="strict")
    with pytest.raises(CallRejected, match=r"cd.folder must be of type string, got int"):
        strict.execute(ToolCall("cd", {"folder": 5}))
    with pytest.raises(CallRejected, match="ls.a must be of type boolean"):
        strict.execute(ToolCall("ls", {"a": "yes"}))
    assert strict.execute(ToolCall("ls", {"a": True})).ok
    with pytest.raises(ValueError, match="unknown arg_types"):
        Toolbox(build_instances(task), task.tools, arg_types="loose")


def test_resource_guards(suite):
    task = next(t for t in suite if "MathAPI" in t.involved_classes)
    box = Toolbox(build_instances(task), task.tools)
    with pytest.raises(CallRejected, match="precision must be a number of at most 1000 digits, got 100000000"):
        box.execute(parse_call_string("logarithm(value=10, base=2, precision=100000000)"))
    with pytest.raises(CallRejected, match="integer exponent 1000000000 exceeds"):
        box.execute(parse_call_string("power(base=10, exponent=1000000000)"))
    assert box.execute(parse_call_string("power(base=2, exponent=10)")).result == '{"result": 1024}'


def test_integer_digit_limit_is_exact():
    assert parse_call_string("f(x=" + "9" * 30 + ")").kwargs["x"] == 10**30 - 1
    assert "more than 30 digits" in to_tool_call("f(x=" + "1" + "0" * 30 + ")").message
