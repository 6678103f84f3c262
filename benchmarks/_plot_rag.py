#!/usr/bin/env python3
"""rag_qps.py's figure, drawn from its JSON alone: p95 and p99 latency (from each query's
scheduled time) against offered QPS, one line per scenario, with the SLO and each scenario's
closed-loop max QPS marked.

    python benchmarks/_plot_rag.py bench-results/rag_qps.json bench-results/rag_qps.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Optional

from _plot import pyplot, save

from flashstream.sizes import format_size

COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def plot_rag(payload: Dict[str, object], path: Path) -> Optional[Path]:
    plt = pyplot()
    if plt is None:
        return None
    capped = (payload.get("capped") or {}).get("runs") or {}
    rows = 2 if capped else 1
    fig, grid = plt.subplots(rows, max(2, len(capped)), figsize=(14, 5 * rows), squeeze=False)
    axes = grid[0]
    slo_ms = float(payload["config"]["slo"]) * 1e3
    if capped:
        _plot_capped(payload["capped"], grid[1], slo_ms)
    for ax in axes[2:]:
        ax.set_visible(False)
    for ax, pct in zip(axes, ("p95", "p99")):
        for color, s in zip(COLORS, payload["scenarios"]):
            runs = [r for r in s["open"] if r["latency_us"][pct] is not None]
            ax.plot([r["offered_qps"] for r in runs], [r["latency_us"][pct] / 1e3 for r in runs],
                    marker="o", color=color, label=_label(s))
            ax.axvline(s["closed"]["achieved_qps"], color=color, linestyle=":", linewidth=0.9)
        ax.axhline(slo_ms, color="gray", linestyle="--", linewidth=1,
                   label=f"SLO {slo_ms:g} ms (p95)")
        ax.set_yscale("log")
        ax.set_xlabel("offered QPS (dotted: closed-loop max QPS)")
        ax.set_title(f"{pct} latency from scheduled send time")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=8)
    env = payload["environment"]
    index = env.get("index") or {}
    fig.suptitle(f"{index.get('type')} of {index.get('ntotal', 0):,} x {index.get('d')} "
                 f"({format_size(int(index.get('file_bytes') or 0))}) on "
                 f"{env.get('device_name') or env.get('device')}, {env.get('threads')} threads, "
                 f"k={env.get('k')}", fontsize=11)
    return save(fig, path)


def _plot_capped(study: Dict[str, object], axes, slo_ms: float) -> None:
    """p95 against offered QPS, mmap and direct, one panel per condition (the second row)."""
    for ax in axes[1:len(study["runs"])]:
        ax.sharey(axes[0])
        ax.sharex(axes[0])
    for ax, (condition, runs) in zip(axes, study["runs"].items()):
        for io, color in (("mmap", "tab:blue"), ("direct", "tab:orange")):
            run = runs[io]
            levels = [r for r in run["levels"] if r["latency_us"]["p95"] is not None]
            label = f"{io}: {run['sustained_qps'] or 0:g} QPS at the SLO"
            ax.plot([r["offered_qps"] for r in levels],
                    [r["latency_us"]["p95"] / 1e3 for r in levels], marker="o", color=color,
                    label=label)
        ax.axhline(slo_ms, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered QPS (Zipf query stream)")
        ax.set_ylabel("p95 ms")
        load = {"alone": "alone", "checkpoint": "beside a checkpoint write",
                "epoch": "beside a ShardStream epoch"}[condition]
        ax.set_title(f"{load}\nindex {study['index_bytes'] / study['room']:.1f} x what the "
                     f"server may cache", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


def _label(scenario: Dict[str, object]) -> str:
    recall = scenario["closed"].get("recall")
    text = scenario["name"] + (f" (recall {recall:.3f})" if recall is not None else "")
    load = scenario.get("write_load")
    if load and load.get("gbps"):
        text += f", writes {load['gbps']:.2f} GB/s"
    return text


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    print(plot_rag(data, Path(sys.argv[2])))
