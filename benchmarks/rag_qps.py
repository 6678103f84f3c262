#!/usr/bin/env python3
"""RAG retrieval QPS and tail latency from the drive: an mmap'd FAISS index served by IndexReader.

    python benchmarks/rag_qps.py                       # builds 1M x 384 IVF-PQ in bench-data/rag
    python benchmarks/rag_qps.py --dir /mnt/plc/rag --write-load
    python benchmarks/rag_qps.py --index my.index --queries q.npy --ground-truth gt.npy

Without --index it builds a realistic index (clustered, normalised synthetic embeddings;
IVF-PQ by default) on the drive under test, with exact ground truth for a query sample. Then:
the cost of recording latency; open time by mmap against a full in-RAM load (on an index of at
least 1 GB: an IVF-Flat of the same vectors when the served index is smaller); warm mmap
against in-RAM QPS (closed loop, alternating rounds); and per scenario (RAM warm, mmap warm,
mmap cold, and with --write-load mmap cold beside an unpaced and a paced CheckpointWriter) a
closed-loop max QPS and open-loop runs at each target QPS, latency measured from each query's
scheduled time. Recall@k against the ground truth beside every latency figure. Table to stdout,
everything to JSON, p95/p99 against offered QPS per scenario to a PNG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402
import _rag_data  # noqa: E402
import _rag_load  # noqa: E402

from flashstream import IndexReader, cache  # noqa: E402
from flashstream.retrieval.load import LoadResult, closed_loop, open_loop  # noqa: E402
from flashstream.sizes import format_size, parse_size  # noqa: E402

MMAP_SHARE = 0.95        # warm mmap QPS at least this share of the in-RAM index's
OPEN_SHARE = 0.02        # mmap open time at most this share of the in-RAM load time
OPEN_MIN_BYTES = 1 << 30  # ... on an index of at least this size
RECORD_US = 2.0          # recording one query's latency costs under this many microseconds
QPS_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.2)  # default targets: x warm in-RAM max QPS


# -- measurements -------------------------------------------------------------------------------
def recording_cost(reader: IndexReader, query: np.ndarray, k: int, calls: int = 50_000,
                   rounds: int = 5) -> Dict[str, float]:
    """What timing a search costs: (1) the timer and histogram alone, per call (the target);
    (2) reader.search against the bare faiss call on a tiny flat index, alternating rounds
    (the whole wrapper, argument checks included)."""
    import faiss

    from flashstream import engine

    recorder = engine.LatencyRecorder()
    clock = time.perf_counter_ns
    per_call = []
    for _ in range(rounds):
        start = clock()
        for _ in range(calls):
            recorder.stop(clock())
        per_call.append((clock() - start) / calls)
    tiny_path = Path(reader.path).with_name(".tiny-flat.index")
    tiny = faiss.IndexFlatL2(reader.d)
    tiny.add(np.random.default_rng(0).standard_normal((16, reader.d)).astype(np.float32))
    faiss.write_index(tiny, str(tiny_path))
    q = np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32)
    overhead = []
    try:
        with IndexReader(tiny_path, mmap=False) as wrapped:
            bare = wrapped.index
            n = calls // 5
            for _ in range(rounds):
                start = clock()
                for _ in range(n):
                    bare.search(q, k)
                middle = clock()
                for _ in range(n):
                    wrapped.search(q, k)
                overhead.append(((clock() - middle) - (middle - start)) / n)
    finally:
        tiny_path.unlink(missing_ok=True)
    return {"record_us": statistics.median(per_call) / 1e3,
            "wrapper_overhead_us": statistics.median(overhead) / 1e3}


def open_times(path: Path, rounds: int = 3) -> Dict[str, object]:
    """Opening by mmap against reading into RAM, each from a cold page cache (median)."""
    mmap_s, ram_s = [], []
    for _ in range(rounds):
        for use_mmap, out in ((True, mmap_s), (False, ram_s)):
            cache.evict([path])
            start = time.perf_counter()
            reader = IndexReader(path, io="mmap", mmap=use_mmap)
            out.append(time.perf_counter() - start)
            if use_mmap:
                info = reader.info()
            reader.close()
    size = path.stat().st_size
    return {"path": str(path), "type": info["type"], "io_flag": info["io_flag"], "bytes": size,
            "mmap_open_s": statistics.median(mmap_s),
            "ram_load_s": statistics.median(ram_s), "mmap_runs_s": mmap_s, "ram_runs_s": ram_s,
            "ratio": statistics.median(mmap_s) / statistics.median(ram_s)}


def warm_up(reader: IndexReader, queries: np.ndarray, k: int) -> None:
    """Page the file in (read it once) and fault every query's pages into the mapping."""
    with open(reader.path, "rb") as f:
        while f.read(16 << 20):
            pass
    for q in queries:
        reader.search(q, k)


