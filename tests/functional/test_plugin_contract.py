"""Plugin parts that break their contract, injected into real `rcgrpo train` runs (plugins=[...] and a user's recipe
folder), `rcgrpo prepare-data` and `rcgrpo eval`: each stops at start with one located line on stderr, exit 2, no traceback. A part that misses its Protocol
names its kind and name, the file and line of its factory (or of its registration) and what is missing; a recipe or a
command line written before the env section moved into ``env.settings`` is told where each key went."""

import inspect
import sys
from pathlib import Path

import pytest

from nemo_rcgrpo.train import main

PLUGINS = Path(__file__).resolve().parents[1] / "data" / "plugins"
FAULTS = "contract_faults_example"


def _args(data_dir, run_dir, *extra):
    return [
        "--config-name=rcgrpo_smollm_cpu",
        "model.path=tiny-llama",
        "rl.stage1_recipe=null",
        f"data.dir={data_dir}",
        f"run_dir={run_dir}",
        "rl.group_size=2",
        "rl.tasks_per_step=1",
        "trainer.max_steps=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "generation=scripted",
        *extra,
    ]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == lines[0]
    return lines[0]


@pytest.fixture
def faults(monkeypatch):
    """The fault module's parts, unregistered again after the test."""
    import nemo_rcgrpo.registry as registry

    monkeypatch.syspath_prepend(str(PLUGINS))
    yield lambda: sys.modules[FAULTS]
    for kind, name in (
        ("generator", "no_flag_example"),
        ("env", "reset_only_example"),
        ("env_settings", "reset_only_example"),
        ("policy_backend", "no_export_example"),
        ("advantage_baseline", "not_callable_example"),
        ("stage", "dict_stage_example"),
        ("failure", "name_only_example"),
        ("eval_policy", "describe_only_example"),
    ):
        registry.table(kind).pop(name, None)
    registry._loaded.discard(FAULTS)
    sys.modules.pop(FAULTS, None)


def _at(obj) -> str:
    """``file.py:line`` where a function or class of the fault module is defined."""
    return f"{FAULTS}.py:{inspect.getsourcelines(obj)[1]}"


def _registered_at(text: str) -> str:
    lines = (PLUGINS / f"{FAULTS}.py").read_text().splitlines()
    return f"{FAULTS}.py:{next(i for i, line in enumerate(lines, 1) if line.startswith('register(') and text in line)}"


@pytest.mark.parametrize(
    "override, expected",
    [
        # the case: a generator written before the Protocol asked what it shares
        (
            "generation.backend=no_flag_example",
            lambda m: (
                f"error: generator no_flag_example: its factory no_flag ({_at(m.no_flag)}) returned a NoFlag "
                f"({_at(m.NoFlag)}) without shares_policy_weights: a generator has version and shares_policy_weights, and "
                "generate(), update_weights() and close() (the Generator Protocol, nemo_rcgrpo/generation/base.py)"
            ),
        ),
        (
            "env.name=reset_only_example",
            lambda m: (
                f"error: env reset_only_example: its factory reset_only ({_at(m.reset_only)}) returned a ResetOnly "
                f"({_at(m.ResetOnly)}) without open(): an env factory returns an opener whose open(task) returns (Env, "
                "opening messages) (the EnvOpener Protocol, nemo_rcgrpo/envs/interfaces.py)"
            ),
        ),
        (
            "policy.backend=no_export_example",
            lambda m: (
                f"error: policy_backend no_export_example: its factory no_export ({_at(m.no_export)}) returned a HalfPolicy "
                f"({_at(m.HalfPolicy)}) without device, fuses_old_logprobs, share_prefix, packs, distributed_rl, "
                "export_is_collective, sharded_checkpoints, skips_nonfinite_updates, layout(), data_parallel(), "
                "sync_hf_model(), frozen_reference(), "
                "export_meta(), export_weights(), state_dict(), load_state_dict(), save_sharded(): a policy declares the "
                "capabilities the loops ask of it"
            ),
        ),
        (
            "rl.advantage.baseline=not_callable_example",
            lambda m: (
                "error: advantage_baseline 'not_callable_example' (registered at "
                f"{_registered_at('not_callable_example')}) is 0.5, which cannot be called: register a fn(rewards [N, G] "
                "float64) -> centred rewards [N, G]"
            ),
        ),
        (
            "stage=dict_stage_example",
            lambda m: (
                f"error: stage 'dict_stage_example' (registered at {_registered_at('dict_stage_example')}) is a dict, not a "
                "Stage: register a Stage(...) (nemo_rcgrpo.stages)"
            ),
        ),
    ],
    ids=["generator", "env", "policy_backend", "advantage_baseline", "stage"],
)
def test_a_part_that_misses_its_protocol_stops_the_run_at_start_in_one_located_line(
    data_dir, tmp_path, capsys, faults, override, expected
):
    capsys.readouterr()
    assert main(_args(data_dir, tmp_path / "run", f"plugins=[{FAULTS}]", override)) == 2
    line = _one_error_line(capsys)
    assert line.startswith(expected(faults())), line
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before any step


