"""Hostile model output: nothing crashes a rollout, nothing hangs, nothing leaks into process state.

Each case was a crash, a hang or a silent difference before the guard that it tests.
"""

import decimal
import sys

import mpmath
import pytest

from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.data.tool_parsers import parse_hermes, parse_llama3_json
from nemo_rcgrpo.envs.bfcl import BFCLEnv
from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
from nemo_rcgrpo.envs.calls import to_tool_call
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import Completion, SamplingParams
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec
from nemo_rcgrpo.types import ToolCall, ToolCallError, valid_text

FS_TASK, MATH_TASK = "multi_turn_base_0", "multi_turn_base_15"


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer(load_tokenizer("smollm2"), "hermes", tool_description="compact")


def _env(suite, task_id=FS_TASK, **kw):
    env = BFCLEnv(mode="merged", **kw)
    env.reset(suite[task_id])
    return env


# --------------------------------------------------------------------------- 1: valid text, isolated rollouts

SURROGATES = [
    ('<tool_call>\n{"name": "cd", "arguments": {"folder": "\\ud800"}}\n</tool_call>', parse_hermes),
    ('{"name": "cd", "parameters": {"folder": "a\\udfff\\ud83d"}}', parse_llama3_json),
    ('<tool_call>\n{"name": "mkdir", "arguments": {"dir_name": "\\udc80x"}}\n</tool_call>', parse_hermes),
]


@pytest.mark.parametrize("text, parser", SURROGATES)
def test_lone_surrogates_never_reach_an_observation(suite, renderer, text, parser):
    calls = parser(text).calls
    env = _env(suite)
    for obs in env.step(calls).observations:
        obs.content.encode("utf-8")  # raised UnicodeEncodeError before
        renderer.encode_text(obs.content)  # and so did the tokenizer, inside the rollout engine
    assert valid_text("a\ud800b") == "a\\ud800b" and valid_text("ok ü") == "ok ü"


class FixedGenerator:
    """Answers every prompt that contains a marker's ids with that marker's text."""

    version = 0

    def __init__(self, renderer, answers):
        self.renderer, self.answers = renderer, answers

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = next(t for marker, t in self.answers if any(p[i : i + len(marker)] == marker for i in range(len(p))))
            ids = self.renderer.encode_text(text) + [params.stop_token_ids[0]]
            out.append(Completion(ids, [-0.1] * len(ids), "stop"))
        return out

    def update_weights(self, weights, version):
        pass


def test_one_failing_rollout_does_not_take_down_its_batch(suite, renderer, monkeypatch):
    tasks = [suite[FS_TASK], suite["multi_turn_base_1"]]
    markers = [renderer.encode_text(t.turns[0][0]["content"][:40], user_text=True)[2:8] for t in tasks]
    hostile = SURROGATES[0][0]
    good = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    gen = FixedGenerator(renderer, [(markers[0], hostile), (markers[1], good)])
    engine = RolloutEngine(
        gen,
        renderer,
        make_opener(EnvConfig(settings=BFCLSettings(mode="merged")), suite),
        SamplingParams(max_new_tokens=64),
        max_turns=2,
    )
    trajs = engine.rollout([RolloutSpec(tasks[0], 0), RolloutSpec(tasks[1], 1)])
    assert [t.error for t in trajs] == [None, None]  # surrogates are now plain escape text
    assert "\\ud800" in trajs[0].observations[0][0]
    # a rollout whose parser raises (any bug of a component) ends alone, reward 0, the error recorded
    real_parse = engine.parse
    line = sys._getframe().f_lineno + 4  # the lambda that raises
    monkeypatch.setattr(
        engine,
        "parse",
        lambda text, names: (_ for _ in ()).throw(RuntimeError("boom")) if "cd" in text else real_parse(text, names),
    )
    trajs = engine.rollout([RolloutSpec(tasks[0], 0), RolloutSpec(tasks[1], 1)])
    # the error keeps where it was raised: the raising function's file, line and name
    boom = f"RuntimeError: boom (at tests/unit/envs/bfcl/test_hostile_inputs.py:{line} in <genexpr>)"
    assert trajs[0].error == boom and trajs[0].reward == 0.0 and trajs[0].truncated == "rollout error"
    assert trajs[0].record()["error"] == boom
    assert len(trajs[0].token_ids) == len(trajs[0].loss_mask) == len(trajs[0].sampler_logprobs)
    assert trajs[1].error is None and trajs[1].num_turns == 2  # the other rollout ran to its turn limit


