"""arg_types="strict": documented argument types, case by case, through every call form.

The rule (executor._JSON_TYPES / _check_type): a boolean is never an integer, float or number
(although bool subclasses int in Python); an int is accepted where a float or number is
documented, a float is never an int; strings are never numbers; None passes only where the
parameter documents a default; array items are checked against "items".
"""

import inspect
import json

import pytest

from nemo_rcgrpo.envs.bfcl import BFCLEnv
from nemo_rcgrpo.envs.bfcl.apis import build_instances
from nemo_rcgrpo.envs.bfcl.executor import Toolbox
from nemo_rcgrpo.envs.bfcl.tasks import ToolDoc
from nemo_rcgrpo.envs.calls import CallRejected, parse_call_string, parse_json_call
from nemo_rcgrpo.types import ToolCall


class Probe:
    """One parameter per documented type; the result says what the method received."""

    def f(self, i=None, x=None, n=None, s=None, flag=None, xs=None, ints=None, d=None, opt=None, free=None):
        return {k: type(v).__name__ for k, v in locals().items() if k != "self" and v is not None}


PARAMS = {
    "i": {"type": "integer"},
    "x": {"type": "float"},
    "n": {"type": "number"},
    "s": {"type": "string"},
    "flag": {"type": "boolean"},
    "xs": {"type": "array", "items": {"type": "float"}},
    "ints": {"type": "array", "items": {"type": "integer"}},
    "d": {"type": "dict"},
    "opt": {"type": "integer", "default": 3},
    "free": {"description": "no type documented"},
}
PROBE = ToolDoc(
    "f", "Probe", {"name": "f", "parameters": {"type": "dict", "properties": PARAMS}}, inspect.signature(Probe.f)
)


def _box(arg_types="strict"):
    return Toolbox({"Probe": Probe()}, [PROBE], arg_types=arg_types)


# (parameter, value, None if accepted else the end of the rejection message)
CASES = [
    ("i", 3, None),
    ("i", -3, None),
    ("i", True, "got a boolean"),  # bool subclasses int, still refused
    ("i", False, "got a boolean"),
    ("i", 3.0, "got float 3.0"),  # a whole float is not an integer
    ("i", "3", "got str '3'"),
    ("i", [3], "got list [3]"),
    ("i", None, "got NoneType None"),  # no default documented
    ("opt", None, None),  # documented default: None stands for "not given"
    ("opt", True, "got a boolean"),
    ("x", 2.5, None),
    ("x", 2, None),  # an int where a float is documented is accepted
    ("x", True, "got a boolean"),
    ("x", "2.5", "got str '2.5'"),
    ("x", None, "got NoneType None"),
    ("n", 7, None),
    ("n", -0.5, None),
    ("n", False, "got a boolean"),
    ("n", "7", "got str '7'"),
    ("s", "a", None),
    ("s", "", None),
    ("s", 5, "got int 5"),
    ("s", True, "got a boolean"),
    ("flag", True, None),
    ("flag", False, None),
    ("flag", 1, "got int 1"),  # nor is an int a boolean
    ("flag", 0, "got int 0"),
    ("flag", "true", "got str 'true'"),
    ("xs", [1, 2.5], None),  # ints inside a float array too
    ("xs", [], None),
    ("xs", [1, True], "xs[1] must be of type float, got a boolean"),
    ("xs", [1, "2"], "xs[1] must be of type float, got str '2'"),
    ("xs", 1.5, "got float 1.5"),
    ("ints", [1, 2], None),
    ("ints", [1, 2.0], "ints[1] must be of type integer, got float 2.0"),
    ("ints", [False], "ints[0] must be of type integer, got a boolean"),
    ("d", {"k": 1}, None),
    ("d", [["k", 1]], "got list [['k', 1]]"),
    ("free", True, None),  # an undocumented type is not checked
    ("free", "anything", None),
]


def _python_form(param, value):
    return parse_call_string(f"f({param}={value!r})")


def _json_form(param, value):
    return parse_json_call({"name": "f", "arguments": json.dumps({param: value})})


def _openai_form(param, value):
    return parse_json_call(
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({param: value})}}
    )


