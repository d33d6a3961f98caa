"""One registration idiom: @register(kind, name); config choices read from the registry; user code by name."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo import register
from nemo_rcgrpo.algorithms.advantages import group_advantages
from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.registry import KINDS, describe, load_plugins, lookup, names, table
from nemo_rcgrpo.utils.config import ConfigError, compose

PLUGINS = Path(__file__).resolve().parents[1] / "data" / "plugins"


@pytest.fixture(autouse=True)
def _restore_registry():
    """Every test leaves the registry, the loaded-plugin set and sys.modules as it found them."""
    import nemo_rcgrpo.registry as registry

    tables = {k: dict(registry.table(k)) for k in registry.KINDS}  # the shipped entries imported first
    loaded = set(registry._loaded)
    yield
    for kind, entries in tables.items():
        registry._TABLES[kind].clear()
        registry._TABLES[kind].update(entries)
    registry._loaded.clear()
    registry._loaded.update(loaded)
    sys.modules.pop("rc_plugin_example", None)


def test_every_kind_has_its_shipped_entries():
    assert names("reward_token_sampler") == ("iid", "stratified")
    assert names("advantage_baseline")[:2] == ("mean", "leave_one_out")
    assert names("advantage_scale")[:2] == ("std", "none") and names("loss_aggregation")[:2] == ("token", "sequence")
    assert names("kl_estimator")[:3] == ("k1", "k2", "k3") and names("generator")[:3] == ("hf", "vllm", "scripted")
    assert set(names("failure")) >= {"wrong_tool", "wrong_param", "premature_termination"}
    assert names("task_source")[:2] == ("bfcl", "bfcl_micro")
    assert names("stage")[:5] == ("sft", "rctp", "grpo", "rcgrpo", "dapo_filter")
    assert names("policy_backend")[:2] == ("torch", "megatron")
    assert names("chat_format")[:2] == ("hermes", "llama3_json")
    assert set(KINDS) == {line.split(" (")[0] for line in describe().splitlines()}


def test_register_refuses_clashes_and_unknown_kinds():
    with pytest.raises(ValueError, match="already registered"):
        register("advantage_baseline", "mean")(lambda r: r)
    with pytest.raises(ValueError, match="unknown kind 'advantage'"):
        register("advantage", "x")
    with pytest.raises(ValueError, match="registered: \\['mean', 'leave_one_out'"):
        lookup("advantage_baseline", "nope")
    fn = register("advantage_scale", "test_double")(lambda r, c, eps: 2 * c)
    try:
        assert register("advantage_scale", "test_double")(fn) is fn  # the same object again is fine
        rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
        assert group_advantages(rewards, scale="test_double").tolist() == [[1.0, -1.0, -1.0, 1.0]]
    finally:
        table("advantage_scale").pop("test_double")


def _cfg(*overrides):
    return TrainConfig.from_dict(compose("smoke_rl", list(overrides)))


def test_a_plugin_module_by_name(monkeypatch):
    with pytest.raises(
        ConfigError,
        match="rl.advantage.baseline='median_example': no advantage_baseline of that name; registered: \\['mean', 'leave_one_out'",
    ):
        _cfg("rl.advantage.baseline=median_example")
    monkeypatch.syspath_prepend(str(PLUGINS))
    assert load_plugins(["rc_plugin_example"]) == ["rc_plugin_example"]
    try:
        cfg = _cfg(
            "rl.advantage.baseline=median_example", "rl.loss.kl_estimator=zero_example", "plugins=[rc_plugin_example]"
        )
        assert cfg.plugins == ("rc_plugin_example",)
        rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0]])  # median 0: A = R / std
        std = rewards.double().std().item()
        assert group_advantages(rewards, baseline="median_example").tolist()[0] == pytest.approx(
            [1 / (std + 1e-6), 0, 0, 0, 1 / (std + 1e-6)]
        )
        assert load_plugins(["rc_plugin_example"]) == []  # once per process
    finally:
        table("advantage_baseline").pop("median_example")
        table("kl_estimator").pop("zero_example")
    with pytest.raises(ConfigError, match="cannot import 'no_such_plugin_module'"):
        load_plugins(["no_such_plugin_module"])
    for bad in ("rc_plugin_example", 5, [""], [{"a": 1}]):  # a string is not a list of modules
        with pytest.raises(ConfigError, match="give a list of module names"):
            load_plugins(bad)


def test_a_plugin_whose_own_import_fails_says_so(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin_example.py").write_text("import not_installed_dependency_example\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError,
        match="importing 'broken_plugin_example' failed: No module named 'not_installed_dependency_example'",
    ):
        load_plugins(["broken_plugin_example"])


def test_two_lambdas_of_one_name_clash():
    register("advantage_scale", "lambda_example")(lambda r, c, eps: c)
    with pytest.raises(ValueError, match="already registered"):
        register("advantage_scale", "lambda_example")(lambda r, c, eps: 2 * c)


def test_an_estimator_of_the_wrong_shape_is_refused():
    register("advantage_scale", "flat_example")(lambda r, c, eps: c.flatten())
    with pytest.raises(ValueError, match="returned shape \\(4,\\) for rewards \\(2, 2\\)"):
        group_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), scale="flat_example")


def test_entry_points_are_loaded(monkeypatch):
    import nemo_rcgrpo.registry as registry

    class EntryPoint:
        name, value = "example", "rc_plugin_example"

        def load(self):
            return register("reward_token_sampler", "all_high_example")(
                lambda n, g, p, rng: [[True] * g for _ in range(n)]
            )

    monkeypatch.setattr(registry, "_entry_points", lambda: [EntryPoint()])
    try:
        assert load_plugins() == ["rc_plugin_example"] and "all_high_example" in names("reward_token_sampler")
        assert _cfg("rl.reward_token_sampling=all_high_example").rl.reward_token_sampling == "all_high_example"
    finally:
        table("reward_token_sampler").pop("all_high_example", None)
        registry._loaded.discard("entry_point:example")


def test_rcgrpo_plugins_lists_a_users_names():
    env = {"PYTHONPATH": f"{PLUGINS}:{Path(__file__).resolve().parents[2]}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "nemo_rcgrpo.cli", "plugins", "plugins=[rc_plugin_example]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = {l.split(" (")[0]: l for l in out.stdout.splitlines()}
    assert lines["advantage_baseline"].endswith("mean, leave_one_out, median_example")
    assert "zero_example" in lines["kl_estimator"]
    bad = subprocess.run(
        [sys.executable, "-m", "nemo_rcgrpo.cli", "plugins", "plugins=[nope_example]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nope_example" in bad.stderr


def test_stages_are_registered_entries_checked_where_they_are_made():
    from nemo_rcgrpo.stages import Stage, has_variance, stage_of

    assert [(n, stage_of(n).loop, stage_of(n).conditioned) for n in ("sft", "rctp", "grpo", "rcgrpo")] == [
        ("sft", "stage1", False),
        ("rctp", "stage1", True),
        ("grpo", "rl", False),
        ("rcgrpo", "rl", True),
    ]
    assert stage_of("rctp").data_file == "rctp.jsonl" and stage_of("dapo_filter").keep_group is has_variance
    assert has_variance([0.0, 1.0]) and not has_variance([1.0, 1.0, 1.0])
    for bad, message in (
        (dict(loop=""), "name a registered loop"),
        (dict(loop="stage1"), "names its data_file"),
        (dict(loop="stage1", data_file="x.jsonl", keep_group=has_variance), "no keep_group"),
        (dict(loop="rl", data_file="x.jsonl"), "RL task pointers"),
    ):
        with pytest.raises(ValueError, match=message):
            Stage(**bad)
    register("stage", "test_ppo_loop")(Stage("ppo"))  # a loop nobody registered: refused where the config is
    with pytest.raises(
        ConfigError,
        match=r"stage test_ppo_loop's loop='ppo': no loop of that name; registered: "
        r"\['stage1', 'rl'\]",
    ):
        _cfg("stage=test_ppo_loop")
    register("stage", "test_not_a_stage")(lambda: None)
    with pytest.raises(ValueError, match="not a Stage"):
        stage_of("test_not_a_stage")
    with pytest.raises(ValueError, match=r"stage='nope': no stage of that name; registered: \['sft', 'rctp'"):
        stage_of("nope")
    register("stage", "test_rl")(Stage("rl", conditioned=True))
    cfg = TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["stage=test_rl"]))
    assert cfg.is_rl and cfg.stage_spec.conditioned
    with pytest.raises(ConfigError, match="conditions on reward tokens"):
        TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["stage=test_rl", "model.reward_tokens=none"]))
    with pytest.raises(ConfigError, match=r"stage='nope': no stage of that name; registered: \['sft', 'rctp', 'grpo'"):
        TrainConfig.from_dict(compose("rcgrpo_smollm_cpu", ["stage=nope"]))


def test_a_policy_backend_is_a_registered_entry_behind_the_policy_seam():
    """policy.backend names a registered factory; make_policy builds it and the loops' helpers use only the
    `Policy` methods (no backend is told apart by its attributes); a wrong name lists the registered ones."""
    from nemo_rcgrpo.models import factory
    from nemo_rcgrpo.models.hf import load_model
    from nemo_rcgrpo.models.interfaces import Policy
    from nemo_rcgrpo.models.torch_policy import TorchPolicy
    from nemo_rcgrpo.utils.dist import DistInfo

    built = []

    @register("policy_backend", "mine")
    def mine(build, model, dist, total_steps):
        policy = TorchPolicy(model, build.trainer, dist, total_steps)
        built.append(policy)
        return policy

    cfg = TrainConfig.from_dict(compose("smoke_stage1", ["policy.backend=mine"]))
    torch.manual_seed(0)
    model = load_model("tiny-llama")
    dist = DistInfo(0, 1, 0, torch.device("cpu"))
    with pytest.raises(TypeError, match="make_policy takes a PolicyBuild, not TrainConfig"):
        factory.make_policy(cfg, model, dist, total_steps=3)  # the factory is given its sections, not the run's
    policy = factory.make_policy(cfg.policy_build(), model, dist, total_steps=3)
    assert built == [policy] and isinstance(policy, Policy)
    view, dp_sum = policy.data_parallel()
    assert view == dist and dp_sum(2.0) == 2.0
    assert policy.sync_hf_model() is model
    ids = torch.randint(0, 100, (2, 6))
    batch = MicroBatch(ids, torch.ones_like(ids), torch.ones_like(ids))
    assert torch.allclose(policy.frozen_reference()(batch), policy.logprobs(batch))
    with pytest.raises(
        ConfigError,
        match=r"policy.backend='nope': no policy_backend of that name; registered: \['torch', 'megatron', 'mine'\]",
    ):
        TrainConfig.from_dict(compose("smoke_stage1", ["policy.backend=nope"]))


def test_a_chat_format_is_a_registered_entry_that_renders_parses_and_validates():
    """chat.format names a registered FormatSpec: a user's format (here ChatML with calls in <call> tags and its
    own parser) renders through ChatRenderer, the rollout engine parses with its parser, and a wrong name lists
    the registered ones."""
    import dataclasses

    from nemo_rcgrpo.data.chat_format import format_spec, render_text
    from nemo_rcgrpo.data.tokenize import ChatRenderer
    from nemo_rcgrpo.data.tool_parsers import ParsedMessage
    from nemo_rcgrpo.generation.base import SamplingParams
    from nemo_rcgrpo.rollout.multi_turn import RolloutEngine
    from nemo_rcgrpo.types import ToolCall
    from tests.unit.data.test_chat_format import CharTokenizer

    parsed = []

    def parse_call_tags(text, known_tools=None):
        parsed.append(text)
        name = text.split("<call>")[1].split("</call>")[0] if "<call>" in text else None
        return ParsedMessage("" if name else text, [ToolCall(name, {})] if name else [])

    hermes = format_spec("hermes")
    mine = register("chat_format", "test_calltags")(
        dataclasses.replace(hermes, parse=parse_call_tags, vllm_tool_parser="calltags", tokenizer_template=False)
    )
    assert format_spec("test_calltags") is mine
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<call>ls</call>"}]
    assert render_text(messages, None, "test_calltags") == render_text(messages, None, "hermes")
    r = ChatRenderer(CharTokenizer(), "test_calltags")
    assert r.spec is mine and r.renderer == "project"
    engine = RolloutEngine(None, r, None, SamplingParams())
    assert engine.parse is parse_call_tags
    assert mine.parse("<call>ls</call>").calls == [ToolCall("ls", {})] and parsed
    cfg = TrainConfig.from_dict(compose("smoke_rl", ["chat.format=test_calltags"]))
    assert cfg.chat.format == "test_calltags"
    with pytest.raises(
        ConfigError,
        match=r"chat.format='nope': no chat_format of that name; registered: \['hermes', 'llama3_json', "
        r"'test_calltags'\]",
    ):
        TrainConfig.from_dict(compose("smoke_rl", ["chat.format=nope"]))
    register("chat_format", "test_not_a_format")(lambda: None)
    with pytest.raises(ValueError, match="not a FormatSpec"):
        format_spec("test_not_a_format")


def test_group_filters_are_registered_and_rl_group_filter_overrides_the_stage():
    """A stage's keep_group names a group filter; rl.group_filter replaces it for a run (grpo + has_variance is
    dapo_filter's rule); a wrong name lists the registered ones."""
    from nemo_rcgrpo.stages import has_variance, not_all_failed

    assert names("group_filter")[:2] == ("has_variance", "not_all_failed")
    assert not_all_failed([0.0, 1.0, 1.0]) and not_all_failed([1.0, 1.0]) and not not_all_failed([0.0, 0.0])
    assert _cfg().keep_group is None  # rcgrpo: every group
    assert _cfg("stage=dapo_filter").keep_group is has_variance
    assert _cfg("rl.group_filter=not_all_failed").keep_group is not_all_failed
    assert _cfg("stage=dapo_filter", "rl.group_filter=not_all_failed").keep_group is not_all_failed
    with pytest.raises(
        ConfigError,
        match=r"rl.group_filter='nope': no group_filter of that name; registered: \['has_variance', 'not_all_failed'",
    ):
        _cfg("rl.group_filter=nope")
    from nemo_rcgrpo.stages import Stage

    register("stage", "test_named_filter")(Stage("rl", keep_group="not_all_failed"))
    assert _cfg("stage=test_named_filter").keep_group is not_all_failed
    register("stage", "test_bad_filter")(Stage("rl", keep_group="nope"))
    with pytest.raises(ConfigError, match=r"stage test_bad_filter's keep_group='nope': no group_filter of that name"):
        _cfg("stage=test_bad_filter")


