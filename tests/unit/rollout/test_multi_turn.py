"""The rollout engine with a scripted generator: token-level consistency, stopping rules, concurrency."""

import dataclasses
import json

import pytest

from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan
from nemo_rcgrpo.envs.config import EnvConfig
from nemo_rcgrpo.envs.sources import make_opener
from nemo_rcgrpo.generation.base import Completion, SamplingParams
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec


@pytest.fixture(scope="module")
def renderer():
    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    return ChatRenderer(tok, "hermes", tool_description="compact")


class ScriptedGenerator:
    """Answers the k-th assistant message of every rollout with script(task, k); records batch sizes."""

    version = 0

    def __init__(self, renderer, scripts, header):
        self.renderer, self.scripts, self.header, self.batches = renderer, scripts, header, []

    def generate(self, prompts, params):
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            key = next(k for k in self.scripts if _contains(p, self.scripts[k]["marker"]))
            turn = _count(p, self.header) - 1
            text = self.scripts[key]["turns"][turn] if turn < len(self.scripts[key]["turns"]) else "done"
            ids = self.renderer.encode_text(text) + [params.stop_token_ids[0]]
            out.append(Completion(ids, [-0.5] * len(ids), "stop"))
        return out

    def update_weights(self, weights, version):
        pass


def _contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _count(seq, sub):
    return sum(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _hermes_calls(calls):
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.kwargs}) + "\n</tool_call>" for c in calls
    )


def _engine(renderer, suite, scripts, mode="merged", **kw):
    header = renderer.generation_prompt_ids()
    gen = ScriptedGenerator(renderer, scripts, header)
    engine = RolloutEngine(
        gen,
        renderer,
        make_opener(EnvConfig(settings=BFCLSettings(mode=mode)), suite),
        SamplingParams(max_new_tokens=512),
        **kw,
    )
    return engine, gen


def _gold_script(renderer, task):
    turns = [_hermes_calls(calls) for calls in gold_plan(task) if calls]
    turns.append(_hermes_calls([type(gold_plan(task)[0][0])("done")]))
    marker = renderer.encode_text(task.turns[0][0]["content"][:40], user_text=True)[2:8]
    return {"marker": marker, "turns": turns}


def test_gold_rollouts_score_one_and_tokens_equal_the_rendered_conversation(suite, renderer):
    tasks = [suite["multi_turn_base_0"], suite["multi_turn_base_5"]]
    scripts = {t.id: _gold_script(renderer, t) for t in tasks}
    engine, gen = _engine(renderer, suite, scripts)
    specs = [RolloutSpec(t, g, token) for g, t in enumerate(tasks) for token in (True, False, True)]
    trajs = engine.rollout(specs)
    assert [t.reward for t in trajs] == [1.0] * 6 and all(t.state_ok and t.actions_ok for t in trajs)
    assert gen.batches[0] == 6  # every live rollout in one generator call
    assert [t.reward_token for t in trajs] == ["high", "low", "high"] * 2
    high = renderer.tokenizer.convert_tokens_to_ids("<|high_reward|>")
    t0 = trajs[0]
    assert t0.token_ids[: t0.prompt_length].count(high) == 1
    assert len(t0.token_ids) == len(t0.loss_mask) == len(t0.sampler_logprobs)
    # the engine's ids are exactly the chat format's rendering of the same conversation
    from nemo_rcgrpo.data.reward_goal import RewardGoal
    from nemo_rcgrpo.envs.bfcl.trajectories import play

    played = play(tasks[0], gold_plan(tasks[0]), "merged")
    messages = RewardGoal().apply(played.messages, True)
    rendered = renderer.render(messages, played.tools)
    tail = renderer.after_stop_ids()  # the rendering closes the last turn with "\n"; a rollout ends at its stop token
    assert rendered.ids[-len(tail) :] == tail
    assert t0.token_ids == rendered.ids[: -len(tail)] and t0.loss_mask == rendered.mask[: -len(tail)]
    assert t0.num_turns == sum(1 for m in messages if m["role"] == "assistant")
    assert t0.calls[0][0] == {"name": "cd", "arguments": {"folder": "document"}}


