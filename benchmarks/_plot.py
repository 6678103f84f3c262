#!/usr/bin/env python3
"""The epoch benchmark's figure, drawn from its JSON alone (so any saved run can be re-drawn).

One row per profile: (1) read throughput over time as the device counted it, for the cold
ShardStream and cold webdataset epochs of the median round, with the probe's best sequential
read and fio's GB/s as horizontal lines; (2) the request-latency CDF of ShardStream's cold
epochs, with the probe's p95 at the nearest request shape marked.

    python benchmarks/_plot.py bench-results/epoch.json bench-results/epoch.png
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

from flashstream.sizes import format_size  # noqa: E402

COLORS = {"ShardStream": "tab:blue", "webdataset": "tab:orange", "probe": "tab:green",
          "fio": "tab:gray"}


def plot_epoch(payload: Dict[str, object], path: Path) -> Optional[Path]:
    """Draw the figure for an epoch.py JSON payload into ``path``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display, and no GUI toolkit to import
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = payload["results"]
    fig, axes = plt.subplots(len(results), 2, figsize=(13, 4.3 * len(results)), squeeze=False)
    for (name, result), (left, right) in zip(results.items(), axes):
        run = result["rounds"][_bench.median_round(result["rounds"])]
        _throughput(left, name, run, result["median"], payload.get("probe"))
        _latency_cdf(right, name, run)
    fig.suptitle(_title(payload), fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(payload: Dict[str, object]) -> str:
    env, loader = payload["environment"], payload["loader"]
    batch = f"batch {loader['batch_size']}" if loader["batch_size"] else "per-sample"
    if loader.get("collate"):
        batch += f", collate {loader['collate']}"
    sizes = ", ".join(f"{name} samples: {r['bytes'] / 1e9:.2f} GB in {len(r['shards'])} shards"
                      for name, r in payload["results"].items())
    return (f"Cold epochs on {env.get('device_name') or env['device']} "
            f"({env.get('device_model') or 'unknown model'}), engine {env['engine']} — "
            f"workers {loader['workers']}, {batch}, epochs {loader['epochs']}, "
            f"median round of {loader['rounds']}\n{sizes}")


def _stitched(epochs: Sequence[Dict[str, object]]) -> Tuple[List[float], List[float]]:
    """The epochs' device timelines laid end to end (eviction time between them left out).

    Each point is the rate over the interval ending at t, so the line starts at t=0 with the
    first interval's rate and is drawn as steps."""
    ts: List[float] = []
    rates: List[float] = []
    offset = 0.0
    for epoch in epochs:
        timeline = [tuple(p[:2]) for p in epoch.get("disk_timeline") or []]
        timeline += _last_interval(timeline, _disk_totals(epoch))
        if timeline:
            ts.append(offset)
            rates.append(timeline[0][1])
        for t, read in timeline:
            ts.append(offset + t)
            rates.append(read)
        offset += epoch["seconds"]
    return ts, rates


def _disk_totals(epoch: Dict[str, object]) -> Optional[Dict[str, object]]:
    """The device totals of the epoch: in the EpochReport for ShardStream, beside it for
    webdataset."""
    return (epoch.get("report") or {}).get("disk") or epoch.get("disk")


def _last_interval(timeline: List[Tuple[float, float]],
                   disk: Optional[Dict[str, object]]) -> List[Tuple[float, float]]:
    """The rate between the last sample and the end of the epoch, from the epoch's totals:
    without it an epoch shorter than a few sampling intervals would hardly show."""
    if not disk or not disk.get("seconds"):
        return []
    last, sampled = 0.0, 0.0
    for t, read in timeline:
        sampled += read * 1e9 * (t - last)
        last = t
    width = disk["seconds"] - last
    if width < 0.01:  # too short a tail to say anything
        return []
    return [(disk["seconds"], max(0.0, disk["read_bytes"] - sampled) / width / 1e9)]


def _throughput(ax, name: str, run: Dict[str, object], median: Dict[str, object],
                probe: Optional[Dict[str, object]]) -> None:
    for key, label in (("cold_shardstream", "ShardStream"), ("cold_webdataset", "webdataset")):
        if not run.get(key):
            continue
        ts, rates = _stitched(run[key]["epochs"])
        if ts:
            ax.step(ts, rates, where="pre", color=COLORS[label], marker=".", markersize=3,
                    label=f"{label} cold ({run[key]['gbps']:.2f} GB/s of shards)")
    best = (probe or {}).get("best_read_gbps")
    if best:
        ax.axhline(best, color=COLORS["probe"], linestyle="--",
                   label=f"probe best sequential read ({best:.2f} GB/s)")
    fio = (median.get("cold_fio") or {}).get("gbps")
    if fio:
        ax.axhline(fio, color=COLORS["fio"], linestyle=":", label=f"fio ({fio:.2f} GB/s)")
    epochs = len(run["cold_shardstream"]["epochs"])
    ax.set_xlabel("seconds" + (f" ({epochs} epochs end to end)" if epochs > 1 else ""))
    ax.set_ylabel("device read GB/s")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set_title(f"{name}: read throughput over time (device counters)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def _latency_cdf(ax, name: str, run: Dict[str, object]) -> None:
    epochs = run["cold_shardstream"]["epochs"]
    for i, epoch in enumerate(epochs):
        cdf = epoch.get("latency_cdf") or {}
        if cdf.get("us"):
            # Start from 0 at the first bucket, so the rise to the first fraction shows.
            ax.step(cdf["us"][:1] + cdf["us"], [0.0] + cdf["fraction"], where="post",
                    color=COLORS["ShardStream"], alpha=1.0 if i == 0 else 0.4,
                    label="ShardStream cold, epoch 1" if i == 0 else
                    ("later epochs" if i == 1 else None))
    report = epochs[0]["report"]
    shape = epochs[0].get("probe_same_shape")
    if shape and shape.get("p95_us"):
        ax.axvline(shape["p95_us"], color=COLORS["probe"], linestyle="--",
                   label=f"probe p95 at {format_size(shape['block_size'])} x "
                         f"{shape['queue_depth']} ({shape['p95_us']:,.0f} us)")
    p95 = report["request_latency_us"].get("p95")
    if p95:
        ax.axvline(p95, color=COLORS["ShardStream"], linestyle=":",
                   label=f"ShardStream p95 ({p95:,.0f} us)")
    ax.axhline(0.95, color="black", linewidth=0.5, alpha=0.4)
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set_xlabel("request latency (us, log scale)")
    ax.set_ylabel("fraction of read requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name}: ShardStream read-request latency CDF "
                 f"({format_size(report['chunk_size'])} x {report['queue_depth']} in flight)",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")


def _plain_log_labels(axis) -> None:
    """Label a log axis 1,000 / 2,000 / 3,000 / 5,000 rather than 10^3 and 2x10^3: latencies are
    read as numbers of microseconds."""
    from matplotlib.ticker import FuncFormatter

    def minor(value: float, _pos) -> str:
        lead = round(value / 10 ** math.floor(math.log10(value)))
        return f"{value:,.0f}" if lead in (2, 3, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.0f}"))
    axis.set_minor_formatter(FuncFormatter(minor))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: _plot.py EPOCH_JSON OUT_PNG")
    out = plot_epoch(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    print(out or "matplotlib is not installed: pip install matplotlib")