def test_the_shipped_generators_satisfy_the_generator_protocol():
    """generate, update_weights, close and version on every shipped generator (the loops call close() on
    whatever a factory returns); a factory whose object lacks close() is refused where it is made."""
    import dataclasses

    from nemo_rcgrpo.generation import make_generator
    from nemo_rcgrpo.generation.base import Generator
    from nemo_rcgrpo.generation.gated import GatedGenerator
    from nemo_rcgrpo.generation.vllm_generator import VLLMGenerator
    from nemo_rcgrpo.models.setup import load_tokenizer_and_model

    for backend in ("hf", "scripted"):
        setup = _cfg(f"generation={backend}", "model.path=tiny-llama").policy_setup()
        tokenizer, model = load_tokenizer_and_model(setup)
        gen = make_generator(setup, model, tokenizer)
        assert isinstance(gen, Generator) and gen.version == 0, backend
        gen.update_weights(iter(()), 3)
        assert gen.version == 3
        gen.close()
        # called from two threads (rollouts generated ahead): behind the gate's lock, unless it samples from the
        # policy's own module (the RL loop refuses that one in a line of its own)
        gated = make_generator(setup, model, tokenizer, gated=True)
        assert isinstance(gated, Generator)
        assert isinstance(gated, GatedGenerator) == (not gated.shares_policy_weights) == (backend == "scripted")
        gated.close()
    assert all(callable(getattr(VLLMGenerator, m, None)) for m in ("generate", "update_weights", "close"))

    class NoClose:
        version, shares_policy_weights = 0, False

        def generate(self, prompts, params):
            return []

        def update_weights(self, weights, version):
            self.version = version

    assert not isinstance(NoClose(), Generator)
    register("generator", "test_no_close")(lambda setup, model, tokenizer: NoClose())
    setup = _cfg("generation=scripted", "model.path=tiny-llama").policy_setup()
    setup = dataclasses.replace(setup, generation=dataclasses.replace(setup.generation, backend="test_no_close"))
    from nemo_rcgrpo.envs.contract import PluginContractError

    with pytest.raises(
        PluginContractError,
        match=r"^generator test_no_close: its factory .*<lambda> \(test_registry"
        r".py:\d+\) returned a .*NoClose \(test_registry.py:\d+\) without "
        r"close\(\): a generator has version and shares_policy_weights",
    ):
        make_generator(setup, None, None)


