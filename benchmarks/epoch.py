#!/usr/bin/env python3
"""One epoch over tar shards: ShardStream vs webdataset vs fio, on the same files, in one run.

    python benchmarks/epoch.py                  # generates 100 KB and 8 KB sample shard sets
    python benchmarks/epoch.py --data /mnt/plc  # the shards already in a directory

Every cold measurement evicts the shards from the page cache first (and residency is checked
after ShardStream's cold epoch). Figures are seconds, GB/s of shard bytes, samples/s, and the
ratios between loaders measured in the same round; the median over rounds is reported. A table
goes to stdout and everything to JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

import flashstream  # noqa: E402
from flashstream.cache import evict, residency  # noqa: E402
from flashstream.sizes import parse_size  # noqa: E402

# name -> (sample payload bytes, default data set bytes, shard bytes)
PROFILES = {"100KB": (100_000, 1 << 30, 128 << 20), "8KB": (8_000, 384 << 20, 64 << 20)}
TARGETS = {
    "cold ShardStream GB/s / fio GB/s (100KB)": ("100KB", "cold_ss_vs_fio", 0.9),
    "warm ShardStream samples/s / webdataset (8KB)": ("8KB", "warm_ss_vs_wds", 5.0),
}
MAX_RESIDENCY = 0.05


def time_epoch(samples: Iterable[dict]) -> Dict[str, float]:
    start = time.perf_counter()
    n = 0
    for _ in samples:
        n += 1
    return {"seconds": time.perf_counter() - start, "samples": n}


def shardstream_epoch(urls: List[str], args) -> Dict[str, float]:
    stream = flashstream.ShardStream(urls, engine=args.engine, chunk_size=args.chunk_size,
                                     queue_depth=args.queue_depth)
    result = time_epoch(stream)
    stats = stream.last_stats
    result.update(engine=stats.engine, direct=stats.direct, bytes_read=stats.bytes_read)
    return result


def webdataset_epoch(urls: List[str]) -> Dict[str, float]:
    import webdataset as wds

    return time_epoch(wds.WebDataset(urls, shardshuffle=False))


def warm_up(paths: List[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def with_rates(result: Optional[Dict[str, float]], nbytes: int) -> Optional[Dict[str, float]]:
    if result is None:
        return None
    result.setdefault("gbps", nbytes / max(result["seconds"], 1e-9) / 1e9)
    if "samples" in result:
        result["samples_per_s"] = result["samples"] / result["seconds"]
    return result


def one_round(paths: List[Path], args) -> Dict[str, object]:
    urls = [str(p) for p in paths]
    nbytes = sum(p.stat().st_size for p in paths)
    run: Dict[str, object] = {}

    def cold(name: str, fn: Callable[[], Optional[Dict[str, float]]]) -> None:
        evict(paths)
        run[name] = with_rates(fn(), nbytes)

    if not args.no_fio:
        cold("cold_fio", lambda: _bench.fio_sequential_read(paths))
    cold("cold_shardstream", lambda: shardstream_epoch(urls, args))
    run["cache_residency_after_shardstream"] = residency(paths)
    if not args.no_webdataset:
        cold("cold_webdataset", lambda: webdataset_epoch(urls))
        warm_up(paths)
        run["warm_webdataset"] = with_rates(webdataset_epoch(urls), nbytes)
    warm_up(paths)
    run["warm_shardstream"] = with_rates(shardstream_epoch(urls, args), nbytes)
    run.update(ratios(run))
    evict(paths)
    return run


def ratios(run: Dict[str, object]) -> Dict[str, Optional[float]]:
    def ratio(a: str, b: str, field: str) -> Optional[float]:
        if run.get(a) is None or run.get(b) is None:
            return None
        return run[a][field] / run[b][field]

    return {
        "cold_ss_vs_fio": ratio("cold_shardstream", "cold_fio", "gbps"),
        "cold_ss_vs_wds": ratio("cold_shardstream", "cold_webdataset", "samples_per_s"),
        "warm_ss_vs_wds": ratio("warm_shardstream", "warm_webdataset", "samples_per_s"),
    }


def summarize(rounds: List[Dict[str, object]]) -> Dict[str, object]:
    """Medians over rounds of every figure and ratio."""
    summary: Dict[str, object] = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            summary[key] = {f: statistics.median(r[key][f] for r in rounds)
                            for f, v in value.items() if isinstance(v, (int, float))
                            and not isinstance(v, bool)}
        elif isinstance(value, float):
            summary[key] = statistics.median(r[key] for r in rounds)
    return summary


def report(name: str, paths: List[Path], summary: Dict[str, object]) -> None:
    nbytes = sum(p.stat().st_size for p in paths)
    print(f"\n== {name}: {len(paths)} shards, {nbytes / 1e9:.3f} GB ==")
    rows = []
    for key in ("cold_fio", "cold_shardstream", "cold_webdataset", "warm_shardstream",
                "warm_webdataset"):
        if summary.get(key):
            rows.append({"run": key.replace("_", " "), **summary[key]})
    _bench.print_table(rows, ["run", "seconds", "gbps", "samples_per_s"])
    for key in ("cold_ss_vs_fio", "cold_ss_vs_wds", "warm_ss_vs_wds",
                "cache_residency_after_shardstream"):
        if summary.get(key) is not None:
            print(f"  {key:36s} {summary[key]:8.3f}")


def check_targets(results: Dict[str, Dict[str, object]]) -> Dict[str, object]:
    verdicts: Dict[str, object] = {}
    for label, (profile, key, floor) in TARGETS.items():
        value = results.get(profile, {}).get("median", {}).get(key)
        if value is not None:
            verdicts[label] = {"value": value, "target": floor, "met": value >= floor}
    for profile, result in results.items():
        value = result["median"].get("cache_residency_after_shardstream")
        if value is not None:
            verdicts[f"page cache after cold ShardStream ({profile})"] = {
                "value": value, "target": f"< {MAX_RESIDENCY}", "met": value < MAX_RESIDENCY}
    if verdicts:
        print("\ntargets (medians over rounds):")
        for label, v in verdicts.items():
            print(f"  {'met    ' if v['met'] else 'NOT met'}  {label}: {v['value']:.3f} "
                  f"(target {v['target']})")
    return verdicts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="directory of existing shards (*.tar, *.tgz, ...)")
    p.add_argument("--workdir", type=Path, default=Path("bench-data"),
                   help="where generated shards go (on the drive under test)")
    p.add_argument("--profiles", default="100KB,8KB",
                   help=f"generated sample sizes, from {', '.join(PROFILES)}")
    p.add_argument("--size", default=None,
                   help="bytes of each generated data set (default: 1GiB for 100KB samples, "
                        "384MiB for 8KB)")
    p.add_argument("--rounds", type=int, default=3, help="measurement rounds (median reported)")
    p.add_argument("--engine", default=None, help="auto, uring, threads or python")
    p.add_argument("--chunk-size", default=None, help="read request size, e.g. 4MiB")
    p.add_argument("--queue-depth", type=int, default=None, help="reads in flight")
    p.add_argument("--no-webdataset", action="store_true")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--json", type=Path, default=Path("bench-results/epoch.json"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    unknown = set(args.profiles.split(",")) - set(PROFILES)
    if unknown:
        p.error(f"unknown profile(s) {sorted(unknown)}; choose from {', '.join(PROFILES)}")
    return args


def datasets(args) -> Dict[str, List[Path]]:
    if args.data is not None:
        paths = sorted(p for p in args.data.iterdir()
                       if p.suffix in (".tar", ".tgz", ".gz", ".bz2", ".xz") and p.is_file())
        if not paths:
            raise SystemExit(f"no shards (*.tar, *.tgz, ...) in {args.data}")
        return {args.data.name or "data": paths}
    out = {}
    for name in args.profiles.split(","):
        sample_size, default_total, shard_bytes = PROFILES[name]
        total = parse_size(args.size, name="--size") if args.size else default_total
        with tqdm(desc=f"writing {name} shards", unit="shard", leave=False) as bar:
            out[name] = _bench.write_synthetic_shards(
                args.workdir / f"samples-{name}-{total}", sample_size=sample_size,
                total_bytes=total, shard_bytes=min(shard_bytes, max(total // 4, 1 << 20)),
                progress=bar)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.no_webdataset is False:
        try:
            import webdataset  # noqa: F401
        except ImportError:
            print("webdataset is not installed: comparing against fio only", file=sys.stderr)
            args.no_webdataset = True
    sets = datasets(args)
    first = next(iter(sets.values()))
    info = _bench.environment(first[0].parent)
    _bench.print_header(info)
    if info["fio"] is None and not args.no_fio:
        print("fio is not installed: no drive baseline (apt-get install -y fio)", file=sys.stderr)
        args.no_fio = True
    results: Dict[str, Dict[str, object]] = {}
    for name, paths in sets.items():
        rounds = [one_round(paths, args)
                  for _ in tqdm(range(args.rounds), desc=f"{name} rounds", leave=False)]
        results[name] = {"shards": [str(p) for p in paths],
                         "bytes": sum(p.stat().st_size for p in paths),
                         "rounds": rounds, "median": summarize(rounds)}
        report(name, paths, results[name]["median"])
    verdicts = check_targets(results)
    settings = flashstream.settings.resolve(engine=args.engine, chunk_size=args.chunk_size,
                                            queue_depth=args.queue_depth)
    path = _bench.write_json(args.json, {"environment": info, "settings": vars(settings),
                                         "results": results, "targets": verdicts})
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
