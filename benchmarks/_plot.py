#!/usr/bin/env python3
"""The benchmarks' figures, drawn from their JSON alone (so any saved run can be re-drawn).

epoch.py:
One row per data set: (1) read throughput over time as the device counted it, for each
loader's cold epoch of the median round, with the probe's best sequential read and fio's GB/s
as horizontal lines; (2) samples/s per loader (median over rounds) with its core-seconds per
GB, the ratios written beside; (3) the request-latency CDF of the flashstream epoch read through
DataLoader workers, with the probe's p95 at the nearest request shape marked.

checkpoint.py: write GB/s over time per writer, the stall per save, and (with --reader) the
reader's p95 beside each writer; see plot_checkpoint.

    python benchmarks/_plot.py bench-results/epoch.json bench-results/epoch.png
    python benchmarks/_plot.py bench-results/checkpoint.json bench-results/checkpoint.png
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

from flashstream.sizes import format_size  # noqa: E402

COLORS = {"ShardStream": "tab:blue", "webdataset": "tab:orange", "probe": "tab:green",
          "fio": "tab:gray"}
LOADER_STYLE = {  # loader -> (label, color)
    "inprocess": ("ShardStream in process", "tab:cyan"),
    "tensors": ("tensors(B) via workers", "tab:blue"),
    "webdataset": ("webdataset chain via workers", "tab:orange"),
    "decode_flashstream": ("flashstream decode chain", "tab:blue"),
    "decode_webdataset": ("webdataset decode chain", "tab:orange"),
}


def pyplot():
    """matplotlib's pyplot drawing to files only (no display, no GUI toolkit to import), or
    None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, path: Path) -> Path:
    """Lay out, write (making the directory) and close ``fig``; returns ``path``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_epoch(payload: Dict[str, object], path: Path) -> Optional[Path]:
    """Draw the figure for an epoch.py JSON payload into ``path``; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    results = payload["results"]
    fig, axes = plt.subplots(len(results), 3, figsize=(18, 4.3 * len(results)), squeeze=False,
                             gridspec_kw={"width_ratios": [5, 3, 4]})
    for (name, result), (left, middle, right) in zip(results.items(), axes):
        monitored = "tensors" if "tensors" in result["loaders"] else "decode_flashstream"
        run = result["rounds"][_bench.median_round(result["rounds"], monitored)]
        _throughput(left, name, run, result, payload.get("probe"))
        _rates(middle, name, result)
        _latency_cdf(right, name, run.get(monitored))
    fig.suptitle(_title(payload), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return save(fig, path)


def _title(payload: Dict[str, object]) -> str:
    env, loader = payload["environment"], payload["loader"]
    sizes = ", ".join(f"{name}: {r['bytes'] / 1e9:.2f} GB in {len(r['shards'])} shards"
                      for name, r in payload["results"].items())
    return (f"Cold epochs on {env.get('device_name') or env['device']} "
            f"({env.get('device_model') or 'unknown model'}), engine {env['engine']} — "
            f"{loader['workers']} DataLoader workers, batch {loader['batch_size']}, "
            f"median round of {loader['rounds']}\n{sizes}")


def _timeline(epoch: Dict[str, object]) -> Tuple[List[float], List[float]]:
    """The epoch's device timeline: each point is the rate over the interval ending at t,
    drawn as steps from t=0; the tail after the last sample comes from the epoch's totals."""
    timeline = [tuple(p[:2]) for p in epoch.get("disk_timeline") or []]
    timeline += _last_interval(timeline, _disk_totals(epoch))
    if not timeline:
        return [], []
    return [0.0] + [t for t, _ in timeline], [timeline[0][1]] + [r for _, r in timeline]


def _disk_totals(epoch: Dict[str, object]) -> Optional[Dict[str, object]]:
    """The device totals of the epoch: in the EpochReport for flashstream, beside it for
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


def _throughput(ax, name: str, run: Dict[str, object], result: Dict[str, object],
                probe: Optional[Dict[str, object]]) -> None:
    for key in result["loaders"]:
        if key == "fio" or not run.get(key):
            continue
        label, color = LOADER_STYLE[key]
        ts, rates = _timeline(run[key])
        if ts:
            ax.step(ts, rates, where="pre", color=color, marker=".", markersize=3,
                    label=f"{label} ({run[key]['gbps']:.2f} GB/s of shards)")
    best = (probe or {}).get("best_read_gbps")
    if best:
        ax.axhline(best, color=COLORS["probe"], linestyle="--",
                   label=f"probe best sequential read ({best:.2f} GB/s)")
    fio = (result["median"].get("fio") or {}).get("gbps")
    if fio:
        ax.axhline(fio, color=COLORS["fio"], linestyle=":", label=f"fio ({fio:.2f} GB/s)")
    ax.set_xlabel("seconds into the epoch (DataLoader start included)")
    ax.set_ylabel("device read GB/s")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set_title(f"{name}: read throughput over time (device counters)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def _rates(ax, name: str, result: Dict[str, object]) -> None:
    median = result["median"]
    keys = [k for k in result["loaders"] if k != "fio" and median.get(k)]
    values = [median[k]["samples_per_s"] for k in keys]
    bars = ax.barh([LOADER_STYLE[k][0] for k in keys], values,
                   color=[LOADER_STYLE[k][1] for k in keys])
    for bar, key, value in zip(bars, keys, values):
        cpu = median[key].get("cpu_s_per_gb")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {value:,.0f}" + ("" if cpu is None else f"  ({cpu:.2f} core-s/GB)"),
                va="center", fontsize=8)
    notes = [f"{k.replace('_', ' ')}: {median[k]:.2f}x" for k in
             ("tensors_vs_inprocess", "tensors_cpu_vs_webdataset", "decode_vs_webdataset",
              "decode_cpu_vs_webdataset", "tensors_vs_webdataset")
             if median.get(k) is not None]
    if notes:
        ax.text(0.98, 0.02, "\n".join(notes), transform=ax.transAxes, ha="right", va="bottom",
                fontsize=8, bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.8"})
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (median over rounds)")
    ax.set_title(f"{name}: samples/s reaching the loop, and CPU per GB", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    ax.set_xlim(right=max(values, default=1) * 1.6)  # room for the labels beside the bars
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=4))


def _latency_cdf(ax, name: str, epoch: Optional[Dict[str, object]]) -> None:
    cdf = (epoch or {}).get("latency_cdf") or {}
    if not cdf.get("us"):
        ax.set_axis_off()
        return
    # Start from 0 at the first bucket, so the rise to the first fraction shows.
    ax.step(cdf["us"][:1] + cdf["us"], [0.0] + cdf["fraction"], where="post",
            color=COLORS["ShardStream"], label="flashstream reads, through workers")
    report = epoch["report"]
    shape = epoch.get("probe_same_shape")
    if shape and shape.get("p95_us"):
        ax.axvline(shape["p95_us"], color=COLORS["probe"], linestyle="--",
                   label=f"probe p95 at {format_size(shape['block_size'])} x "
                         f"{shape['queue_depth']} ({shape['p95_us']:,.0f} us)")
    p95 = report["request_latency_us"].get("p95")
    if p95:
        ax.axvline(p95, color=COLORS["ShardStream"], linestyle=":",
                   label=f"flashstream p95 ({p95:,.0f} us)")
    ax.axhline(0.95, color="black", linewidth=0.5, alpha=0.4)
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set_xlabel("request latency (us, log scale)")
    ax.set_ylabel("fraction of read requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name}: read-request latency CDF "
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
        return f"{value:,.0f}" if lead in (2, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.0f}"))
    axis.set_minor_formatter(FuncFormatter(minor))


# -- checkpoint.py ------------------------------------------------------------------------------
WRITER_COLORS = {"torch.save": "tab:orange", "dcp": "tab:purple", "unpaced": "tab:blue",
                 "fixed": "tab:green", "auto": "tab:red", "copy": "tab:cyan"}


def plot_checkpoint(payload: Dict[str, object], path: Path) -> Optional[Path]:
    """Draw checkpoint.py's figure from its JSON payload: (1) write GB/s over time of each
    writer's last save (CheckpointWriter from its SaveReport timeline, with the pacing rate in
    force dashed; torch.save and dcp from the device counters), with fio's sequential write;
    (2) the stall per save; (3) with --reader, the reader's p95 request latency beside each
    writer against idle. None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    writers = {k: v for k, v in payload["writers"].items() if "error" not in v}
    reader = any(v.get("reader") for v in writers.values())
    fig, axes = plt.subplots(1, 3 if reader else 2, figsize=(18 if reader else 13, 4.8),
                             gridspec_kw={"width_ratios": [2.2, 1, 1][:3 if reader else 2]})
    _write_timelines(axes[0], writers, payload.get("fio") or {})
    _stalls(axes[1], writers)
    if reader:
        _reader_p95(axes[2], writers, payload.get("reader_idle") or {})
    env, config = payload["environment"], payload["config"]
    fig.suptitle(f"Checkpoint saves of {format_size(int(env.get('state_bytes') or 0))} "
                 f"({env.get('tensors')} tensors) on {env.get('device_name') or env['device']} "
                 f"({env.get('device_model') or 'unknown model'}), engine {env['engine']}, "
                 f"{config['saves']} saves per writer", fontsize=11)
    return save(fig, path)


