"""The generic scripted generator (generation/scripted.py) on an env that is not BFCL's: a success plays the suite's
oracle_calls, a failure is the oracle plan with a call dropped (or no call), each played through the env before it
is used; the coin is seeded; later turns continue their rollout. The env here is a counter with an ``add(n)`` tool,
small enough to check every message by hand; BFCL's own plans: tests/unit/envs/bfcl/test_scripted.py."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.scripted import FINAL_TEXT, ScriptedGenerator
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec
from nemo_rcgrpo.types import Observation, RewardInfo, ToolCall
from nemo_rcgrpo.utils.config import ConfigError


def _tool(name, params):
    props = {p: {"type": "integer"} for p in params}
    schema = {"type": "object", "properties": props, "required": list(params)}
    return {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}


ADD, DONE = _tool("add", ["n"]), _tool("done", [])


@dataclass(frozen=True)
class Task:
    id: str
    category: str  # "counted": paid for exactly the oracle's adds, in their turns | "free": always paid | "never"
    turns: tuple[tuple[int, ...], ...]  # the numbers to add, per user turn


def _ask(turn):
    return "Add " + ", then ".join(map(str, turn)) + "." if turn else "Nothing to add."


@dataclass
class CounterEnv:
    """per_turn: the user turns come one at a time, a message without calls ends one (no done tool); merged: every
    turn in the first message, done() or a message without calls ends the episode."""

    task: Task
    per_turn: bool
    turn: int = 0
    done: bool = False
    truncated: str | None = None
    added: list = field(default_factory=list)  # (turn, n) per add

    @property
    def tools(self):
        return [ADD] if self.per_turn else [ADD, DONE]

    def step(self, calls):
        observations, messages = [], []
        for c in calls:
            if isinstance(c, ToolCall) and c.name == "done":
                self.done = True
            elif isinstance(c, ToolCall) and c.name == "add" and isinstance(c.kwargs.get("n"), int):
                self.added.append((self.turn, c.kwargs["n"]))
                observations.append(Observation("ok", True, "add", c.id))
            else:
                observations.append(Observation("Error: add(n: int)", False, None, c.id))
        messages = [{"role": "tool", "tool_call_id": o.tool_call_id, "content": o.content} for o in observations]
        if not calls:
            self.turn += 1
            if not self.per_turn or self.turn == len(self.task.turns):
                self.done = True
            else:
                messages.append({"role": "user", "content": _ask(self.task.turns[self.turn])})
        return SimpleNamespace(observations=observations, messages=messages, tools_changed=False)

    def truncate(self, reason):
        self.done, self.truncated = True, reason

    def reward(self):
        want = [(t if self.per_turn else 0, n) for t, ns in enumerate(self.task.turns) for n in ns]
        ok = {"free": True, "never": False}.get(self.task.category, self.added == want)
        return RewardInfo(float(ok), ok, ok, {})

    def official_verdict(self):
        return None


class Opener:
    def __init__(self, per_turn=False):
        self.per_turn = per_turn

    def open(self, task):
        turns = task.turns[:1] if self.per_turn else task.turns
        text = " ".join(_ask(t) for t in turns) if not self.per_turn else _ask(turns[0])
        return CounterEnv(task, self.per_turn), [{"role": "user", "content": f"Task {task.id}: {text}"}]


class Suite:
    def __init__(self, *tasks, oracle=True):
        self.tasks = {t.id: t for t in tasks}
        if oracle:
            self.oracle_calls = lambda task: [[ToolCall("add", {"n": n}) for n in turn] for turn in task.turns]

    def __getitem__(self, task_id):
        return self.tasks[task_id]


TASKS = (Task("a", "counted", ((2, 3), (5,))), Task("b", "counted", ((7,),)), Task("c", "counted", ((1, 4),)))


@pytest.fixture(scope="module")
def renderer():
    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    return ChatRenderer(tok, "hermes", tool_description="compact")


def _engine(renderer, suite, per_turn=False, **kw):
    gen = ScriptedGenerator(renderer, suite, Opener(per_turn), env_name="counter", **kw)
    engine = RolloutEngine(
        gen,
        renderer,
        Opener(per_turn),
        SamplingParams(max_new_tokens=256),
        max_turns=8,
        max_total_tokens=4096,
        reward_goal=RewardGoal(),
    )
    return gen, engine


def _adds(calls):
    return [c["arguments"]["n"] if c.get("name") == "add" else c.get("name", "?") for c in calls]


def test_a_success_plays_the_oracle_calls_and_a_failure_drops_one(renderer):
    suite = Suite(*TASKS)
    gen, engine = _engine(renderer, suite, success_high=1.0, success_low=0.0)
    specs = [RolloutSpec(suite[t.id], g, token) for g, t in enumerate(TASKS) for token in (True, False, False)]
    trajs = engine.rollout(specs, seed=3)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0] * 3 and gen.played == {"success": 3, "failure": 6}
    assert all(t.truncated is None and t.error is None and t.tool_errors == 0 for t in trajs)
    # merged episodes: one message per user turn with its calls, then done() (the env offers it)
    assert [_adds(c) for c in trajs[0].calls] == [[2, 3], [5], ["done"]]
    assert [_adds(c) for c in trajs[3].calls] == [[7], ["done"]]
    assert [_adds(c) for c in trajs[6].calls] == [[1, 4], ["done"]]
    for t, oracle in zip(trajs, [[2, 3, 5]] * 3 + [[7]] * 3 + [[1, 4]] * 3):
        played = [n for calls in t.calls for n in _adds(calls) if n != "done"]
        if t.reward == 0.0:  # the oracle's calls less one, in order (a one-call task: no call at all)
            assert len(played) == len(oracle) - 1 and any(oracle[:i] + oracle[i + 1 :] == played for i in range(3))
        assert t.calls[-1] == [{"name": "done", "arguments": {}}]
    # the variants differ: task a's failures drop different calls across rollouts (seeded per rollout)
    dropped = set()
    for seed in range(6):
        for t in engine.rollout([RolloutSpec(suite["a"], 0, False)], seed=seed):
            dropped.add(tuple(n for calls in t.calls for n in _adds(calls)))
    assert len(dropped) > 1 and all(len(d) == 3 for d in dropped)  # two adds and done()


def test_later_user_turns_continue_their_rollout(renderer):
    """An env that hands out user turns one at a time: the oracle plan as one request scores 0 there, so a closing
    text ends each turn; each later prompt extends the rollout's own earlier prompt and completion."""
    suite = Suite(*TASKS)
    gen, engine = _engine(renderer, suite, per_turn=True, success_rate=1.0)
    trajs = engine.rollout([RolloutSpec(suite[t.id], g, None) for g, t in enumerate(TASKS * 2)], seed=1)
    assert [t.reward for t in trajs] == [1.0] * 6 and gen.played == {"success": 6, "failure": 0}
    assert [_adds(c) for c in trajs[0].calls] == [[2, 3], [], [5], []]
    assert trajs[0].texts[1] == FINAL_TEXT and trajs[0].followups[1] == [{"role": "user", "content": "Add 5."}]
    assert [_adds(c) for c in trajs[1].calls] == [[7], []]
    _, engine = _engine(renderer, suite, per_turn=True, success_rate=0.0)
    failed = engine.rollout([RolloutSpec(suite["a"], 0, None)] * 4, seed=1)
    assert {t.reward for t in failed} == {0.0} and all(t.texts.count(FINAL_TEXT) == 2 for t in failed)  # both closed


