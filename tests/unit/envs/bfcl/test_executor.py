import inspect
import json

import pytest

from nemo_rcgrpo.envs.bfcl.apis import build_instances
from nemo_rcgrpo.envs.bfcl.executor import (
    MAX_INT_EXPONENT,
    MAX_PRECISION,
    MAX_TREE_ENTRIES,
    Toolbox,
    _resource_guard,
    _walk_fits,
    format_result,
    named_arguments,
)
from nemo_rcgrpo.envs.bfcl.tasks import ToolDoc
from nemo_rcgrpo.envs.calls import (
    MAX_CALL_CHARS,
    MAX_CALL_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_NESTING,
    CallRejected,
    parse_call_string,
    parse_json_call,
    to_tool_call,
)
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


# -------------------- `make mutation`'s survivors killed (docs/testing.md); each test names its mutants


def _lists(n):  # n nested lists: the innermost element sits at depth n
    return "[" * n + "1" + "]" * n


def _dicts(n):  # n nested dicts: the innermost key and value sit at depth n
    text = "1"
    for _ in range(n):
        text = "{'k': " + text + "}"
    return text


def _tuples(n):  # n nested 1-tuples
    text = "1"
    for _ in range(n):
        text = f"({text},)"
    return text


def test_nesting_limit_is_exact():
    # kills: depth default 0 -> 1, `depth > MAX_NESTING` -> `>=`, `depth + 1` -> `depth - 1` / `depth + 2` (lists, dict
    # keys, dict values). An argument value is at depth 0; MAX_NESTING = 16 levels below it are allowed.
    assert MAX_NESTING == 16
    for nested in (_lists, _dicts):
        parse_call_string(f"f(a={nested(16)})")
        with pytest.raises(CallRejected, match="nested deeper than 16"):
            parse_call_string(f"f(a={nested(17)})")
    # a dict key is one level below its dict: key (((1,),),...) of 15 tuples puts the 1 at depth 1 + 15 = 16
    parse_call_string("f(a={" + _tuples(15) + ": 0})")
    with pytest.raises(CallRejected, match="nested deeper than 16"):
        parse_call_string("f(a={" + _tuples(16) + ": 0})")


def test_text_budget_is_exact():
    # kills: `budget[0] < 0` -> `<= 0` / `< 1`; `budget[0] -= len(list)` -> `+=`
    # the budget is MAX_CALL_CHARS = 16384, checked when text is counted:
    # key "a" (1) + a 16383-character value = 16384, accepted
    assert MAX_CALL_CHARS == 16384
    parse_json_call({"name": "f", "arguments": {"a": "x" * 16383}})
    with pytest.raises(CallRejected, match="more than 16384 characters"):
        parse_json_call({"name": "f", "arguments": {"a": "x" * 16384}})
    # a list costs one unit per element (checked at the next text): "a" 1 + 16382 + "b" 1 = 16384 accepted,
    # "a" 1 + 16383 + "b" 1 = 16385 refused
    parse_json_call({"name": "f", "arguments": {"a": [0] * 16382, "b": 0}})
    with pytest.raises(CallRejected, match="more than 16384 characters"):
        parse_json_call({"name": "f", "arguments": {"a": [0] * 16383, "b": 0}})


def test_length_limits_are_exact():
    # kills: `len(text) > MAX_CALL_CHARS` -> `>=`, `len(name) > MAX_NAME_CHARS` -> `>=`,
    # `len(arguments) > MAX_CALL_CHARS` -> `>=`
    call = "f(a='" + "x" * (16384 - 7) + "')"  # 5 + 16377 + 2 = 16384 characters
    assert len(call) == MAX_CALL_CHARS and parse_call_string(call).name == "f"
    with pytest.raises(CallRejected, match="call is 16385 characters long"):
        parse_call_string(call[:-2] + "x')")
    assert MAX_NAME_CHARS == 128
    assert parse_json_call({"name": "n" * 128}).name == "n" * 128
    with pytest.raises(CallRejected, match="longer than 128"):
        parse_json_call({"name": "n" * 129})
    arguments = '{"a": "' + "x" * (16384 - 9) + '"}'  # 7 + 16375 + 2 = 16384
    assert len(arguments) == MAX_CALL_CHARS
    assert len(parse_json_call({"name": "f", "arguments": arguments}).kwargs["a"]) == 16375
    with pytest.raises(CallRejected, match="arguments are 16385 characters long"):
        parse_json_call({"name": "f", "arguments": arguments[:-2] + 'x"}'})
    # kills: `len(call_id) > MAX_CALL_ID_CHARS` -> `>=`: an id of exactly 64 characters is kept, 65 is refused
    assert MAX_CALL_ID_CHARS == 64
    raw = {"type": "function", "function": {"name": "ls", "arguments": {}}}
    assert to_tool_call({**raw, "id": "c" * 64}).id == "c" * 64
    refused = to_tool_call({**raw, "id": "c" * 65})
    assert isinstance(refused, ToolCallError) and "1 to 64 characters" in refused.message