def _write_timelines(ax, writers: Dict[str, Dict], fio: Dict[str, object]) -> None:
    for name, result in writers.items():
        save = result["saves"][-1]
        points = save.get("write_timeline") or []
        color = WRITER_COLORS.get(name)
        if points:
            ts = [save.get("write_start_s", 0.0)] + [p[0] for p in points]
            ax.step(ts, [points[0][1]] + [p[1] for p in points], where="pre", color=color,
                    label=f"{result['label']} ({save['gbps']:.2f} GB/s end to end)")
        rates = [r for r in save.get("rate_timeline") or [] if r[1] > 0]
        if rates:
            ax.step([r[0] for r in rates], [r[1] for r in rates], where="pre", color=color,
                    linestyle="--", linewidth=0.9, alpha=0.7)
    if fio.get("gbps"):
        ax.axhline(fio["gbps"], color=COLORS["fio"], linestyle=":",
                   label=f"fio sequential write ({fio['gbps']:.2f} GB/s)")
    ax.set_xlabel("seconds since the save was called (last save of each writer)")
    ax.set_ylabel("write GB/s")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title("write throughput over time (CheckpointWriter: its own timeline, pacing rate "
                 "dashed; others: device counters)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _stalls(ax, writers: Dict[str, Dict]) -> None:
    names = list(writers)
    xs = range(len(names))
    first = [writers[n]["stall_first_s"] * 1e3 for n in names]
    later = [writers[n]["stall_s"] * 1e3 for n in names]
    ax.bar([x - 0.2 for x in xs], first, width=0.4, color="lightgray", label="first save")
    ax.bar([x + 0.2 for x in xs], later, width=0.4,
           color=[WRITER_COLORS.get(n, "tab:gray") for n in names], label="median of the others")
    ax.set_xticks(list(xs), [writers[n]["label"].replace("CheckpointWriter", "CW") for n in names],
                  rotation=20, fontsize=7, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("stall (ms, log scale)")
    ax.set_title("training stall per save", fontsize=10)
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=7)


def _reader_p95(ax, writers: Dict[str, Dict], idle: Dict[str, object]) -> None:
    names = [n for n in writers if writers[n].get("reader")]
    values = [writers[n]["reader"]["p95_us"] / 1e3 for n in names]
    ax.bar(range(len(names)), values, color=[WRITER_COLORS.get(n, "tab:gray") for n in names])
    if idle.get("p95_us"):
        ax.axhline(idle["p95_us"] / 1e3, color="black", linestyle="--",
                   label=f"idle ({idle['p95_us'] / 1e3:.1f} ms)")
        ax.legend(fontsize=7)
    ax.set_xticks(range(len(names)),
                  [writers[n]["label"].replace("CheckpointWriter", "CW") for n in names],
                  rotation=20, fontsize=7, ha="right")
    ax.set_ylabel("p95 read-request latency (ms)")
    ax.set_title("cold ShardStream epochs beside each save", fontsize=10)
    ax.grid(alpha=0.3, axis="y")


PLOTS = {"epoch": plot_epoch, "checkpoint": plot_checkpoint}

if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: _plot.py EPOCH_OR_CHECKPOINT_JSON OUT_PNG")
    data = json.loads(Path(sys.argv[1]).read_text())
    out = PLOTS["checkpoint" if "writers" in data else "epoch"](data, Path(sys.argv[2]))
    print(out or "matplotlib is not installed: pip install matplotlib")
