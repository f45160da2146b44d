"""PNG plots for `mooncake simulate paper --out DIR`, next to `paper.md`.

One figure per experiment of `sim/paper.py`, drawn from the same result dict the Markdown
tables come from (and the load series of the overload runs). Figures are built with the
object API on the Agg canvas, never pyplot: no global state, no display needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mooncake.sim.metrics import TBT_THRESHOLDS_MS
from mooncake.sim.runner import SYSTEMS

Samples = dict[str, list[tuple[float, float, float]]]
# No timestamp or version in the file: the same numbers draw the same bytes.
_PNG_META = {"Software": None}


def _figure(rows: int, cols: int, width: float, height: float) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png", dpi=100, metadata=_PNG_META)
    return path


def _bars(ax: Axes, groups: Sequence[str], series: Mapping[str, Sequence[float]]) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series."""
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(groups)), list(groups))
    # Headroom above the tallest bar for a one-row legend that covers no bar.
    top = max((v for values in series.values() for v in values), default=1.0)
    ax.set_ylim(0, (top or 1.0) * 1.25)
    ax.legend(fontsize="small", loc="upper center", ncols=len(series))


def plot_capacity(r: dict[str, Any], out: Path) -> Path:
    caps = r["effective_capacity"]
    fig, axes = _figure(1, len(caps), 5.5 * len(caps), 4)
    for ax, (trace, by_system) in zip(axes, caps.items(), strict=True):
        series = {str(s): [by_system[s][str(ms)] for ms in TBT_THRESHOLDS_MS] for s in SYSTEMS}
        _bars(ax, [f"TBT {ms} ms" for ms in TBT_THRESHOLDS_MS], series)
        ax.set_ylabel("effective request capacity")
        ax.set_title(f"{trace} (speed {r['capacity_speed']}x)")
    fig.suptitle("Effective request capacity (TTFT <= 30 s and TBT <= threshold)")
    return _save(fig, out / "capacity.png")


def plot_hit_rate(r: dict[str, Any], out: Path) -> Path:
    hr = r["hit_rate"]
    variants = {
        "global": "global pool",
        "local": "local (LB)",
        "local_cache_aware": "local (aware)",
    }
    traces = list(hr)
    fig, (hit_ax, pre_ax) = _figure(1, 2, 11, 4)
    _bars(hit_ax, traces, {lbl: [hr[t][k] for t in traces] for k, lbl in variants.items()})
    hit_ax.set_ylabel("prefix cache hit rate (tokens)")
    hit_ax.set_title("Hit rate, 10 prefill nodes x 3 M tokens")
    pre = {lbl: [hr[t]["prefill_s"][k] for t in traces] for k, lbl in variants.items()}
    _bars(pre_ax, traces, pre)
    pre_ax.set_ylabel("prefill GPU time (s)")
    pre_ax.set_title("Prefill compute time")
    fig.suptitle("Global KVCache pool vs per-node local caches (FAST'25 Fig. 10)")
    return _save(fig, out / "hit_rate.png")


def plot_scheduling(r: dict[str, Any], out: Path, paper: dict[str, float]) -> Path:
    s = r["scheduling_ttft_mean_s"]
    fig, (ax,) = _figure(1, 1, 7, 4)
    names = list(s)
    _bars(ax, names, {"simulated": [s[n] for n in names], "paper": [paper[n] for n in names]})
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("Scheduling policies, conversation trace (FAST'25 Fig. 5)")
    return _save(fig, out / "scheduling.png")


def plot_overload(r: dict[str, Any], out: Path) -> Path:
    setups = r["overload"]
    fig, axes = _figure(1, len(setups), 5.5 * len(setups), 4)
    for ax, (label, rows) in zip(axes, setups.items(), strict=True):
        policies = list(rows)
        series = {
            "rejected": [rows[p]["rejected"] for p in policies],
            "goodput": [rows[p]["goodput"] for p in policies],
            "wasted prefills": [rows[p]["wasted_prefills"] for p in policies],
        }
        _bars(ax, policies, series)
        ax.set_ylabel("requests")
        ax.set_title(label)
    fig.suptitle("Overload: rejection policies, conversation trace at 2x (arXiv v3 Table 3)")
    return _save(fig, out / "overload.png")


def plot_load(samples: Samples, setup: str, out: Path) -> Path | None:
    """Prefill and decode load over time under each policy of one overload setup: the
    anti-phase oscillation of early rejection (PAPER.md §5) and whether prediction damps it."""
    runs = {k.removeprefix(f"{setup}_"): v for k, v in samples.items() if k.startswith(f"{setup}_")}
    if not runs:
        return None
    fig, axes = _figure(len(runs), 1, 10, 2.4 * len(runs))
    for ax, (policy, series) in zip(axes, runs.items(), strict=True):
        ts = [t for t, _, _ in series]
        ax.plot(ts, [p for _, p, _ in series], label="prefill load (TTFT / limit)", lw=0.8)
        ax.plot(ts, [d for _, _, d in series], label="decode load (TBT / limit)", lw=0.8)
        ax.axhline(1.0, color="grey", ls="--", lw=0.6)
        top = max((max(p, d) for _, p, d in series), default=1.0)
        ax.set_ylim(0, max(top, 1.0) * 1.3)
        ax.set_ylabel(f"{policy}: load")
        ax.legend(fontsize="small", loc="upper left", ncols=2)
    axes[-1].set_xlabel("simulated time (s)")
    fig.suptitle(f"Load over time, {setup}")
    return _save(fig, out / f"load_{setup}.png")


def plot_pd_ratio(r: dict[str, Any], out: Path) -> Path:
    pd = r["pd_ratio"]
    ratios = list(pd)
    xs = range(len(ratios))  # positions, not the "8P8D" strings (matplotlib parses those as dates)
    fig, (good_ax, ttft_ax) = _figure(1, 2, 10, 4)
    good_ax.plot(xs, [pd[k]["goodput"] for k in ratios], marker="o")
    good_ax.set_ylabel("goodput (requests)")
    good_ax.set_title("Goodput")
    ttft_ax.plot(xs, [pd[k]["ttft_mean_s"] for k in ratios], marker="o")
    ttft_ax.set_ylabel("mean TTFT (s)")
    tbt_ax = ttft_ax.twinx()
    tbt_ax.plot(xs, [pd[k]["tbt_p90_s"] for k in ratios], marker="s", color="C1")
    tbt_ax.set_ylabel("p90 TBT (s)", color="C1")
    ttft_ax.set_title("Latency")
    for ax in (good_ax, ttft_ax):
        ax.set_xticks(xs, ratios)
    fig.suptitle("P:D ratio on 16 nodes (synthetic, TTFT 10 s, TBT 100 ms)")
    return _save(fig, out / "pd_ratio.png")


def write_plots(
    r: dict[str, Any], samples: Samples, out: Path, paper_sched_ttft: dict[str, float]
) -> list[Path]:
    written = [
        plot_capacity(r, out),
        plot_hit_rate(r, out),
        plot_scheduling(r, out, paper_sched_ttft),
        plot_overload(r, out),
    ]
    for setup in r["overload"]:
        path = plot_load(samples, setup, out)
        if path is not None:
            written.append(path)
    written.append(plot_pd_ratio(r, out))
    return written
