"""The loops ask a part what it can do, never which one it is: no branch on a backend's name, no attribute probe of a
policy, generator or weight sync, no raw registry table, no dispatch on an eval policy's or a loop's name. Each rule
is a pattern over the package's source; the exemptions say why they stay (config validation of a backend's own
section, until each component validates its own)."""

import re
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "nemo_rcgrpo"

# (what it is, pattern, files where it may stay)
RULES = [
    # config.py included: a backend validates its own section (its factory's check, model_parallel, server_gpus)
    (
        "a branch on a backend's name (ask the Policy / Generator for its capability)",
        r"\b(generation|policy)\.backend\s*(==|!=|\bin\b|\bnot in\b)",
        set(),
    ),
    (
        "an attribute probe of a policy, generator or weight sync (declare it on the Protocol)",
        r"\b(getattr|hasattr)\(\s*(self\.)?(policy|generator|sync|env_config)\s*,\s*[\"']",
        # generation/base.py: the Protocol's optional capability (places_groups) read in one place, with its default
        {"base.py"},
    ),
    ("a raw registry table (registry.lookup / names / table)", r"\b_TABLES\b", {"registry.py"}),
    # evaluation/config.py validates each shipped policy's own section (checkpoint.path, endpoint.*) by its name;
    # BFCL's official pipeline plays each shipped policy its own way (OfficialPipeline.policy(name, ...))
    (
        "a dispatch on the eval policy's name (kind eval_policy)",
        r"\b(cfg|self)\.policy\s*(==|!=)",
        {"config.py", "leaderboard.py"},
    ),
    # stages.py: a Stage's shape rules for the two shipped loops (a stage-1 stage names its data file)
    ("a dispatch on a stage's loop name (kind loop: ask Loop.rl)", r"\.loop\s*(==|!=)\s*[\"']rl", {"stages.py"}),
    (
        "a branch on an environment's or task source's name (ask the registry or the suite)",
        r"\b(env|env\.name|task_source|env_name)\s*(==|!=)\s*[\"']",
        set(),
    ),
]


def _hits(pattern: str, allowed: set[str], root: Path = PACKAGE) -> list[str]:
    regex = re.compile(pattern)
    return [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.name not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if regex.search(line)
    ]