def test_to_tool_call_passes_parsed_calls_through_and_clips_raw_text():
    # kills: `return raw` -> `return None`; raw[:200] -> [:199] / [:201]
    call, error = ToolCall("f", {"a": 1}), ToolCallError(raw="f(", message="bad")
    assert to_tool_call(call) is call and to_tool_call(error) is error
    text = "f(" + "x" * 300  # 302 characters, not a valid call
    result = to_tool_call(text)
    assert isinstance(result, ToolCallError) and result.raw == text[:200] and len(result.raw) == 200
    # kills: repr(raw)[:200] -> [:199] / [:201]: a call of another type is clipped the same way
    odd = [0] * 200  # not a string nor an object: its repr is 600 characters
    result = to_tool_call(odd)
    assert isinstance(result, ToolCallError) and result.raw == repr(odd)[:200] and len(result.raw) == 200
    # kills: `len(call_id) <= MAX_CALL_ID_CHARS` -> `<`: a refused call keeps an id of exactly 64 characters
    assert to_tool_call("f(", "c" * 64).id == "c" * 64 and to_tool_call("f(", "c" * 65).id is None


def test_only_names_must_be_written_in_plain_characters():
    # kills: `t.type == tokenize.NAME` -> `!=`: a look-alike name is refused, a look-alike inside a string is data
    with pytest.raises(CallRejected, match="not written in plain characters"):
        parse_call_string("ﬁnd(path='.')")
    assert parse_call_string("find(path='ﬁle ｃｄ')").kwargs == {"path": "ﬁle ｃｄ"}


class Probe:
    def f(self, i=None, xs=None):
        return "ok"


PROBE = ToolDoc(
    "f",
    "Probe",
    {"name": "f", "parameters": {"type": "dict", "properties": {"i": {"type": "integer"}, "xs": {"type": "array"}}}},
    inspect.signature(Probe.f),
)


def test_strict_array_without_item_type_accepts_any_items():
    # kills: `"items" in spec and isinstance(value, list)` -> `or` (a KeyError on spec["items"])
    box = Toolbox({"Probe": Probe()}, [PROBE], arg_types="strict")
    assert box.execute(ToolCall("f", {"xs": [1, "a", None]})).result == "ok"


def test_named_arguments_binds_positional_and_drops_self():
    # kills: named_arguments returning None, `k != "self"` -> `==`, "self" -> "XXselfXX"
    assert named_arguments(PROBE, ToolCall("f", {"xs": [1]}, args=(3,))) == {"i": 3, "xs": [1]}


class Node:
    """A directory for _tree_entries: ``contents`` maps names to Nodes (directories) or plain objects (files)."""

    def __init__(self, contents=None):
        self.contents = {} if contents is None else contents


