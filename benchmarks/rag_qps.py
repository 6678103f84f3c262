#!/usr/bin/env python3
"""RAG retrieval QPS and tail latency from the drive: a FAISS index served by IndexReader, its
IVF lists fetched by O_DIRECT (io="direct") against the file memory-mapped (io="mmap").

    python benchmarks/rag_qps.py                  # builds 1M x 128 IVF1024,Flat in bench-data/rag
    python benchmarks/rag_qps.py --dir /mnt/plc/rag --write-load
    python benchmarks/rag_qps.py --index my.index --queries q.npy --ground-truth gt.npy

Without --index it builds a realistic index (clustered, normalised synthetic embeddings;
IVF-Flat by default) on the drive under test, with exact ground truth for a query sample. Then:
the cost of recording latency; open time by mmap against a full in-RAM load; warm mmap against
in-RAM QPS (closed loop, alternating rounds); direct against mmap cold (page cache and list
cache emptied before every query, batch 1) and warm (everything cached), on the same queries;
per scenario (RAM warm, mmap and direct warm and cold, with --write-load cold beside an unpaced
and a paced CheckpointWriter) a closed-loop max QPS and open-loop runs at each target QPS,
latency measured from each query's scheduled time; and the larger-than-memory study
(_rag_capped.py): each mode in a serving process whose memory cgroup lets it cache half the
index, a Zipf query stream at rising open-loop QPS, alone, beside a checkpoint being written and
beside a ShardStream epoch, for the QPS at which p95 crosses the SLO. Every result is compared
with FAISS in RAM; recall@k against the ground truth beside the latency figures. Tables to
stdout, everything to JSON, p95 against offered QPS (both modes) to a PNG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402
import _rag_capped  # noqa: E402
import _rag_data  # noqa: E402
import _rag_direct  # noqa: E402
import _rag_load  # noqa: E402
import _rag_open  # noqa: E402
import _rag_report  # noqa: E402

from flashstream import IndexReader  # noqa: E402
from flashstream.retrieval.load import LoadResult, closed_loop, open_loop  # noqa: E402
from flashstream.sizes import format_size, parse_size  # noqa: E402

QPS_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.2)  # default targets: x warm in-RAM max QPS
CAPPED_QPS = (5, 10, 20, 40, 60, 100, 150, 250, 400, 600, 1000, 1500)  # larger than memory


# -- measurements -------------------------------------------------------------------------------
def warm_up(reader: IndexReader, queries: np.ndarray, k: int) -> None:
    """Page the file in (read it once) and fault every query's pages into the mapping; served
    direct, fetch every query's lists into the list cache (and leave the page cache alone)."""
    if reader.info()["io"] != "direct":
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
    return {"name": name, "io": reader.info()["io"], "cold": cold, "closed": closed,
            "open": opened,
            "sustainable_qps": _rag_report.sustainable(opened, args.slo)}


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
    p.add_argument("--dim", type=int, default=128, help="embedding dimension (default 128)")
    p.add_argument("--n", type=parse_count, default=1_000_000, help="vectors (default 1M)")
    p.add_argument("--kind", choices=_rag_data.KINDS, default="ivfflat",
                   help="index to build (default ivfflat)")
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
    _add_direct_args(p)
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
    for name in ("cold_queries", "warm_rounds", "serve_threads", "stream_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (args.cache_share > 0 and args.list_cache_share >= 0 and args.warmup >= 0
            and min(args.capped_qps) > 0 and args.zipf >= 0):
        p.error("--cache-share, --capped-qps must be positive; --list-cache-share, --warmup "
                "and --zipf at least 0")
    args.epoch_size = parse_size(args.epoch_size, name="--epoch-size")
    if args.capped_write_rate not in (None, "auto"):
        args.capped_write_rate = float(parse_size(args.capped_write_rate,
                                                  name="--capped-write-rate"))
    args.write_size = parse_size(args.write_size, name="--write-size")
    args.write_rate = float(parse_size(args.write_rate, name="--write-rate")) \
        if args.write_rate else None
    args.plot = args.plot or args.json.with_suffix(".png")
    return args


