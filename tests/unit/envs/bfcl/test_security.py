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
    assert all(
        "this message has 10 tool calls; at most 4 are run per message" in o.content for o in result.observations[4:]
    )


def test_mutable_default_arguments_do_not_leak_between_rollouts(suite):
    # TwitterAPI.post_tweet(content, tags=[], mentions=[]): one default list per process in BFCL
    task = suite["multi_turn_base_5"]
    gold = suite.gold(task)
    gold_tweets = json.dumps(gold.final_state["TwitterAPI"]["tweets"], default=str)
    attacker, victim = BFCLEnv(mode="merged"), BFCLEnv(mode="merged")
    attacker.reset(task, gold=gold)
    victim.reset(task, gold=gold)
    login = "authenticate_twitter(username='dr_smith', password='securePass123')"
    posted = attacker.step([login, "post_tweet(content='x')"]).observations[1].content
    attacker.step([f"mention(tweet_id={json.loads(posted)['id']}, mentioned_usernames=['INJECTED'])"])
    assert "INJECTED" in json.dumps(attacker.instances["TwitterAPI"].tweets)
    clean = victim.step([login, "post_tweet(content='other rollout')"]).observations[1].content
    assert json.loads(clean)["mentions"] == []
    assert json.dumps(gold.final_state["TwitterAPI"]["tweets"], default=str) == gold_tweets
    victim2 = BFCLEnv(mode="merged")
    victim2.reset(task, gold=gold)
    victim2.step([c for turn in task.ground_truth for c in turn] + ["done()"])
    assert victim2.reward().value == 1.0


def test_call_records_keep_arguments_as_called(suite):
    # post_tweet stores the mentions list; a later mention() extends it in the tweet, not in the record
    actions = [a for a in suite.gold("multi_turn_base_90").actions if a.name == "post_tweet"]
    assert actions[0].arguments["mentions"] == ["@TravelBuddy"]


@pytest.mark.parametrize(
    "task_id, call, message",
    [
        (
            "multi_turn_base_15",
            "round_number(number=5, decimal_places=-10000000)",
            "decimal_places must be a number of at most 1000 digits, got -10000000",
        ),
        (
            "multi_turn_base_15",
            "logarithm(value=10, base=2, precision=2e6)",
            "precision must be a number of at most 1000 digits, got 2000000.0",
        ),
        (
            "multi_turn_base_15",
            "logarithm(value=10, base=2, precision='2000000')",
            "precision must be a number of at most 1000 digits, got '2000000'",
        ),
        ("multi_turn_base_15", "round_number(number=5, decimal_places=" + "9" * 31 + ")", "more than 30 digits"),
    ],
)
def test_numeric_resource_guards(suite, task_id, call, message):
    env = BFCLEnv(mode="merged")
    env.reset(suite[task_id])
    obs = env.step([call]).observations[0]
    assert not obs.ok and message in obs.content


def test_exponential_directory_walk_is_refused(suite):
    # cp copies directories shallowly: 40 levels copied 40 times = 2^40 paths for find/du
    env = BFCLEnv(mode="merged", max_steps=50)
    env.reset(suite["multi_turn_base_0"])
    env.step([c for _ in range(40) for c in ("mkdir(dir_name='a')", "cd(folder='a')")])
    env.step([c for _ in range(40) for c in ("cd(folder='..')", "cp(source='a', destination='b')")])
    for call in ("find(path='.')", "du()", "find(path='.', name='zzz')"):
        obs = env.step([call]).observations[0]
        assert not obs.ok and "more than 100000 entries or 4000000 characters" in obs.content, call
    env.reward()  # comparing the state with the gold state stays cheap


def test_text_budget_applies_to_object_arguments_and_results_are_clipped(suite):
    env = BFCLEnv(mode="merged", max_observation_chars=1000)
    env.reset(suite["multi_turn_base_150"])  # TravelAPI
    big = {
        "name": "compute_exchange_rate",
        "arguments": {"base_currency": "USD", "target_currency": "JPY", "value": "x" * 20_000},
    }
    obs = env.step([big]).observations[0]
    assert not obs.ok and "more than 16384 characters of text" in obs.content
    amplified = {**big, "arguments": {**big["arguments"], "value": "x" * 16_000}}
    obs = env.step([amplified]).observations[0]
    assert len(obs.content) < 1100 and obs.content.endswith(" characters]") and "[truncated " in obs.content
    long_name = {"name": "n" * 1000, "arguments": {}}
    assert "tool name longer than 128" in env.step([long_name]).observations[0].content
