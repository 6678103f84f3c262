#!/usr/bin/env python3
"""Start-up cost of a ShardStream: how the index is found, and time to the first batch.

    python benchmarks/startup.py                      # generates 1 MiB- and 8 KB-member shards
    python benchmarks/startup.py --data /mnt/plc/set  # the tar shards in a directory
    python benchmarks/startup.py --ranks 1,2,4 --rounds 3

Part 1, scan methods (one process, cold: the shards evicted from the page cache before each
run): the same shards indexed by each value of FLASHSTREAM_INDEX_SCAN, in an order that
rotates from round to round:

    full        the reader's own pass, samples built (every scan before header hopping)
    sequential  every byte read by the C++ indexer, no samples built
    hop         header hopping: one small read per header, data jumped over
    auto        the default: hop, or sequential where members are small

Part 2, ranks: 1, 2 and 4 processes in a real gloo process group on this machine, started
together, cold, each building ShardStream(shards) and taking its first batch of --batch-size
samples, in process and then through a DataLoader with --workers workers (worker start-up
included, as a training loop meets it). Where the index comes from:

    sidecar     SHARD.fsidx files written beforehand by `flashstream index` (beside symlinks
                to the shards, so a --data directory is left as it is)
    cache       index cache entries from an earlier run
    scan        neither, cache off: the ranks share the scan (auto method)
    scan_full   the same with FLASHSTREAM_INDEX_SCAN=full: every rank scanning every shard
                with the reader's pass, as before this work, when sharing is off too

Figures: seconds to the stream being built and to the first batch (the slowest rank), bytes
read to index (flashstream's counters, all ranks) against the data set, and the drive's own
read bytes over the indexing (from /proc/diskstats, so other activity on the drive shows up
too; part 1 shows them as well, which also exposes a buffered fallback's read-ahead). A
table goes to stdout, everything to JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

from flashstream import settings  # noqa: E402
from flashstream.pagecache import evict  # noqa: E402
from flashstream.sizes import format_size, parse_size  # noqa: E402
from flashstream.stream.handlers import reraise_exception  # noqa: E402
from flashstream.stream.index_scan import (  # noqa: E402
    SCAN_ENV,
    ScanState,
    hop_threshold,
    scan_shards,
)
from flashstream.stream.samples import ReadStats  # noqa: E402
from flashstream.telemetry.diskstats import DiskSampler  # noqa: E402

METHODS = ("full", "sequential", "hop", "auto")
SOURCES = ("sidecar", "cache", "scan", "scan_full")
# name -> (member bytes, default data set bytes, shard bytes)
PROFILES = {"1MiB": (1 << 20, 2 << 30, 256 << 20), "8KB": (8_000, 256 << 20, 32 << 20)}
# (profile, figure, bound, "min" or "max", what it says)
TARGETS = [
    ("1MiB", "hop_bytes_share", 0.02, "max", "header hopping: bytes read / shard bytes"),
    ("1MiB", "full_vs_hop", 10.0, "min", "full scan seconds / header-hopping seconds"),
    ("8KB", "full_vs_auto", 1.0, "min", "full scan seconds / auto seconds (no slower)"),
    ("8KB", "rank4_scan_bytes_share", 1.05, "max",
     "4 gloo ranks, no sidecar or cache: index bytes read / data set (small members: read "
     "whole, so sharing is what keeps it at 1x)"),
]


# -- part 1 ------------------------------------------------------------------------------------
def time_method(shards: Sequence[Path], method: str, device: Optional[str]
                ) -> Dict[str, object]:
    evict(shards)
    os.environ[SCAN_ENV] = method
    read, state = ReadStats(), ScanState()
    disk = DiskSampler(device).start()
    start = time.perf_counter()
    index = scan_shards([str(s) for s in shards], settings.current(), reraise_exception,
                        read=read, state=state)
    seconds = time.perf_counter() - start
    drive = disk.stop()
    return {"seconds": seconds, "bytes": read.bytes_read, "samples": sum(i.count for i in index),
            "methods": state.methods, "drive_bytes": drive.read_bytes if drive else None}


def compare_methods(shards: Sequence[Path], rounds: int, device: Optional[str]
                    ) -> Dict[str, object]:
    # The device lookup behind auto's threshold is made once per process: not in round 1.
    hop_threshold(str(shards[0]), len(shards))
    runs: Dict[str, List[Dict[str, object]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        # Rotated, and reversed every other round, so no method always follows the same one
        # (a drive or host cache warmed by one run favours the next).
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for method in (order[::-1] if r % 2 else order):
            runs[method].append(time_method(shards, method, device))
    os.environ.pop(SCAN_ENV, None)
    median = {m: {"seconds": statistics.median(x["seconds"] for x in v),
                  "bytes": int(statistics.median(x["bytes"] for x in v)),
                  "drive_bytes": (int(statistics.median(x["drive_bytes"] for x in v))
                                  if all(x["drive_bytes"] is not None for x in v) else None),
                  "samples": v[0]["samples"], "methods": v[0]["methods"],
                  # within each round, then the median: the drive's drift between rounds
                  # cancels out of the ratio
                  "vs_full": statistics.median(f["seconds"] / x["seconds"]
                                               for f, x in zip(runs["full"], v))}
              for m, v in runs.items()}
    return {"rounds": runs, "median": median}


# -- part 2 ------------------------------------------------------------------------------------
def rank_child(argv: Sequence[str]) -> None:
    """One rank: joins the group, builds the stream, takes a batch in process and one through
    a DataLoader with workers (the training loop's path), prints JSON."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from flashstream import ShardStream
    from flashstream.telemetry.diskstats import disk_counters

    rank, world, init, urls_file, batch, workers, device = (
        int(argv[0]), int(argv[1]), argv[2], argv[3], int(argv[4]), int(argv[5]), argv[6])
    urls = Path(urls_file).read_text().split("\n")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    dist.barrier()
    before = disk_counters(device) if rank == 0 else None
    start = time.perf_counter()
    stream = ShardStream(urls)
    built = time.perf_counter() - start
    dist.barrier()  # every rank's index is built: what the drive read meanwhile was indexing
    after = disk_counters(device) if rank == 0 else None
    first = list(itertools.islice(iter(stream), batch))
    to_batch = time.perf_counter() - start
    # The same stream through DataLoader workers, as a training loop takes it: the built
    # stream's time plus the loader's first batch (worker start-up included).
    loader = DataLoader(stream, batch_size=batch, num_workers=workers, collate_fn=list)
    loader_start = time.perf_counter()
    loader_first = next(iter(loader))
    to_loader_batch = built + time.perf_counter() - loader_start
    info = stream.index_info
    print(json.dumps({
        "rank": rank, "build_s": built, "first_batch_s": to_batch,
        "loader_first_batch_s": to_loader_batch, "loader_samples": len(loader_first),
        "samples": len(first),
        "index_bytes": info.get("bytes_read"), "by_source": info.get("by_source"),
        "drive_bytes": (after.read_bytes - before.read_bytes) if before and after else None}),
        flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(urls: Sequence[str], world: int, env: Dict[str, str], batch: int, workers: int,
              device: Optional[str], workdir: Path) -> Dict[str, object]:
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        urls_file = Path(scratch) / "urls"
        urls_file.write_text("\n".join(urls))
        init = Path(scratch) / "init"
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--rank-child", str(r), str(world), str(init),
             str(urls_file), str(batch), str(workers), device or ""], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
            for r in range(world)]
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            if proc.returncode != 0:  # the others would wait for it in the group
                for other in procs:
                    other.kill()
            if proc.returncode != 0:
                raise RuntimeError(f"rank failed: {err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    return {"ranks": world,
            "build_s": max(r["build_s"] for r in results),
            "first_batch_s": max(r["first_batch_s"] for r in results),
            "loader_first_batch_s": max(r["loader_first_batch_s"] for r in results),
            "index_bytes": sum(r["index_bytes"] or 0 for r in results),
            "drive_bytes": results[0]["drive_bytes"], "per_rank": results}


