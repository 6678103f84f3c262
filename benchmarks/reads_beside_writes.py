#!/usr/bin/env python3
"""What a checkpoint's writes and deletes do to reads on the same drive, measured interleaved.

    python benchmarks/reads_beside_writes.py [--dir bench-data/reads-beside] [--rounds 12]

An open-loop reader (250 random 128 KiB O_DIRECT reads/s, latency from each read's scheduled
time: benchmarks/_open_loop.py) runs throughout. Beside it, in windows of ``--window`` seconds
shuffled anew each round, one of:

- ``idle``: nothing (the baseline);
- ``write-new``: the checkpoint writer's paced write (``--rate``, 1 MiB requests, 8 in flight,
  flashstream's engine) into a new, preallocated file, as a save without recycling makes;
- ``write-over``: the same write over an existing file's blocks, as a recycled save makes;
- ``free-unlink``: unlinking a written file of the same size (then ``sync``);
- ``free-gradual``: freeing it 8 MiB at a time as the writer does on online-discard
  filesystems (flashstream.checkpoint.store.remove_step).

Files are laid out and removed between windows, outside them. Per condition: the reader's
p50/p95/p99 over all its windows, the p95 against idle's (pooled), and the median of the
per-round ratios (each round's windows are minutes apart at most, so the disk's drift cancels).
JSON beside it. Interleaving is the point: on this project's disk the idle p95 itself moves
0.8-4 ms from one minute to the next, more than most of these effects.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import _bench
import _open_loop
from _open_loop import latency_summary

from flashstream import engine
from flashstream.checkpoint import store
from flashstream.sizes import parse_size

CONDITIONS = ("idle", "write-new", "write-over", "free-unlink", "free-gradual")
SETTLE_S = 1.5  # between windows: the last one's after-effects stay out of the next


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("bench-data/reads-beside"),
                   help="a directory on the drive under test (O_DIRECT must work there)")
    p.add_argument("--rate", default="500MB",
                   help="the paced writes' bytes per second (default 500MB: a deadline pace "
                        "of the emulated plc benchmark here)")
    p.add_argument("--window", type=float, default=2.0, help="seconds per window")
    p.add_argument("--rounds", type=int, default=12, help="windows per condition")
    p.add_argument("--conditions", default=",".join(CONDITIONS),
                   help=f"from {', '.join(CONDITIONS)} (idle always runs)")
    p.add_argument("--reader-rate", type=float, default=250.0, help="reads per second")
    p.add_argument("--reader-block", default="128KiB", help="bytes per read")
    p.add_argument("--seed", type=int, default=1, help="the windows' shuffle")
    p.add_argument("--json", type=Path, default=Path("bench-results/reads_beside_writes.json"))
    args = p.parse_args(argv)
    chosen = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CONDITIONS))
    if unknown:
        p.error(f"unknown condition(s) {unknown}; allowed: {', '.join(CONDITIONS)}")
    if args.rounds < 2 or not args.window > 0:
        p.error("--rounds must be at least 2 and --window positive")
    conditions = ["idle"] + [c for c in CONDITIONS[1:] if c in chosen]
    rate = float(parse_size(args.rate, name="--rate"))
    args.dir.mkdir(parents=True, exist_ok=True)
    info = _bench.environment(args.dir)
    _bench.print_header(info)
    size = int(rate * args.window) // (1 << 20) * (1 << 20)
    print(f"{args.rounds} rounds of {len(conditions)} windows of {args.window:.1f} s; writes of "
          f"{size / 1e9:.2f} GB at {rate / 1e6:,.0f} MB/s; reader {args.reader_rate:.0f} x "
          f"{args.reader_block}/s")
    windows, reads = run(args, conditions, size, rate)
    rows, results = summarize(conditions, windows, reads, args.rounds)
    _bench.print_table(rows, list(rows[0]))
    payload = {"environment": info, "rate": rate, "window_s": args.window,
               "rounds": args.rounds, "file_bytes": size, "conditions": results,
               "windows": [[r, c, a, b] for r, c, a, b in windows]}
    print(f"\nJSON: {_bench.write_json(args.json, payload)}")
    return 0


def run(args, conditions: List[str], size: int, rate: float
        ) -> Tuple[List[Tuple[int, str, float, float]], List[Tuple[float, float]]]:
    work = args.dir / "files"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    data = mmap.mmap(-1, size)
    data[:] = os.urandom(1 << 20) * (size >> 20)
    over = work / "over.bin"
    _write(over, data, 0.0)  # the recycled file: laid out once, written over in its windows
    reader_file = _open_loop.make_file(args.dir / "reader.bin", 1 << 30)
    reader = _open_loop.OpenLoopReader(reader_file, rate=args.reader_rate,
                                       block=parse_size(args.reader_block),
                                       out=args.dir / "reads.json")
    reader.start()
    rng = random.Random(args.seed)
    windows = []
    try:
        time.sleep(2.0)  # the reader's threads start
        for round_ in range(args.rounds):
            order = conditions[:]
            rng.shuffle(order)
            for condition in order:
                victim = work / "victim.bin"
                if condition.startswith("free"):
                    _write(victim, data, 0.0)
                    os.sync()
                    time.sleep(SETTLE_S)
                start = time.perf_counter()
                if condition == "write-new":
                    _write(work / "new.bin", data, rate)
                elif condition == "write-over":
                    _write(over, data, rate, existing=True)
                elif condition == "free-unlink":
                    os.unlink(victim)
                    os.sync()
                elif condition == "free-gradual":
                    step = work / "step-000000001"
                    step.mkdir()
                    os.rename(victim, step / victim.name)
                    store.remove_step(step, gradual=True)
                time.sleep(max(0.0, start + args.window - time.perf_counter()))
                windows.append((round_, condition, start, time.perf_counter()))
                if condition == "write-new":
                    (work / "new.bin").unlink()
                    os.sync()
                time.sleep(SETTLE_S)
                print(f"  round {round_ + 1}/{args.rounds}: {condition}", file=sys.stderr)
    finally:
        got = reader.stop()
        shutil.rmtree(work, ignore_errors=True)
    return windows, got


def _write(path: Path, data: mmap.mmap, rate: float, existing: bool = False) -> None:
    out = engine.open_output(path, len(data), engine="auto", direct=True, existing=existing)
    try:
        out.write(data, 0, chunk_size=8 << 20, queue_depth=8, rate=rate,
                  paced_chunk_size=1 << 20)
        out.commit(len(data))
    except BaseException:
        out.close()
        raise


def summarize(conditions: List[str], windows, reads, rounds: int):
    def summary(condition: str, round_=None) -> Dict[str, object]:
        bounds = [t for r, c, a, b in windows
                  if c == condition and (round_ is None or r == round_) for t in (a, b)]
        return latency_summary(reads, *bounds)

    idle = summary("idle")["p95_s"]
    idle_by_round = [summary("idle", r)["p95_s"] for r in range(rounds)]
    rows: List[Dict[str, object]] = []
    results: Dict[str, Dict[str, object]] = {}
    for condition in conditions:
        result = summary(condition)
        per_round = [summary(condition, r)["p95_s"] / idle_by_round[r] for r in range(rounds)]
        result.update(p95_x_idle=result["p95_s"] / idle, p95_x_idle_per_round=per_round,
                      p95_x_idle_round_median=statistics.median(per_round))
        results[condition] = result
        rows.append({"beside the reader": condition, "reads": result["reads"],
                     "p50 ms": round(result["p50_s"] * 1e3, 2),
                     "p95 ms": round(result["p95_s"] * 1e3, 2),
                     "p99 ms": round(result["p99_s"] * 1e3, 2),
                     "p95 x idle": round(result["p95_x_idle"], 2),
                     "per-round median": round(result["p95_x_idle_round_median"], 2),
                     "per round": " ".join(f"{x:.2f}" for x in per_round)})
    return rows, results


if __name__ == "__main__":
    sys.exit(main())
