"""Every shipped recipe composes with Hydra and passes validation."""

import pytest

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.prepare_data import PrepareDataConfig
from nemo_rcgrpo.utils.cli_help import recipes
from nemo_rcgrpo.utils.config import ConfigError, compose, conf_dir

# every recipe `rcgrpo train --help` lists (all of conf/ built on stage1_defaults, bases left out)
TRAIN_RECIPES = [name for name, _ in recipes("stage1_defaults")]


def test_recipes_are_found():
    assert {
        "sft_smollm_cpu",
        "rctp_smollm_cpu",
        "sft_qwen7b",
        "sft_llama8b",
        "rctp_qwen7b",
        "rctp_llama8b",
        "rcgrpo_smollm_cpu",
        "rcgrpo_qwen7b",
        "rcgrpo_llama8b",
        "grpo_qwen7b",
        "grpo_llama8b",
    } <= set(TRAIN_RECIPES)
    assert len([n for n in TRAIN_RECIPES if n.startswith("ablation_")]) == 8
    assert {"smoke_stage1", "smoke_rl"} <= set(TRAIN_RECIPES)
    assert not {"stage1_defaults", "rl_defaults", "rl_gpu_defaults", "eval", "prepare_data"} & set(TRAIN_RECIPES)
    # everything in conf/ is a train recipe, a base, or belongs to eval / prepare-data
    others = {n for n, _ in recipes("eval")} | {"eval", "prepare_data"}
    assert {p.stem for p in conf_dir().glob("*.yaml")} - set(TRAIN_RECIPES) - others == {
        "stage1_defaults",
        "rl_defaults",
        "rl_gpu_defaults",
        "paper_rl_defaults",
        "paper_stage1_defaults",
    }


@pytest.mark.parametrize("name", TRAIN_RECIPES)
def test_train_recipe_validates(name, monkeypatch):
    monkeypatch.setenv("RCGRPO_QWEN7B_PATH", "/models/qwen")
    cfg = TrainConfig.from_dict(compose(name))
    if name.startswith("ablation_"):
        _, init, algo, _ = name.split("_")
        assert cfg.stage == algo and cfg.model.path.endswith(f"{init}_{name.rsplit('_', 1)[1]}/hf")
        assert cfg.rl.tasks_per_step == (256 if algo == "rcgrpo" else 64)
        assert (cfg.trainer.lr, cfg.rl.group_size, cfg.rl.loss.kl_beta, cfg.rl.loss.clip_low) == (1e-6, 5, 0.1, 0.2)
        return
    if name.startswith("smoke_"):  # the README's first run: a tiny random model, seconds per step
        assert cfg.model.path == "tiny-llama" or cfg.rl.stage1_recipe == "smoke_stage1"
        return
    if name.startswith("micro_"):  # the bfcl_micro experiment (docs/experiments.md): its own tasks and data
        assert cfg.stage == name.split("_")[1] and cfg.env.task_source == "bfcl_micro"
        assert cfg.data.dir == "data/bfcl_micro" and cfg.chat.tool_description == "compact"
        return
    assert cfg.stage == name.split("_")[0]
    if cfg.stage in ("grpo", "rcgrpo"):
        assert cfg.env.settings.mode == "merged" and cfg.rl.group_size == 5
        return
    if name.endswith(("qwen7b", "llama8b")):  # Appendix E
        assert (cfg.trainer.lr, cfg.trainer.global_batch_size, cfg.model.dtype) == (1e-5, 16, "bfloat16")
        assert cfg.trainer.epochs == (2 if cfg.stage == "sft" else 5)
        assert cfg.chat.format == ("llama3_json" if "llama" in name else "hermes")
    if name == "sft_qwen7b":
        assert cfg.model.path == "/models/qwen"  # from the environment variable