def test_prepare_data_refuses_a_part_that_cannot_be_called_in_one_located_line(tmp_path, capsys, faults, monkeypatch):
    from nemo_rcgrpo.cli import main as cli

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # prepare-data re-executes itself without it
    capsys.readouterr()
    out = tmp_path / "data"
    assert (
        cli(
            [
                "prepare-data",
                f"plugins=[{FAULTS}]",
                "+failures.types.name_only_example=1.0",
                f"out_dir={out}",
                "categories=[base]",
                "tokenizer=null",
                "progress=false",
            ]
        )
        == 2
    )
    assert _one_error_line(capsys) == (
        f"error: failure 'name_only_example' (registered at {_registered_at('name_only_example')}) is 'wrong_tool', "
        "which cannot be called: register a fn(task, plan, rng) -> (perturbed plan, description) or None"
    )
    assert not out.exists()


def test_rcgrpo_eval_refuses_a_policy_that_misses_what_evaluation_calls_in_one_located_line(tmp_path, capsys, faults):
    """An ``eval_policy`` whose part lacks ``description`` and ``close()`` (which `evaluate` reads for its first line
    and results.json, and calls after the episodes) stops before any episode in one line, not with an
    AttributeError's traceback."""
    from nemo_rcgrpo.evaluation.run import main as eval_main

    capsys.readouterr()
    out = tmp_path / "eval"
    assert (
        eval_main(
            [
                f"plugins=[{FAULTS}]",
                "policy=describe_only_example",
                "protocol=bfcl",
                "limit=1",
                f"out_dir={out}",
                "progress=false",
            ]
        )
        == 2
    )
    m = faults()
    assert _one_error_line(capsys) == (
        f"error: eval_policy describe_only_example: its factory describe_only ({_at(m.describe_only)}) returned a "
        f"DescribeOnly ({_at(m.DescribeOnly)}) without description, close(): an eval policy has description, and "
        "run() and close() (the EvalPolicy Protocol, nemo_rcgrpo/evaluation/policies.py)"
    )
    assert not (out / "trajectories.jsonl").exists() and not (out / "results.json").exists()


def test_a_recipe_or_command_line_with_the_old_env_keys_is_told_where_they_went(data_dir, tmp_path, capsys):
    """``env.max_steps`` and ``env.mode`` moved into ``env.settings`` (each env's own section): a user's recipe that
    still gives them, and a command line that does, get one line naming the new keys."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "old_env_keys_example.yaml").write_text(
        "defaults:\n  - rcgrpo_smollm_cpu\n  - _self_\nenv:\n  max_steps: 4\n  mode: per_turn\n"
    )
    capsys.readouterr()
    args = _args(data_dir, tmp_path / "run")[1:]  # the user's recipe instead of the shipped one
    assert main(["--config-dir", str(recipes), "--config-name", "old_env_keys_example", *args]) == 2
    assert _one_error_line(capsys) == (
        "error: unknown setting env.max_steps: it moved to env.settings.max_steps (each env has a settings section "
        "of its own; in a recipe: env: {settings: {max_steps: ...}}) (moved too: ['env.mode'])"
    )
    for override in ("env.max_steps=5", "+env.max_steps=5"):  # an override of a key the schema no longer has
        assert main(_args(data_dir, tmp_path / "run", override)) == 2
        assert _one_error_line(capsys).startswith(
            "error: unknown setting env.max_steps: it moved to env.settings.max_steps ("
        )
    assert main(_args(data_dir, tmp_path / "run", "env.settings.max_steps=5", "--cfg", "job")) == 0  # the new key
    assert not (tmp_path / "run").exists()
