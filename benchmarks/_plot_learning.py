#!/usr/bin/env python3
"""checkpoint.py --emulate random --learning's figure, drawn from its JSON alone: per scenario
(fresh, a model 4 x too slow, 4 x too fast), each save's duration over the shortest cliff-free
duration the drive allowed (one line per drive), with the saves that met the cliff marked and
the 1.3 x target drawn.

    python benchmarks/_plot_learning.py bench-results/checkpoint-learning.json out.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot  # noqa: E402

TARGET = 1.3


def plot(payload: Dict[str, object], path: Path) -> Optional[Path]:
    plt = _plot.pyplot()
    if plt is None:
        return None
    drives = payload["drives"]
    names = [n for n in ("fresh", "slow", "fast") if any(n in d["scenarios"] for d in drives)]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False,
                             sharey=True)
    for ax, name in zip(axes[0], names):
        for drive in drives:
            run = drive["scenarios"].get(name)
            if run is None:
                continue
            steps = [r["step"] + 1 for r in run["saves"]]
            ratios = [r["ratio"] for r in run["saves"]]
            line, = ax.plot(steps, ratios, marker="o", lw=1, ms=3, alpha=0.8,
                            label=f"seed {drive['seed']}")
            cliffs = [(s, q) for s, q, r in zip(steps, ratios, run["saves"]) if r["cliff_s"] > 0]
            if cliffs:
                ax.scatter(*zip(*cliffs), marker="x", s=40, color=line.get_color())
        ax.axhline(TARGET, color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_title({"fresh": "fresh start", "slow": "stored model 4 x too slow",
                      "fast": "stored model 4 x too fast"}[name], fontsize=9)
        ax.set_xlabel("save")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axes[0, 0].set_ylabel("write duration / shortest cliff-free (x: met the cliff)")
    if len(drives) <= 12:
        axes[0, -1].legend(fontsize=6, loc="upper right")
    fig.suptitle("rate='auto' against the best each emulated drive allows", fontsize=10)
    return _plot.save(fig, path)


if __name__ == "__main__":
    print(plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
