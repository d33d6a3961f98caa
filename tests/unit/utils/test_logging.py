"""Metric names: flat in metrics.jsonl, in namespaces in TensorBoard (and W&B)."""

from nemo_rcgrpo.utils.logging import MetricsLogger, namespaced, read_metrics


def test_namespaces():
    assert [namespaced(k) for k in ("loss", "grad_norm", "kl", "entropy", "lr", "tokens")] == [
        "train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/lr", "train/tokens"]
    assert [namespaced(k) for k in ("reward_mean", "reward_mean_high", "zero_variance_fraction", "success_base",
                                    "advantage_std", "entropy_reward_corr", "tool_error_rate", "turns")] == [
        "rollout/reward_mean", "rollout/reward_mean_high", "rollout/zero_variance_fraction", "rollout/success_base",
        "rollout/advantage_std", "rollout/entropy_reward_corr", "rollout/tool_error_rate", "rollout/turns"]
    assert [namespaced(k) for k in ("step_seconds", "generation_seconds", "tokens_per_s", "eval_accuracy",
                                    "eval_accuracy_base", "eval_seconds")] == [
        "timing/step_seconds", "timing/generation_seconds", "timing/tokens_per_s", "eval/accuracy",
        "eval/accuracy_base", "eval/seconds"]


def test_tensorboard_tags_are_namespaced_and_jsonl_stays_flat(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, tensorboard=True)
    log.log(1, {"loss": 0.5, "reward_mean": 0.25, "step_seconds": 3.0, "eval_accuracy": 50.0})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/accuracy", "rollout/reward_mean", "timing/step_seconds",
                                                "train/loss"]
    assert events.Scalars("rollout/reward_mean")[0].value == 0.25 and events.Scalars("train/loss")[0].step == 1
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 0.5, "reward_mean": 0.25, "step_seconds": 3.0,
                                       "eval_accuracy": 50.0}]


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
