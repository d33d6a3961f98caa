"""`rcgrpo compare`: several evaluation results side by side (e.g. the 2x2 ablation).

    rcgrpo compare runs/eval/sft_grpo runs/eval/rctp_rcgrpo ... --labels "SFT+GRPO" "RCTP+RC-GRPO" \\
        --out runs/eval/comparison

Each input is a results.json or the folder holding one. Writes OUT.md (a
Markdown table: rows = runs, columns = categories and overall, in percent)
and OUT.png (grouped bars per category). Runs of different protocols are
refused: their numbers are not comparable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from nemo_rcgrpo.utils.run_command import run_command


def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        result = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {p}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON: {e.msg}") from None
    if not isinstance(result, dict) or "overall" not in result or "categories" not in result:
        raise ValueError(f"{p} is not a results.json written by rcgrpo eval")
    result["_path"] = str(p)
    return result


def _source(result: dict[str, Any]) -> Any:
    """The registered task source a result was evaluated on (its function: ``title``, ``category_order``), or None."""
    from nemo_rcgrpo.registry import table

    return table("task_source").get(str((result.get("config") or {}).get("task_source")))


def _categories(results: Sequence[dict[str, Any]]) -> list[str]:
    """Every category of the results: in the order the first result's task source declares (``category_order``),
    else as the results list them (each results.json in its suite's order)."""
    names = list(dict.fromkeys(c for r in results for c in r["categories"]))
    order = getattr(_source(results[0]), "category_order", None)
    return sorted(names, key=order) if callable(order) else names


def _tasks_title(results: Sequence[dict[str, Any]]) -> str:
    """What the results were evaluated on: each results.json's ``tasks_title`` (its suite's ``title``); for one
    written before it, its task source's."""
    titles = [
        r.get("tasks_title")
        or getattr(_source(r), "title", None)
        or f"task source {(r.get('config') or {}).get('task_source', '?')}"
        for r in results
    ]
    return " / ".join(dict.fromkeys(titles))


def comparison_table(results: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    cats = _categories(results)
    protocol = results[0]["protocol"]
    head = "| run | " + " | ".join(cats) + " | overall | tasks |"
    lines = [
        f"### {_tasks_title(results)}, {protocol} protocol (accuracy, %)",
        "",
        head,
        "|---|" + "---:|" * (len(cats) + 2),
    ]
    best = max(r["overall"] for r in results)
    for r, label in zip(results, labels):
        cells = [f"{r['categories'][c]['accuracy']:.1f}" if c in r["categories"] else "-" for c in cats]
        overall = f"{r['overall']:.1f}"
        if r["overall"] == best and len(results) > 1:
            overall = f"**{overall}**"
        note = "" if r.get("complete", True) else " (incomplete)"
        lines.append(f"| {label}{note} | " + " | ".join(cells) + f" | {overall} | {r['tasks']} |")
    return "\n".join(lines) + "\n"


def bar_chart(results: Sequence[dict[str, Any]], labels: Sequence[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = _categories(results) + ["overall"]
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cats)), 4.0))
    for i, (r, label) in enumerate(zip(results, labels)):
        values = [r["overall"] if c == "overall" else r["categories"].get(c, {}).get("accuracy", 0.0) for c in cats]
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(cats))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{_tasks_title(results)} ({results[0]['protocol']} protocol)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rcgrpo compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files or the folders holding them")
    parser.add_argument("--labels", nargs="+", help="one label per result (default: the result folder names)")
    parser.add_argument("--out", required=True, help="output path without extension: writes OUT.md and OUT.png")
    args = parser.parse_args(argv)
    return run_command(lambda: _compare(args))


def _compare(args: argparse.Namespace) -> int:
    results = [load_result(p) for p in args.results]
    labels = args.labels or [Path(r["_path"]).parent.name for r in results]
    if len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} results")
    protocols = {r["protocol"] for r in results}
    if len(protocols) > 1:
        raise ValueError(f"results of different protocols {sorted(protocols)} are not comparable")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = comparison_table(results, labels)
    out.with_suffix(".md").write_text(table)
    bar_chart(results, labels, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