def test_a_generator_that_places_groups_gets_each_prompts_group_every_turn(suite, renderer):
    """places_groups: every call names each prompt's group, the same key for a group's rollouts on every turn, and
    another rollout call's groups get other keys (rollouts generated ahead overlap a step's)."""
    tasks = [suite["multi_turn_base_0"], suite["multi_turn_base_5"]]
    scripts = {t.id: _gold_script(renderer, t) for t in tasks}
    engine, gen = _engine(renderer, suite, scripts)
    seen = []

    class Placing(type(gen)):
        places_groups = True

        def generate(self, prompts, params, groups):
            seen.append(list(groups))
            return super().generate(prompts, params)

    engine.generator = placing = Placing(renderer, scripts, gen.header)
    specs = [RolloutSpec(t, g, token) for g, t in enumerate(tasks) for token in (True, False)]
    assert [t.reward for t in engine.rollout(specs)] == [1.0] * 4
    assert len(seen) > 1 and len(seen) == len(placing.batches)  # one call per round, every round keyed
    first = seen[0]
    assert [g for _, g in first] == [0, 0, 1, 1] and len({c for c, _ in first}) == 1
    assert all(set(keys) <= set(first) for keys in seen[1:])  # later turns keep their group's key
    engine.rollout(specs[:1])
    assert seen[-1][0] != first[0]  # the next rollout call: a key of its own


def test_a_rejected_message_is_what_a_server_hands_its_client(suite, renderer):
    """chat.rejected_message=content (the default): a message the parser rejects whole is, as vLLM's parser hands it
    to a client, the whole text as content and no call: nothing runs, the turn ends (merged: the episode), the
    reward is what the env saw. A good call before it still counts; with error observations it would not end."""
    task = suite["multi_turn_base_0"]
    script = _gold_script(renderer, task)
    garbage = 'Sure. <tool_call>{"name": "cd", "arguments": {"folder": "document"}}</tool_call> <tool_call>{not json'
    engine, _ = _engine(renderer, suite, {"x": {"marker": script["marker"], "turns": [garbage] * 50}}, max_turns=3)
    traj = engine.rollout([RolloutSpec(task, 0, None)])[0]
    assert traj.num_turns == 1 and traj.rejected_messages == 1 and traj.calls == [[]] and traj.truncated is None
    assert traj.observations == [[]] and traj.tool_errors == 0 and traj.reward == 0.0
    assert traj.messages()[0]["content"] == garbage and traj.record()["rejected_messages"] == 1
    # the first gold step, then a rejected message: the env saw one step; per turn, only that turn ends
    turns = [script["turns"][0], garbage, script["turns"][1]]
    engine, _ = _engine(renderer, suite, {"x": {"marker": script["marker"], "turns": turns}}, max_turns=5)
    traj = engine.rollout([RolloutSpec(task, 0, None)])[0]
    assert traj.num_turns == 2 and traj.calls[1] == [] and traj.calls[0][0]["name"] == "cd"
    with pytest.raises(ValueError, match="rejected_message"):
        _engine(renderer, suite, {}, rejected_message="retry")


def test_the_rejected_message_rule_decides_what_is_rewarded(suite, renderer):
    """Mixed rewards in both modes: of two rollouts of a task, one plays the ground truth and one writes a rejected
    message first and then the ground truth. Served (content), the second ends at the rejected message and pays 0;
    with error observations it recovers and pays 1, a success that a served model would never have had."""
    task = suite["multi_turn_base_0"]
    script = _gold_script(renderer, task)
    other = suite["multi_turn_base_1"]
    retry = _gold_script(renderer, other)
    scripts = {"gold": script, "retry": {"marker": retry["marker"], "turns": ["<tool_call>{not json", *retry["turns"]]}}
    rewards = {}
    for mode in ("content", "error"):
        engine, _ = _engine(renderer, suite, scripts, max_turns=20, rejected_message=mode)
        trajs = engine.rollout([RolloutSpec(task, 0, None), RolloutSpec(other, 1, None)])
        rewards[mode] = [t.reward for t in trajs]
        assert [t.rejected_messages for t in trajs] == [0, 1]
    assert rewards == {"content": [1.0, 0.0], "error": [1.0, 1.0]}


