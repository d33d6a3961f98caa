"""``rcgrpo report RUN_DIR -o report.html``: one self-contained HTML page of a run, to read in any browser.

It holds the run's config, the training-dynamics plot (embedded PNG), the evaluation table and a browsable
transcript of every rollout: per step for a stage-2 run (``rollouts/step_N.jsonl`` and ``eval/step_N.jsonl``),
per task for an evaluation (``rcgrpo eval``'s ``trajectories.jsonl``), filtered by step, task, reward token and
reward, each training rollout with the weight version of its turns. No network, no server: styles, script, data
and images are inside the file. Model output is untrusted: the page's script writes every piece of it as text
(``textContent``), never as markup, and the embedded JSON cannot close its ``<script>`` element.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from nemo_rcgrpo.rollout.record import EpisodeRecord
from nemo_rcgrpo.utils.logging import read_metrics
from nemo_rcgrpo.utils.run_command import run_command
from nemo_rcgrpo.utils.run_dir import config_files

MAX_ROLLOUTS = 3000  # without --last-steps / --all: the last steps whose rollouts fit (a page a browser can hold)


class ReportError(ValueError):
    """The folder is not a run this command can report on."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"error": f"line {n} of {path.name} is not JSON", "reward": None})
    return out


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    found = [
        (int(m.group(1)), p) for p in folder.glob("step_*.jsonl") if (m := re.fullmatch(r"step_(\d+)\.jsonl", p.name))
    ]
    return sorted(found)


def _episode(record: dict[str, Any], source: str, step: int | None) -> dict[str, Any]:
    """One rollout in the page's shape, from any dump's line (`rollout/record.py: EpisodeRecord`: a training dump,
    an in-training eval dump or an eval trajectory, of this version or an older one)."""
    r = EpisodeRecord.from_json(record)
    return {
        "source": source,
        "step": r.step if r.step is not None else step,
        "task": r.task_id,
        "category": r.category,
        "group": r.group,
        "token": r.reward_token,
        "reward": r.reward,
        "advantage": r.advantage,
        "state_ok": r.state_ok,
        "actions_ok": r.actions_ok,
        "truncated": r.truncated,
        "error": r.error or r.failure_reason,
        "prompt": r.prompt,
        "prompt_line": r.prompt_line,
        "messages": r.messages,
        "details": r.reward_details or None,
        # the weight version of each turn (a rollout generated ahead may span an update); older dumps: none
        "versions": r.turn_versions or ([r.weight_version] if r.weight_version is not None else []),
    }


def _fitting(steps: list[tuple[int, Path]], budget: int) -> list[tuple[int, Path]]:
    """The last steps whose rollouts fit in ``budget`` lines (at least one step)."""
    kept, total = [], 0
    for step, path in reversed(steps):
        lines = sum(1 for line in path.open(errors="replace") if line.strip())
        if kept and total + lines > budget:
            break
        kept.insert(0, (step, path))
        total += lines
    return kept