@pytest.mark.parametrize("what,pattern,allowed", RULES, ids=[r[0].split(" (")[0] for r in RULES])
def test_the_package_has_none(what, pattern, allowed):
    hits = _hits(pattern, allowed)
    assert not hits, f"{what}:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "line,rule",
    [
        ('fused = self.updates == 1 and self.cfg.policy.backend == "torch"', 0),
        ('if cfg.generation.backend != "hf":', 0),
        ('flag = torch.tensor([1], device=getattr(policy, "device", None) or "cpu")', 1),
        ('if self.sync is not None and hasattr(self.sync, "close"):', 1),
        ('GENERATORS = _TABLES["generator"]', 2),
        ('if cfg.policy == "oracle":', 3),
        ('return stage_of(str(stage)).loop == "rl"', 4),
        ('if cfg.task_source == "bfcl":', 5),
        ('ok = isinstance(s, BFCLSettings) or cfg.env.name != "bfcl"', 5),
    ],
)
def test_each_rule_catches_what_it_is_for(tmp_path, line, rule):
    """The branches and probes this package had, planted in a module: each rule finds its own."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "planted.py").write_text(f"def f(self, cfg, policy):\n    {line}\n")
    _, pattern, allowed = RULES[rule]
    assert _hits(pattern, allowed, tmp_path / "pkg") == [f"pkg/planted.py:2: {line}"]


def test_a_policy_declares_what_the_loops_ask_of_it():
    from nemo_rcgrpo.config_schema import TrainerConfig
    from nemo_rcgrpo.models.interfaces import Policy
    from nemo_rcgrpo.models.megatron.policy import MegatronPolicy
    from nemo_rcgrpo.models.torch_policy import TorchPolicy
    from nemo_rcgrpo.utils.dist import DistInfo

    model = torch.nn.Linear(3, 3)
    policy = TorchPolicy(model, TrainerConfig(), DistInfo(), total_steps=1)
    assert isinstance(policy, Policy)
    assert policy.module is model and policy.device == torch.device("cpu")
    assert policy.fuses_old_logprobs and not policy.distributed_rl
    assert not MegatronPolicy.fuses_old_logprobs and MegatronPolicy.distributed_rl


class _SyncedPolicy:
    """What sync_generator reads of a policy: the HF module made current, or the weights exported."""

    export_is_collective, device = False, torch.device("cpu")

    def __init__(self):
        self.synced, self.exported = 0, 0

    def sync_hf_model(self):
        self.synced += 1

    def export_meta(self):
        return [("w", (2,), torch.float32)]

    def export_weights(self):
        self.exported += 1
        yield "w", torch.ones(2)


def test_a_generator_that_shares_the_policys_weights_is_told_the_version_only():
    from nemo_rcgrpo.generation.hf_local import HFGenerator
    from nemo_rcgrpo.generation.scripted import ScriptedGenerator
    from nemo_rcgrpo.models.factory import sync_generator

    shared, policy = HFGenerator(torch.nn.Linear(2, 2), 0), _SyncedPolicy()
    weight = shared.model.weight.detach().clone()
    assert shared.shares_policy_weights and not ScriptedGenerator.shares_policy_weights
    sync_generator(policy, shared, shared.shares_policy_weights, 5)
    assert shared.version == 5 and policy.synced == 1 and policy.exported == 0
    assert torch.equal(shared.model.weight, weight)  # nothing was loaded into it

    class Receiver:  # a generator with its own copy: the weights are streamed to it
        shares_policy_weights, version = False, 0

        def update_weights(self, weights, version):
            self.got, self.version = dict(weights), version

    receiver, policy = Receiver(), _SyncedPolicy()
    sync_generator(policy, receiver, receiver.shares_policy_weights, 6)
    assert receiver.version == 6 and policy.synced == 0 and torch.equal(receiver.got["w"], torch.ones(2))


class _Client:
    """The server calls a folder sync makes; ``fail`` makes the reload fail on the server."""

    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def collective_rpc(self, method, kwargs, timeout):
        from nemo_rcgrpo.generation.vllm_client import GeneratorError

        self.calls.append(method)
        if self.fail:
            raise GeneratorError("reload failed")


def test_a_weight_sync_owns_the_version_set_once_a_push_finished(tmp_path):
    from nemo_rcgrpo.generation.base import WeightSync
    from nemo_rcgrpo.generation.vllm_sync import FolderSync, WeightSyncError
    from nemo_rcgrpo.generation.weight_transfer import CollectiveSync

    folder = tmp_path / "v3"
    folder.mkdir()
    sync = FolderSync(_Client(), tmp_path, 10.0, version=2)
    assert isinstance(sync, WeightSync) and sync.version == 2
    sync.push(folder, 3)
    assert sync.version == 3 and sync.client.calls == ["pause", "reload_weights", "resume"]
    failing = FolderSync(_Client(fail=True), tmp_path, 10.0, version=3)
    with pytest.raises(WeightSyncError):
        failing.push(folder, 4)
    assert failing.version == 3  # the server still holds version 3
    collective = CollectiveSync(_Client(), None, 10.0, sync, backend="gloo")
    assert isinstance(collective, WeightSync) and collective.version == 3
    collective.push(folder, 4)  # a folder goes the folder way; the version is the collective sync's too
    assert collective.version == 4 and sync.version == 4


def test_a_vllm_generators_version_is_its_syncs_and_survives_close(tmp_path):
    from types import SimpleNamespace

    from nemo_rcgrpo.config_schema import VLLMConfig
    from nemo_rcgrpo.generation.vllm_generator import VLLMGenerator

    gen = VLLMGenerator(VLLMConfig(), model=None, tokenizer=None, weight_dir=tmp_path, dtype="float32")
    assert gen.version == 0 and not gen.shares_policy_weights  # before a server: nothing served yet
    closed = []
    gen.sync = SimpleNamespace(version=7, close=lambda: closed.append(True))
    assert gen.version == 7  # the sync's, not a copy the generator keeps
    gen.close()
    assert closed == [True] and gen.sync is None and gen.version == 7


def test_a_plugin_generator_without_a_declared_capability_is_refused_naming_it():
    import dataclasses

    from nemo_rcgrpo import registry
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.generation import make_generator
    from nemo_rcgrpo.utils.config import compose

    class OldStyle:  # the four members of the Protocol before it asked what a generator shares
        version = 0

        def generate(self, prompts, params):
            return []

        def update_weights(self, weights, version):
            self.version = version

        def close(self):
            pass

    registry.register("generator", "test_old_style")(lambda setup, model, tokenizer: OldStyle())
    try:
        setup = TrainConfig.from_dict(compose("smoke_stage1", [])).policy_setup()
        setup = dataclasses.replace(setup, generation=dataclasses.replace(setup.generation, backend="test_old_style"))
        from nemo_rcgrpo.envs.contract import PluginContractError  # a ValueError: the CLI's one line, exit 2

        with pytest.raises(
            PluginContractError,
            match=r"^generator test_old_style: its factory .*<lambda> "
            r"\(test_seams.py:\d+\) returned a .*OldStyle \(test_seams.py:"
            r"\d+\) without shares_policy_weights: ",
        ):
            make_generator(setup, None, None)
    finally:
        registry.table("generator").pop("test_old_style", None)


def test_a_plugin_loop_says_whether_it_trains_from_rollouts():
    from nemo_rcgrpo import registry
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.stages import Loop, Stage
    from nemo_rcgrpo.utils.config import ConfigError, compose

    registry.register("loop", "test_rl_like")(Loop(lambda cfg, recipe=None: {}, rl=True))
    registry.register("stage", "test_rl_like")(Stage("test_rl_like"))
    try:
        assert TrainConfig.from_dict(compose("smoke_rl", ["stage=test_rl_like"])).is_rl
        assert not TrainConfig.from_dict(compose("smoke_stage1", [])).is_rl
        with pytest.raises(ConfigError, match=r"chat.format=\['hermes'\]: no chat_format of that name"):
            registry.lookup("chat_format", ["hermes"], setting="chat.format")  # a list for a name: one line
    finally:
        registry.table("stage").pop("test_rl_like", None)
        registry.table("loop").pop("test_rl_like", None)


RECIPE_FUNCTION_LINES = 40  # a recipe reads as the steps it takes; what a step does is a part of its own


def long_functions(folder: Path, limit: int = RECIPE_FUNCTION_LINES) -> list[str]:
    """``file:function (lines)`` of every function (docstring included) in ``folder`` longer than ``limit`` lines."""
    import ast

    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.name}:{node.name} ({lines} lines)")
    return found


def test_no_function_in_the_recipes_runs_past_40_lines(tmp_path):
    assert long_functions(PACKAGE / "recipes") == []
    body = "\n".join(f"    x{i} = {i}" for i in range(RECIPE_FUNCTION_LINES))  # with its def: one line too many
    (tmp_path / "long.py").write_text(f"def short():\n    pass\n\n\ndef run():\n{body}\n")
    assert long_functions(tmp_path) == [f"long.py:run ({RECIPE_FUNCTION_LINES + 1} lines)"]
