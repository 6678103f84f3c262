#!/usr/bin/env python3
"""The device probe against fio, on the same file and request shape.

    python benchmarks/probe_vs_fio.py [--dir bench-data/probe] [--pairs 8] [--size 512MiB]

For each of sequential read, rewrite and new-file write (1 MiB x 32 O_DIRECT requests over a
whole file, writes synced), the probe and fio run in back-to-back pairs in ABBA order; the
figure is the median of the pairs' ratios (flashstream.telemetry.probe_check). Target: each
within 15% of fio. This is a benchmark, not a test: single runs on a shared virtual disk
swing by 30% and more, and a noisy stretch can move a whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import _bench

from flashstream import engine
from flashstream.sizes import parse_size
from flashstream.telemetry.fio import fio_available
from flashstream.telemetry.probe_check import OPS, paired_ratio

TOLERANCE = 0.15


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("bench-data/probe"),
                   help="a directory on the drive to measure (O_DIRECT must work there)")
    p.add_argument("--pairs", type=int, default=8, help="probe/fio pairs per operation")
    p.add_argument("--size", default="512MiB", help="the test file's size")
    p.add_argument("--json", type=Path, default=Path("bench-data/probe_vs_fio.json"))
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    if not fio_available():
        print("fio is not installed (apt-get install -y fio)", file=sys.stderr)
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    info = _bench.environment(args.dir)
    _bench.print_header(info)
    path = args.dir / "probe.bin"
    engine.create_probe_file(str(path), parse_size(args.size, name="--size"))
    rows, results, verdicts = [], {}, {}
    try:
        for op in OPS:
            ratio, ours, theirs = paired_ratio(path, op, args.pairs)
            results[op] = {"ratio": ratio, "probe_gbps": ours, "fio_gbps": theirs}
            rows.append({"operation": op, "probe GB/s": round(statistics.median(ours), 3),
                         "fio GB/s": round(statistics.median(theirs), 3),
                         "probe / fio (median of pairs)": round(ratio, 3),
                         "pairs' range": f"{min(a / b for a, b in zip(ours, theirs)):.2f}-"
                                         f"{max(a / b for a, b in zip(ours, theirs)):.2f}"})
            verdicts[f"{op}: probe / fio GB/s"] = {
                "value": ratio, "target": f"within 1 +- {TOLERANCE}",
                "met": abs(ratio - 1) <= TOLERANCE}
    finally:
        path.unlink(missing_ok=True)
    _bench.print_table(rows, list(rows[0]))
    print("\ntargets:")
    _bench.print_verdicts(verdicts)
    payload = {"environment": info, "pairs": args.pairs, "size": args.size,
               "results": results, "targets": verdicts}
    print(f"\nJSON: {_bench.write_json(args.json, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