@pytest.mark.parametrize("model", ["llama8b", "qwen7b"])
def test_the_paper_recipes_are_composed_from_groups(model):
    """Every cell of the 2x2 ablation is the method's recipe with other init / algorithm groups, and the other model
    is one group away: the recipes are composed, not copied (conf/model, conf/init, conf/algorithm)."""
    other = "qwen7b" if model == "llama8b" else "llama8b"
    for init in ("sft", "rctp"):
        for algo in ("grpo", "rcgrpo"):
            cell = compose(f"ablation_{init}_{algo}_{model}")
            assert (
                compose(
                    f"rcgrpo_{model}",
                    [f"init={init}", f"algorithm={algo}", f"run_dir=runs/ablation_{init}_{algo}_{model}"],
                )
                == cell
            )
            assert (
                compose(
                    f"rcgrpo_{other}",
                    [
                        f"model={model}",
                        f"init={init}",
                        f"algorithm={algo}",
                        f"run_dir=runs/ablation_{init}_{algo}_{model}",
                    ],
                )
                == cell
            )
            assert (
                cell["model"]["path"] == f"runs/{init}_{model}/hf" and cell["rl"]["stage1_recipe"] == f"{init}_{model}"
            )
    assert compose(f"grpo_{model}", [f"run_dir=runs/ablation_sft_grpo_{model}"]) == compose(
        f"ablation_sft_grpo_{model}"
    )
    assert compose(f"sft_{model}", ["stage=rctp", f"run_dir=runs/rctp_{model}", "trainer.epochs=5"]) == compose(
        f"rctp_{model}"
    )


def test_prepare_data_config_validates():
    import dataclasses

    from nemo_rcgrpo.envs.sources import source_categories

    # the defaults, with categories (empty: every one the task source declares) resolved to BFCL's four
    assert PrepareDataConfig.from_dict(compose("prepare_data")) == dataclasses.replace(
        PrepareDataConfig(), categories=source_categories("bfcl")
    )


def test_unknown_config_name():
    with pytest.raises(ConfigError, match="no config named 'sft_gpt5'"):
        compose("sft_gpt5")


GPU_RECIPES = [n for n in TRAIN_RECIPES if n.endswith(("qwen7b", "llama8b"))]


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_layouts_add_up(name):
    cfg = TrainConfig.from_dict(compose(name))
    plan = cfg.parallel_plan()  # what the launchers use (raises when TP x PP x CP does not divide the GPUs)
    assert plan.tp * plan.pp * plan.cp * plan.dp == plan.world_size
    assert plan.world_size == plan.train_nodes * plan.train_gpus_per_node
    assert cfg.policy.backend == "megatron" and cfg.model.dtype == "bfloat16"
    if cfg.stage in ("sft", "rctp"):  # stage 1 uses every GPU of the node
        assert plan.world_size == 8 and plan.generation_gpus == 0
    else:  # stage 2: the vLLM server's GPUs fit beside the trainers and hold whole TP groups
        assert cfg.generation.backend == "vllm" and cfg.rl.stage1_recipe
        assert plan.generation_gpus % plan.generation_tp == 0
        assert plan.train_gpus_per_node + plan.generation_gpus == plan.gpus_per_node == 8
        assert TrainConfig.from_dict(compose(cfg.rl.stage1_recipe)).stage in ("sft", "rctp")


