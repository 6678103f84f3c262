"""rag_qps.py's larger-than-memory runs: mmap against direct, each in a serving process of its
own (_rag_serve.py) that may cache only part of the index, under open-loop load at rising QPS
with a skewed (Zipf) query stream: alone, beside a checkpoint being written, and beside a
ShardStream epoch (both loads run in this process, outside the serving process's cgroup).

Both modes get the same stream, the same schedule seeds, the same levels and the same memory
limit; each starts with the index evicted from the page cache, so nothing of it is charged to
another group. Without root or a memory controller the runs go uncapped, and say so.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import _memcap
import _rag_load
import _rag_report
import numpy as np

from flashstream import pagecache

CONDITIONS = ("alone", "checkpoint", "epoch")
MIN_ROOM = 64 << 20
SERVE = Path(__file__).resolve().parent / "_rag_serve.py"


def zipf_stream(pool: int, length: int, exponent: float, seed: int) -> np.ndarray:
    """Pool indices of a query stream whose popularity falls as 1/rank**exponent (the ranks a
    seeded permutation of the pool): a few queries asked very often, most rarely."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, pool + 1) ** exponent
    ranked = rng.permutation(pool)
    return ranked[rng.choice(pool, size=length, p=weights / weights.sum())].astype(np.int64)


@contextlib.contextmanager
def _load(condition: str, args, directory: Path):
    if condition == "alone":
        yield None
    elif condition == "checkpoint":
        with _rag_load.WriteLoad(directory / "write-load", args.write_size,
                                 args.capped_write_rate) as load:
            yield load
    else:
        with _rag_load.EpochLoad(directory / "epoch-shards", args.epoch_size) as load:
            yield load


class _Server:
    """A serving process (_rag_serve.py) in a memory cgroup of its own, driven level by level."""

    def __init__(self, args, index: Path, io: str, list_cache: int, work: Path, room: int,
                 support: Optional[str], out: Path) -> None:
        self.io, self.out = io, out
        self.cap = _memcap.MemoryCap.create() if support else None
        command = [sys.executable, str(SERVE), "--index", str(index), "--io", io,
                   "--list-cache", str(list_cache), "--nprobe", str(args.nprobe), "--k",
                   str(args.k), "--work", str(work), "--duration", str(args.duration),
                   "--warmup", str(args.warmup), "--threads", str(args.serve_threads),
                   "--room", str(room), "--out", str(out)]
        if self.cap is not None:
            command += ["--cgroup", str(self.cap.path)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        self.ready = self._answer()["ready"]

    def _answer(self) -> Dict[str, object]:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.io} serving process exited with status "
                                   f"{self.process.wait()}")
            if line.startswith("{"):  # anything else a library printed is passed on
                return json.loads(line)
            print(line, end="")

    def level(self, qps: float, seed: int) -> Dict[str, object]:
        self.process.stdin.write(json.dumps({"qps": qps, "seed": seed}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def finish(self) -> Dict[str, object]:
        self.process.stdin.write(json.dumps({"end": True}) + "\n")
        self.process.stdin.close()
        if self.process.wait() != 0:
            raise RuntimeError(f"the {self.io} serving process exited with status "
                               f"{self.process.returncode}")
        return json.loads(self.out.read_text())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.cap is not None:
            self.cap.remove()


def _ladder(args, servers: Dict[str, _Server]) -> None:
    """The levels in rising order, the modes taking turns at each (the order alternating), a
    mode stopping after two levels in a row off the SLO."""
    failed = {io: 0 for io in servers}
    for i, qps in enumerate(args.capped_qps):
        order = list(servers) if i % 2 == 0 else list(servers)[::-1]
        for io in order:
            if failed[io] >= 2:
                continue
            summary = servers[io].level(qps, seed=i)
            print(f"  {io} {qps:g} QPS: p95 {summary['latency_us']['p95'] or 0:,.0f} us, "
                  f"achieved {summary['achieved_qps']:,.1f}", flush=True)
            on_time = _rag_report.sustainable([summary], args.slo) is not None
            failed[io] = 0 if on_time else failed[io] + 1
        if all(f >= 2 for f in failed.values()):
            break


def _condition(args, condition: str, index: Path, list_cache: int, work: Path, room: int,
               support: Optional[str], directory: Path) -> Dict[str, object]:
    pagecache.evict([index])
    servers: Dict[str, _Server] = {}
    try:
        with _load(condition, args, directory) as load:
            # direct first: it leaves the page cache alone, so the mmap process, started
            # second, evicts and warms its own without the other undoing it.
            for io in ("direct", "mmap"):
                servers[io] = _Server(args, index, io, list_cache if io == "direct" else 0,
                                      work, room, support, work / f"{condition}-{io}.json")
                if io == "direct":  # the file's page cache before anything else reads it
                    alone_after = pagecache.resident_bytes(index) / index.stat().st_size
            _ladder(args, {io: servers[io] for io in ("mmap", "direct")})
            runs = {io: servers[io].finish() for io in ("mmap", "direct")}
        for result in runs.values():
            result["load"] = load.summary() if load is not None else None
    finally:
        for server in servers.values():
            server.close()
    runs["direct"]["residency_after_warmup"] = alone_after
    for result in runs.values():
        result["sustained_qps"] = _rag_report.sustainable(result["levels"], args.slo)
        result["wrong"] = result["warmup"]["wrong"] + sum(r["wrong"] for r in result["levels"])
    m, d = runs["mmap"]["sustained_qps"], runs["direct"]["sustained_qps"]
    runs["ratio"] = (d / m) if d and m else None
    return runs


def run(args, index: Path, pool: np.ndarray, expected: Dict[str, np.ndarray],
        directory: Path) -> Dict[str, object]:
    """Every condition, the two modes in turns in each; returns the runs and the ratios."""
    size = index.stat().st_size
    # What the serving process may cache. Its own growth while serving (results, threads)
    # comes out of it too; the floor keeps a tiny index's run from being killed for memory.
    room = max(int(size * args.cache_share), MIN_ROOM)
    list_cache = int(size * args.list_cache_share)
    work = directory / "capped-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    stream = zipf_stream(len(pool), args.stream_length, args.zipf, seed=7)
    np.save(work / "pool.npy", pool)
    np.save(work / "stream.npy", stream)
    np.savez(work / "expected.npz", **expected)
    support = _memcap.memcap_support()
    out: Dict[str, object] = {
        "index_bytes": size, "room": room, "list_cache": list_cache, "capped": support,
        "zipf": args.zipf, "stream_length": len(stream),
        "distinct_queries": int(len(np.unique(stream))), "levels_qps": list(args.capped_qps),
        "threads": args.serve_threads, "write_rate": args.capped_write_rate, "runs": {}}
    where = f"a {support} memory cgroup" if support else \
        "NOT capped: no memory cgroup here (needs root)"
    print(f"\nlarger than memory: {size / 2**20:,.0f} MiB index; the serving process may cache "
          f"{room / 2**20:,.0f} MiB ({where}); direct list cache {list_cache / 2**20:,.0f} MiB; "
          f"Zipf {args.zipf:g} over {len(pool):,} queries", flush=True)
    for condition in args.conditions:
        print(f" {condition}:", flush=True)
        out["runs"][condition] = runs = _condition(args, condition, index, list_cache, work,
                                                   room, support, directory)
        runs["lowest_level_p95"] = _rag_report.lowest_level_p95(runs)
    shutil.rmtree(work, ignore_errors=True)
    return out
