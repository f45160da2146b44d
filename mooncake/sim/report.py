"""Markdown tables, CSV load series and PNG plots for `mooncake simulate paper --out DIR`.

The plots (`sim/plots.py`) are drawn from the same result dict as the tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mooncake.sim.metrics import TBT_THRESHOLDS_MS
from mooncake.sim.runner import SYSTEMS

PAPER_CAPACITY_GAIN = {"conversation": (498, 157, 59), "synthetic": (62, 40, 28)}
PAPER_HIT_RATIO = {"conversation": 2.22, "synthetic": 2.36}
PAPER_PREFILL_RATIO = {"conversation": 0.76, "synthetic": 0.52}
PAPER_REJECTIONS = {"baseline": 4183, "early": 3771, "predicted": 3589}  # `forecast` is ours
PAPER_SCHED_TTFT = {
    "random": 19.65,
    "load-balancing": 5.27,
    "local-cache-aware": 3.58,
    "global-cache-aware": 3.07,
}


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _gain(ours: float, base: float) -> str:
    return f"{(ours / base - 1) * 100:+.0f} %" if base > 0 else "n/a (baseline 0)"


def hit_rate_md(r: dict[str, Any]) -> str:
    rows = []
    for name, h in r["hit_rate"].items():
        rows.append([
            name, h["global"], h["local"], h["local_cache_aware"],
            f"{h['ratio']:.2f}x / {h['ratio_cache_aware']:.2f}x", f"{PAPER_HIT_RATIO[name]}x",
            f"x{h['prefill_ratio']:.2f} / x{h['prefill_ratio_cache_aware']:.2f}",
            f"x{PAPER_PREFILL_RATIO[name]}",
        ])  # fmt: skip
    head = [
        "trace", "global", "local (LB)", "local (cache-aware)", "ratio (LB / aware)",
        "paper ratio", "prefill time (LB / aware)", "paper prefill",
    ]  # fmt: skip
    return "## Global pool vs local caches (10 prefill nodes, 3 M tokens each)\n\n" + table(
        head, rows
    )


def capacity_md(r: dict[str, Any]) -> str:
    parts = [f"## Effective request capacity (speed {r['capacity_speed']}x)\n"]
    for name, caps in r["effective_capacity"].items():
        rows = [[s, *(caps[s][str(ms)] for ms in TBT_THRESHOLDS_MS)] for s in SYSTEMS]
        best = [max(caps[s][str(ms)] for s in SYSTEMS[1:]) for ms in TBT_THRESHOLDS_MS]
        ours = [caps["mooncake"][str(ms)] for ms in TBT_THRESHOLDS_MS]
        vllm = [caps["vllm"][str(ms)] for ms in TBT_THRESHOLDS_MS]
        rows.append(["mooncake vs vllm", *(_gain(o, b) for o, b in zip(ours, vllm, strict=True))])
        rows.append(
            ["mooncake vs best baseline", *(_gain(o, b) for o, b in zip(ours, best, strict=True))]
        )
        rows.append(["paper (vs vllm)", *(f"+{g} %" for g in PAPER_CAPACITY_GAIN[name])])
        head = ["system", *(f"TBT {ms} ms" for ms in TBT_THRESHOLDS_MS)]
        parts.append(f"### {name}\n\n" + table(head, rows) + "\n")
        pre = r["prefill_compute_s"][name]
        prow = [[s, pre[s], f"{pre[s] / pre['vllm']:.2f}"] for s in SYSTEMS]
        parts.append(table(["system", "prefill GPU s", "vs vllm"], prow) + "\n")
    return "\n".join(parts)


def scheduling_md(r: dict[str, Any]) -> str:
    s = r["scheduling_ttft_mean_s"]
    rows = [[k, v, PAPER_SCHED_TTFT[k]] for k, v in s.items()]
    return "## Scheduling policies: mean TTFT (s), conversation\n\n" + table(
        ["scheduler", "ours", "paper"], rows
    )


def overload_md(r: dict[str, Any]) -> str:
    parts = ["## Overload: rejection policies (conversation trace at 2x)\n"]
    for label, rows_by in r["overload"].items():
        rows = [
            [p, v["rejected"], v["by_stage"], v["wasted_prefills"], v["goodput"],
             v["prefill_load_mean"], v["decode_load_mean"], v["decode_load_std"],
             v["prefill_decode_corr"],
             PAPER_REJECTIONS.get(p, "") if label == "paper_8p8d" else ""]
            for p, v in rows_by.items()
        ]  # fmt: skip
        head = [
            "policy", "rejected", "by stage", "wasted prefills", "goodput",
            "prefill load mean", "decode load mean", "decode load std",
            "corr(prefill, decode)", "paper rejected",
        ]  # fmt: skip
        parts.append(f"### {label}\n\n" + table(head, rows) + "\n")
    return "\n".join(parts)


def pd_md(r: dict[str, Any]) -> str:
    rows = [[k, *v.values()] for k, v in r["pd_ratio"].items()]
    head = ["P:D", "goodput", "rejected", "mean TTFT s", "p90 TBT s"]
    return "## P:D ratio on 16 nodes (synthetic, TTFT 10 s, TBT 100 ms)\n\n" + table(head, rows)


def cpp_md(r: dict[str, Any]) -> str:
    c = r.get("cpp")
    if not c:
        return ""
    rows = []
    for trace, by_policy in c.items():
        if not isinstance(by_policy, dict):
            continue
        for policy, row in by_policy.items():
            off, on = row["off"], row["on"]
            rows.append([
                trace, policy,
                f"{off['long_ttft_p90_s']} -> {on['long_ttft_p90_s']}",
                f"{off['long_ttft_p99_s']} -> {on['long_ttft_p99_s']}",
                f"{off['ttft_mean_s']} -> {on['ttft_mean_s']}",
                f"{off['rejected']} -> {on['rejected']}", on["cpp_prefills"],
            ])  # fmt: skip
    head = [
        "trace", "policy", f"TTFT p90 s, prompts >= {c['long_prompt_tokens']}", "... p99 s",
        "mean TTFT s (all)", "rejected", "prefills on a group",
    ]  # fmt: skip
    return (
        f"## Chunked pipeline parallelism (8P+8D, groups of up to {c['max_stages']}; "
        "without -> with)\n\n" + table(head, rows)
    )


def write_report(
    r: dict[str, Any], samples: dict[str, list[tuple[float, float, float]]], out: Path
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    head = (
        f"# Simulated paper experiments\n\nquick: {r['quick']}; requests: {r['requests']}; "
        f"elapsed {r['elapsed_s']} s. Plots: `capacity.png`, `hit_rate.png`, "
        "`scheduling.png`, `overload.png`, `load_<setup>.png`, `pd_ratio.png`; the load "
        "series are also in the CSV files.\n"
    )
    body = [
        head, hit_rate_md(r), capacity_md(r), scheduling_md(r), overload_md(r), pd_md(r),
        cpp_md(r),
    ]  # fmt: skip
    md = out / "paper.md"
    md.write_text("\n\n".join(body) + "\n", encoding="utf-8")
    written = [md]
    for key, series in samples.items():
        path = out / f"load_{key}.csv"
        lines = ["t_s,prefill_load,decode_load"]
        lines += [f"{t},{p:.4f},{d:.4f}" for t, p, d in series]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written.append(path)
    from mooncake.sim.plots import write_plots  # matplotlib: imported only when writing

    written += write_plots(r, samples, out, PAPER_SCHED_TTFT)
    return written