def _add_direct_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("direct against mmap")
    g.add_argument("--cold-queries", type=int, default=200,
                   help="queries searched cold (caches emptied before each), per mode")
    g.add_argument("--warm-rounds", type=int, default=3,
                   help="alternating warm direct / mmap rounds over the queries (default 3)")
    g.add_argument("--capped", action=argparse.BooleanOptionalAction, default=True,
                   help="run the larger-than-memory study (default: on)")
    g.add_argument("--cache-share", type=float, default=0.5,
                   help="memory the serving process may cache, as a share of the index "
                        "(default 0.5: the index is 2 x it)")
    g.add_argument("--list-cache-share", type=float, default=0.1,
                   help="direct's list cache, as a share of the index (default 0.1)")
    g.add_argument("--zipf", type=float, default=1.0,
                   help="exponent of the query stream's popularity (default 1.0)")
    g.add_argument("--stream-length", type=int, default=50_000,
                   help="queries in the stream (default 50000)")
    g.add_argument("--capped-qps", type=float, nargs="+", default=list(CAPPED_QPS),
                   help="rising open-loop QPS levels (default: "
                        f"{', '.join(f'{q:g}' for q in CAPPED_QPS)})")
    g.add_argument("--warmup", type=float, default=10.0,
                   help="closed-loop seconds before the levels (default 10)")
    g.add_argument("--serve-threads", type=int, default=8,
                   help="caller threads of the serving process (default 8)")
    g.add_argument("--conditions", nargs="+", choices=_rag_capped.CONDITIONS,
                   default=list(_rag_capped.CONDITIONS),
                   help="alone, beside a checkpoint being written, beside a ShardStream "
                        "epoch (default: all)")
    g.add_argument("--epoch-size", default="1GiB", help="the epoch load's shards (default 1GiB)")
    g.add_argument("--capped-write-rate", default=None,
                   help="the checkpoint load's rate: bytes/s, or auto (default: unpaced, as "
                        "CheckpointWriter writes by default)")


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
    if served.stat().st_size >= _rag_report.OPEN_MIN_BYTES or prepared["spec"] is None:
        return [served]
    data = prepared["data"]
    if data.n * data.dim * 4 < _rag_report.OPEN_MIN_BYTES:
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
               "ram": _rag_load.open_reader(index_path, False, knobs),
               # warm means every list in memory: a list cache the size of the index
               "direct": _rag_load.open_reader(index_path, True, knobs, io="direct",
                                               list_cache=index_path.stat().st_size)}
    if readers["direct"].info()["io"] != "direct":
        print(f"direct: {readers['direct'].info()['io_reason']}; direct runs skipped")
        readers.pop("direct").close()
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

    record = _rag_open.recording_cost(readers["ram"], queries[0], args.k)
    print(f"recording latency: {record['record_us']:.3f} us per query (timer + histogram); "
          f"whole wrapper vs a bare faiss call: {record['wrapper_overhead_us']:+.2f} us")
    opened: List[Dict[str, object]] = []
    if args.open_test:
        for path in open_test_indexes(args, prepared):
            opened.append(_rag_open.open_times(path))
            o = opened[-1]
            print(f"open {Path(path).name} ({format_size(o['bytes'])}, cold cache): mmap "
                  f"{o['mmap_open_s'] * 1e3:.2f} ms ({o['io_flag']}) vs in-RAM load "
                  f"{o['ram_load_s'] * 1e3:,.0f} ms = {o['ratio']:.4f}")
    for reader in readers.values():
        warm_up(reader, queries, args.k)
    warm_ram = compare_warm({m: readers[m] for m in ("mmap", "ram")}, queries, args)
    print(f"warm closed loop, {args.threads} threads, median of {args.rounds} alternating "
          f"rounds: mmap {warm_ram['median_qps']['mmap']:,.0f} QPS, in-RAM "
          f"{warm_ram['median_qps']['ram']:,.0f} QPS = {warm_ram['ratio']:.3f}")
    expected = _rag_direct.expected_results(readers["ram"], queries, args.k)
    cold = warm = None
    if "direct" in readers:
        pair = {m: readers[m] for m in _rag_direct.MODES}
        cold = _rag_direct.cold_per_query(pair, queries, expected, args.k, args.cold_queries)
        warm = _rag_direct.warm(pair, queries, expected, args.k, args.warm_rounds)
        _rag_report.cold_and_warm(cold, warm)
    targets = args.qps or [round(f * warm_ram["median_qps"]["ram"], 1) for f in QPS_FRACTIONS]
    scenarios = run_scenarios(args, readers, targets, queries, truth)
    for reader in readers.values():  # a mapping left open would keep pages the runs evict
        reader.close()
    study = None
    if args.capped and "direct" in readers:
        study = _rag_capped.run(args, index_path, queries, expected, args.dir)
    _rag_report.table(scenarios, args.slo)
    if cold is not None:
        _rag_report.cold_and_warm(cold, warm)
    if study is not None:
        _rag_report.capped(study)
    wrong = sum(x[m]["wrong"] for x in (cold, warm) if x for m in _rag_direct.MODES)
    wrong += sum(r["wrong"] for c in (study or {}).get("runs", {}).values()
                 for r in (c["mmap"], c["direct"]))
    verdicts = _rag_report.check_targets(record, opened, warm_ram, cold, warm, study, wrong)
    payload = {"environment": info, "config": {k: str(v) if isinstance(v, Path) else v
                                               for k, v in vars(args).items()},
               "build": prepared["build"], "recording": record, "open": opened,
               "warm": warm_ram, "cold_direct_vs_mmap": cold, "warm_direct_vs_mmap": warm,
               "targets_qps": targets, "scenarios": scenarios, "capped": study,
               "targets": verdicts}
    import _plot_rag

    _bench.write_outputs(payload, args.json, _plot_rag.plot_rag, args.plot)
    return 0


