#!/usr/bin/env python3
"""What a checkpoint's writes and deletes do to reads on the same drive, measured interleaved.

    python benchmarks/reads_beside_writes.py [--dir bench-data/reads-beside] [--rounds 12]
    python benchmarks/reads_beside_writes.py --rate 120MB,250MB,380MB,600MB \
        --conditions write-over        # what each pace costs the reads: a curve and its plot
    python benchmarks/reads_beside_writes.py --rate 570MB --request 1MiB,256KiB,64KiB \
        --conditions write-over        # what each request size costs them at one pace

An open-loop reader (250 random 128 KiB O_DIRECT reads/s, latency from each read's scheduled
time: benchmarks/_open_loop.py) runs throughout. Beside it, in windows of ``--window`` seconds
shuffled anew each round, one of:

- ``idle``: nothing (the baseline);
- ``write-new``: the checkpoint writer's paced write (``--rate``, ``--request`` bytes per
  request, by default the writer's ``paced_chunk_size``, 8 in flight, flashstream's engine)
  into a new, preallocated file, as a save without recycling makes;
- ``write-over``: the same write over an existing file's blocks, as a recycled save makes;
- ``free-unlink``: unlinking a written file of the same size (then ``sync``);
- ``free-gradual``: freeing it 8 MiB at a time as the writer does on online-discard
  filesystems (flashstream.checkpoint.store.remove_step).

With several ``--rate`` values, each write condition runs once per rate (``write-over
250 MB/s``, ...), all shuffled into the same rounds, and a plot shows the reader's p95 against
idle over the pace: the price in read latency of the rate a checkpoint's deadline asks for,
whoever writes it (on this project's disk it rose with the pace from 120 MB/s on in 1 MiB
requests; the read calls alone showed the request size moving it: at 570 MB/s 1.38 x idle in
1 MiB requests, 1.00 x in 256 KiB). With several ``--request`` sizes, each write condition
runs once per size (and rate).

Files are laid out and removed between windows, outside them. Per condition: the reader's
p50/p95/p99 over all its windows, the p95 against idle's (pooled), the median of the
per-round ratios (each round's windows are minutes apart at most, so the disk's drift cancels),
and the same median for the read calls alone (the latency less the wait before the call:
the drive's share, apart from the CPU's; ``_open_loop.read_calls``).
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
from typing import Dict, List, Optional, Tuple

import _bench
import _open_loop
import _plot
from _open_loop import latency_summary, read_calls

from flashstream import engine
from flashstream.checkpoint import WriterConfig, store
from flashstream.sizes import format_size, parse_size

CONDITIONS = ("idle", "write-new", "write-over", "free-unlink", "free-gradual")
WRITES = ("write-new", "write-over")  # the conditions that run once per --rate
SETTLE_S = 1.5  # between windows: the last one's after-effects stay out of the next
CHUNK = 8 << 20  # the writer's unpaced request size; a paced request is at most this long


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("bench-data/reads-beside"),
                   help="a directory on the drive under test (O_DIRECT must work there)")
    p.add_argument("--rate", default="500MB",
                   help="the paced writes' bytes per second (default 500MB: a deadline pace "
                        "of the emulated plc benchmark here); a comma-separated list sweeps "
                        "the write conditions over each rate")
    p.add_argument("--request", default=None,
                   help="bytes per write request (default: the checkpoint writer's "
                        "paced_chunk_size); a comma-separated list runs the write conditions "
                        "once per size")
    p.add_argument("--window", type=float, default=2.0, help="seconds per window")
    p.add_argument("--rounds", type=int, default=12, help="windows per condition")
    p.add_argument("--conditions", default=",".join(CONDITIONS),
                   help=f"from {', '.join(CONDITIONS)} (idle always runs)")
    p.add_argument("--reader-rate", type=float, default=250.0, help="reads per second")
    p.add_argument("--reader-block", default="128KiB", help="bytes per read")
    p.add_argument("--seed", type=int, default=1, help="the windows' shuffle")
    p.add_argument("--json", type=Path, default=Path("bench-results/reads_beside_writes.json"))
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of p95 x idle over the pace (with several --rate; default: "
                        "beside the JSON)")
    args = p.parse_args(argv)
    chosen = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CONDITIONS))
    if unknown:
        p.error(f"unknown condition(s) {unknown}; allowed: {', '.join(CONDITIONS)}")
    if args.rounds < 2 or not args.window > 0:
        p.error("--rounds must be at least 2 and --window positive")
    rates = [float(parse_size(r.strip(), name="--rate")) for r in args.rate.split(",")
             if r.strip()]
    if not rates or min(rates) <= 0 or len(set(rates)) != len(rates):
        p.error("--rate: one or more distinct positive sizes per second, e.g. 250MB,500MB")
    requests = [int(parse_size(r.strip(), name="--request"))
                for r in (args.request or WriterConfig.paced_chunk_size).split(",")
                if r.strip()]
    if not requests or len(set(requests)) != len(requests) or \
            any(r <= 0 or r % 4096 or r > CHUNK for r in requests):
        p.error(f"--request: one or more distinct sizes, multiples of 4KiB up to "
                f"{format_size(CHUNK)}, e.g. 1MiB,256KiB")
    # label: (condition, rate, request); a write condition once per rate and request size
    conditions: Dict[str, Tuple[str, float, int]] = {"idle": ("idle", 0.0, 0)}
    for condition in CONDITIONS[1:]:
        if condition in chosen:
            for rate in rates if condition in WRITES else [max(rates)]:
                for request in requests if condition in WRITES else [0]:
                    label = _label(condition, rate, len(rates), request, len(requests))
                    if label in conditions:
                        p.error(f"two conditions would both be labelled {label!r}: choose "
                                "rates or request sizes further apart")
                    conditions[label] = (condition, rate, request)
    args.dir.mkdir(parents=True, exist_ok=True)
    info = _bench.environment(args.dir)
    _bench.print_header(info)
    size = int(max(rates) * args.window) // (1 << 20) * (1 << 20)
    print(f"{args.rounds} rounds of {len(conditions)} windows of {args.window:.1f} s; writes of "
          f"{args.window:.1f} s at {', '.join(f'{r / 1e6:,.0f}' for r in rates)} MB/s in "
          f"{', '.join(format_size(r) for r in requests)} requests; "
          f"reader {args.reader_rate:.0f} x {args.reader_block}/s")
    windows, reads = run(args, conditions, size)
    rows, results = summarize(list(conditions), windows, reads, args.rounds)
    for label, result in results.items():
        result["condition"], result["rate"], result["request"] = conditions[label]
    _bench.print_table(rows, list(rows[0]))
    payload = {"environment": info, "rate": rates[0] if len(rates) == 1 else None,
               "rates": rates, "requests": requests, "window_s": args.window, "rounds": args.rounds,
               "file_bytes": size, "conditions": results,
               "windows": [[r, c, a, b] for r, c, a, b in windows]}
    if len(rates) > 1:
        _bench.write_outputs(payload, args.json, plot, args.plot or args.json.with_suffix(".png"))
    else:
        print(f"\nJSON: {_bench.write_json(args.json, payload)}")
    return 0


def _label(condition: str, rate: float, rates: int, request: int, requests: int) -> str:
    if condition not in WRITES:
        return condition
    return " ".join([condition] + ([f"{rate / 1e6:,.0f} MB/s"] if rates > 1 else [])
                    + ([f"in {format_size(request)}"] if requests > 1 else []))


def run(args, conditions: Dict[str, Tuple[str, float, int]], size: int
        ) -> Tuple[List[Tuple[int, str, float, float]], List[Tuple[float, float, float]]]:
    work = args.dir / "files"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    data = mmap.mmap(-1, size)
    data[:] = os.urandom(1 << 20) * (size >> 20)
    over = work / "over.bin"
    # The recycled file: laid out once, written over in its windows.
    _write(over, data, 0.0)
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
            order = list(conditions)
            rng.shuffle(order)
            for label in order:
                condition, rate, request = conditions[label]
                victim = work / "victim.bin"
                if condition.startswith("free"):
                    _write(victim, data, 0.0)
                    os.sync()
                    time.sleep(SETTLE_S)
                start = time.perf_counter()
                # Each write lasts the window: rate x window bytes (all of them at the top rate).
                part = memoryview(data)[:int(rate * args.window) // (1 << 20) * (1 << 20)]
                if condition == "write-new":
                    _write(work / "new.bin", part, rate, request=request, total=size)
                elif condition == "write-over":
                    _write(over, part, rate, request=request, existing=True, total=size)
                elif condition == "free-unlink":
                    os.unlink(victim)
                    os.sync()
                elif condition == "free-gradual":
                    step = work / "step-000000001"
                    step.mkdir()
                    os.rename(victim, step / victim.name)
                    store.remove_step(step, gradual=True)
                time.sleep(max(0.0, start + args.window - time.perf_counter()))
                windows.append((round_, label, start, time.perf_counter()))
                if condition == "write-new":
                    (work / "new.bin").unlink()
                    os.sync()
                time.sleep(SETTLE_S)
                print(f"  round {round_ + 1}/{args.rounds}: {label}", file=sys.stderr)
    finally:
        got = reader.stop()
        shutil.rmtree(work, ignore_errors=True)
    return windows, got


def _write(path: Path, data, rate: float, request: int = 0, existing: bool = False,
           total: Optional[int] = None) -> None:
    """Writes ``data`` at the start of a file of ``total`` bytes (default: just ``data``),
    paced at ``rate`` in ``request``-byte requests (0 and unpaced: CHUNK)."""
    total = len(data) if total is None else total
    out = engine.open_output(path, total, engine="auto", direct=True, existing=existing)
    try:
        out.write(data, 0, chunk_size=CHUNK, queue_depth=8, rate=rate,
                  paced_chunk_size=request)
        out.commit(total)
    except BaseException:
        out.close()
        raise


def summarize(conditions: List[str], windows, reads, rounds: int):
    calls = read_calls(reads)

    def summary(condition: str, round_=None, of=reads) -> Dict[str, object]:
        bounds = [t for r, c, a, b in windows
                  if c == condition and (round_ is None or r == round_) for t in (a, b)]
        return latency_summary(of, *bounds)

    def per_round(of):
        """A condition's p95 against idle's, round by round, for reads ``of``."""
        idle_p95 = [summary("idle", r, of)["p95_s"] for r in range(rounds)]
        return lambda condition: [summary(condition, r, of)["p95_s"] / idle_p95[r]
                                  for r in range(rounds)]

    latency_per_round, calls_per_round = per_round(reads), per_round(calls)

    idle = summary("idle")["p95_s"]
    rows: List[Dict[str, object]] = []
    results: Dict[str, Dict[str, object]] = {}
    for condition in conditions:
        result = summary(condition)
        ratios, call_ratios = latency_per_round(condition), calls_per_round(condition)
        result.update(p95_x_idle=result["p95_s"] / idle, p95_x_idle_per_round=ratios,
                      p95_x_idle_round_median=statistics.median(ratios),
                      read_calls=summary(condition, of=calls),
                      read_calls_p95_x_idle_round_median=statistics.median(call_ratios))
        results[condition] = result
        rows.append({"beside the reader": condition, "reads": result["reads"],
                     "p50 ms": round(result["p50_s"] * 1e3, 2),
                     "p95 ms": round(result["p95_s"] * 1e3, 2),
                     "p99 ms": round(result["p99_s"] * 1e3, 2),
                     "p95 x idle": round(result["p95_x_idle"], 2),
                     "per-round median": round(result["p95_x_idle_round_median"], 2),
                     "read calls: per-round median": round(
                         result["read_calls_p95_x_idle_round_median"], 2),
                     "per round": " ".join(f"{x:.2f}" for x in ratios)})
    return rows, results


def plot(payload: Dict[str, object], path: Path) -> Optional[Path]:
    """The reader's p95 against idle over the writes' pace, per write condition: pooled over
    all windows, and the median of the per-round ratios."""
    plt = _plot.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    results: Dict[str, Dict] = payload["conditions"]
    requests = payload["requests"]
    for condition, request in [(c, q) for c in WRITES for q in requests]:
        points = sorted((r["rate"] / 1e6, r["p95_x_idle"], r["p95_x_idle_round_median"])
                        for r in results.values()
                        if r["condition"] == condition and r["request"] == request)
        if points:
            mbps, pooled, median = zip(*points)
            name = f"{condition} in {format_size(request)}" if len(requests) > 1 else condition
            line, = ax.plot(mbps, pooled, "o-", label=f"{name}: pooled")
            ax.plot(mbps, median, "s--", color=line.get_color(), alpha=0.6,
                    label=f"{name}: median of rounds")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("write pace, MB/s")
    ax.set_ylabel("reader p95 / idle p95")
    ax.set_ylim(bottom=0.9)
    ax.legend(fontsize=8)
    ax.set_title(f"{payload['rounds']} rounds of {payload['window_s']:.1f} s windows, "
                 f"reads 128 KiB random, open loop", fontsize=9)
    return _plot.save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