def test_bad_output_becomes_error_observations_and_limits_end_rollouts(suite, renderer):
    """chat.rejected_message=error: each call attempt of a rejected message is an error observation and the episode
    goes on (what serving does not do: the opt-in of training on retries)."""
    task = suite["multi_turn_base_0"]
    marker = _gold_script(renderer, task)["marker"]
    garbage = "<tool_call>{not json</tool_call>"
    engine, _ = _engine(
        renderer, suite, {"x": {"marker": marker, "turns": [garbage] * 50}}, max_turns=3, rejected_message="error"
    )
    traj = engine.rollout([RolloutSpec(task, 0, None)])[0]
    assert traj.num_turns == 3 and traj.tool_errors == 3 and traj.truncated.startswith("more than 3")
    assert traj.reward == 0.0 and "not valid JSON" in traj.observations[0][0] and traj.rejected_messages == 3
    engine, _ = _engine(
        renderer,
        suite,
        {"x": {"marker": marker, "turns": ['<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'] * 50}},
        max_total_tokens=700,
    )
    traj = engine.rollout([RolloutSpec(task, 0, None)])[0]
    assert traj.truncated == "context budget" and traj.reward == 0.0 and len(traj.token_ids) <= 700
    engine, _ = _engine(renderer, suite, {"x": {"marker": marker, "turns": ["I refuse."]}})
    traj = engine.rollout([RolloutSpec(task, 0, None)])[0]
    assert traj.num_turns == 1 and traj.truncated is None and traj.reward == 0.0  # merged: no call ends it


def test_per_turn_rollout_walks_the_user_turns(suite, renderer):
    from nemo_rcgrpo.envs.bfcl.trajectories import ClosingTexts, play

    task = suite["multi_turn_miss_param_0"]  # has a turn where the model must ask for the missing value
    closing = ClosingTexts()
    turns = []
    for t, calls in enumerate(gold_plan(task)):
        if calls:
            turns.append(_hermes_calls(calls))
        turns.append(closing.for_turn(task, t, len(calls)))
    marker = _gold_script(renderer, task)["marker"]
    engine, _ = _engine(renderer, suite, {"x": {"marker": marker, "turns": turns}}, mode="per_turn", max_turns=50)
    traj = engine.rollout([RolloutSpec(task, 0, None)])[0]
    assert (traj.reward, traj.official_valid, traj.truncated) == (1.0, True, None)
    played = play(task, gold_plan(task), "per_turn")
    rendered = renderer.render(played.messages, played.tools)
    tail = renderer.after_stop_ids()
    assert traj.token_ids == rendered.ids[: -len(tail)] and traj.loss_mask == rendered.mask[: -len(tail)]