def _stated(yaml_section, defaults, prefix=""):
    """(key, stated value, schema default) for every value a YAML file states, nested sections walked."""
    for key, value in yaml_section.items():
        if key == "defaults":
            continue
        default = defaults.get(key, "<not a field>") if isinstance(defaults, dict) else "<not a field>"
        if isinstance(value, dict) and isinstance(default, dict) and value:
            yield from _stated(value, default, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value, list(default) if isinstance(default, tuple) else default


# (file, the schema node its recipes build on, the key prefix of a group member's keys)
BASES = [
    ("stage1_defaults.yaml", "train_schema", ""),
    ("rl_defaults.yaml", "train_schema", ""),
    ("generation/hf.yaml", "train_schema", "generation"),
    ("generation/scripted.yaml", "train_schema", "generation"),
    ("generation/vllm.yaml", "train_schema", "generation"),
    ("eval.yaml", "eval_schema", ""),
    ("prepare_data.yaml", "prepare_data_schema", ""),
]


@pytest.mark.parametrize("name,node,prefix", BASES, ids=[b[0] for b in BASES])
def test_the_base_files_state_only_what_they_change(name, node, prefix):
    """The schema dataclasses state every default once (their node in the config store: train_schema, ...); the base
    files of conf/ state only what they change, so no value there equals the schema's (rl_defaults.yaml sits on
    stage1_defaults.yaml, which changes only run_dir), and every key they state is one of the schema's."""
    import yaml

    from nemo_rcgrpo.utils.config import SCHEMAS, schema_defaults

    stated = yaml.safe_load((conf_dir() / name).read_text()) or {}
    schema = schema_defaults(SCHEMAS[node])
    for part in filter(None, prefix.split(".")):
        schema = schema[part]
    rows = list(_stated(stated, schema))
    unknown = [k for k, _, d in rows if d == "<not a field>"]
    assert not unknown, f"{name} states keys the schema does not have: {unknown}"
    restated = [(k, v) for k, v, d in rows if v == d]
    assert not restated, f"{name} restates schema defaults (state only what it changes): {restated}"
    if not prefix and name != "rl_defaults.yaml":  # a root: it builds on the schema's node
        assert stated["defaults"][0] == node


def test_the_help_prints_every_default_the_schema_has():
    """--help's defaults are the schema's, every one of them (env.settings: the default env's), with the meaning
    written beside the field; --cfg job prints the same keys."""
    from nemo_rcgrpo.utils.cli_help import field_comments, help_text, schema_settings
    from nemo_rcgrpo.utils.run_dir import flat_config

    rows = schema_settings(TrainConfig)
    assert [k for k, _, _ in rows] == list(flat_config(TrainConfig().to_dict()))
    assert "env.settings.mode" in dict((k, v) for k, v, _ in rows)
    text = help_text("train")
    for key, value, meaning in rows:
        line = next((l for l in text.splitlines() if l.strip().startswith(f"{key}=")), None)
        assert line is not None and (not meaning or meaning in line), (key, line)
    from nemo_rcgrpo.config_schema import RLConfig

    assert field_comments(RLConfig)["group_size"] == "G rollouts per task"
    assert field_comments(RLConfig)["tasks_per_step"].startswith("groups per RL step")
    # a section heading (# -- which tasks --) is no field's meaning
    from nemo_rcgrpo.evaluation.config import EvalConfig

    eval_comments = field_comments(EvalConfig)
    assert eval_comments["data_dir"].startswith("paper: the split.json") and eval_comments["checkpoint"] == ""
    assert eval_comments["reward_token"].startswith("checkpoint and endpoint: auto")


def test_the_hardware_group_composes_and_a_users_machine_is_a_file(tmp_path, monkeypatch):
    """The GPU layout is a group (conf/hardware): another one is an override, a user's machine is a file in their
    own recipe folder, and an unknown one is one line listing the options."""
    import nemo_rcgrpo.utils.config as config_utils

    method = compose("rcgrpo_llama8b")
    assert (method["generation"]["backend"], method["layout"]["generation_gpus"]) == ("vllm", 2)
    stage1_layout = compose("rcgrpo_llama8b", ["hardware=h200x8"])
    assert stage1_layout["policy"]["megatron"]["tp"] == 2 and stage1_layout["trainer"] == method["trainer"]
    mine = tmp_path / "recipes"
    (mine / "hardware").mkdir(parents=True)
    (mine / "hardware" / "a100x4.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /generation: vllm\n"
        "policy: {backend: megatron, megatron: {tp: 1}}\n"
        "layout: {nodes: 1, gpus_per_node: 4, generation: separate, generation_gpus: 1}\n"
    )
    monkeypatch.setattr(config_utils, "_USER_DIRS", [])
    config_utils.add_config_dir(mine)
    cfg = TrainConfig.from_dict(compose("rcgrpo_llama8b", ["hardware=a100x4"]))
    assert (cfg.policy.megatron.tp, cfg.layout.gpus_per_node, cfg.generation.backend) == (1, 4, "vllm")
    with pytest.raises(ConfigError) as e:
        compose("rcgrpo_llama8b", ["hardware=nope"])
    msg = str(e.value)
    assert "\n" not in msg and "Available options in 'hardware'" in msg and "h200x8_vllm" in msg
    assert "a100x4" in msg and "Config search path" not in msg


def test_hydra_hints_survive_on_one_line():
    """A group a recipe does not list: Hydra's '+model=' hint is kept, on the one line."""
    with pytest.raises(ConfigError) as e:
        compose("rcgrpo_smollm_cpu", ["model=llama8b"])
    assert "\n" not in str(e.value) and "+model=llama8b" in str(e.value)