def prepare_source(source: str, shards: Sequence[Path], workdir: Path) -> tuple:
    """(urls, environment) for a source of the index; sidecars and cache entries are made
    here, untimed."""
    if source == "sidecar":
        view = workdir / "sidecar-view"
        view.mkdir(parents=True, exist_ok=True)
        links = []
        for shard in shards:
            link = view / shard.name
            if not link.exists():
                link.symlink_to(shard.resolve())
            links.append(str(link))
        from flashstream.cli import main as cli

        with contextlib.redirect_stdout(io.StringIO()):  # one line per shard
            cli(["index", *links])
        return links, {"FLASHSTREAM_INDEX_CACHE": "off"}
    urls = [str(s) for s in shards]
    if source == "cache":
        from flashstream import ShardStream

        cache = workdir / "index-cache"
        saved = os.environ.get("FLASHSTREAM_INDEX_CACHE")
        os.environ["FLASHSTREAM_INDEX_CACHE"] = str(cache)
        try:
            ShardStream(urls)  # scans once, untimed: later streams read the cache
        finally:
            if saved is None:
                del os.environ["FLASHSTREAM_INDEX_CACHE"]
            else:
                os.environ["FLASHSTREAM_INDEX_CACHE"] = saved
        return urls, {"FLASHSTREAM_INDEX_CACHE": str(cache)}
    if source == "scan":
        return urls, {"FLASHSTREAM_INDEX_CACHE": "off"}
    return urls, {"FLASHSTREAM_INDEX_CACHE": "off", SCAN_ENV: "full",
                  "FLASHSTREAM_INDEX_SHARE": "0"}