def compare_warm(readers: Dict[str, IndexReader], queries, args) -> Dict[str, object]:
    """Closed-loop QPS of warm mmap and in-RAM readers in alternating rounds (noise hits both)."""
    runs: Dict[str, List[float]] = {name: [] for name in readers}
    for _ in tqdm(range(args.rounds), desc="warm mmap vs RAM", leave=False, disable=None):
        for name, reader in readers.items():
            runs[name].append(closed_loop(reader, queries, args.k, threads=args.threads,
                                          seconds=args.duration).qps)
    qps = {name: statistics.median(v) for name, v in runs.items()}
    return {"rounds": runs, "median_qps": qps, "ratio": qps["mmap"] / qps["ram"]}


def run_scenario(name: str, reader: IndexReader, cold: bool, targets: List[float], queries,
                 truth, args, bar) -> Dict[str, object]:
    """One closed-loop run, then one open-loop run per target QPS (cold: evicted before each)."""

    def one(run) -> Dict[str, object]:
        before = reader.evict() if cold else reader.residency()
        if cold and before > 0.05:
            raise RuntimeError(f"{name}: evict left {before:.1%} of the index cached")
        result: LoadResult = run()
        summary = result.summary(truth)
        summary.update(residency_before=before, residency_after=reader.residency())
        bar.update(1)
        return summary

    closed = one(lambda: closed_loop(reader, queries, args.k, threads=args.threads,
                                     seconds=args.duration))
    opened = [one(lambda q=q, i=i: open_loop(reader, queries, args.k, qps=q,
                                             seconds=args.duration, threads=args.threads,
                                             seed=i))
              for i, q in enumerate(targets)]
    return {"name": name, "mmap": reader.mmap, "cold": cold, "closed": closed, "open": opened,
            "sustainable_qps": sustainable(opened, args.slo)}


def sustainable(runs: List[Dict[str, object]], slo_s: float) -> Optional[float]:
    """The highest offered QPS served on time: p95 within the SLO, and at least 95% of the
    rate its Poisson schedule actually offered achieved."""
    ok = [r["offered_qps"] for r in runs
          if r["latency_us"]["p95"] is not None and r["latency_us"]["p95"] <= slo_s * 1e6
          and r["achieved_qps"] >= 0.95 * r.get("scheduled_qps", r["offered_qps"])]
    return max(ok) if ok else None


