import pytest

from nemo_rcgrpo.utils.logging import MetricsLogger
from nemo_rcgrpo.utils.plots import main, plot_runs


def _run(path, slope):
    log = MetricsLogger(path, tensorboard=False)
    for step in range(1, 6):
        log.log(step, {"reward_mean": slope * step, "entropy": 1 / step, "kl": 0.01 * step,
                       "zero_variance_fraction": 0.5, "entropy_reward_corr": -0.1})
    log.close()


def test_plot_two_runs(tmp_path):
    _run(tmp_path / "rcgrpo", 0.1)
    _run(tmp_path / "grpo", 0.05)
    out = plot_runs([tmp_path / "rcgrpo", tmp_path / "grpo"], tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")]) == 2
    with pytest.raises(ValueError, match="none of the metrics"):
        plot_runs([tmp_path / "grpo"], tmp_path / "y.png", ["no_such_metric"])
