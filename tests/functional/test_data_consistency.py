"""Stage 2 renders its prompts as stage 1 was trained: the reward goal comes from the prepared data, a mismatch
of tokens or env settings stops the run at start with one line naming the setting."""

from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.train import main


def _rl(data_dir, run_dir, *extra):
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
        "trainer.export_hf=false",
        *extra,
    ]


def _error(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_changed_system_prompt_is_refused(data_dir, tmp_path, capsys):
    assert main(_rl(data_dir, tmp_path / "r", "env.settings.system_prompt='Be brief.'")) == 2
    err = _error(capsys)
    assert err.startswith("error: the RL prompt of multi_turn_base_") and "check env.settings.system_prompt" in err, err


def test_reward_tokens_other_than_the_data_s_are_refused(data_dir, tmp_path, capsys):
    assert main(_rl(data_dir, tmp_path / "r", "reward_tokens.high='<|good|>'")) == 2
    assert (
        "was prepared with reward_goal tokens <|high_reward|> / <|low_reward|> but the run's reward_tokens are "
        "<|good|> / <|low_reward|>" in _error(capsys)
    )
    stage1 = [
        "--config-name=rctp_smollm_cpu",
        "model.path=tiny-llama",
        f"data.dir={data_dir}",
        f"run_dir={tmp_path / 's1'}",
        "reward_tokens.low='<|bad|>'",
        "logging.progress=false",
    ]
    assert main(stage1) == 2 and "reward_tokens are <|high_reward|> / <|bad|>" in _error(capsys)


def test_the_data_s_reward_goal_is_used(tmp_path):
    """Data prepared with another goal template and position: the RL engine uses it (and the prefix check, which
    compares ids with the data's own rendering, passes)."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.prepare_data import PrepareDataConfig, run
    from nemo_rcgrpo.recipes.rl import RLTrainer
    from nemo_rcgrpo.utils.config import compose, split_argv
    from nemo_rcgrpo.utils.dist import init_distributed

    data = tmp_path / "data"
    goal = RewardGoal(template="<<goal {token}>>", position="prefix", separator="\n")
    run(PrepareDataConfig(out_dir=str(data), categories=("base",), tokenizer=None, progress=False, reward_goal=goal))
    name, overrides = split_argv(_rl(data, tmp_path / "r"), "")
    trainer = RLTrainer.from_config(TrainConfig.from_dict(compose(name, overrides)), init_distributed())
    assert trainer.engine.reward_goal == goal and trainer.record["reward_goal"]["template"] == "<<goal {token}>>"
    ids = trainer.engine.prompt_ids(trainer.suite[trainer.task_ids[0]], True)
    text = trainer.tokenizer.decode(ids)
    assert "<<goal <|high_reward|>>>\nStep 1:" in text  # prefix position, the data's separator


def test_a_reward_goal_changed_after_preparation_is_refused(data_dir, tmp_path, capsys):
    """The data's lines were rendered with one goal template, its config.yaml now names another: the RL prompt is
    no longer a prefix of the stage-1 rendering."""
    import shutil

    import yaml

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    settings = yaml.safe_load((data / "config.yaml").read_text())
    settings["reward_goal"]["template"] = "(goal: {token})"
    (data / "config.yaml").write_text(yaml.safe_dump(settings))
    assert main(_rl(data, tmp_path / "r")) == 2
    err = _error(capsys)
    assert "is not a prefix of its stage-1 rendering" in err and "check the reward goal or the env's rendering" in err


def test_rows_that_carry_only_reward_pass_the_prefix_check(tmp_path):
    """A user's RCTP rows with only ``reward: 1`` / ``reward: 0`` (no goal in the text, no ``reward_goal``): stage 1
    templates the goal (the ``rctp`` dataset); stage 2's prefix check renders the row through the same function, so
    the RL prompt with the high token is a prefix of it."""
    import json
    from types import SimpleNamespace

    from nemo_rcgrpo.data.consistency import check_prompt_prefix
    from nemo_rcgrpo.data.stage1_datasets import stage1_dataset
    from nemo_rcgrpo.data.tokenize import ChatRenderer
    from nemo_rcgrpo.generation.base import SamplingParams
    from nemo_rcgrpo.models.hf import load_tokenizer
    from nemo_rcgrpo.rollout.multi_turn import RolloutEngine

    tools = [{"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {}}}}]
    opening = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Store blue."}]

    class Opener:
        def open(self, task):
            return SimpleNamespace(tools=tools, done=False, truncated=None), [dict(m) for m in opening]

    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    renderer = ChatRenderer(tok, "hermes", tool_description="compact")
    engine = RolloutEngine(None, renderer, Opener(), SamplingParams(), name="toy")
    answer = {"role": "assistant", "content": "Done."}
    rows = [
        {"task_id": "t0", "messages": opening + [answer], "tools": tools, "reward": 0},
        {"task_id": "t0", "messages": opening + [answer], "tools": tools, "reward": 1},
    ]
    (tmp_path / "rctp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    suite = {"t0": SimpleNamespace(id="t0", category="c")}
    env = SimpleNamespace(name="toy", settings=SimpleNamespace(mode="merged"))  # not BFCL's: its mode is its own
    assert check_prompt_prefix(engine, renderer, suite, tmp_path, ["t0"], env, conditioned=True) == "t0"
    # what stage 1 trained on: the rctp dataset's rendering of the reward-1 row, with the high goal
    prepared = stage1_dataset("rctp").prepare(rows[1], engine.reward_goal)
    assert prepared["messages"][1]["content"] == "Store blue. [Reward Goal: <|high_reward|>]"
    prompt = engine.prompt_ids(suite["t0"], True)
    assert renderer.render(prepared["messages"], tools).ids[: len(prompt)] == prompt