def test_a_plugin_that_raises_at_import_names_its_file_line_and_function(tmp_path, monkeypatch):
    (tmp_path / "raising_plugin_example.py").write_text("def build():\n    return {}['key']\n\n\nTABLE = build()\n")
    (tmp_path / "syntax_plugin_example.py").write_text("x = 1\ndef broken(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        load_plugins(["raising_plugin_example"])
    # the innermost frame in the plugin's own file: line 2, in build (not importlib's, not this package's)
    assert str(e.value).startswith("plugins: importing 'raising_plugin_example' failed: KeyError: 'key' (at ")
    assert str(e.value).endswith("raising_plugin_example.py:2 in build)") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"SyntaxError: .*syntax_plugin_example.py:2\)$"):
        load_plugins(["syntax_plugin_example"])
    # a task source or env factory that raises: one line with the plugin's function, file and line
    from nemo_rcgrpo.envs.contract import PluginContractError
    from nemo_rcgrpo.envs.sources import make_opener, make_suite

    def broken_source(categories):
        return {"tasks": 1}["task"]

    def broken_env(config, suite):
        raise RuntimeError("no store")

    register("task_source", "broken_source_example")(broken_source)
    register("env", "broken_env_example")(broken_env)
    try:
        with pytest.raises(PluginContractError) as e:
            make_suite("broken_source_example", ["base"])
        line = broken_source.__code__.co_firstlineno
        assert str(e.value).startswith(
            "task source broken_source_example: test_a_plugin_that_raises_at_import_names_its_file_line_and_function."
            f"<locals>.broken_source (test_registry.py:{line}) failed: KeyError: 'task' (at "
        )
        assert str(e.value).endswith(f"test_registry.py:{line + 1} in broken_source)")
        with pytest.raises(
            PluginContractError,
            match=r"^env broken_env_example: its factory .*broken_env "
            r"\(test_registry.py:\d+\) failed: RuntimeError: no store "
            r"\(at .*test_registry.py:\d+ in broken_env\)$",
        ):
            make_opener(type("EnvSection", (), {"name": "broken_env_example", "settings": None})(), None)
    finally:
        table("task_source").pop("broken_source_example", None)
        table("env").pop("broken_env_example", None)