def test_the_engine_runs_an_environment_that_is_not_bfcl(renderer, suite):
    """The seam of `envs/interfaces.py`: an opener whose ``open(task)`` gives a toy key-value environment (no BFCL
    type anywhere) drives the engine end to end: tool calls parsed and answered, an unknown tool an error
    observation, the reward the environment's own. BFCL's environment satisfies the same Protocol."""
    from dataclasses import dataclass, field

    from nemo_rcgrpo.envs.interfaces import Env
    from nemo_rcgrpo.types import Observation, OfficialVerdict, RewardInfo, ToolCall

    @dataclass(frozen=True)
    class KVTask:
        id: str
        category: str
        key: str
        value: str

    @dataclass
    class Result:
        observations: list
        messages: list
        tools_changed: bool = False

    @dataclass
    class KVEnv:
        task: KVTask
        store: dict = field(default_factory=dict)
        done: bool = False
        truncated: str | None = None

        @property
        def tools(self):
            return [
                {
                    "type": "function",
                    "function": {
                        "name": "put",
                        "description": "store a value under a key",
                        "parameters": {
                            "type": "object",
                            "properties": {"key": {"type": "string"}, "value": {"type": "string"}},
                            "required": ["key", "value"],
                        },
                    },
                }
            ]

        def step(self, calls):
            obs, msgs = [], []
            for i, c in enumerate(calls):
                if isinstance(c, ToolCall) and c.name == "put" and set(c.kwargs) == {"key", "value"}:
                    self.store[c.kwargs["key"]] = c.kwargs["value"]
                    o = Observation("ok", True, "put")
                elif isinstance(c, ToolCall) and c.name == "done":
                    self.done = True
                    continue
                else:
                    o = Observation(f"error: no such call {getattr(c, 'name', c)!r}", False)
                obs.append(o)
                msgs.append({"role": "tool", "content": o.content, "tool_call_id": f"c{i}"})
            if not calls:
                self.done = True
            return Result(obs, msgs)

        def truncate(self, reason):
            self.done, self.truncated = True, reason

        def reward(self):
            ok = self.truncated is None and self.store.get(self.task.key) == self.task.value
            return RewardInfo(float(ok), ok, ok, {"store": dict(self.store)})

        def official_verdict(self):
            return OfficialVerdict(valid=self.reward().value == 1.0)

    class KVOpener:
        def open(self, task):
            env = KVEnv(task)
            return env, [{"role": "user", "content": f"Store {task.value} under {task.key}. [{task.id}]"}]

    tasks = [KVTask("kv_0", "kv", "colour", "blue"), KVTask("kv_1", "kv", "shape", "round")]
    scripts = {
        "kv_0": {
            "marker": renderer.encode_text("[kv_0]", user_text=True)[1:4],
            "turns": [
                '<tool_call>\n{"name": "put", "arguments": {"key": "colour", "value": "blue"}}\n</tool_call>',
                '<tool_call>\n{"name": "done", "arguments": {}}\n</tool_call>',
            ],
        },
        "kv_1": {
            "marker": renderer.encode_text("[kv_1]", user_text=True)[1:4],
            "turns": ['<tool_call>\n{"name": "rm", "arguments": {"key": "shape"}}\n</tool_call>', "I cannot."],
        },
    }
    gen = ScriptedGenerator(renderer, scripts, renderer.generation_prompt_ids())
    engine = RolloutEngine(gen, renderer, KVOpener(), SamplingParams(max_new_tokens=128), max_turns=4)
    first, second = engine.rollout([RolloutSpec(tasks[0], 0), RolloutSpec(tasks[1], 1)])
    assert (first.task_id, first.category, first.reward, first.num_turns) == ("kv_0", "kv", 1.0, 2)
    assert first.observations[0] == ["ok"] and first.official_valid is True
    assert second.reward == 0.0 and second.tool_errors == 1 and second.observations[0][0].startswith("error")
    assert isinstance(KVEnv(tasks[0]), Env)
    bfcl_env, messages = make_opener(EnvConfig(), suite).open(suite["multi_turn_base_0"])
    assert isinstance(bfcl_env, Env) and messages[-1]["role"] == "user"


