"""Metric names: flat in metrics.jsonl, in namespaces in TensorBoard (and W&B)."""

from nemo_rcgrpo.utils.logging import MetricsLogger, namespaced, read_metrics


def test_namespaces():
    assert [namespaced(k) for k in ("loss", "grad_norm", "kl", "entropy", "lr", "tokens")] == [
        "train/loss",
        "train/grad_norm",
        "train/kl",
        "train/entropy",
        "train/lr",
        "train/tokens",
    ]
    assert [
        namespaced(k)
        for k in (
            "reward_mean",
            "reward_mean_high",
            "zero_variance_fraction",
            "success_base",
            "advantage_std",
            "entropy_reward_corr",
            "tool_error_rate",
            "turns",
        )
    ] == [
        "rollout/reward_mean",
        "rollout/reward_mean_high",
        "rollout/zero_variance_fraction",
        "rollout/success_base",
        "rollout/advantage_std",
        "rollout/entropy_reward_corr",
        "rollout/tool_error_rate",
        "rollout/turns",
    ]
    assert [
        namespaced(k)
        for k in (
            "step_seconds",
            "generation_seconds",
            "tokens_per_s",
            "eval_accuracy",
            "eval_accuracy_base",
            "eval_seconds",
        )
    ] == [
        "timing/step_seconds",
        "timing/generation_seconds",
        "timing/tokens_per_s",
        "eval/accuracy",
        "eval/accuracy_base",
        "eval/seconds",
    ]


def test_tensorboard_tags_are_namespaced_and_jsonl_stays_flat(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, tensorboard=True)
    log.log(1, {"loss": 0.5, "reward_mean": 0.25, "step_seconds": 3.0, "eval_accuracy": 50.0})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == [
        "eval/accuracy",
        "rollout/reward_mean",
        "timing/step_seconds",
        "train/loss",
    ]
    assert events.Scalars("rollout/reward_mean")[0].value == 0.25 and events.Scalars("train/loss")[0].step == 1
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 0.5, "reward_mean": 0.25, "step_seconds": 3.0, "eval_accuracy": 50.0}
    ]


def test_the_run_log_keeps_tracebacks_in_the_file_and_never_stops_a_run(tmp_path, caplog):
    """run_log: the package's DEBUG records (a failed rollout's traceback) go to run_dir/run.log only, WARNING and up
    also reach the root logger's handlers (here pytest's); an unwritable log is given up with one line."""
    import logging

    from nemo_rcgrpo.utils.logging import run_log

    log = logging.getLogger("nemo_rcgrpo.rollout.multi_turn")
    caplog.set_level(logging.DEBUG)
    with run_log(tmp_path / "run") as path:
        log.warning("rollout of t1 failed")
        try:
            raise KeyError("boom")
        except KeyError as e:
            log.debug("the traceback", exc_info=e)
    text = (tmp_path / "run" / "run.log").read_text()
    assert path.endswith("run.log") and "WARNING nemo_rcgrpo.rollout.multi_turn: rollout of t1 failed" in text
    assert "Traceback (most recent call last):" in text and "KeyError: 'boom'" in text
    assert [r.getMessage() for r in caplog.records] == ["rollout of t1 failed"]  # the DEBUG one stayed in the file
    package = logging.getLogger("nemo_rcgrpo")
    assert package.propagate and not package.handlers  # left as it was
    blocker = tmp_path / "file"
    blocker.write_text("")
    with run_log(blocker / "run") as path:  # its folder cannot be made: a file is in the way
        log.warning("still logged")
        log.warning("and again")
    assert [r.getMessage() for r in caplog.records][-2:] == ["still logged", "and again"]


def _history(path, steps, torn=None):
    import json

    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps) + (torn or ""))


def test_a_resume_keeps_the_history_to_its_step_and_drops_a_torn_last_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    _history(path, [1, 2, 3, 4, 5], torn='{"step": 6, "lo')  # killed while writing step 6
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]  # plots and reports read past it
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=3)
    assert "last line was cut off" in capsys.readouterr().err
    log.log(4, {"loss": 0.0})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_the_history_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """Dropped lines go through a new file renamed into place: a run killed while writing it (here: the rename
    never happens) leaves the old history whole, and a history with nothing to drop is not rewritten at all."""
    import os

    path = tmp_path / "metrics.jsonl"
    _history(path, [1, 2, 3])
    inode = path.stat().st_ino
    MetricsLogger(tmp_path, tensorboard=False, resume_step=3).close()
    assert path.stat().st_ino == inode  # appended to, never rewritten

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    try:
        MetricsLogger(tmp_path, tensorboard=False, resume_step=1)
    except KeyboardInterrupt:
        pass
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # the old history, whole
    monkeypatch.undo()
    MetricsLogger(tmp_path, tensorboard=False, resume_step=1).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1] and path.stat().st_ino != inode


def test_a_malformed_line_inside_the_history_is_one_line_naming_the_file(tmp_path):
    import pytest

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a metrics record"):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=2)


def test_a_whole_last_record_without_its_newline_is_kept_and_ended(tmp_path):
    """A kill (or a full disk) after a record but before its newline: the record is kept, and the next one starts
    on a line of its own, so a later resume does not find two records joined on one line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}')
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=2)
    log.log(3, {"loss": 0.125})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    MetricsLogger(tmp_path, tensorboard=False, resume_step=3).close()  # and a later resume reads it