# -- reporting ----------------------------------------------------------------------------------
def table(scenarios: List[Dict[str, object]], slo_s: float) -> None:
    rows = []
    for s in scenarios:
        c = s["closed"]
        rows.append({"scenario": s["name"], "max QPS": c["achieved_qps"],
                     "p50 us": c["latency_us"]["p50"], "p95 us": c["latency_us"]["p95"],
                     "p99 us": c["latency_us"]["p99"], "recall": c["recall"],
                     "cached after": c["residency_after"],
                     f"QPS at p95<={slo_s * 1e3:g}ms": s["sustainable_qps"],
                     "write GB/s": (s.get("write_load") or {}).get("gbps")})
    print("\nclosed loop (max QPS) per scenario:")
    _bench.print_table(rows, list(rows[0]))
    print("\nopen loop (latency from each query's scheduled time):")
    rows = [{"scenario": s["name"], "offered": r["offered_qps"], "achieved": r["achieved_qps"],
             "p50 us": r["latency_us"]["p50"], "p95 us": r["latency_us"]["p95"],
             "p99 us": r["latency_us"]["p99"], "late": r["late"], "recall": r["recall"],
             "cached before": r["residency_before"]}
            for s in scenarios for r in s["open"]]
    _bench.print_table(rows, list(rows[0]))


def check_targets(record: Dict[str, float], opened: List[Dict[str, object]],
                  warm: Dict[str, object]) -> Dict[str, Dict[str, object]]:
    verdicts = {
        "warm mmap QPS / warm in-RAM QPS": {"value": warm["ratio"], "target": f">= {MMAP_SHARE}",
                                            "met": warm["ratio"] >= MMAP_SHARE},
        "recording latency, us per query": {"value": record["record_us"],
                                            "target": f"< {RECORD_US}",
                                            "met": record["record_us"] < RECORD_US}}
    for o in opened:
        big = o["bytes"] >= OPEN_MIN_BYTES
        verdicts[f"mmap open time / in-RAM load time, {o['type']}"] = {
            "value": o["ratio"],
            "target": f"<= {OPEN_SHARE}" + ("" if big else
                                            f" (not applicable: {format_size(o['bytes'])} "
                                            f"< {format_size(OPEN_MIN_BYTES)})"),
            "met": o["ratio"] <= OPEN_SHARE or not big}
    print("\ntargets:")
    _bench.print_verdicts(verdicts)
    return verdicts