# ---------------------------------------------------------------- the plugin contract, enforced by the engine
class _Fault:
    """A deliberately misbehaving environment: ``task.id`` names what it gets wrong (envs/contract.py)."""

    TOOLS = [
        {"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "done", "parameters": {"type": "object", "properties": {}}}},
    ]

    def __init__(self, task):
        self.task, self.done, self.truncated, self.seen = task, False, None, []

    @property
    def tools(self):
        return self.TOOLS if self.task.id != "no_wrapper" else [{"name": "put", "parameters": {}}]

    def step(self, calls):
        from nemo_rcgrpo.types import Observation

        self.seen.append([c.name for c in calls])
        if self.task.id == "step_raises":
            raise RuntimeError("the env's own bug")
        obs = ["ok"] if self.task.id == "str_observation" else [Observation("ok", True, "put")]
        tools_changed = "yes" if self.task.id == "str_tools_changed" else False
        return type(
            "Result",
            (),
            {"observations": obs, "messages": [{"role": "tool", "content": "ok"}], "tools_changed": tools_changed},
        )()

    def truncate(self, reason):  # ignores it: neither done nor truncated is set
        pass

    def reward(self):
        from nemo_rcgrpo.types import RewardInfo

        value = {
            "none_reward": None,
            "str_reward": "1",
            "nan_reward": float("nan"),
            "big_reward": 2.0,
            "bool_reward": True,
        }.get(self.task.id, 1.0)  # 1.0 whatever happened, truncated or not
        return RewardInfo(value, True, True, {"said": value})

    def official_verdict(self):
        return None


class _FaultOpener:
    def __init__(self):
        self.envs = []

    def open(self, task):
        self.envs.append(_Fault(task))
        return self.envs[-1], [{"role": "user", "content": f"Do it. [{task.id}]"}]


class _Answers:
    """Answers the k-th assistant message of every rollout with texts[k] (the last one again after the end)."""

    version = 0

    def __init__(self, renderer, texts):
        self.renderer, self.texts, self.header = renderer, texts, renderer.generation_prompt_ids()

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            turn = min(_count(p, self.header) - 1, len(self.texts) - 1)
            ids = self.renderer.encode_text(self.texts[turn]) + [params.stop_token_ids[0]]
            out.append(Completion(ids, [-0.5] * len(ids), "stop"))
        return out


def _call(name):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {}}) + "\n</tool_call>"


def _fault_rollouts(renderer, ids, texts, **kw):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class T:
        id: str
        category: str = "c"

    opener = _FaultOpener()
    engine = RolloutEngine(
        _Answers(renderer, texts), renderer, opener, SamplingParams(max_new_tokens=64), name="fault_example", **kw
    )
    return engine.rollout([RolloutSpec(T(i), g) for g, i in enumerate(ids)]), opener


def test_a_bad_value_from_a_plugin_ends_that_rollout_alone_with_the_reason(renderer):
    bad = [
        "none_reward",
        "str_reward",
        "nan_reward",
        "big_reward",
        "bool_reward",
        "str_observation",
        "str_tools_changed",
        "step_raises",
    ]
    trajs, _ = _fault_rollouts(renderer, ["ok", *bad], [_call("put"), _call("done")], max_turns=4)
    assert trajs[0].error is None and trajs[0].reward == 1.0 and trajs[0].truncated is None
    for t in trajs[1:]:  # each pays 0 and says which plugin, object and field broke the contract
        assert t.reward == 0.0 and t.truncated == "rollout error" and t.record()["error"] == t.error, t.task_id
    errors = {t.task_id: t.error for t in trajs[1:]}
    assert (
        errors["none_reward"].startswith("PluginContractError: env fault_example: _Fault.reward (test_multi_turn.py:")
        and "task none_reward: reward().value is None (NoneType)" in errors["none_reward"]
    )
    assert "reward().value is '1' (str): give a float in [0, 1]" in errors["str_reward"]
    assert "reward().value is nan: give a finite float in [0, 1]" in errors["nan_reward"]
    assert "reward().value is 2.0: give a finite float in [0, 1]" in errors["big_reward"]
    assert "reward().value is True (bool)" in errors["bool_reward"]
    assert "_Fault.step (test_multi_turn.py:" in errors["str_observation"]
    assert "step().observations[0] is 'ok', not an Observation" in errors["str_observation"]
    assert "step().tools_changed is 'yes': give True" in errors["str_tools_changed"]
    # an exception in the plugin's code: one line with the plugin's file, line and function
    assert errors["step_raises"].startswith("RuntimeError: the env's own bug (at ")
    assert "test_multi_turn.py:" in errors["step_raises"] and errors["step_raises"].endswith(" in step)")


