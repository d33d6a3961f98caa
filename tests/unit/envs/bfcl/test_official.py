"""The BFCL pipeline's pieces (envs/bfcl/official.py): the safe executor against BFCL's own executor on call text
that is safe to eval, what it refuses instead of running, BFCL's reply parsing and its inference-error label."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rcgrpo.envs.bfcl.official import InferenceError, SafeExecutor, bfcl, bfcl_entry, parse_reply, play_entry

REFERENCE = Path(__file__).parents[3] / "data" / "bfcl_reference.py"
MODEL = "oracle-model.v1"  # dashes and dots: BFCL rewrites them in its instance names

# call text as BFCL's decoder writes it (convert_to_function_call), and what a model can make it write
STEPS = [
    ("multi_turn_base_0", ["ls(a=True)", "cd(folder='document')", "mkdir(dir_name='temp')", "ls()"]),
    (
        "multi_turn_base_0",
        [
            "cd(fold='x')",
            "cd()",
            "cd(folder='nowhere')",
            "think(step=1)",
            "kill(pid=1)",
            "mkdir(dir_name=nan)",
            "mkdir(dir_name=-inf)",
            "touch(file_name='a.txt'",
        ],
    ),
    # a string argument that names a method followed by "(" is rewritten inside the string, as BFCL rewrites it
    (
        "multi_turn_base_0",
        [
            "touch(file_name='notes.txt')",
            "echo(content='ls() then cd(x)', file_name='notes.txt')",
            "cat(file_name='notes.txt')",
        ],
    ),
    (
        "multi_turn_base_0",
        [
            "post_tweet(content='hi')",
            "post_tweet(content='again', tags=['a'])",
            "cd('document')",
            "ls(**{'a': True})",
            "ls(a=True, **{'a': False})",
            "cd(*['..'])",
            "mv(source='temp', destination='temp')",
        ],
    ),
    (
        "multi_turn_base_15",
        [
            "mean(numbers=[1, 2, 3.5])",
            "logarithm(value=8, base=2, precision=50)",
            "square_root(number=2, precision=30)",
            "add(a=0.1, b=0.2)",
            "max_value(numbers=[])",
        ],
    ),
    (
        "multi_turn_base_15",
        [
            "standard_deviation(numbers=[1, 2])",
            "wc(file_name='x', mode='l')",
            "si_unit_conversion(value=1, unit_in='km', unit_out='m')",
            "'string'",
            "[1, {'a': None}]",
        ],
    ),
    ("multi_turn_long_context_0", ["ls(a=True)", "du(human_readable=True)", "find(path='.', name='a')"]),
    ("multi_turn_miss_func_0", ["ls()", "sort(file_name='x')"]),  # any public method, held out or not
    # what eval looks up first: an unknown prefix, a name inside a list, a keyword after **{...}
    (
        "multi_turn_miss_func_0",
        [
            "functions.ls()",
            "cd(folder=[1, inf])",
            "cd(folder={'a': nan})",
            "ls(**{'a': True}, a=False)",
            "mkdir(dir_name=-nan)",
        ],
    ),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bfcl_exec")
    (tmp / "spec.json").write_text(json.dumps({"model": MODEL, "steps": STEPS}))
    done = subprocess.run(
        [sys.executable, str(REFERENCE), "execute", str(tmp / "spec.json"), str(tmp / "out.json")],
        env={"BFCL_PROJECT_ROOT": str(tmp / "root"), "PATH": "/usr/bin:/bin", "HOME": str(tmp)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp / "out.json").read_text())


def test_the_safe_executor_says_and_does_what_bfcls_eval_does(suite, reference):
    executors = {}
    for (entry_id, calls), theirs in zip(STEPS, reference):
        executor = executors.setdefault(entry_id, SafeExecutor(suite[entry_id], MODEL))
        assert executor.execute(calls) == theirs["results"], entry_id
        state = {
            c: {k: repr(v) for k, v in vars(i).items() if not k.startswith("_")} for c, i in executor.instances.items()
        }
        assert state == theirs["state"], entry_id
    # the inputs reach the cases they are for
    flat = [r for step in reference for r in step["results"]]
    assert "Error during execution: name 'think' is not defined" in flat
    assert "Error during execution: Function call kill is not allowed." in flat
    assert any("unexpected keyword argument 'fold'" in r for r in flat)
    assert any("was never closed" in r for r in flat)
    assert any("oracle_model_v1_multi_turn_base_0_GorillaFileSystem_instance.ls()" in r for r in flat)


@pytest.mark.parametrize(
    "call",
    [
        "__import__('os').system('touch /tmp/rcgrpo_pwned')",
        "eval('1')",
        "exec('x=1')",
        "open(file='/etc/passwd')",
        "print(x=1)",
        "json.loads(s='1')",
        "importlib.import_module(name='os')",
        "re.compile(pattern='a')",
        "ls.__globals__()",
        "1 + 2",
        "().__class__",
        "cd(folder=__import__('os').getcwd())",
        "cd(folder=ls())",
        "cd(folder=(lambda: 1)())",
        "cd(*(print(),))",
        "cd(folder=[x for x in 'ab'])",
        "ls().__class__()",
    ],
)
def test_what_would_run_code_is_refused_with_an_error_text(suite, call, tmp_path):
    executor = SafeExecutor(suite["multi_turn_base_0"], MODEL)
    before = {c: repr(vars(i)) for c, i in executor.instances.items()}
    [result] = executor.execute([call])
    assert result.startswith("Error"), result
    assert {c: repr(vars(i)) for c, i in executor.instances.items()} == before
    assert not Path("/tmp/rcgrpo_pwned").exists()


def test_resource_bombs_are_refused(suite):
    executor = SafeExecutor(suite["multi_turn_base_15"], MODEL)
    [result] = executor.execute(["logarithm(value=8, base=2, precision=10000000)"])
    assert result.startswith("Error: precision must be a number of at most")
    nested = "mean(numbers=" + "[" * 100_000 + "]" * 100_000 + ")"  # past the parser's nesting limit
    [result] = executor.execute([nested])
    assert result.startswith("Error")


def test_replies_are_parsed_as_bfcls_handler_parses_them():
    calls = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "a", "type": "function", "function": {"name": "ls", "arguments": "{}"}}],
                }
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    r = parse_reply(calls)
    assert r.model_responses == [{"ls": "{}"}] and r.tool_call_ids == ["a"] and r.echo is calls["choices"][0]["message"]
    assert (r.input_token, r.output_token) == (3, 4)
    # no tool calls, null tool calls, or a call without an id: the content is the response (BFCL's except branch)
    for message in (
        {"content": "hi"},
        {"content": "hi", "tool_calls": None},
        {"content": "hi", "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}]},
    ):
        r = parse_reply({"choices": [{"message": message}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        assert r.model_responses == "hi" and r.tool_call_ids == []
    for bad in ({}, {"choices": []}, {"choices": [{"message": "x"}]}, {"choices": [{"message": {}}]}):
        with pytest.raises(InferenceError):
            parse_reply(bad)


def test_a_refused_request_is_bfcls_inference_error(suite):
    task = suite["multi_turn_base_1"]

    def respond(body, turn, step):
        if turn == 1:
            raise InferenceError("endpoint refused the request (HTTP 400): context too long")
        return {
            "choices": [{"message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        }

    run = play_entry(task, suite.gold(task), respond, model_name=MODEL)
    assert run.result == "Error during inference: endpoint refused the request (HTTP 400): context too long"
    assert not run.verdict.valid and run.verdict.error_type == "multi_turn:inference_error"
    assert run.result_line(task.id)["result"] == run.result


def test_the_entry_and_tools_are_bfcls(suite):
    entry = bfcl_entry("multi_turn_miss_func_0")
    held = [d["name"] for docs in entry["missed_function"].values() for d in docs]
    assert held and not {d["name"] for d in entry["function"]} & set(held)
    assert all(
        d["description"].endswith("Note that the provided function is in Python 3 syntax.") for d in entry["function"]
    )
    assert not any("Python 3" in d["description"] for docs in entry["missed_function"].values() for d in docs)
    tools = bfcl().convert_to_tool(entry["function"])
    assert tools[0]["type"] == "function" and tools[0]["function"]["parameters"]["type"] == "object"
    assert bfcl_entry("multi_turn_miss_func_0") == entry  # a private copy each time


def test_what_an_entry_raises_is_its_inference_error_and_a_dead_server_stops_the_run(suite):
    task = suite["multi_turn_base_1"]

    def broken(body, turn, step):
        raise KeyError("something the handler did not expect")

    run = play_entry(task, suite.gold(task), broken, model_name=MODEL)
    assert run.result == "Error during inference: 'something the handler did not expect'"  # BFCL's str(e)

    class Dead(RuntimeError):
        pass

    def dead(body, turn, step):
        raise Dead("no server")

    with pytest.raises(Dead):
        play_entry(task, suite.gold(task), dead, model_name=MODEL, fatal=(Dead,))


def test_a_huge_power_is_refused(suite):
    executor = SafeExecutor(suite["multi_turn_base_15"], MODEL)
    [result] = executor.execute([f"power(base={10**4000}, exponent=4096)"])
    assert result.startswith("Error: the result of power would hold more than")
    [result] = executor.execute(["power(base=3, exponent=4000)"])  # a big but bounded result still runs
    assert not result.startswith("Error")
    [result] = executor.execute([f"power(base={10**4000}, exponent=-4096)"])  # a tiny float: BFCL's answer
    assert result.startswith("Error during execution: int too large to convert to float")