def collect(run_dir: Path, last_steps: int | None = None, everything: bool = False) -> dict[str, Any]:
    """Everything the page shows, as plain data. Without ``last_steps`` or ``everything``, a long run keeps the
    last steps whose training rollouts fit in MAX_ROLLOUTS (``note`` says so)."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder")
    if last_steps is not None and last_steps < 1:
        raise ReportError(f"--last-steps {last_steps}: give at least 1")
    configs = config_files(run_dir)
    metrics = read_metrics(run_dir)
    episodes: list[dict[str, Any]] = []
    train_steps = _numbered(run_dir / "rollouts")
    if last_steps is not None:
        kept = train_steps[-last_steps:]
    else:
        kept = train_steps if everything else _fitting(train_steps, MAX_ROLLOUTS)
    note = (
        ""
        if len(kept) == len(train_steps)
        else (
            f"rollouts of the last {len(kept)} of {len(train_steps)} steps (from step {kept[0][0]}); "
            "rcgrpo report --all (or --last-steps N) for more"
        )
    )
    first = kept[0][0] if kept else 0
    for kind in ("rollouts", "eval"):
        steps = kept if kind == "rollouts" else [(n, p) for n, p in _numbered(run_dir / kind) if n >= first]
        for step, path in steps:
            records = _jsonl(path)
            for r in records:  # resolve the prompt pointers of a training dump (prompt once per group and token)
                if (
                    r.get("prompt") is None
                    and isinstance(r.get("prompt_line"), int)
                    and 0 < r["prompt_line"] <= len(records)
                ):
                    r["prompt"] = records[r["prompt_line"] - 1].get("prompt")
            episodes += [_episode(r, "train" if kind == "rollouts" else "eval", step) for r in records]
    results = None
    if (run_dir / "results.json").is_file():  # an evaluation's folder
        results = json.loads((run_dir / "results.json").read_text())
        if (run_dir / "trajectories.jsonl").is_file():
            episodes += [_episode(r, "eval", None) for r in _jsonl(run_dir / "trajectories.jsonl")]
    if not configs and results is None and not metrics and not episodes:
        raise ReportError(f"{run_dir} holds no run: no config.yaml, results.json, metrics.jsonl or rollouts")
    config_name, config_text = "", ""
    if configs:  # the newest invocation's (a resume with resume_may_change writes config.N.yaml)
        config_name, config_text = configs[-1].name, configs[-1].read_text()
    elif results is not None:
        config_name, config_text = "results.json: config", json.dumps(results.get("config", {}), indent=1)
    evals = [
        {k: v for k, v in m.items() if k == "step" or k.startswith("eval_")}
        for m in metrics
        if any(k.startswith("eval_accuracy") for k in m)
    ]
    if results is not None:
        evals.append(
            {
                "step": "final",
                "eval_accuracy": results.get("overall"),
                **{f"eval_accuracy_{c}": v.get("accuracy") for c, v in (results.get("categories") or {}).items()},
            }
        )
    return {
        "name": run_dir.resolve().name,
        "path": str(run_dir),
        "config": config_text,
        "config_name": config_name,
        "evals": evals,
        "episodes": episodes,
        "steps": len(metrics),
        "last": metrics[-1] if metrics else {},
        "note": note,
    }


def _finite(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither; one would make the page's data unreadable)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _plot_png(run_dir: Path) -> str | None:
    if not read_metrics(run_dir):
        return None
    import matplotlib.pyplot as plt

    from nemo_rcgrpo.utils.plots import dynamics_figure

    try:
        fig = dynamics_figure([run_dir])
    except ValueError:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _eval_table(evals: list[dict[str, Any]]) -> str:
    if not evals:
        return "<p>No evaluation in this run (stage 2: rl.eval_every &gt; 0 logs one).</p>"
    cols = sorted({k for e in evals for k in e if k != "step"}, key=lambda k: (k != "eval_accuracy", k))
    head = "".join(f"<th>{html.escape(c.removeprefix('eval_'))}</th>" for c in cols)
    rows = []
    for e in evals:
        cells = "".join(
            f"<td>{'' if e.get(c) is None else html.escape(f'{e[c]:.4g}' if isinstance(e[c], float) else str(e[c]))}</td>"
            for c in cols
        )
        rows.append(f"<tr><td>{html.escape(str(e['step']))}</td>{cells}</tr>")
    return f"<table id='evals'><tr><th>step</th>{head}</tr>{''.join(rows)}</table>"


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1200px;color:#222}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.5em;border-radius:4px;margin:.3em 0}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
.filters label{margin-right:1em} .ep{border:1px solid #ddd;border-radius:4px;margin:.4em 0;padding:.3em .6em}
.ep summary{cursor:pointer} .ok{color:#070} .bad{color:#a00} .role{font-weight:bold;margin-top:.4em}
img{max-width:100%}
"""

_SCRIPT = r"""
const data = JSON.parse(document.getElementById('report-data').textContent);
const eps = data.episodes;
const PAGE = 200;
let limit = PAGE;
const $ = (id) => document.getElementById(id);
function el(tag, text, cls) { const e = document.createElement(tag); if (text !== undefined && text !== null) e.textContent = String(text); if (cls) e.className = cls; return e; }
function fill(select, values) { for (const v of values) { const o = el('option', v); o.value = v; select.appendChild(o); } }
function key(v) { return v === null || v === undefined ? 'none' : String(v); }
fill($('f-step'), [...new Set(eps.map(e => e.source + ' ' + key(e.step)))]);
fill($('f-task'), [...new Set(eps.map(e => key(e.task)))].sort());
fill($('f-token'), [...new Set(eps.map(e => key(e.token)))].sort());
function body(d, e) {  // built when a rollout is first opened: the page holds thousands
  d.appendChild(el('div', `R_state ${key(e.state_ok)} · R_action ${key(e.actions_ok)}` + (e.truncated ? ` · truncated: ${e.truncated}` : '') + (e.error ? ` · error: ${e.error}` : '')));
  if (e.prompt) { const p = el('details'); p.appendChild(el('summary', 'prompt (as the model saw it)')); p.appendChild(el('pre', e.prompt)); d.appendChild(p); }
  for (const m of e.messages || []) {
    d.appendChild(el('div', m.role, 'role'));
    d.appendChild(el('pre', m.content, 'msg ' + m.role));
    if (m.tool_calls && m.tool_calls.length) d.appendChild(el('pre', 'calls: ' + JSON.stringify(m.tool_calls)));
  }
  if (e.details && Object.keys(e.details).length) d.appendChild(el('pre', 'reward details: ' + JSON.stringify(e.details, null, 1)));
}
function card(e) {
  const d = el('details', undefined, 'ep'); d.dataset.task = key(e.task); d.dataset.token = key(e.token);
  d.dataset.reward = key(e.reward);
  const s = el('summary');
  s.appendChild(el('span', `${e.source} step ${key(e.step)} · ${key(e.task)} · group ${key(e.group)} · token ${key(e.token)} · `));
  s.appendChild(el('span', `reward ${key(e.reward)}`, e.reward === 1 ? 'ok' : 'bad'));
  if (e.versions && e.versions.length) s.appendChild(el('span', ' · weights ' + [...new Set(e.versions)].map(v => 'v' + key(v)).join('→')));
  if (e.advantage !== null && e.advantage !== undefined) s.appendChild(el('span', ` · advantage ${Number(e.advantage).toFixed(3)}`));
  d.appendChild(s);
  d.addEventListener('toggle', () => { if (d.open && !d.dataset.built) { d.dataset.built = '1'; body(d, e); } });
  return d;
}
function render() {
  const step = $('f-step').value, task = $('f-task').value, token = $('f-token').value, reward = $('f-reward').value;
  const list = $('episodes'); list.replaceChildren();
  let shown = 0;
  for (const e of eps) {
    if (step !== 'all' && e.source + ' ' + key(e.step) !== step) continue;
    if (task !== 'all' && key(e.task) !== task) continue;
    if (token !== 'all' && key(e.token) !== token) continue;
    if (reward === '1' && e.reward !== 1) continue;
    if (reward === '<1' && e.reward === 1) continue;
    shown += 1;
    if (shown <= limit) list.appendChild(card(e));
  }
  $('count').textContent = `${shown} of ${eps.length} rollouts`;
  $('more').hidden = shown <= limit;
  $('more').textContent = `show ${Math.min(PAGE, shown - limit)} more (${Math.min(limit, shown)} shown)`;
}
for (const id of ['f-step', 'f-task', 'f-token', 'f-reward']) $(id).addEventListener('change', () => { limit = PAGE; render(); });
$('more').addEventListener('click', () => { limit += PAGE; render(); });
render();
"""


