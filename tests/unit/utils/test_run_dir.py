"""Run folders: which differences refuse a resume, which may change, and the saved configs."""

import pytest
import yaml

from nemo_rcgrpo.utils.config import ConfigError
from nemo_rcgrpo.utils.run_dir import RESUME_FREE, config_files, differences, prepare_run_dir

BASE = {
    "stage": "rcgrpo",
    "model": {"path": "m"},
    "trainer": {"lr": 1e-6, "max_steps": 10, "resume": True, "stop_after": None},
    "logging": {"progress": True, "wandb": {"enabled": False}},
    "data": {"dir": "d"},
}


def _with(**changes):
    import copy

    cfg = copy.deepcopy(BASE)
    for key, value in changes.items():
        node = cfg
        *path, last = key.split("__")
        for p in path:
            node = node[p]
        node[last] = value
    return cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ({"stage": "grpo"}, "stage is 'rcgrpo' there and 'grpo' now"),  # grpo into an rcgrpo folder
        ({"stage": "sft"}, "stage is 'rcgrpo' there and 'sft' now"),  # stage 1 into a stage-2 folder
        ({"trainer__lr": 2e-6}, "trainer.lr is 1e-06 there and 2e-06 now"),
        ({"model__path": "other"}, "model.path is 'm' there and 'other' now"),
        ({"data__dir": "d2"}, "data.dir is 'd' there and 'd2' now"),
    ],
)
def test_a_different_run_is_refused(tmp_path, change, message):
    prepare_run_dir(tmp_path, BASE, resume=True, overwrite=False)
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    with pytest.raises(ConfigError, match="cannot resume run_dir") as e:
        prepare_run_dir(tmp_path, _with(**change), resume=True, overwrite=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert config_files(tmp_path) == [tmp_path / "config.yaml"]  # nothing written by a refused start


def test_free_and_allowed_changes(tmp_path):
    prepare_run_dir(tmp_path, BASE, resume=True, overwrite=False)
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    free = _with(trainer__stop_after=3, logging__progress=False, logging__wandb={"enabled": True})
    assert differences(BASE, free, ()) == []
    prepare_run_dir(tmp_path, free, resume=True, overwrite=False)
    longer = _with(trainer__max_steps=20)
    assert differences(BASE, longer, ()) == ["trainer.max_steps is 10 there and 20 now"]
    prepare_run_dir(tmp_path, longer, resume=True, overwrite=False, may_change=("trainer.max_steps",))
    assert [p.name for p in config_files(tmp_path)] == ["config.yaml", "config.1.yaml", "config.2.yaml"]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == BASE  # the original, untouched
    # the next resume compares with the last invocation's config
    prepare_run_dir(tmp_path, longer, resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="trainer.max_steps is 20 there and 10 now"):
        prepare_run_dir(tmp_path, BASE, resume=True, overwrite=False)
    # a gap in the numbering never overwrites a kept config
    (tmp_path / "config.2.yaml").unlink()
    assert prepare_run_dir(tmp_path, longer, resume=True, overwrite=False).name == "config.4.yaml"
    assert "trainer.resume" in RESUME_FREE and "trainer.lr" not in RESUME_FREE


def test_resume_false_needs_overwrite_and_overwrite_removes_the_old_outputs(tmp_path):
    prepare_run_dir(tmp_path, BASE, resume=True, overwrite=False)
    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="holds a run"):
        prepare_run_dir(tmp_path, BASE, resume=False, overwrite=False)
    assert (tmp_path / "checkpoints" / "step_5").is_dir()
    prepare_run_dir(tmp_path, BASE, resume=False, overwrite=True)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert [p.name for p in config_files(tmp_path)] == ["config.yaml", "config.1.yaml"]


def test_a_checkpoint_without_a_config_is_a_run_too(tmp_path):
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds a run"):
        prepare_run_dir(tmp_path, BASE, resume=False, overwrite=False)
    prepare_run_dir(tmp_path, BASE, resume=True, overwrite=False)  # nothing saved to compare with: resumes


def test_a_run_stopped_before_its_first_checkpoint_starts_again_with_new_settings(tmp_path):
    prepare_run_dir(tmp_path, BASE, resume=True, overwrite=False)  # no checkpoint written
    prepare_run_dir(tmp_path, _with(trainer__lr=5e-6), resume=True, overwrite=False)
    assert [p.name for p in config_files(tmp_path)] == ["config.yaml", "config.1.yaml"]


def test_overwrite_with_resume_is_refused(tmp_path):
    prepare_run_dir(tmp_path, BASE, resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="overwrite=true starts the run over and needs trainer.resume=false"):
        prepare_run_dir(tmp_path, BASE, resume=True, overwrite=True)


