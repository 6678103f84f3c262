#!/usr/bin/env python3
"""checkpoint.py --emulate's figure, drawn from its JSON alone: one row per writer, over time,
the emulated cache's fill and the drive's write rate (left axis), the reader's latency per
read (right axis, log), the cliff shaded, each save's due time and deadline marked.

    python benchmarks/_plot_emulated.py bench-results/checkpoint-emulated.json out.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot  # noqa: E402


def plot(payload: Dict[str, object], path: Path) -> Optional[Path]:
    plt = _plot.pyplot()
    if plt is None:
        return None
    modes: Dict[str, Dict] = payload["modes"]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 2.8 * len(modes)), squeeze=False,
                             sharex=False)
    for ax, (mode, result) in zip(axes[:, 0], modes.items()):
        _row(ax, mode, result, payload)
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=4)
    fig.suptitle(f"emulated {payload['emulated']} drive: cache "
                 f"{payload['settings']['cache_size'] / 1e9:.2f} GB, post-cache "
                 f"{payload['settings']['post_cache_rate'] / 1e9:.2f} GB/s; saves of "
                 f"{payload['schedule']['save_size'] / 1e9:.2f} GB every "
                 f"{payload['schedule']['gap']:.1f} s", fontsize=10)
    return _plot.save(fig, path)


def _row(ax, mode: str, result: Dict, payload: Dict) -> None:
    points = result["timeline"]
    t = [p[0] for p in points]
    ax.fill_between(t, [p[1] / 1e9 for p in points], color="tab:blue", alpha=0.25,
                    label="cache fill (GB)")
    ax.plot(t, [p[3] / 1e9 for p in points], color="tab:blue", lw=0.8,
            label="drive writes (GB/s)")
    for start, end in _spans([(p[0], p[2]) for p in points]):
        ax.axvspan(start, end, color="tab:red", alpha=0.15, lw=0)
    for save in result["saves"]:
        ax.axvline(save["due_s"], color="tab:gray", lw=0.7, ls=":")
        ax.axvline(save["due_s"] + save["deadline_s"], color="tab:gray", lw=0.7, ls="--")
    ax.axhline(payload["settings"]["cache_size"] / 1e9, color="tab:blue", lw=0.5, ls="--")
    ax.set_ylabel("GB  |  GB/s")
    ax.set_title(f"{mode}: {result['cliff_seconds']:.1f} s in the cliff (shaded); due (:) and "
                 f"deadline (--) of each save", fontsize=9)
    lat = ax.twinx()
    reads = result["reads"]
    lat.scatter([r[0] for r in reads], [max(r[1], 1e-5) * 1e3 for r in reads], s=1.5,
                color="tab:orange", label="reader latency (ms)")
    lat.set_yscale("log")
    lat.set_ylabel("read latency (ms)")
    # The reference: the targets' baseline, the row's own quiet p95 (older JSON: the no-writer
    # run's, else the row's idle one).
    reader = result["reader"]
    reference = ((reader.get("quiet") or {}).get("p95_s") or payload.get("reader_baseline_p95_s")
                 or reader["idle"]["p95_s"])
    if reference:
        lat.axhline(reference * 1e3, color="tab:orange", lw=0.7, ls="--")
    ax.plot([], [], color="tab:orange", marker=".", ls="", label="reader latency (ms, right)")
    ax.set_xlabel("seconds")


def _spans(flags):
    """(start, end) of each run of True in [(time, flag), ...]."""
    out, start, last = [], None, 0.0
    for time_s, flag in flags:
        if flag and start is None:
            start = last
        elif not flag and start is not None:
            out.append((start, last))
            start = None
        last = time_s
    if start is not None:
        out.append((start, last))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