def render_html(report: dict[str, Any], plot_png: str | None) -> str:
    # JSON inside <script>: "</" and "<!--" are escaped so no text can end the element; the script reads it as data
    payload = json.dumps(_finite({"episodes": report["episodes"]}), default=str, allow_nan=False).replace(
        "<", "\\u003c"
    )
    script_hash = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()  # CSP: this script only
    last = ", ".join(
        f"{k} {v:.4g}"
        for k, v in report["last"].items()
        if k in ("loss", "reward_mean", "zero_variance_fraction", "eval_accuracy")
    )
    plot = (
        f"<img alt='training dynamics' src='data:image/png;base64,{plot_png}'>"
        if plot_png
        else "<p>No metrics to plot.</p>"
    )
    name = html.escape(report["name"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{name} · nemo_rcgrpo report</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'">
<style>{_STYLE}</style></head><body>
<h1>{name}</h1>
<p>{html.escape(report["path"])} · {report["steps"]} logged steps{" · last: " + html.escape(last) if last else ""}</p>
<h2>Training dynamics</h2>{plot}
<h2>Evaluation</h2>{_eval_table(report["evals"])}
<h2>Rollouts</h2>
<div class="filters">
<label>step <select id="f-step"><option value="all">all</option></select></label>
<label>task <select id="f-task"><option value="all">all</option></select></label>
<label>reward token <select id="f-token"><option value="all">all</option></select></label>
<label>reward <select id="f-reward"><option value="all">all</option><option value="1">1 (success)</option>
<option value="&lt;1">below 1</option></select></label>
<span id="count"></span></div>
{f"<p id='note'>{html.escape(report['note'])}</p>" if report["note"] else ""}
<div id="episodes"></div><button id="more" hidden></button>
<h2>Config ({html.escape(report["config_name"] or "none")})</h2><pre id="config">{html.escape(report["config"])}</pre>
<script type="application/json" id="report-data">{payload}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


def write_report(run_dir: str | Path, out: str | Path, last_steps: int | None = None, everything: bool = False) -> Path:
    run_dir = Path(run_dir)
    report = collect(run_dir, last_steps, everything)
    if report["note"]:
        print(f"note: {report['note']}", file=sys.stderr)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(render_html(report, _plot_png(run_dir)), encoding="utf-8")
    tmp.replace(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rcgrpo report",
        description="one self-contained HTML page of a run: config, "
        "dynamics plot, eval table, every rollout with filters (stage 2 and eval runs)",
    )
    p.add_argument("run_dir", help="a training run folder (run_dir) or an evaluation's out_dir")
    p.add_argument("-o", "--out", default=None, help="the HTML file (default: RUN_DIR/report.html)")
    p.add_argument(
        "--last-steps",
        type=int,
        default=None,
        help=f"the rollouts of the last N steps (default: the last steps whose rollouts fit in {MAX_ROLLOUTS})",
    )
    p.add_argument("--all", action="store_true", help="every step's rollouts, however many")
    args = p.parse_args(argv)

    def report() -> int:
        print(write_report(args.run_dir, args.out or Path(args.run_dir) / "report.html", args.last_steps, args.all))
        return 0

    return run_command(report)  # ReportError: a folder that is not a run, its files unreadable


if __name__ == "__main__":
    sys.exit(main())