def test_a_setting_newer_than_the_saved_run_is_free_only_while_empty():
    newer = {**BASE, "plugins": []}
    assert differences(BASE, newer, ()) == []  # a run saved before `plugins` existed resumes
    assert differences(BASE, {**BASE, "plugins": ["mine"]}, ()) == ["plugins is '<unset>' there and ['mine'] now"]
    assert differences(newer, BASE, ()) == ["plugins is [] there and '<unset>' now"]
    # env.task_source: a run saved before it existed trained on BFCL v4
    assert differences(BASE, {**BASE, "env.task_source": "bfcl"}, ()) == []
    assert differences(BASE, {**BASE, "env.task_source": "bfcl_micro"}, ()) == [
        "env.task_source is '<unset>' there and 'bfcl_micro' now"
    ]
    # model.name: a 7B/8B run saved before the model groups resumes under its composed recipe
    assert differences(BASE, {**BASE, "model": {"path": "m", "name": "llama8b"}}, ()) == []
    assert differences(BASE, {**BASE, "model": {"path": "m", "name": None}}, ()) == []


def test_a_run_saved_before_the_registered_choices_existed_resumes_with_their_defaults():
    """env.settings.reward, rl.group_filter, rl.loss.policy_loss and data.dataset name registered parts; a run saved
    before them resumes at the values that mean what it did, and is refused at any other."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    now = TrainConfig.from_dict(compose("smoke_rl", [])).to_dict()
    saved = {k: dict(v) if isinstance(v, dict) else v for k, v in now.items()}
    saved["env"] = {**now["env"], "settings": {k: v for k, v in now["env"]["settings"].items() if k != "reward"}}
    saved["data"] = {k: v for k, v in now["data"].items() if k != "dataset"}
    saved["rl"] = {k: v for k, v in now["rl"].items() if k != "group_filter"}
    saved["rl"]["loss"] = {k: v for k, v in now["rl"]["loss"].items() if k != "policy_loss"}
    assert differences(saved, now, ()) == []
    state = {**now, "env": {**now["env"], "settings": {**now["env"]["settings"], "reward": "state"}}}
    assert differences(saved, state, ()) == ["env.settings.reward is '<unset>' there and 'state' now"]
    for key, section, value in (("rl.group_filter", "rl", "has_variance"), ("data.dataset", "data", "rctp")):
        changed = {**now, section: {**now[section], key.split(".")[1]: value}}
        assert differences(saved, changed, ()) == [f"{key} is '<unset>' there and {value!r} now"]
    unclipped = {**now, "rl": {**now["rl"], "loss": {**now["rl"]["loss"], "policy_loss": "unclipped"}}}
    assert differences(saved, unclipped, ()) == ["rl.loss.policy_loss is '<unset>' there and 'unclipped' now"]


def test_a_run_saved_with_the_env_settings_at_the_top_of_env_resumes():
    """BFCL's settings were env.mode, env.max_steps, ... before each env had env.settings: a run saved so resumes
    when they hold the same values under env.settings, and a changed one is named by its new key."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    now = TrainConfig.from_dict(compose("smoke_rl", [])).to_dict()
    old = {k: v for k, v in now["env"].items() if k != "settings"}
    saved = {**now, "env": {**old, **now["env"]["settings"]}}
    assert "mode" in saved["env"] and differences(saved, now, ()) == []
    per_turn = {**now, "env": {**now["env"], "settings": {**now["env"]["settings"], "mode": "per_turn"}}}
    assert differences(saved, per_turn, ()) == ["env.settings.mode is 'merged' there and 'per_turn' now"]


