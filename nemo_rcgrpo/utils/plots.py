"""Training-dynamics plots from ``metrics.jsonl``: one PNG, one panel per metric, one line per run.

    rcgrpo plot runs/rcgrpo_a runs/grpo_b --out dynamics.png
    python -m nemo_rcgrpo.utils.plots RUN [RUN ...] --out dynamics.png [--metrics reward_mean entropy ...]

Default panels: reward, zero-variance group fraction, entropy, KL to the
reference, entropy-reward correlation (rho: RC-GRPO keeps it low or negative
while reward rises; GRPO's collapse shows as rising rho with falling
variance), and for RC-GRPO the correlation and the reward under each token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from nemo_rcgrpo.utils.logging import read_metrics

DEFAULT_METRICS = ("reward_mean", "zero_variance_fraction", "entropy", "kl", "entropy_reward_corr",
                   "entropy_reward_corr_high", "entropy_reward_corr_low", "reward_mean_high", "reward_mean_low")
TITLES = {"reward_mean": "reward", "zero_variance_fraction": "zero-variance groups", "entropy": "entropy (token mean)",
          "kl": "KL to reference", "entropy_reward_corr": "entropy-reward correlation",
          "entropy_reward_corr_high": "entropy-reward corr. | high token",
          "entropy_reward_corr_low": "entropy-reward corr. | low token",
          "reward_mean_high": "reward | high token", "reward_mean_low": "reward | low token"}


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, metrics: Sequence[str] = DEFAULT_METRICS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(r).name: read_metrics(r) for r in run_dirs}
    missing = [r for r in run_dirs if not read_metrics(r)]
    if missing:
        raise FileNotFoundError(f"no metrics.jsonl with records in {missing}")
    shown = [m for m in metrics if any(m in rec for recs in runs.values() for rec in recs)]
    if not shown:
        raise ValueError(f"none of the metrics {list(metrics)} were logged by these runs")
    cols = min(3, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, shown):
        for name, records in runs.items():
            points = [(r["step"], r[metric]) for r in records if metric in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
        ax.set_title(TITLES.get(metric, metric), fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rcgrpo plot", description="plot training dynamics of one or more runs")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="dynamics.png")
    p.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    args = p.parse_args(argv)
    try:
        print(plot_runs(args.runs, args.out, args.metrics))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