def test_a_format_of_one_call_per_message_gets_each_call_alone(renderer):
    """Under a chat format that renders one call per assistant message (llama3_json), each oracle call is a message
    of its own, and the plan is verified played so."""
    suite = Suite(*TASKS)
    gen = ScriptedGenerator(renderer, suite, Opener(), env_name="counter")
    turns = gen._turns(suite["a"])
    assert gen._moves(turns, per_turn=False)[:2] == [turns[0], turns[1]]  # hermes: a turn's calls together
    gen.renderer = SimpleNamespace(spec=SimpleNamespace(one_call_per_message=True))
    moves = gen._moves(turns, per_turn=False)
    assert moves[:3] == [[ToolCall("add", {"n": 2})], [ToolCall("add", {"n": 3})], [ToolCall("add", {"n": 5})]]
    plan = gen._plan(suite["a"], True, 0)
    assert [[c["function"]["arguments"] for c in m.get("tool_calls", [])] for m in plan] == [
        ['{"n": 2}'],
        ['{"n": 3}'],
        ['{"n": 5}'],
        ["{}"],
    ]


def test_the_coin_is_seeded_and_follows_the_probability(renderer):
    suite = Suite(*TASKS)
    specs = [RolloutSpec(suite[t.id], g, None) for g, t in enumerate(TASKS) for _ in range(8)]
    runs = []
    for _ in range(2):
        _, engine = _engine(renderer, suite, success_rate=0.5)
        runs.append([(t.reward, t.token_ids) for t in engine.rollout(specs, seed=11)])
    assert runs[0] == runs[1] and 0 < sum(r for r, _ in runs[0]) < len(specs)  # reproducible, mixed
    _, engine = _engine(renderer, suite, success_rate=0.5)
    assert [t.reward for t in engine.rollout(specs, seed=12)] != [r for r, _ in runs[0]]  # other coins
    _, engine = _engine(renderer, suite, success_rate=0.5, seed=1)
    assert [t.reward for t in engine.rollout(specs, seed=11)] != [r for r, _ in runs[0]]  # generation.scripted.seed


