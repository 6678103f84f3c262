#!/usr/bin/env python3
"""An open-loop reader: random O_DIRECT reads sent on a fixed schedule, each one's latency
counted from when it was due, not from when it was sent.

A closed-loop reader (the next read once the last is back) slows down with a stalled drive and
so reports few slow reads (coordinated omission); an open-loop one keeps sending on schedule,
so a second-long stall shows as a second of late reads, as a retrieval service would see it.

It runs as a process of its own, so that the writer's process (its GIL, its copies) cannot
delay the schedule, and a drive emulator can place it under the same throttle:

    python benchmarks/_open_loop.py FILE --rate 250 --block 131072 --out reads.json

It reads until SIGTERM or SIGINT, then writes {"reads": [[due, latency, waited], ...]} with
``due`` in time.perf_counter() seconds (CLOCK_MONOTONIC: the same clock in every process of the
machine) and ``waited`` the part of ``latency`` before the read call was made (the reader's own
timer and threads: the CPU's share, not the drive's; see :func:`read_calls`).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

MAX_IN_FLIGHT = 128  # reads outstanding at once; more wait for a thread (still timed from due)


def make_file(path: Path, size: int) -> Path:
    """A file of ``size`` random bytes to read from (kept when it is already that size),
    dropped from the page cache either way."""
    if not path.exists() or path.stat().st_size != size:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for _ in range(0, size, 64 << 20):
                f.write(os.urandom(min(64 << 20, size - f.tell())))
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def sample_p95(path: Path, block: int, seconds: float = 1.0, interval: float = 0.004) -> float:
    """p95 (seconds) of O_DIRECT reads of ``block`` bytes at random offsets of ``path``, one
    every ``interval`` for ``seconds``, in this process: a quick look at whether the drive is
    as fast as it was, not the open-loop measure. Paced like the reader, not the probe's
    back-to-back reads (``telemetry.probe.measure``): those load the drive themselves, and
    their p95 swung 0.46-4.2 ms from one second to the next here."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    try:
        blocks = max(1, os.fstat(fd).st_size // block)
        latencies, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            began = time.perf_counter()
            os.preadv(fd, [buffer], random.randrange(blocks) * block)
            latencies.append(time.perf_counter() - began)
            time.sleep(max(0.0, began + interval - time.perf_counter()))
    finally:
        os.close(fd)
        buffer.close()
    return statistics.quantiles(latencies, n=20)[-1] if len(latencies) > 1 else latencies[0]


def read_schedule(path: str, rate: float, block: int, stop: threading.Event,
                  seed: int = 0) -> List[Tuple[float, float, float]]:
    """Sends reads every 1/rate s until ``stop``; returns (due, latency, waited) per read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    blocks = os.fstat(fd).st_size // block
    if blocks < 1:
        raise ValueError(f"{path} is smaller than one {block}-byte read")
    local = threading.local()
    rng = random.Random(seed)
    out: List[Tuple[float, float, float]] = []

    def one(due: float, offset: int) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:  # O_DIRECT needs an aligned buffer: an anonymous map is page-aligned
            buf = local.buf = mmap.mmap(-1, block)
        sent = time.perf_counter()
        os.preadv(fd, [buf], offset)
        out.append((due, time.perf_counter() - due, sent - due))

    period = 1.0 / rate
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        due = time.perf_counter()
        while not stop.is_set():
            pool.submit(one, due, rng.randrange(blocks) * block)
            due += period
            wait = due - time.perf_counter()
            if wait > 0:
                stop.wait(wait)
    os.close(fd)
    return sorted(out)


class OpenLoopReader:
    """The reader as a child process: start(), then stop() returns its reads
    (due, latency, waited)."""

    def __init__(self, path: Path, *, rate: float, block: int, out: Path) -> None:
        self.path, self.rate, self.block, self.out = path, rate, block, out
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> int:
        self.out.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(self.path), "--rate", str(self.rate),
             "--block", str(self.block), "--out", str(self.out)])
        return self.process.pid

    def stop(self) -> List[Tuple[float, float, float]]:
        if self.process is None:
            return []
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.process = None
        if code != 0:
            raise RuntimeError(f"the open-loop reader exited with status {code}")
        return [tuple(r) for r in json.loads(self.out.read_text())["reads"]]


def read_calls(reads: Sequence[Tuple[float, ...]]) -> List[Tuple[float, float]]:
    """(due, seconds in the read call) per read: the latency less the wait before the call.

    On a 2-core machine a busy core delays the reader's timer and threads as much as a disk
    write delays its reads; the read call alone is mostly what the drive (and the kernel under
    it) took, so a writer's cost to the drive shows apart from most of its cost to the CPU.
    Not all: the thread's wake-up after the read is inside the call, and reads queued behind
    MAX_IN_FLIGHT others (a stall of half a second and more) count their queueing as waiting."""
    return [(due, latency - waited) for due, latency, waited, *_ in reads]


def latency_summary(reads: Sequence[Tuple[float, ...]], *bounds: float) -> Dict[str, object]:
    """p50/p95/p99 (seconds) of the reads due in [bounds[0], bounds[1]) (and in each further
    pair of bounds)."""
    spans = list(zip(bounds[::2], bounds[1::2]))
    lat = sorted(latency for due, latency, *_ in reads if any(a <= due < b for a, b in spans))
    if not lat:
        return {"reads": 0, "p50_s": None, "p95_s": None, "p99_s": None, "max_s": None}
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
    return {"reads": len(lat), "p50_s": q[49], "p95_s": q[94], "p99_s": q[98],
            "max_s": lat[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="the file to read (on the drive under test)")
    p.add_argument("--rate", type=float, default=250.0, help="reads per second")
    p.add_argument("--block", type=int, default=128 << 10, help="bytes per read")
    p.add_argument("--out", type=Path, required=True, help="JSON of [due, latency] per read")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    reads = read_schedule(args.file, args.rate, args.block, stop)
    args.out.write_text(json.dumps({"reads": reads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