def compare_ranks(shards: Sequence[Path], ranks: Sequence[int], sources: Sequence[str],
                  batch: int, workers: int, device: Optional[str], workdir: Path
                  ) -> List[Dict[str, object]]:
    rows = []
    data = sum(s.stat().st_size for s in shards)
    for source in sources:
        urls, env = prepare_source(source, shards, workdir)
        for world in ranks:
            cache = env["FLASHSTREAM_INDEX_CACHE"]
            index_files = list(Path(urls[0]).parent.glob("*.fsidx")) + (
                list(Path(cache).glob("*")) if cache != "off" else [])
            evict(list(shards) + index_files)  # cold: sidecars and cache entries too
            row = run_ranks(urls, world, env, batch, workers, device, workdir)
            row.update(source=source, index_share=row["index_bytes"] / data,
                       drive_share=(row["drive_bytes"] / data
                                    if row["drive_bytes"] is not None else None))
            rows.append(row)
    return rows


# -- main --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="a directory of .tar shards (default: generate)")
    p.add_argument("--workdir", type=Path, default=Path("bench-data/startup"),
                   help="where generated shards, sidecar links and caches go")
    p.add_argument("--size", default=None,
                   help="bytes per generated data set (default: 2GiB of 1 MiB members, "
                        "256MiB of 8 KB ones)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the scan-method comparison")
    p.add_argument("--ranks", default="1,2,4", help="process group sizes, comma-separated")
    p.add_argument("--sources", default=",".join(SOURCES),
                   help=f"index sources for part 2, from {', '.join(SOURCES)}")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers per rank for the loader's first batch")
    p.add_argument("--no-ranks", action="store_true", help="part 1 only")
    p.add_argument("--json", type=Path, default=Path("bench-results/startup.json"))
    args = p.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    args.sources = [s for s in args.sources.split(",") if s]
    bad = [s for s in args.sources if s not in SOURCES]
    if bad or not args.ranks or min(args.ranks) < 1 or args.rounds < 1:
        p.error(f"--sources from {', '.join(SOURCES)}; --ranks and --rounds positive")
    return args