def test_a_run_saved_with_rl_loss_tis_cap_resumes_as_its_correction():
    """rl.loss.tis_cap (null: off) became rl.loss.correction + rl.loss.correction_cap: a run saved with a cap resumes
    as token_tis at that cap, one saved with null as none, and any other choice is named by its new key."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    now = TrainConfig.from_dict(compose("smoke_rl", [])).to_dict()
    loss = {k: v for k, v in now["rl"]["loss"].items() if k not in ("correction", "correction_cap")}

    def saved(cap):
        return {**now, "rl": {**now["rl"], "loss": {**loss, "tis_cap": cap}}}

    def with_loss(**kw):
        return {**now, "rl": {**now["rl"], "loss": {**now["rl"]["loss"], **kw}}}

    assert now["rl"]["loss"]["correction"] == "none" and differences(saved(None), now, ()) == []
    assert differences(saved(1.5), with_loss(correction="token_tis", correction_cap=1.5), ()) == []
    assert differences(saved(1.5), with_loss(correction="token_tis"), ()) == [
        "rl.loss.correction_cap is 1.5 there and 2.0 now"
    ]
    assert differences(saved(1.5), now, ()) == [
        "rl.loss.correction is 'token_tis' there and 'none' now",
        "rl.loss.correction_cap is 1.5 there and 2.0 now",
    ]
    assert differences(saved(None), with_loss(correction="geometric_mask"), ()) == [
        "rl.loss.correction is 'none' there and 'geometric_mask' now"
    ]


def test_a_run_saved_with_the_group_filters_former_names_resumes(tmp_path):
    """rl.dapo_max_rounds and rl.dapo_shortfall became rl.group_filter_refills and rl.group_filter_shortfall (the
    same meaning): a run folder whose saved config has the old names resumes when the new ones hold the same values,
    and a changed one is named by its new key, with the resume_may_change that allows it."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    now = TrainConfig.from_dict(compose("smoke_rl", ["stage=dapo_filter"])).to_dict()
    old_rl = {k: v for k, v in now["rl"].items() if k not in ("group_filter_refills", "group_filter_shortfall")}
    saved = {**now, "rl": {**old_rl, "dapo_max_rounds": 2, "dapo_shortfall": "train"}}
    assert differences(saved, now, ()) == []
    more = {**now, "rl": {**now["rl"], "group_filter_refills": 4}}
    assert differences(saved, more, ()) == ["rl.group_filter_refills is 2 there and 4 now"]
    # a launcher that still allows the change under the old name: allowed under the new one
    assert (
        differences(saved, more, ("rl.dapo_max_rounds",))
        == []
        == differences(saved, more, ("rl.group_filter_refills",))
    )
    strict = {**now, "rl": {**now["rl"], "group_filter_shortfall": "error"}}
    assert differences(saved, strict, ()) == ["rl.group_filter_shortfall is 'train' there and 'error' now"]
    # the folder as the trainer finds it: the old run's config.yaml and a checkpoint
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    assert prepare_run_dir(tmp_path, now, resume=True, overwrite=False).name == "config.1.yaml"
    assert "group_filter_refills" in yaml.safe_load((tmp_path / "config.1.yaml").read_text())["rl"]
    (tmp_path / "config.1.yaml").unlink()  # compare with the old run's again
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(tmp_path, more, resume=True, overwrite=False)
    assert str(e.value) == (
        f"cannot resume run_dir {tmp_path} (config.yaml): rl.group_filter_refills is 2 there and 4 now; use a new "
        "run_dir, or allow the change: trainer.resume_may_change=[rl.group_filter_refills]"
    )
    prepare_run_dir(tmp_path, more, resume=True, overwrite=False, may_change=("rl.group_filter_refills",))


def test_a_plugin_env_run_saved_with_bfcls_settings_at_the_top_of_env_resumes():
    """Before env.settings, every env's section held BFCL's settings (env.mode, ...), read only by BFCL's env: a
    plugin env's run saved so resumes on the settings its env takes, and a changed one is still named."""
    saved = {
        "stage": "rcgrpo",
        "env": {"name": "kv", "task_source": "kv", "mode": "merged", "arg_types": "strict", "max_steps": 4},
    }
    now = {"stage": "rcgrpo", "env": {"name": "kv", "task_source": "kv", "settings": {"max_steps": 4}}}
    assert differences(saved, now, ()) == []
    now["env"]["settings"]["max_steps"] = 8
    assert differences(saved, now, ()) == ["env.settings.max_steps is 4 there and 8 now"]


def test_a_run_saved_before_chat_rejected_message_resumes_as_it_ran():
    """RL runs saved before the setting answered rejected messages with error observations: they resume with
    chat.rejected_message=error and are refused (the line says how it ran) with the new default; a stage-1 run,
    which never reads it, resumes with either."""
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.utils.config import compose

    for recipe, rl in (("smoke_rl", True), ("smoke_stage1", False)):
        now = TrainConfig.from_dict(compose(recipe, [])).to_dict()
        saved = {**now, "chat": {k: v for k, v in now["chat"].items() if k != "rejected_message"}}
        as_ran = {**now, "chat": {**now["chat"], "rejected_message": "error"}}
        assert now["chat"]["rejected_message"] == "content" and differences(saved, as_ran, ()) == []
        if rl:
            assert differences(saved, now, ()) == [
                "chat.rejected_message is '<unset>' there (that run ran as "
                "chat.rejected_message=error) and 'content' now"
            ]
        else:
            assert differences(saved, now, ()) == []
