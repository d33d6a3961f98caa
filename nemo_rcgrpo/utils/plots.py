"""Training-dynamics plots from ``metrics.jsonl``: one PNG, one panel per metric, one line per run.

    rcgrpo plot runs/rcgrpo_a runs/grpo_b --out dynamics.png
    python -m nemo_rcgrpo.utils.plots RUN [RUN ...] --out dynamics.png [--metrics reward_mean entropy ...]

Default panels of a stage-2 run: reward, zero-variance group fraction, entropy, KL to the reference,
entropy-reward correlation (rho: RC-GRPO keeps it low or negative while reward rises; GRPO's collapse shows as
rising rho with falling variance), for RC-GRPO the correlation and the reward under each token, and held-out
accuracy where the run evaluated (rl.eval_every). A stage-1 run (no rollout metrics) gets loss, gradient norm,
learning rate and throughput. Steps are integers on the x axis; y labels are plain numbers (no offset).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from nemo_rcgrpo.utils.logging import read_metrics
from nemo_rcgrpo.utils.run_command import run_command

DEFAULT_METRICS = (
    "reward_mean",
    "zero_variance_fraction",
    "entropy",
    "kl",
    "entropy_reward_corr",
    "entropy_reward_corr_high",
    "entropy_reward_corr_low",
    "reward_mean_high",
    "reward_mean_low",
    "eval_accuracy",
)
STAGE1_METRICS = ("loss", "grad_norm", "lr", "tokens_per_s")
TITLES = {
    "reward_mean": "reward",
    "zero_variance_fraction": "zero-variance groups",
    "entropy": "entropy (token mean)",
    "kl": "KL to reference",
    "entropy_reward_corr": "entropy-reward correlation",
    "entropy_reward_corr_high": "entropy-reward corr. | high token",
    "entropy_reward_corr_low": "entropy-reward corr. | low token",
    "reward_mean_high": "reward | high token",
    "reward_mean_low": "reward | low token",
    "eval_accuracy": "held-out accuracy (%)",
    "loss": "loss",
    "grad_norm": "gradient norm",
    "lr": "learning rate",
    "tokens_per_s": "tokens / s",
}


def plot_runs(
    run_dirs: Sequence[str | Path], out: str | Path, metrics: Sequence[str] | None = None, title: str | None = None
) -> Path:
    """One image at exactly ``out`` (PNG when its suffix names no image format); ``metrics`` None: the defaults of
    the runs' stage."""
    import matplotlib.pyplot as plt

    fig = dynamics_figure(run_dirs, metrics, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = out.suffix[1:].lower()
    with out.open("wb") as f:
        fig.savefig(f, dpi=110, format=suffix if suffix in fig.canvas.get_supported_filetypes() else "png")
    plt.close(fig)
    return out


def dynamics_figure(run_dirs: Sequence[str | Path], metrics: Sequence[str] | None = None, title: str | None = None):
    """The matplotlib figure: one panel per logged metric, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    missing = [str(r) for r in run_dirs if not read_metrics(r)]
    if missing:
        raise FileNotFoundError(f"no metrics.jsonl with records in {missing}")
    runs = {Path(r).name: read_metrics(r) for r in run_dirs}

    def logged(names: Sequence[str]) -> list[str]:
        return [m for m in names if any(m in rec for recs in runs.values() for rec in recs)]

    shown = logged(metrics) if metrics is not None else (logged(DEFAULT_METRICS) or logged(STAGE1_METRICS))
    if not shown:
        raise ValueError(f"none of the metrics {list(metrics or DEFAULT_METRICS)} were logged by these runs")
    steps = [r["step"] for recs in runs.values() for r in recs]
    lo, hi = min(steps), max(steps)
    pad = 0.05 * (hi - lo) if hi > lo else 0.5
    cols = min(3, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows + 0.5), squeeze=False)
    for ax, metric in zip(axes.flat, shown):
        for name, records in runs.items():
            points = [(r["step"], r[metric]) for r in records if metric in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
        ax.set_title(TITLES.get(metric, metric), fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(lo - pad, hi + pad)  # every panel on the runs' whole step range: integer ticks even for a point
        ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))  # 10.781, not 0.001 + 1.078e1
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title or "training dynamics: " + ", ".join(runs), fontsize=11)
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rcgrpo plot", description="plot training dynamics of one or more runs")
    p.add_argument("runs", nargs="+")
    p.add_argument(
        "--out",
        default="dynamics.png",
        help="the image, written at exactly this path (PNG unless its suffix names another format)",
    )
    p.add_argument(
        "--metrics",
        nargs="+",
        default=None,
        help="panels (default: the stage-2 set, or loss, grad_norm, lr and tokens_per_s for a stage-1 run)",
    )
    p.add_argument("--title", default=None, help="figure title (default: the runs' folder names)")
    args = p.parse_args(argv)

    def plot() -> int:
        print(plot_runs(args.runs, args.out, args.metrics, args.title))
        return 0

    return run_command(plot)


if __name__ == "__main__":
    sys.exit(main())