FORMS = {
    "python": _python_form,
    "json": _json_form,
    "openai": _openai_form,
    "ToolCall": lambda p, v: ToolCall("f", {p: v}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("param, value, rejection", CASES, ids=[f"{p}={v!r}" for p, v, _ in CASES])
def test_strict_types(form, param, value, rejection):
    call = FORMS[form](param, value)
    assert call.kwargs == {param: value} and type(call.kwargs[param]) is type(value)  # the form kept the type
    if rejection is None:
        executed = _box().execute(call)
        want = {} if value is None else {param: type(value).__name__}
        assert executed.ok and json.loads(executed.result) == want
    else:
        spec_type = PARAMS[param]["type"]
        message = rejection if "must be" in rejection else f"{param} must be of type {spec_type}, {rejection}"
        with pytest.raises(CallRejected) as err:
            _box().execute(call)
        assert str(err.value) == f"f.{message}"


@pytest.mark.parametrize(
    "param, value, rejection",
    [c for c in CASES if c[2] is not None],
    ids=[f"{p}={v!r}" for p, v, r in CASES if r is not None],
)
def test_bfcl_mode_leaves_types_to_the_method(param, value, rejection):
    executed = _box("bfcl").execute(ToolCall("f", {param: value}))
    assert executed.ok  # the same values run when the API method judges them


@pytest.mark.parametrize(
    "text, rejection",
    [
        ('{"i": 1e2}', "f.i must be of type integer, got float 100.0"),  # JSON exponent notation is a float
        ('{"i": 100}', None),
        ('{"i": true}', "f.i must be of type integer, got a boolean"),
        ('{"x": 1}', None),
        ('{"flag": 1}', "f.flag must be of type boolean, got int 1"),
        ('{"opt": null}', None),
    ],
)
def test_json_literals(text, rejection):
    call = parse_json_call({"name": "f", "arguments": text})
    if rejection is None:
        assert _box().execute(call).ok
    else:
        with pytest.raises(CallRejected, match=rf"^{rejection}$"):
            _box().execute(call)


def test_positional_arguments_are_checked_too():
    with pytest.raises(CallRejected, match=r"^f.i must be of type integer, got a boolean$"):
        _box().execute(parse_call_string("f(True)"))
    with pytest.raises(CallRejected, match=r"^f.x must be of type float, got str '1'$"):
        _box().execute(parse_call_string("f(1, '1')"))
    assert _box().execute(parse_call_string("f(1, 1, 1.5, 'a', False)")).ok


def test_real_bfcl_tools(suite):
    task = suite["multi_turn_base_0"]  # TwitterAPI + GorillaFileSystem
    strict = Toolbox(build_instances(task), task.tools, arg_types="strict")
    with pytest.raises(CallRejected, match=r"^get_tweet.tweet_id must be of type integer, got a boolean$"):
        strict.execute(parse_call_string("get_tweet(tweet_id=True)"))
    with pytest.raises(CallRejected, match=r"^tail.lines must be of type integer, got float 2.0$"):
        strict.execute(parse_json_call({"name": "tail", "arguments": '{"file_name": "a.txt", "lines": 2.0}'}))
    with pytest.raises(CallRejected, match=r"^tail.lines must be of type integer, got a boolean$"):
        strict.execute(parse_call_string("tail('a.txt', True)"))  # positional
    math_task = suite["multi_turn_base_15"]  # GorillaFileSystem + MathAPI
    strict = Toolbox(build_instances(math_task), math_task.tools, arg_types="strict")
    assert strict.execute(parse_call_string("add(a=2, b=3)")).result == '{"result": 5}'  # ints for floats
    with pytest.raises(CallRejected, match=r"^round_number.decimal_places must be of type integer, got float 1.0$"):
        strict.execute(parse_call_string("round_number(number=2.5, decimal_places=1.0)"))


def test_env_passes_arg_types_to_its_toolbox(suite):
    task = suite["multi_turn_base_15"]
    calls = [
        "add(a=True, b=1)",
        {"name": "add", "arguments": '{"a": 2, "b": true}'},
        "mean(numbers=[1, True])",
        "add(a=2, b=3.5)",
    ]
    env = BFCLEnv(arg_types="strict")
    env.reset(task)
    assert [(o.content, o.ok) for o in env.step(calls).observations] == [
        ("Error: add.a must be of type float, got a boolean", False),
        ("Error: add.b must be of type float, got a boolean", False),
        ("Error: mean.numbers[1] must be of type float, got a boolean", False),
        ('{"result": 5.5}', True),
    ]
    env = BFCLEnv()  # default "bfcl": True is 1 to MathAPI, as on the leaderboard
    env.reset(task)
    assert [o.content for o in env.step(calls[:2]).observations] == ['{"result": 2}', '{"result": 3}']