def test_an_unknown_name_suggests_the_closest_registered_one():
    from nemo_rcgrpo.envs.sources import make_opener, make_suite

    with pytest.raises(
        ValueError,
        match=r"registered: \['mean', 'leave_one_out'\]; did you mean 'mean'\? \(a plugin's advantage_baseline needs plugins=\[its module\]\)$",
    ):
        lookup("advantage_baseline", "meen")
    with pytest.raises(
        ConfigError,
        match=r"rl.advantage.baseline='leave_one_ot': no advantage_baseline of that name; registered: \['mean', "
        r"'leave_one_out'\]; did you mean 'leave_one_out'\? \(",
    ):
        _cfg("rl.advantage.baseline=leave_one_ot")
    with pytest.raises(
        ConfigError,
        match=r"env.name='bfc': no env of that name; registered: \['bfcl'\]; did you mean 'bfcl'\? \(a plugin's env needs",
    ):
        _cfg("env.name=bfc")
    with pytest.raises(
        ConfigError,
        match=r"env.task_source='bfcl_mikro': no task_source of that name; registered: .*; did you mean 'bfcl_micro'",
    ):
        _cfg("env.task_source=bfcl_mikro")
    with pytest.raises(ConfigError, match=r"registered: \['bfcl', 'bfcl_micro'\]; did you mean 'bfcl_micro'\? "):
        make_suite("bfcl_mcro", ["base"])
    with pytest.raises(ConfigError, match=r"registered: \['bfcl'\]; did you mean 'bfcl'\? \(a plugin's env"):
        make_opener(type("EnvSection", (), {"name": "BFCL"})(), None)
    with pytest.raises(
        ConfigError,
        match=r"registered: \['sft', 'rctp', 'grpo', 'rcgrpo', 'dapo_filter'.*\] \(a plugin's stage needs plugins=\[its module\]\)$",
    ):
        _cfg("stage=zzz")  # nothing close: no suggestion