def test_a_tool_without_the_function_wrapper_is_one_line_naming_the_env(renderer):
    from nemo_rcgrpo.envs.contract import PluginContractError

    with pytest.raises(
        PluginContractError,
        match=r"^env fault_example: open\(task no_wrapper\): tools\[0\] is "
        r"\{'name': 'put', 'parameters': \{\}\}: a tool is an OpenAI "
        r"function schema \{\"type\": \"function\", \"function\"",
    ):
        _fault_rollouts(renderer, ["no_wrapper"], [_call("put")])


def test_the_engine_owns_truncation_and_the_done_tool(renderer):
    # the env pays 1.0 whatever happens and ignores truncate(): the engine's limit still ends the episode, pays 0
    # and records why (reward_details keeps what the env said)
    trajs, _ = _fault_rollouts(renderer, ["ok"], [_call("put")], max_turns=2)
    t = trajs[0]
    assert (t.num_turns, t.reward, t.truncated) == (2, 0.0, "more than 2 assistant messages")
    assert t.reward_details == {"said": 1.0, "truncated": "more than 2 assistant messages"}
    # a done() call ends the episode although this env never sets done; the call after it is not run
    trajs, opener = _fault_rollouts(renderer, ["ok"], [_call("put"), _call("done") + "\n" + _call("put")], max_turns=5)
    assert (trajs[0].num_turns, trajs[0].reward, trajs[0].truncated) == (2, 1.0, None)
    assert opener.envs[0].seen == [["put"], ["done"]]


def test_a_rollout_records_the_weight_version_it_started_from(renderer):
    """Trajectory.weight_version is the generator's version when the rollout started, even where the weights
    change while it runs (an update between two of its turns), and it reaches the dump record."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class T:
        id: str
        category: str = "c"

    class Updating(_Answers):
        version = 3

        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            self.version += 1  # new weights after every call: later turns of the same rollouts run on them
            return out

    gen = Updating(renderer, [_call("put"), _call("done")])
    engine = RolloutEngine(
        gen, renderer, _FaultOpener(), SamplingParams(max_new_tokens=64), name="fault_example", max_turns=4
    )
    first = engine.rollout([RolloutSpec(T("ok"), 0), RolloutSpec(T("ok"), 1)])
    assert [t.weight_version for t in first] == [3, 3] and gen.version > 4  # several turns, one start
    assert [t.record()["weight_version"] for t in first] == [3, 3]
    version = gen.version
    again = engine.rollout([RolloutSpec(T("ok"), 0)])
    assert again[0].weight_version == version  # the next rollouts start from the newer weights


def test_each_turn_records_the_weight_version_that_produced_it(suite, renderer):
    """An episode that spans a weight update (rollouts generated ahead) keeps its turns, each with the version it
    ran on; its staleness counts from its first turn. A completion's own version (a gated generator's) wins over
    the generator's version read before the call."""
    task = suite["multi_turn_base_0"]
    engine, gen = _engine(renderer, suite, {task.id: _gold_script(renderer, task)})
    versions = iter([3, 3, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5])

    class Updating(type(gen)):
        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            self.version = next(versions)  # an update lands after each call
            return out

    gen.__class__ = Updating
    gen.version = 3
    (traj,) = engine.rollout([RolloutSpec(task, 0, None)])
    assert traj.num_turns >= 3 and len(traj.turn_versions) == traj.num_turns
    assert traj.turn_versions[:3] == [3, 3, 3] and traj.weight_version == 3  # read before each call
    assert traj.record()["turn_versions"] == traj.turn_versions

    class Stamping(type(gen)):
        def generate(self, prompts, params):
            return [dataclasses.replace(c, version=7) for c in ScriptedGenerator.generate(self, prompts, params)]

    gen.__class__ = Stamping
    (traj,) = engine.rollout([RolloutSpec(task, 0, None)])
    assert set(traj.turn_versions) == {7} and traj.weight_version == 7
