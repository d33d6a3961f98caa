"""recipes/run_loop.py, what both training loops do around their steps, over a fake policy: checkpoints where due,
a clean stop on a signal (the step finishes and is saved, the run raises StopRequested), resume from the newest
checkpoint (refused for another model), and the HF export only when the last step was reached."""

import os
import signal

import pytest
import torch

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.recipes.run_loop import RunLoop, RunSettings, open_run
from nemo_rcgrpo.utils.checkpoint import CheckpointError, latest_checkpoint
from nemo_rcgrpo.utils.config import compose
from nemo_rcgrpo.utils.dist import DistInfo
from nemo_rcgrpo.utils.logging import read_metrics
from nemo_rcgrpo.utils.signals import StopRequested


class FakePolicy:
    """A policy whose state is one tensor; records what the loop asks of it."""

    sharded_checkpoints = False
    skips_nonfinite_updates = False

    def __init__(self):
        self.weight = torch.zeros(2)
        self.loaded = None
        self.exported = 0

    def state_dict(self):
        return {"model": {"w": self.weight.clone()}, "optimizer": {"state": {}, "param_groups": []}, "scheduler": {}}

    def load_state_dict(self, model, optimizer, scheduler):
        self.loaded = model["w"]

    def sync_hf_model(self):
        self.exported += 1
        return None


def _cfg(tmp_path, *extra):
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "trainer.save_every=2",
        "trainer.log_every=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "trainer.export_hf=true",
        *extra,
    ]
    return RunSettings.of(TrainConfig.from_dict(compose("smoke_stage1", overrides)))


def _train(cfg, policy, start, total, stop_at=None, monkeypatch=None):
    """Run the loop from ``start``; at ``stop_at`` a SIGUSR1 arrives inside the step. Returns the steps run."""
    ran = []
    with RunLoop(cfg, DistInfo(), policy, None, {"stage": "sft"}, start, total, "fp") as loop:
        for step in loop.steps():
            policy.weight += 1.0
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            ran.append(step)
            loop.end_step(step, {"loss": float(step)}, log=True, trainer_state={"marker": step * 10})
    if monkeypatch is not None:  # the HF export itself (a tokenizer and a model) is the export's own tests'
        monkeypatch.setattr("nemo_rcgrpo.recipes.run_loop.export_hf", lambda *a, **k: None)
    loop.finish()
    return ran


def test_checkpoints_where_due_and_the_export_at_the_last_step(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    policy = FakePolicy()
    assert _train(cfg, policy, 0, 5, monkeypatch=monkeypatch) == [1, 2, 3, 4, 5]
    run = tmp_path / "run"
    # every save_every=2 steps and at the end (keep_last prunes the older ones)
    assert latest_checkpoint(run).name == "step_5"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept[-2:] == ["step_4", "step_5"] and "step_3" not in kept and "step_1" not in kept
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5]
    assert policy.exported == 1  # the HF model synced once, for the export


def test_a_signal_finishes_the_step_saves_it_and_stops(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    policy = FakePolicy()
    with pytest.raises(StopRequested) as stop:
        _train(cfg, policy, 0, 6, stop_at=3, monkeypatch=monkeypatch)
    assert stop.value.step == 3 and stop.value.signum == signal.SIGUSR1 and stop.value.exit_code == 138
    assert latest_checkpoint(tmp_path / "run").name == "step_3"  # saved although 3 is not a multiple of 2
    assert policy.exported == 0  # not the last step: no export
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handlers are put back

    # the next invocation resumes from it: weights, step and the loop's own trainer state
    cfg = _cfg(tmp_path, "trainer.resume=true")
    fresh = FakePolicy()
    ckpt, state = open_run(cfg, DistInfo(), fresh, "fp")
    assert ckpt.name == "step_3" and state["step"] == 3 and state["marker"] == 30 and state["stage"] == cfg.stage
    assert torch.equal(fresh.loaded, torch.full((2,), 3.0))
    assert _train(cfg, fresh, state["step"], 6, monkeypatch=monkeypatch) == [4, 5, 6]
    assert fresh.exported == 1
    with pytest.raises(CheckpointError, match="written for another model"):
        open_run(cfg, DistInfo(), FakePolicy(), "another fingerprint")


def test_stop_after_ends_the_invocation_early_without_an_export(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "trainer.stop_after=2")
    policy = FakePolicy()
    assert _train(cfg, policy, 0, 5, monkeypatch=monkeypatch) == [1, 2]
    assert latest_checkpoint(tmp_path / "run").name == "step_2" and policy.exported == 0


def test_skip_is_refused_for_a_policy_that_cannot_skip_a_non_finite_update(tmp_path):
    from nemo_rcgrpo.utils.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.on_nonfinite=skip needs a policy backend that skips"):
        RunLoop(_cfg(tmp_path, "trainer.on_nonfinite=skip"), DistInfo(), FakePolicy(), None, {}, 0, 3, "fp")
    able = FakePolicy()
    able.skips_nonfinite_updates = True
    RunLoop(_cfg(tmp_path, "trainer.on_nonfinite=skip"), DistInfo(), able, None, {}, 0, 3, "fp")


def test_a_stop_decides_what_to_save_from_memory_not_from_the_disk(tmp_path, monkeypatch):
    """A signal between steps (here: during step 3's end, after its check) stops before step 4; step 3 was not
    due for a checkpoint, so it is saved then, whatever another rank's view of the folder would say."""
    from pathlib import Path

    import nemo_rcgrpo.recipes.run_loop as run_loop

    cfg = _cfg(tmp_path, "trainer.save_every=100")
    policy = FakePolicy()
    # a rank whose view of the folder (a stale NFS listing) shows step 3 saved already: it must save all the same,
    # as every other rank does
    monkeypatch.setattr(run_loop, "latest_checkpoint", lambda run_dir: Path(run_dir) / "checkpoints" / "step_3")
    ran = []
    with pytest.raises(StopRequested) as stop:
        with RunLoop(cfg, DistInfo(), policy, None, {"stage": "sft"}, 0, 6, "fp") as loop:
            for step in loop.steps():
                ran.append(step)
                loop.end_step(step, {"loss": 1.0}, log=True, trainer_state={})
                if step == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)
        loop.finish()
    assert ran == [1, 2, 3] and stop.value.step == 3
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_3"]


def test_a_whole_config_is_refused_in_one_line_naming_the_settings_to_pass(tmp_path):
    from nemo_rcgrpo.prepare_data import ensure_data
    from nemo_rcgrpo.utils.banner import start_banner

    cfg = TrainConfig.from_dict(compose("smoke_stage1", [f"run_dir={tmp_path / 'run'}"]))
    with pytest.raises(TypeError, match=r"open_run takes RunSettings.of\(cfg\), not TrainConfig"):
        open_run(cfg, DistInfo(), FakePolicy(), "fp")
    with pytest.raises(TypeError, match=r"RunLoop takes RunSettings.of\(cfg\), not TrainConfig"):
        RunLoop(cfg, DistInfo(), FakePolicy(), None, {}, 0, 3, "fp")
    with pytest.raises(TypeError, match=r"ensure_data takes DataNeed.of\(cfg\), not TrainConfig"):
        ensure_data(cfg, DistInfo())
    with pytest.raises(TypeError, match=r"start_banner takes the run's RunSettings.of\(cfg\), not TrainConfig"):
        start_banner(cfg, recipe=None, parameters=1, data="", steps="", checkpoint=None, start_step=0)