# --------------------------------------------------------------------------- 2: argument types the guard cannot read


@pytest.mark.parametrize(
    "call",
    [
        "logarithm(value=10, base=2, precision=b'1000000')",
        "logarithm(value=10, base=2, precision=[1000000])",
        "logarithm(value=10, base=2, precision={'p': 1})",
        "logarithm(value=10, base=2, precision='nan')",
        "logarithm(value=10, base=2, precision='1e6')",
        "round_number(number=5, decimal_places=b'99999999')",
        "round_number(number=5, decimal_places=(5,))",
    ],
)
def test_unreadable_precision_is_refused_at_once(suite, call):
    env = _env(suite, MATH_TASK)
    obs = env.step([call]).observations[0]
    assert not obs.ok and "must be a number of at most 1000 digits" in obs.content


def test_readable_precision_still_runs(suite):
    env = _env(suite, MATH_TASK)
    for call in ("logarithm(value=8, base=2, precision=10)", "logarithm(value=8, base=2, precision='10')"):
        obs = env.step([call]).observations[0]
        assert obs.ok and "3.0" in obs.content, (call, obs.content)


# -------------------- 4: find output bounded before it is built


def test_find_over_long_shared_paths_is_refused_before_it_is_built(suite):
    # 12 levels of 250-character names, each level copied (shallowly) beside itself: about 16 000 entries (under
    # the entry bound) but tens of millions of path characters for find() to build
    a, b = "a" * 250, "b" * 250
    env = _env(suite, max_steps=50)
    env.step([c for _ in range(12) for c in (f"mkdir(dir_name='{a}')", f"cd(folder='{a}')")])
    env.step([c for _ in range(12) for c in ("cd(folder='..')", f"cp(source='{a}', destination='{b}')")])
    for call in ("find(path='.')", "du()"):
        obs = env.step([call]).observations[0]
        assert not obs.ok and "characters of paths" in obs.content, (call, obs.content[:200])
    assert env.step(["find(path='.', name='zzz')"]).observations[0].ok is False


# --------------------------------------------------------------------------- 6: process state restored exactly


def test_numeric_state_is_restored_exactly(suite):
    env = _env(suite, MATH_TASK)
    old_prec = mpmath.mp.prec
    try:
        mpmath.mp.prec = 64  # not a whole number of decimal digits: dps alone cannot restore it
        with decimal.localcontext() as ctx:
            ctx.prec, ctx.rounding = 7, decimal.ROUND_DOWN
            for call in (
                "logarithm(value=10, base=2, precision=50)",
                "round_number(number=2.5, decimal_places=3)",
                "square_root(number=2, precision=40)",
            ):
                env.step([call])
                assert mpmath.mp.prec == 64, call
                assert decimal.getcontext() is ctx, call  # the outer localcontext keeps its own object
                assert (ctx.prec, ctx.rounding) == (7, decimal.ROUND_DOWN), call
    finally:
        mpmath.mp.prec = old_prec


# --------------------------------------------------------------------------- 7: names matched exactly as written


@pytest.mark.parametrize(
    "call", ["ｃｄ(folder='document')", "𝐥𝐬(a=True)", "ls(ａ=True)", "ls(𝐚=True)", "ﬁnd(path='.')"]
)
def test_look_alike_names_are_refused_in_the_python_form(suite, call):
    obs = _env(suite).step([call]).observations[0]
    assert not obs.ok and "not written in plain characters" in obs.content


@pytest.mark.parametrize("name", ["ｃｄ", "𝐥𝐬"])
def test_look_alike_names_are_refused_in_the_json_form(suite, name):
    obs = _env(suite).step([{"name": name, "arguments": {}}]).observations[0]
    assert not obs.ok and "unknown tool" in obs.content


