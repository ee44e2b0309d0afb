"""PNG plots of a bench result (matplotlib, Agg backend: no display needed).

    write_plots(result, out_dir) -> [paths]
      compression_speedup.png   compression and speedup per dataset and config (bars; 1.0 = greedy)
      accepted_per_step.png     histogram of tokens accepted per decode step, per dataset and config
      step_latency.png          ms per decode step against tokens per step T (and the tuner's step cost)
`result` is the bench JSON object (see trt_lookahead.bench); rows without data are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _row_label(row: dict[str, Any]) -> str:
    label = str(row["config"])
    if row.get("config") == "auto" and row.get("resolved"):
        label += f" ({row['resolved']})"
    return label


def _ordered(values: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _subtitle(result: dict[str, Any]) -> str:
    m = result.get("machine", {})
    load = m.get("load") or []
    load_text = "/".join(f"{x:.1f}" for x in load[:3]) if load else "?"
    return (
        f"{Path(str(result.get('model', '?'))).name} {result.get('dtype', '')} {result.get('backend', '')}, "
        f"{result.get('max_new_tokens', '?')} new tokens\n"
        f"{m.get('cpu', '?')} x{m.get('cpus', '?')}, {m.get('threads', '?')} threads, load {load_text}, "
        f"{m.get('date', '')}"
    )


def plot_compression_speedup(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    rows = result["results"]
    datasets = _ordered([r["dataset"] for r in rows])
    labels = _ordered([_row_label(r) for r in rows])
    width = 0.8 / max(len(labels), 1)
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(datasets) + 5), 4.6), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, measure, title in (
        (axes[0, 0], "compression", "compression (tokens per step)"),
        (axes[0, 1], "speedup", "speedup vs greedy (decode time)"),
    ):
        for i, label in enumerate(labels):
            xs, ys = [], []
            for d, dataset in enumerate(datasets):
                row = next((r for r in rows if r["dataset"] == dataset and _row_label(r) == label), None)
                if row is not None and row.get(measure) is not None:
                    xs.append(d - 0.4 + width * (i + 0.5))
                    ys.append(row[measure])
            if xs:
                bars = ax.bar(xs, ys, width, label=label, color=cmap(i % 10))
                ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max([1.2] + [r.get(measure) or 0 for r in rows]) * 1.15)
    axes[0, 1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(_subtitle(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accepted_histogram(result: dict[str, Any], path: Path) -> Path | None:
    plt = _pyplot()
    rows = [r for r in result["results"] if r.get("accepted_histogram") and (r.get("T") or 0) > 1]
    if not rows:
        return None
    datasets = _ordered([r["dataset"] for r in rows])
    labels = _ordered([_row_label(r) for r in rows])
    max_k = max(int(k) for r in rows for k in r["accepted_histogram"])
    width = 0.8 / max(len(labels), 1)
    fig, axes = plt.subplots(1, len(datasets), figsize=(max(6.0, 4.2 * len(datasets)), 3.8), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for d, dataset in enumerate(datasets):
        ax = axes[0, d]
        for i, label in enumerate(labels):
            row = next((r for r in rows if r["dataset"] == dataset and _row_label(r) == label), None)
            if row is None:
                continue
            hist = {int(k): v for k, v in row["accepted_histogram"].items()}
            total = sum(hist.values()) or 1
            ks = range(1, max_k + 1)
            ax.bar([k - 0.4 + width * (i + 0.5) for k in ks], [hist.get(k, 0) / total for k in ks], width,
                   label=label, color=cmap(i % 10))
        ax.set_xticks(range(1, max_k + 1))
        ax.set_xlabel("tokens accepted in the step")
        ax.set_title(dataset, fontsize=10)
        if d == 0:
            ax.set_ylabel("fraction of decode steps")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle("tokens accepted per decode step: " + _subtitle(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step_latency(result: dict[str, Any], path: Path, step_cost_ms: dict[str, float] | None = None) -> Path | None:
    plt = _pyplot()
    rows = [r for r in result["results"] if r.get("T") and r.get("ms_per_step")]
    if not rows and not step_cost_ms:
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    markers = "osD^v<>"
    for d, dataset in enumerate(_ordered([r["dataset"] for r in rows])):
        pts = sorted((r["T"], r["ms_per_step"], _row_label(r)) for r in rows if r["dataset"] == dataset)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[d % len(markers)], linestyle=":",
                label=f"bench: {dataset}")
        if d == 0:  # one label per T (configs of equal T share a point)
            by_t: dict[int, list] = {}
            for t, ms, label in pts:
                by_t.setdefault(t, [ms, []])[1].append(label)
            for t, (ms, labels) in by_t.items():
                ax.annotate(", ".join(labels), (t, ms), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if step_cost_ms:
        costs = sorted((int(t), v) for t, v in step_cost_ms.items())
        ax.plot([c[0] for c in costs], [c[1] for c in costs], color="black", marker="x",
                label="tune: executor step + commit (its own run)")
    ax.set_xscale("log", base=2)
    ticks = sorted({int(r["T"]) for r in rows} | {int(t) for t in (step_cost_ms or {})})
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("tokens per step T = (W + G)(N - 1)")
    ax.set_ylabel("ms per decode step (median over prompts)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("step latency against T: " + _subtitle(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(
    result: dict[str, Any], out_dir: str | Path, step_cost_ms: dict[str, float] | None = None
) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_compression_speedup(result, out / "compression_speedup.png"),
        plot_accepted_histogram(result, out / "accepted_per_step.png"),
        plot_step_latency(result, out / "step_latency.png", step_cost_ms),
    ]
    return [p for p in written if p is not None]


def _series(levels: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The levels of each plotted line, by concurrency: one line per mode, and per prefill if several ran."""
    several = len({r.get("prefill") for r in levels}) > 1
    lines: dict[str, list[dict[str, Any]]] = {}
    for mode in _ordered([r["mode"] for r in levels]):
        for r in sorted((r for r in levels if r["mode"] == mode), key=lambda r: r["concurrency"]):
            lines.setdefault(f"{mode}, {r.get('prefill')} prefill" if several else mode, []).append(r)
    return lines


def write_concurrency_plots(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """concurrency.png: output tokens/s, TTFT and ITL (p50 solid, p95 dashed) against streams, per mode."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13.0, 4.2))
    panels = (
        ("tokens_per_second", None, "output tokens / s"),
        ("ttft_p50_ms", "ttft_p95_ms", "time to first token (ms)"),
        ("itl_p50_ms", "itl_p95_ms", "inter-token latency (ms)"),
    )
    for ax, (p50, p95, title) in zip(axes, panels, strict=True):
        for label, rows in _series(result["levels"]).items():
            xs = [r["concurrency"] for r in rows]
            (line,) = ax.plot(xs, [r[p50] for r in rows], marker="o", label=label)
            if p95:
                ax.plot(xs, [r[p95] for r in rows], marker=".", linestyle="--", color=line.get_color())
        ax.set_xscale("log", base=2)
        ticks = sorted({r["concurrency"] for r in result["levels"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(result['model']).name} {result['dtype']}: " + _subtitle(result), fontsize=8)
    fig.tight_layout()
    path = out / "concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