def run_scenarios(args, readers: Dict[str, IndexReader], targets: List[float], queries,
                  truth) -> List[Dict[str, object]]:
    """Per scenario a closed-loop max QPS and an open-loop run at each target QPS."""
    plan = [("RAM, warm", "ram", False, None), ("mmap, warm", "mmap", False, None),
            ("mmap, cold", "mmap", True, None)]
    if "direct" in readers:
        plan += [("direct, warm", "direct", False, None), ("direct, cold", "direct", True, None)]
    if args.write_load:
        for mode in ("mmap", "direct") if "direct" in readers else ("mmap",):
            plan += [(f"{mode}, cold + unpaced write", mode, True, "unpaced"),
                     (f"{mode}, cold + paced write", mode, True, "paced")]
    scenarios: List[Dict[str, object]] = []
    runs = sum(1 + len(targets) for _ in plan)
    with tqdm(total=runs, desc="scenarios", unit="run", leave=False, disable=None) as bar:
        for name, mode, cold, write in plan:
            bar.set_description(name)
            reader = readers[mode]
            if write is None:
                scenarios.append(run_scenario(name, reader, cold, targets, queries, truth,
                                              args, bar))
                continue
            rate = None if write == "unpaced" else args.write_rate or _half_unpaced(scenarios)
            with _rag_load.WriteLoad(args.dir / "write-load", args.write_size, rate) as load:
                result = run_scenario(name, reader, cold, targets, queries, truth, args, bar)
            result["write_load"] = load.summary()
            scenarios.append(result)
    return scenarios


def _half_unpaced(scenarios: List[Dict[str, object]]) -> float:
    for s in scenarios:
        load = s.get("write_load") or {}
        if load.get("rate") is None and load.get("gbps"):
            return load["gbps"] * 1e9 / 2
    return 500e6


if __name__ == "__main__":
    sys.exit(main())