def test_a_task_sources_tasks_are_checked_once_at_load():
    from types import SimpleNamespace

    from nemo_rcgrpo.envs.contract import PluginContractError
    from nemo_rcgrpo.envs.sources import make_suite

    class Suite:
        def __init__(self, tasks):
            self.tasks = {t.id if isinstance(getattr(t, "id", None), str) else "k": t for t in tasks}

        def __getitem__(self, task_id):
            return self.tasks[task_id]

    good = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    cases = {  # task source -> (its tasks, the one line)
        "no_category_example": (
            [SimpleNamespace(id="t0", category="a"), SimpleNamespace(id="t1")],
            "task source no_category_example: task t1 has category None: give every task a non-empty string .category",
        ),
        "no_id_example": ([SimpleNamespace(category="a")], "task source no_id_example: task 'k' has id None"),
        "bare_tool_example": (
            [SimpleNamespace(id="t0", category="a", tools=[good, {"name": "sub"}])],
            "task source bare_tool_example: task t0: tools[1] is {'name': 'sub'}: a tool is an OpenAI function schema",
        ),
    }
    try:
        for name, (tasks, message) in cases.items():
            register("task_source", name)(lambda categories, tasks=tasks: Suite(tasks))
            with pytest.raises(PluginContractError) as e:
                make_suite(name, ["base"])
            assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
        register("task_source", "fine_example")(
            lambda categories: Suite([SimpleNamespace(id="t0", category="a", tools=[good])])
        )
        assert list(make_suite("fine_example", ["base"]).tasks) == ["t0"]
    finally:
        for name in [*cases, "fine_example"]:
            table("task_source").pop(name, None)