def data_sets(args: argparse.Namespace) -> Dict[str, List[Path]]:
    if args.data is not None:
        shards = sorted(args.data.glob("*.tar"))
        if not shards:
            raise SystemExit(f"no .tar shards in {args.data}")
        return {args.data.name: shards}
    out = {}
    for name, (member, total, shard) in PROFILES.items():
        if args.size is not None:
            total = parse_size(args.size)
            shard = max(member * 4, total // 8)
        out[name] = _bench.write_synthetic_shards(args.workdir / name, sample_size=member,
                                                  total_bytes=total, shard_bytes=shard)
    return out


def verdicts(results: Dict[str, Dict[str, object]]) -> Dict[str, Dict[str, object]]:
    out = {}
    for profile, figure, bound, kind, label in TARGETS:
        value = results.get(profile, {}).get("figures", {}).get(figure)
        if value is None:
            continue
        met = value <= bound if kind == "max" else value >= bound
        out[f"{profile} {label}"] = {"value": value, "target": f"{'<=' if kind == 'max' else '>='} "
                                     f"{bound}", "met": met}
    return out


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--rank-child":
        rank_child(sys.argv[2:])
        return 0
    args = parse_args(argv)
    args.workdir = args.workdir.resolve()  # the ranks' rendezvous file needs an absolute path
    args.workdir.mkdir(parents=True, exist_ok=True)
    sets = data_sets(args)
    first = next(iter(sets.values()))[0]
    info = _bench.environment(first.parent)
    _bench.print_header(info)
    device = info.get("device_name")
    results: Dict[str, Dict[str, object]] = {}
    for name, shards in sets.items():
        data = sum(s.stat().st_size for s in shards)
        print(f"\n== {name}: {len(shards)} shards, {format_size(data)}")
        methods = compare_methods(shards, args.rounds, device)
        median = methods["median"]
        rows = [{"method": m, "seconds": v["seconds"], "MB read": v["bytes"] / 1e6,
                 "read share": v["bytes"] / data,
                 "drive share": (v["drive_bytes"] / data if v["drive_bytes"] is not None
                                 else None),
                 "vs full": v["vs_full"], "samples": v["samples"],
                 "hop/seq/full": "/".join(str(v["methods"].get(k, 0))
                                          for k in ("hop", "sequential", "full"))}
                for m, v in median.items()]
        print(f"scan methods, one process, cold (median of {args.rounds}):")
        _bench.print_table(rows, ["method", "seconds", "MB read", "read share", "drive share",
                                  "vs full", "samples", "hop/seq/full"])
        ranks = [] if args.no_ranks else compare_ranks(
            shards, args.ranks, args.sources, args.batch_size, args.workers, device,
            args.workdir / f"{name}-ranks")
        if ranks:
            print("\nranks, cold (the slowest rank's seconds; bytes of all ranks):")
        _bench.print_table([{"source": r["source"], "ranks": r["ranks"],
                             "build s": r["build_s"], "first batch s": r["first_batch_s"],
                             "loader batch s": r["loader_first_batch_s"],
                             "index MB": r["index_bytes"] / 1e6,
                             "index / data": r["index_share"],
                             "drive / data": r["drive_share"]} for r in ranks],
                           ["source", "ranks", "build s", "first batch s", "loader batch s",
                            "index MB",
                            "index / data", "drive / data"]) if ranks else None
        figures = {"hop_bytes_share": median["hop"]["bytes"] / data,
                   "full_vs_hop": median["hop"]["vs_full"],
                   "full_vs_auto": median["auto"]["vs_full"]}
        four = [r for r in ranks if r["source"] == "scan" and r["ranks"] == 4]
        if four:
            figures["rank4_scan_bytes_share"] = four[0]["index_share"]
        results[name] = {"shards": len(shards), "bytes": data, "methods": methods,
                         "ranks": ranks, "figures": figures}
    checks = verdicts(results)
    if checks:
        print("\ntargets:")
        _bench.print_verdicts(checks)
    payload = {"environment": info, "args": {k: str(v) for k, v in vars(args).items()},
               "results": results, "targets": checks}
    print(f"\nJSON: {_bench.write_json(args.json, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
