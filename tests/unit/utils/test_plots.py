import pytest

from nemo_rcgrpo.utils.logging import MetricsLogger
from nemo_rcgrpo.utils.plots import main, plot_runs


def _run(path, slope):
    log = MetricsLogger(path, tensorboard=False)
    for step in range(1, 6):
        log.log(
            step,
            {
                "reward_mean": slope * step,
                "entropy": 1 / step,
                "kl": 0.01 * step,
                "zero_variance_fraction": 0.5,
                "entropy_reward_corr": -0.1,
            },
        )
    log.close()


def test_plot_two_runs(tmp_path):
    _run(tmp_path / "rcgrpo", 0.1)
    _run(tmp_path / "grpo", 0.05)
    out = plot_runs([tmp_path / "rcgrpo", tmp_path / "grpo"], tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")]) == 2
    with pytest.raises(ValueError, match="none of the metrics"):
        plot_runs([tmp_path / "grpo"], tmp_path / "y.png", ["no_such_metric"])


def _visible(fig):
    return [ax for ax in fig.axes if ax.axison]


def test_panels_have_integer_steps_plain_labels_and_a_title(tmp_path):
    import matplotlib.pyplot as plt

    from nemo_rcgrpo.utils.plots import dynamics_figure

    log = MetricsLogger(tmp_path / "rc", tensorboard=False)
    for step in (1, 2):  # an entropy that moves in its sixth digit used to get an offset label (+1.078e1)
        log.log(
            step,
            {
                "reward_mean": 0.0,
                "entropy": 10.776573 + 1e-5 * step,
                "kl": 0.0,
                **({"eval_accuracy": 25.0} if step == 2 else {}),
            },
        )
    log.close()
    fig = dynamics_figure([tmp_path / "rc"])
    fig.canvas.draw()
    titles = [ax.get_title() for ax in _visible(fig)]
    assert titles == ["reward", "entropy (token mean)", "KL to reference", "held-out accuracy (%)"]
    assert "rc" in fig._suptitle.get_text()
    for ax in _visible(fig):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)  # also the 1-point panel
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_title()
    plt.close(fig)


def test_stage1_run_gets_its_own_panels_and_out_is_the_exact_path(tmp_path):
    log = MetricsLogger(tmp_path / "sft", tensorboard=False)
    for step in range(1, 4):
        log.log(step, {"loss": 2.0 / step, "grad_norm": 1.0, "lr": 1e-5, "tokens_per_s": 100.0})
    log.close()
    from nemo_rcgrpo.utils.plots import dynamics_figure

    assert [ax.get_title() for ax in _visible(dynamics_figure([tmp_path / "sft"]))] == [
        "loss",
        "gradient norm",
        "learning rate",
        "tokens / s",
    ]
    assert main([str(tmp_path / "sft"), "--out", str(tmp_path / "plot")]) == 0  # no suffix: that file, a PNG
    assert (tmp_path / "plot").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "plot.png").exists()