def test_what_cannot_be_scripted_is_one_line(renderer):
    with pytest.raises(
        ConfigError,
        match=r"^generation.backend=scripted plays a suite's oracle_calls\(task\); task_source=counter's "
        r"suite \(Suite\) has none \(envs/interfaces.py: Suite\)$",
    ):
        ScriptedGenerator(renderer, Suite(*TASKS, oracle=False), Opener(), task_source="counter")
    suite = Suite(Task("free", "free", ((1,),)), Task("never", "never", ((2, 3), (4,))))
    gen, _ = _engine(renderer, suite)
    with pytest.raises(ValueError, match=r"^scripted generator: no reward-0 plan of free: its oracle calls with one "):
        gen._plan(suite["free"], False, 0)
    with pytest.raises(
        ValueError,
        match=r"^scripted generator: the oracle calls of never score 0.0 through env counter \(as one request "
        r"and with a closing text after each user turn\), not 1: ",
    ):
        gen._plan(suite["never"], True, 0)
    with pytest.raises(ValueError, match="holds no known task's first user message"):
        gen.generate([renderer.tokenizer("hello")["input_ids"]], SamplingParams())


READ, WRITE = _tool("read", []), _tool("write", ["v"])


@dataclass
class VaultEnv:
    """Tasks that open alike ("Copy the secret.") on other secrets: read() tells them apart, write(v) must give it."""

    secret: int
    written: int | None = None
    done: bool = False
    truncated: str | None = None
    tools: tuple = (READ, WRITE, DONE)

    def step(self, calls):
        out = []
        for c in calls:
            if c.name == "done":
                self.done = True
                continue
            if c.name == "write":
                self.written = c.kwargs.get("v")
            out.append(
                Observation(f"the secret is {self.secret}" if c.name == "read" else "written", True, c.name, c.id)
            )
        messages = [{"role": "tool", "tool_call_id": o.tool_call_id, "content": o.content} for o in out]
        self.done = self.done or not calls
        return SimpleNamespace(observations=out, messages=messages, tools_changed=False)

    def truncate(self, reason):
        self.done, self.truncated = True, reason

    def reward(self):
        ok = self.written == self.secret
        return RewardInfo(float(ok), ok, ok, {})

    def official_verdict(self):
        return None


class VaultOpener:
    def open(self, task):
        return VaultEnv(task.turns[0][0]), [{"role": "user", "content": "Copy the secret."}]


def test_tasks_that_open_alike_are_told_apart_by_what_the_env_answers(renderer):
    """Twins whose oracle plans differ from their first message (read, then write what it returned): each call goes
    in a message of its own, the rollout keeps the twin whose env answered as the prompt shows, and a success pays
    1 on every twin; a failure plays a plan common to all of them (here: no write) and pays 0."""
    twins = [Task(f"v{s}", "vault", ((s,),)) for s in (17, 42, 99)]
    suite = Suite(*twins)
    suite.oracle_calls = lambda task: [[ToolCall("read", {}), ToolCall("write", {"v": task.turns[0][0]})]]
    gen = ScriptedGenerator(renderer, suite, VaultOpener(), env_name="vault", success_high=1.0, success_low=0.0)
    engine = RolloutEngine(
        gen, renderer, VaultOpener(), SamplingParams(max_new_tokens=256), max_turns=8, max_total_tokens=4096,
        reward_goal=RewardGoal(),
    )  # fmt: skip
    specs = [RolloutSpec(t, g, token) for g, t in enumerate(twins) for token in (True, False)]
    trajs = engine.rollout(specs, seed=0)
    assert [t.reward for t in trajs] == [1.0, 0.0] * 3
    for t, twin in zip(trajs[::2], twins):  # read alone, then the write of this twin's own secret, then done()
        assert [[c["name"] for c in calls] for calls in t.calls] == [["read"], ["write"], ["done"]]
        assert t.calls[1][0]["arguments"] == {"v": twin.turns[0][0]}
    for t in trajs[1::2]:
        assert all(c["name"] != "write" for calls in t.calls for c in calls)


def test_an_oracle_that_fails_or_gives_another_shape_is_one_line_naming_the_task(renderer):
    for oracle, said in (
        (lambda task: {}["missing"], r"oracle_calls\(b\) failed: KeyError"),
        (lambda task: [ToolCall("add", {"n": 7})], r"oracle_calls\(b\) failed: TypeError"),  # not per turn
        (lambda task: [["add(7)"]], r"oracle_calls\(b\) must give a list of user turns, each a list of ToolCall"),
    ):
        suite = Suite(*TASKS)
        suite.oracle_calls = oracle
        gen = ScriptedGenerator(renderer, suite, Opener(), env_name="counter")
        with pytest.raises(ValueError, match=said):
            gen._plan(suite["b"], True, 0)