# --------------------------------------------------------------------------- 8: tool-call ids


@pytest.mark.parametrize("call_id", [{"x": 1}, 7, "x" * 65, "", ["a"]])
def test_tool_call_ids_must_be_short_strings(call_id):
    raw = {"id": call_id, "type": "function", "function": {"name": "ls", "arguments": {}}}
    parsed = to_tool_call(raw)
    assert isinstance(parsed, ToolCallError) and "tool-call id must be a string" in parsed.message
    assert parsed.id is None
    ok = to_tool_call({**raw, "id": "call_1"})
    assert isinstance(ok, ToolCall) and ok.id == "call_1"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_the_renderer_never_raises_on_invalid_text(fmt):
    from nemo_rcgrpo.data.tokenize import ensure_format_tokens

    tok = load_tokenizer("smollm2")
    ensure_format_tokens(tok, fmt)
    r = ChatRenderer(tok, fmt, tool_description="compact")
    messages = [{"role": "user", "content": "u\ud800"}, {"role": "tool", "content": "x\udfffy"}]
    ids = r.render(messages).ids  # raised inside the tokenizer before
    assert tok.decode(ids).count("\\ud800") == 1


# --------------------------------------------------------------------------- 8: silent limits are errors


def test_llama3_json_past_128_calls_and_duplicate_keys_are_error_observations(suite):
    import json

    many = "; ".join(json.dumps({"name": "ls", "parameters": {}}) for _ in range(129))
    (call,) = parse_llama3_json(many, {"ls"}).calls  # one error for the message, not 128 (and 1 silently dropped)
    assert isinstance(call, ToolCallError) and "more than 128 tool calls; at most 128 are read" in call.message
    (obs,) = _env(suite).step([call]).observations
    assert not obs.ok and "at most 128 are read per message, so none of them was run" in obs.content
    for text, parser in (
        ('{"name": "ls", "parameters": {"a": true, "a": false}}', parse_llama3_json),
        ('<tool_call>{"name": "ls", "arguments": {"a": true, "a": false}}</tool_call>', parse_hermes),
    ):
        (call,) = parser(text, {"ls"}).calls
        assert isinstance(call, ToolCallError) and "duplicate key 'a'" in call.message
    assert "given twice" in _env(suite).step(["ls(a=True, a=False)"]).observations[0].content


# --------------------------------------------------------------------------- 9: the cap on calls per message is said


def test_a_message_past_the_call_cap_is_one_error_observation_in_the_dump(suite, renderer):
    """5000 calls in one message: before, 128 errors (4872 calls dropped without a word) or, with the default
    chat.rejected_message=content, no call, no observation and no reason in the rollout record."""
    task = suite[FS_TASK]
    block = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    many = "\n".join([block] * 5000)
    parsed = parse_hermes(many, {"ls"})
    assert parsed.rejected is None and len(parsed.calls) == 1
    assert parsed.calls[0].message.startswith("this message has 5000 tool calls; at most 128 are read per message")
    marker = renderer.encode_text(task.turns[0][0]["content"][:40], user_text=True)[2:8]
    engine = RolloutEngine(
        FixedGenerator(renderer, [(marker, many)]),
        renderer,
        make_opener(EnvConfig(settings=BFCLSettings(mode="merged")), suite),
        SamplingParams(max_new_tokens=100_000),
        max_turns=1,
        max_total_tokens=200_000,
    )
    (traj,) = engine.rollout([RolloutSpec(task, 0)])
    record = traj.record()
    assert record["turns"][0] == [{"error": parsed.calls[0].message, "raw": parsed.calls[0].raw}]
    (observation,) = traj.observations[0]
    assert "5000 tool calls; at most 128 are read per message" in observation
    assert any(m["role"] == "tool" and m["content"] == observation for m in record["messages"])


def test_calls_past_the_env_cap_name_the_cap(suite):
    obs = _env(suite, max_calls_per_step=2).step(["ls()"] * 3).observations
    assert [o.ok for o in obs] == [True, True, False]
    assert (
        obs[2].content == "Error: this message has 3 tool calls; at most 2 are run per message, so this one was not run"
    )
