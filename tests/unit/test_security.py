"""Model output is data: injection attempts run nothing and leave no trace."""

import builtins
import decimal
import json
import sys

import mpmath
import pytest

from nemo_rcgrpo.envs.bfcl import BFCLEnv
from nemo_rcgrpo.envs.bfcl.apis import snapshot, state_differences


def _attacks(canary):
    c = str(canary)
    return [
        f"__import__('os').system('touch {c}')",
        f"open('{c}', 'w')",
        f"exec(\"open('{c}', 'w')\")",
        f"eval(\"open('{c}', 'w')\")",
        "().__class__.__mro__[1].__subclasses__()",
        "cd.__globals__['__builtins__']['open']('x', 'w')",
        "(lambda: __import__('os'))()",
        f"mv(source=__import__('os').system('touch {c}'), destination='x')",
        "mv(source=ls(), destination='x')",
        "mv(source=[x for x in ().__class__.__bases__], destination='y')",
        "cd(folder=f'{__import__(\"os\").getcwd()}')",
        "_load_scenario({})",
        "__init__()",
        "_current_dir()",
        "print('hi')",
        "getattr(ls, '__globals__')",
        "send_message(receiver_id='USR001', message='x')",  # a method of a class not involved
        "breakpoint()",
        "touch(file_name='a' * 10**8)",
        "ls(a=" + "[" * 60 + "]" * 60 + ")",
        "ls(a=" + "(" * 5000 + ")" * 5000 + ")",
        "ls(a=" + "9" * 6000 + ")",
        "touch(file_name='" + "A" * 100_000 + "')",
        "cd(folder='x'); import os",
        "cd(folder='x')\nimport os",
        {"name": "__import__", "arguments": {"name": "os"}},
        {"name": "ls", "arguments": '{"a": ' * 100_000 + "1" + "}" * 100_000},
        {"name": "cd", "arguments": {"folder": {"$eval": "__import__('os')"}}},  # data, passed as a dict
        {"name": ["cd"], "arguments": {}},
        {"name": "_load_scenario", "arguments": {"scenario": {}}},
        None,
    ]


def test_injections_execute_nothing_and_leave_state_untouched(suite, tmp_path, monkeypatch):
    canary = tmp_path / "pwned"
    calls = []

    def forbidden(*a, **k):  # eval/exec must never be reached
        calls.append(a)
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    task = suite["multi_turn_base_0"]  # GorillaFileSystem + TwitterAPI
    env = BFCLEnv(mode="per_turn")
    env.reset(task)
    before = snapshot(env.instances)
    modules_before = set(sys.modules)
    dps, prec = mpmath.mp.dps, decimal.getcontext().prec
    attacks = _attacks(canary)
    result = env.step(attacks)
    assert len(result.observations) == len(attacks)
    for attack, obs in zip(attacks, result.observations):
        assert not obs.ok, attack
        assert obs.content.startswith("Error"), (attack, obs.content)
    # the one dict-valued folder reaches the API as data and fails there; everything else never ran
    assert calls == [] and not canary.exists()
    assert state_differences(env.instances, before) == {}
    assert set(sys.modules) - modules_before == set()
    assert (mpmath.mp.dps, decimal.getcontext().prec) == (dps, prec)
    assert env.executed and all(e.name == "cd" for e in env.executed)  # only the documented cd ran
    json.dumps([o.content for o in result.observations])  # observations are plain strings


def test_bfcl_executor_would_have_run_the_same_text(tmp_path):
    """Why the safe executor exists: BFCL's own executor eval()s model text."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

    canary = tmp_path / "bfcl_ran_it"
    results, _ = execute_multi_turn_func_call(
        [f"__import__('pathlib').Path('{canary}').touch()"], {}, ["MathAPI"], "security_probe", "probe_0"
    )
    assert canary.exists(), results


def test_enormous_step_is_bounded(suite):
    env = BFCLEnv(mode="per_turn", max_calls_per_step=4)
    env.reset(suite["multi_turn_base_0"])
    result = env.step(["ls()"] * 10)
    assert sum(o.ok for o in result.observations) == 4
    assert all("more than 4 calls" in o.content for o in result.observations[4:])
