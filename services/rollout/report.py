"""End-of-run report: PNG plots and a one-page HTML summary in <run_dir>/report/."""
from __future__ import annotations

import html
import json
import pathlib
from typing import Any

from services.rollout.store import RunDir

_TIME_PHASES = [("time/generation_s", "generation"), ("time/training_s", "training"),
                ("time/weight_sync_s", "weight sync")]


def _plot_lines(path: pathlib.Path, title: str, series: list[tuple[str, list[int], list[float]]],
                ylabel: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for label, xs, ys in series:
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_title(title)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(xs for _, xs, _ in series):
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_time(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in _TIME_PHASES:
        vals = [float(r.get(key, 0.0)) for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("time per step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _col(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        if key in r:
            xs.append(int(r["step"]))
            ys.append(float(r[key]))
    return xs, ys


def write_report(rd: RunDir) -> pathlib.Path:
    """Write plots and index.html for the run in `rd`; return the report folder."""
    out = rd.path / "report"
    out.mkdir(exist_ok=True)
    steps = rd.read_jsonl("metrics.jsonl")
    evals = rd.read_jsonl("eval.jsonl")
    info = rd.read_info()
    _plot_lines(out / "reward.png", "reward over steps",
                [("reward mean", *_col(steps, "reward_mean")), ("success rate", *_col(steps, "success_rate"))],
                "reward / rate")
    _plot_lines(out / "eval.png", "held-out greedy evaluation",
                [("eval success", *_col(evals, "eval/success_rate")),
                 ("eval reward", *_col(evals, "eval/reward_mean"))], "rate / reward")
    if steps:
        _plot_time(out / "time.png", steps)
    summary = {k: v for k, v in info.last_metrics.items() if not k.startswith("success/")}
    first_eval = evals[0].get("eval/success_rate") if evals else None
    last_eval = evals[-1].get("eval/success_rate") if evals else None
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>" for k, v in sorted(summary.items()))
    evline = (f"<p>Held-out greedy success: {first_eval:.2f} at step {evals[0]['step']} &rarr; "
              f"{last_eval:.2f} at step {evals[-1]['step']}</p>" if evals else "<p>No evaluation.</p>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>rlyard run {info.run_id}</title>
<style>body{{font-family:sans-serif;max-width:980px;margin:2em auto}}img{{width:48%}}
td{{padding:2px 8px;border-bottom:1px solid #ddd}}</style></head><body>
<h1>rlyard run {html.escape(info.run_id)} {html.escape(info.name)}</h1>
<p>State: <b>{info.state}</b> &mdash; {info.step}/{info.total_steps} steps &mdash; {html.escape(info.message)}</p>
{evline}
<img src="reward.png"><img src="eval.png">{'<img src="time.png">' if steps else ''}
<h2>Last step</h2><table>{rows}</table>
<h2>Config</h2><pre>{html.escape(json.dumps(json.loads((rd.path / 'config.json').read_text()), indent=1))}</pre>
</body></html>"""
    (out / "index.html").write_text(page)
    return out