# -- command line -------------------------------------------------------------------------------
def parse_count(text: str) -> int:
    """1M, 250K, 5000 -> int."""
    scale = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(text[-1:].upper())
    try:
        value = float(text[:-1]) * scale if scale else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 5000, 250K, 1M)") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"count must be positive, got {text!r}")
    return int(value)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, help="serve this FAISS index instead of building one")
    p.add_argument("--queries", type=Path, help=".npy of query vectors (with --index)")
    p.add_argument("--ground-truth", type=Path,
                   help=".npy of true neighbour ids per query (with --index; for recall)")
    p.add_argument("--dir", type=Path, default=Path("bench-data/rag"),
                   help="where the built index and the write load go (the drive under test)")
    p.add_argument("--dim", type=int, default=384, help="embedding dimension (default 384)")
    p.add_argument("--n", type=parse_count, default=1_000_000, help="vectors (default 1M)")
    p.add_argument("--kind", choices=_rag_data.KINDS, default="ivfpq",
                   help="index to build (default ivfpq)")
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default ~sqrt(n))")
    p.add_argument("--pq-m", type=int, default=None, help="PQ bytes per vector (default d/8)")
    p.add_argument("--nprobe", type=int, default=16, help="IVF lists searched (default 16)")
    p.add_argument("--ef-search", type=int, default=64, help="HNSW efSearch (default 64)")
    p.add_argument("--k", type=int, default=10, help="neighbours per query (default 10)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="caller threads (default: one per CPU)")
    p.add_argument("--qps", type=float, nargs="+", default=None,
                   help="open-loop target QPS list (default: "
                        f"{', '.join(f'{f:g}' for f in QPS_FRACTIONS)} x warm in-RAM max QPS)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per run (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating warm mmap / in-RAM closed-loop rounds (default 3)")
    p.add_argument("--slo", default="10ms", help="p95 latency objective (default 10ms)")
    p.add_argument("--open-test", action=argparse.BooleanOptionalAction, default=True,
                   help="time opening by mmap against loading into RAM (default: on)")
    p.add_argument("--write-load", action="store_true",
                   help="also run mmap cold beside an unpaced and a paced CheckpointWriter")
    p.add_argument("--write-size", default="1GiB", help="the write load's state dict size")
    p.add_argument("--write-rate", default=None,
                   help="the paced writer's bytes/s (default: half the unpaced one's GB/s)")
    p.add_argument("--json", type=Path, default=Path("bench-results/rag_qps.json"))
    p.add_argument("--plot", type=Path, default=None, help="PNG (default: beside the JSON)")
    args = p.parse_args(argv)
    for name in ("dim", "k", "threads", "rounds", "nprobe", "ef_search"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.duration <= 0 or (args.qps and min(args.qps) <= 0):
        p.error("--duration and --qps must be positive")
    if (args.queries or args.ground_truth) and not args.index:
        p.error("--queries and --ground-truth go with --index")
    slo = args.slo.strip().lower()
    try:
        args.slo = float(slo[:-2]) / 1e3 if slo.endswith("ms") else float(slo.rstrip("s"))
    except ValueError:
        p.error(f"--slo: not a duration: {args.slo!r} (e.g. 10ms, 0.02)")
    args.write_size = parse_size(args.write_size, name="--write-size")
    args.write_rate = float(parse_size(args.write_rate, name="--write-rate")) \
        if args.write_rate else None
    args.plot = args.plot or args.json.with_suffix(".png")
    return args


def prepare(args) -> Dict[str, object]:
    """The index to serve, its queries and ground truth (built and cached unless --index)."""
    if args.index:
        queries = np.load(args.queries) if args.queries else None
        truth = np.load(args.ground_truth) if args.ground_truth else None
        return {"index": args.index, "queries": queries, "truth": truth, "build": None,
                "spec": None}
    data = _rag_data.DataSpec(n=args.n, dim=args.dim)
    spec = _rag_data.IndexSpec(kind=args.kind,
                               nlist=args.nlist or _rag_data.default_nlist(args.n),
                               pq_m=args.pq_m or _rag_data.default_pq_m(args.dim))
    built = _build(args.dir, data, spec)
    return {"index": built["index"], "queries": np.load(built["queries"]),
            "truth": np.load(built["ground_truth"]), "build": built, "spec": spec, "data": data}


def _build(directory: Path, data, spec) -> Dict[str, object]:
    with tqdm(total=data.n, desc=f"building {spec.filename(data)}", unit="vec", leave=False,
              disable=None) as bar:
        def progress(stage, done, total):
            bar.set_description(stage)
            bar.n = done
            bar.refresh()
        return _rag_data.build(directory, data, spec, progress)


def open_test_indexes(args, prepared) -> List[Path]:
    """Indexes of at least 1 GB to time opening: the served one if it is that big, else an
    IVF-Flat and a flat index of the same vectors (when they make 1 GB); else the served one
    (timed anyway, the target then does not apply)."""
    served = Path(prepared["index"])
    if served.stat().st_size >= OPEN_MIN_BYTES or prepared["spec"] is None:
        return [served]
    data = prepared["data"]
    if data.n * data.dim * 4 < OPEN_MIN_BYTES:
        return [served]
    nlist = prepared["spec"].nlist
    return [Path(_build(args.dir, data, _rag_data.IndexSpec(kind=kind, nlist=nlist, pq_m=0))
                 ["index"]) for kind in ("ivfflat", "flat")]


def main(argv=None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    import faiss

    info = _bench.environment(args.dir)
    info.update(faiss=faiss.__version__, threads=args.threads, k=args.k)
    prepared = prepare(args)
    index_path = Path(prepared["index"])
    queries, truth = prepared["queries"], prepared["truth"]
    knobs = {"nprobe": args.nprobe, "ef_search": args.ef_search}
    readers = {"mmap": _rag_load.open_reader(index_path, True, knobs),
               "ram": _rag_load.open_reader(index_path, False, knobs)}
    if queries is None:
        queries = np.random.default_rng(0).standard_normal((1000, readers["mmap"].d)) \
            .astype(np.float32)
    served = readers["mmap"].info()
    info.update(index=served)
    _bench.print_header(info)
    print(f"index: {served['type']} of {served['ntotal']:,} x {served['d']} "
          f"({format_size(served['file_bytes'])}), served by {served['io_flag']} "
          f"({served['mapped_fraction']:.0%} of the file mapped); {len(queries):,} queries"
          + ("" if truth is None else f", ground truth k={truth.shape[1]}"))

    record = recording_cost(readers["ram"], queries[0], args.k)
    print(f"recording latency: {record['record_us']:.3f} us per query (timer + histogram); "
          f"whole wrapper vs a bare faiss call: {record['wrapper_overhead_us']:+.2f} us")
    opened: List[Dict[str, object]] = []
    if args.open_test:
        for path in open_test_indexes(args, prepared):
            opened.append(open_times(path))
            o = opened[-1]
            print(f"open {Path(path).name} ({format_size(o['bytes'])}, cold cache): mmap "
                  f"{o['mmap_open_s'] * 1e3:.2f} ms ({o['io_flag']}) vs in-RAM load "
                  f"{o['ram_load_s'] * 1e3:,.0f} ms = {o['ratio']:.4f}")
    for reader in readers.values():
        warm_up(reader, queries, args.k)
    warm = compare_warm(readers, queries, args)
    print(f"warm closed loop, {args.threads} threads, median of {args.rounds} alternating "
          f"rounds: mmap {warm['median_qps']['mmap']:,.0f} QPS, in-RAM "
          f"{warm['median_qps']['ram']:,.0f} QPS = {warm['ratio']:.3f}")
    targets = args.qps or [round(f * warm["median_qps"]["ram"], 1) for f in QPS_FRACTIONS]
    plan = [("RAM, warm", readers["ram"], False, None), ("mmap, warm", readers["mmap"], False,
                                                         None),
            ("mmap, cold", readers["mmap"], True, None)]
    if args.write_load:
        plan += [("mmap, cold + unpaced write", readers["mmap"], True, "unpaced"),
                 ("mmap, cold + paced write", readers["mmap"], True, "paced")]
    scenarios = []
    runs = sum(1 + len(targets) for _ in plan)
    with tqdm(total=runs, desc="scenarios", unit="run", leave=False, disable=None) as bar:
        for name, reader, cold, write in plan:
            bar.set_description(name)
            if write is None:
                scenarios.append(run_scenario(name, reader, cold, targets, queries, truth,
                                              args, bar))
                continue
            rate = None if write == "unpaced" else args.write_rate or _half_unpaced(scenarios)
            with _rag_load.WriteLoad(args.dir / "write-load", args.write_size, rate) as load:
                result = run_scenario(name, reader, cold, targets, queries, truth, args, bar)
            result["write_load"] = load.summary()
            scenarios.append(result)
    for reader in readers.values():
        reader.close()
    table(scenarios, args.slo)
    verdicts = check_targets(record, opened, warm)
    payload = {"environment": info, "config": {k: str(v) if isinstance(v, Path) else v
                                               for k, v in vars(args).items()},
               "build": prepared["build"], "recording": record, "open": opened, "warm": warm,
               "targets_qps": targets, "scenarios": scenarios, "targets": verdicts}
    import _plot_rag

    _bench.write_outputs(payload, args.json, _plot_rag.plot_rag, args.plot)
    return 0


def _half_unpaced(scenarios: List[Dict[str, object]]) -> float:
    for s in scenarios:
        load = s.get("write_load") or {}
        if load.get("rate") is None and load.get("gbps"):
            return load["gbps"] * 1e9 / 2
    return 500e6


if __name__ == "__main__":
    sys.exit(main())