def test_walk_bounds_by_hand():
    # kills: the entry count (1 per directory, 1 per file, `>` -> `>=`), the path characters (1 + len(name) per
    # level on top of the parent's), a cycle or a shared subtree walked as often as it is reached
    file = object()
    tree = Node({"a": file, "b": Node({"c": file, "dd": file})})  # paths: "", /a, /b, /b/c, /b/dd
    assert _walk_fits(tree, 5, 100) and not _walk_fits(tree, 4, 100)
    chars = 0 + 2 + 2 + 4 + 5
    assert _walk_fits(tree, 100, chars) and not _walk_fits(tree, 100, chars - 1)
    # the bounds hold exactly where the last entry counted is a directory, too (its own check, before its contents)
    nested = Node({"b": Node({})})  # paths: "", /b
    assert _walk_fits(nested, 2, 2) and not _walk_fits(nested, 1, 2) and not _walk_fits(nested, 2, 1)
    named = Node({"x": file})
    named.name = "root"  # the walk starts from the directory's own name: "root", "root/x"
    assert _walk_fits(named, 100, 4 + 6) and not _walk_fits(named, 100, 4 + 5)
    loop = Node({"f": file})
    loop.contents["self"] = loop  # a cycle: stops at the bound instead of running forever
    assert not _walk_fits(loop, 1000, 10**9)
    shared = Node({"f": file})
    for _ in range(40):  # cp's shallow copies: 2^40 paths, refused after at most max_entries steps
        shared = Node({"a": shared, "b": shared})
    assert not _walk_fits(shared, 10_000, 10**9)


def test_walk_of_a_deep_tree_needs_no_recursion():
    deep = Node()
    for _ in range(5 * 1000):  # deeper than the default recursion limit (1000)
        deep = Node({"d": deep})
    assert _walk_fits(deep, 10_001, 10**9)  # iterative: no RecursionError
    assert not _walk_fits(deep, 10_001, 1000)  # long paths: over the character bound


def test_resource_limits_are_exact():
    # kills: `abs(number) > MAX_PRECISION` -> `>=`, `abs(exponent) > MAX_INT_EXPONENT` -> `>=`,
    # `entries > MAX_TREE_ENTRIES` -> `>=`, `name in ("find", "du") and hasattr(...)` -> `or`
    assert (MAX_PRECISION, MAX_INT_EXPONENT, MAX_TREE_ENTRIES) == (1000, 4096, 100_000)
    for key in ("precision", "decimal_places"):
        _resource_guard("round_number", {key: 1000}, None)
        _resource_guard("round_number", {key: -1000}, None)
        with pytest.raises(CallRejected, match="at most 1000 digits"):
            _resource_guard("round_number", {key: 1001}, None)
        # mpmath and decimal read numeric text too: the guard reads it as they do (not as "unreadable")
        _resource_guard("round_number", {key: "1000"}, None)
        with pytest.raises(CallRejected, match="at most 1000 digits"):
            _resource_guard("round_number", {key: "1001"}, None)
    _resource_guard("power", {"base": 2, "exponent": 4096}, None)
    _resource_guard("power", {"base": 2, "exponent": -4096}, None)
    with pytest.raises(CallRejected, match="exceeds the limit of 4096"):
        _resource_guard("power", {"base": 2, "exponent": 4097}, None)

    class FS:
        def __init__(self, files):
            self.root = Node({str(i): object() for i in range(files)})

    _resource_guard("find", {}, FS(99_999))  # 1 + 99 999 = 100 000 entries: allowed
    with pytest.raises(CallRejected, match="more than 100000 entries"):
        _resource_guard("du", {}, FS(100_000))
    _resource_guard("ls", {}, FS(100_000))  # only find and du walk the tree


def test_one_size_budget_for_every_argument():
    """Containers are checked against the budget before they are walked: a 2M-element list or a nested mapping of
    100k integer keys is refused at once, not after copying and canonicalising it."""
    with pytest.raises(CallRejected, match="more than 16384 characters of text"):
        parse_json_call({"name": "f", "arguments": {"a": [0] * 2_000_000}})
    with pytest.raises(CallRejected, match="more than 16384 characters of text"):
        parse_json_call({"name": "f", "arguments": {"a": {i: i for i in range(100_000)}}})
    # a nested mapping costs one per entry besides its text: "a" 1 + 2 entries + "x" 1 + "y" 1 = 5
    parse_json_call({"name": "f", "arguments": {"a": {"x": 0, "y": 0}, "b": "z" * (16384 - 6)}})
    with pytest.raises(CallRejected, match="more than 16384"):
        parse_json_call({"name": "f", "arguments": {"a": {"x": 0, "y": 0}, "b": "z" * (16384 - 5)}})
