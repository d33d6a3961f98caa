"""Stage 2 renders its prompts as stage 1 was trained: the reward goal comes from the prepared data, a mismatch
of tokens or env settings stops the run at start with one line naming the setting."""


from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.train import main


def _rl(data_dir, run_dir, *extra):
    return ["--config-name=rcgrpo_smollm_cpu", "model.path=tiny-llama", "rl.stage1_recipe=null",
            f"data.dir={data_dir}", f"run_dir={run_dir}", "rl.group_size=2", "rl.tasks_per_step=1",
            "trainer.max_steps=1", "logging.progress=false", "logging.tensorboard=false", "generation=scripted",
            "trainer.export_hf=false", *extra]


def _error(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_changed_system_prompt_is_refused(data_dir, tmp_path, capsys):
    assert main(_rl(data_dir, tmp_path / "r", "+env.system_prompt='Be brief.'")) == 2
    err = _error(capsys)
    assert err.startswith("error: the RL prompt of multi_turn_base_") and "check env.system_prompt" in err, err


def test_reward_tokens_other_than_the_data_s_are_refused(data_dir, tmp_path, capsys):
    assert main(_rl(data_dir, tmp_path / "r", "reward_tokens.high='<|good|>'")) == 2
    assert "was prepared with reward_goal tokens <|high_reward|> / <|low_reward|> but the run's reward_tokens are " \
        "<|good|> / <|low_reward|>" in _error(capsys)
    stage1 = ["--config-name=rctp_smollm_cpu", "model.path=tiny-llama", f"data.dir={data_dir}",
              f"run_dir={tmp_path / 's1'}", "reward_tokens.low='<|bad|>'", "logging.progress=false"]
    assert main(stage1) == 2 and "reward_tokens are <|high_reward|> / <|bad|>" in _error(capsys)


def test_the_data_s_reward_goal_is_used(tmp_path):
    """Data prepared with another goal template and position: the RL engine uses it (and the prefix check, which
    compares ids with the data's own rendering, passes)."""
    from nemo_rcgrpo.algorithms.rcgrpo import RLTrainer
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.prepare_data import PrepareDataConfig, run
    from nemo_rcgrpo.utils.config import compose, split_argv
    from nemo_rcgrpo.utils.dist import init_distributed

    data = tmp_path / "data"
    goal = RewardGoal(template="<<goal {token}>>", position="prefix", separator="\n")
    run(PrepareDataConfig(out_dir=str(data), categories=("base",), tokenizer=None, progress=False, reward_goal=goal))
    name, overrides = split_argv(_rl(data, tmp_path / "r"), "")
    trainer = RLTrainer(TrainConfig.from_dict(compose(name, overrides)), init_distributed())
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
