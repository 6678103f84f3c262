#!/usr/bin/env python3
"""Epochs over tar shards: ShardStream vs webdataset vs fio vs the drive's probe, in one run.

    python benchmarks/epoch.py                  # generates 100 KB and 8 KB sample shard sets
    python benchmarks/epoch.py --data /mnt/plc  # the shards already in a directory
    python benchmarks/epoch.py --workers 4 --batch-size 64 --epochs 3

Every cold epoch evicts the shards from the page cache first (and residency is checked after
each cold ShardStream epoch). Figures are seconds, GB/s of shard bytes, samples/s, GB/s as a
share of the device probe's best sequential read, and the ratios between loaders measured in
the same round; the median over epochs, then over rounds, is reported. The cold ShardStream
epochs run under EpochMonitor (request latency, batch wait, device counters); webdataset's
device throughput is sampled the same way. A table goes to stdout, everything to JSON, and the
throughput-over-time and latency plots to a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402
import _plot  # noqa: E402

import flashstream  # noqa: E402
from flashstream.cache import evict, residency  # noqa: E402
from flashstream.sizes import parse_size  # noqa: E402
from flashstream.telemetry.diskstats import DiskSampler  # noqa: E402
from flashstream.telemetry.probe import ProbeResult  # noqa: E402
from flashstream.telemetry.report import EpochMonitor  # noqa: E402

# name -> (sample payload bytes, default data set bytes, shard bytes)
PROFILES = {"100KB": (100_000, 1 << 30, 128 << 20), "8KB": (8_000, 384 << 20, 64 << 20)}
TARGETS = {
    "cold ShardStream GB/s / fio GB/s (100KB)": ("100KB", "cold_ss_vs_fio", 0.9),
    "warm ShardStream samples/s / webdataset (8KB)": ("8KB", "warm_ss_vs_wds", 5.0),
}
MAX_RESIDENCY = 0.05
LOADERS = ("cold_fio", "cold_shardstream", "cold_webdataset", "warm_shardstream",
           "warm_webdataset")
SAMPLE_INTERVAL = 0.1  # seconds between device-counter samples: the plot's time resolution
FIGURES = ("seconds", "samples", "batches", "bytes_read", "gbps", "samples_per_s",
           "gbps_vs_probe")


@dataclasses.dataclass
class Setup:
    """What every measurement of the run shares."""

    args: argparse.Namespace
    probe: Optional[ProbeResult]
    device: Optional[str]  # the disk as /proc/diskstats names it, for the device counters

    @property
    def probe_gbps(self) -> Optional[float]:
        best = self.probe.best("read") if self.probe else None
        return best.gbps if best else None

    @property
    def size(self) -> Optional[Callable[[object], int]]:
        """How many samples one item of the loader holds (None: each item is one sample)."""
        if self.args.collate == "count" and (self.args.workers or self.args.batch_size):
            return int  # the DataLoader's collate already counted them
        return len if self.args.batch_size is not None else None


# -- loaders ------------------------------------------------------------------------------------
def loader_for(dataset, args):
    """The dataset itself (no workers, no batch: per-sample in this process), else a
    DataLoader whose collate counts the samples or keeps them as they are (--collate)."""
    if not args.workers and args.batch_size is None:
        return dataset
    from torch.utils.data import DataLoader

    collate = _bench.COLLATES[args.collate, args.batch_size is not None]
    return DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                      collate_fn=collate)


def time_epoch(batches: Iterable, size: Optional[Callable[[object], int]]) -> Dict[str, float]:
    start = time.perf_counter()
    samples = count = 0
    if size is None:  # one sample per item: the tightest loop, as a training loop would be
        for _ in batches:
            count += 1
        samples = count
    else:
        for batch in batches:
            count += 1
            samples += size(batch)
    return {"seconds": time.perf_counter() - start, "samples": samples, "batches": count}


def shardstream_epochs(paths: List[Path], setup: Setup, *, cold: bool) -> List[Dict]:
    """E consecutive epochs of one stream. Cold: evict before each and run under EpochMonitor.
    Warm epochs run without it, so the warm figure is the bare loop (the monitor's generator
    and clock reads cost under a microsecond an item, visible only with small samples)."""
    args = setup.args
    stream = flashstream.ShardStream([str(p) for p in paths], engine=args.engine,
                                     chunk_size=args.chunk_size, queue_depth=args.queue_depth)
    loader = loader_for(stream, args)
    monitor = (EpochMonitor(stream, probe=setup.probe, device=setup.device,
                            sample_interval=SAMPLE_INTERVAL) if cold else None)
    epochs = []
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        if cold:
            evict(paths)
        stream.reset_stats()
        timed = time_epoch(monitor.track(loader) if monitor else loader, setup.size)
        if monitor:
            timed["residency"] = residency(paths)  # first, before anything else reads them
            timed.update(monitored(monitor))
        totals = stream.stats()  # summed over DataLoader workers
        timed.update(bytes_read=totals["bytes_read"],
                     direct=totals["direct_files"] > 0 and totals["buffered_files"] == 0)
        epochs.append(timed)
    return epochs


def monitored(monitor: EpochMonitor) -> Dict[str, object]:
    """The epoch report and what the plot needs: device timeline, latency CDF, probe shape."""
    report = monitor.report()
    latency_ns, fraction = report.request_latency.cdf()
    shape = report.probe_same_shape
    return {
        "report": report.to_dict(),
        "report_table": report.format_table(),
        "disk_timeline": monitor.disk_timeline,
        "latency_cdf": {"us": [round(float(v) / 1e3, 3) for v in latency_ns],
                        "fraction": [round(float(f), 6) for f in fraction]},
        "probe_same_shape": None if shape is None else {
            "block_size": shape.block_size, "queue_depth": shape.queue_depth,
            "p95_us": shape.latency_us.get("p95")},
    }


def webdataset_epochs(paths: List[Path], setup: Setup, *, cold: bool) -> List[Dict]:
    """E consecutive epochs of webdataset; cold ones are evicted first and have the device
    sampled (webdataset keeps no statistics of its own)."""
    import webdataset as wds

    # empty_check=False: a DataLoader worker left without a shard yields nothing, as ours does.
    dataset = wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False)
    loader = loader_for(dataset, setup.args)
    epochs = []
    for _ in range(setup.args.epochs):
        if cold:
            evict(paths)
        sampler = DiskSampler(setup.device, SAMPLE_INTERVAL if cold else None).start()
        timed = time_epoch(loader, setup.size)
        disk = sampler.stop()
        if cold:
            timed.update(disk=disk.to_dict() if disk else None, disk_timeline=sampler.timeline)
        epochs.append(timed)
    return epochs


def warm_up(paths: List[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


# -- one round ----------------------------------------------------------------------------------
def with_rates(result: Optional[Dict], nbytes: int, probe_gbps: Optional[float]) -> Optional[Dict]:
    if result is None:
        return None
    result.setdefault("gbps", nbytes / max(result["seconds"], 1e-9) / 1e9)
    if "samples" in result:
        result["samples_per_s"] = result["samples"] / result["seconds"]
    if probe_gbps:
        result["gbps_vs_probe"] = result["gbps"] / probe_gbps
    return result


def over_epochs(epochs: List[Dict], nbytes: int, setup: Setup) -> Dict[str, object]:
    """A loader's figures for the round: the median over its epochs, with every epoch kept."""
    for epoch in epochs:
        with_rates(epoch, nbytes, setup.probe_gbps)
    figures: Dict[str, object] = {k: statistics.median(e[k] for e in epochs)
                                  for k in FIGURES if k in epochs[0]}
    figures["epochs"] = epochs
    return figures


def one_round(paths: List[Path], setup: Setup, step: Callable[[str], None]) -> Dict[str, object]:
    args = setup.args
    nbytes = sum(p.stat().st_size for p in paths)
    run: Dict[str, object] = {}

    def measure(name: str, fn: Callable[..., List[Dict]], *, cold: bool) -> None:
        step(name.replace("_", " "))
        if not cold:
            warm_up(paths)
        run[name] = over_epochs(fn(paths, setup, cold=cold), nbytes, setup)

    if not args.no_fio:
        step("cold fio")
        evict(paths)
        run["cold_fio"] = with_rates(_bench.fio_sequential_read(paths), nbytes, setup.probe_gbps)
    measure("cold_shardstream", shardstream_epochs, cold=True)
    run["cache_residency_after_shardstream"] = max(
        e["residency"] for e in run["cold_shardstream"]["epochs"])
    if not args.no_webdataset:
        measure("cold_webdataset", webdataset_epochs, cold=True)
        measure("warm_webdataset", webdataset_epochs, cold=False)
    measure("warm_shardstream", shardstream_epochs, cold=False)
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
    """Medians over rounds of every figure and ratio, and of each epoch's seconds."""
    summary: Dict[str, object] = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            summary[key] = {f: statistics.median(r[key][f] for r in rounds)
                            for f, v in value.items() if isinstance(v, (int, float))
                            and not isinstance(v, bool)}
            if "epochs" in value:
                summary[key]["epoch_seconds"] = [
                    statistics.median(r[key]["epochs"][i]["seconds"] for r in rounds)
                    for i in range(len(value["epochs"]))]
        elif isinstance(value, float):
            summary[key] = statistics.median(r[key] for r in rounds)
    return summary


# -- output -------------------------------------------------------------------------------------
def report(name: str, result: Dict[str, object]) -> None:
    summary = result["median"]
    print(f"\n== {name}: {len(result['shards'])} shards, {result['bytes'] / 1e9:.3f} GB ==")
    rows = []
    for key in LOADERS:
        figures = summary.get(key)
        if not figures:
            continue
        share = figures.get("gbps_vs_probe")
        rows.append({"run": key.replace("_", " "), **figures,
                     "% of probe": None if share is None else f"{share:.0%}",
                     "epochs (s)": " ".join(f"{s:.2f}" for s in figures.get("epoch_seconds", []))
                     or None})
    columns = ["run", "seconds", "gbps", "samples_per_s", "% of probe"]
    if any(len(summary.get(k, {}).get("epoch_seconds", [])) > 1 for k in LOADERS):
        columns.append("epochs (s)")
    _bench.print_table(rows, columns)
    for key in ("cold_ss_vs_fio", "cold_ss_vs_wds", "warm_ss_vs_wds",
                "cache_residency_after_shardstream"):
        if summary.get(key) is not None:
            print(f"  {key:36s} {summary[key]:8.3f}")
    index = _bench.median_round(result["rounds"])
    first = result["rounds"][index]["cold_shardstream"]["epochs"][0]
    print(f"\nShardStream cold epoch (round {index + 1}, epoch 1), EpochMonitor report:")
    print("  " + first["report_table"].replace("\n", "\n  "))


def check_targets(results: Dict[str, Dict[str, object]], args) -> Dict[str, object]:
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
        if args.workers or args.batch_size or args.epochs > 1:
            print("  (set for per-sample iteration in one process, one epoch: with other loader "
                  "settings they are only indicative)")
        _bench.print_verdicts(verdicts)
    return verdicts


# -- command line -------------------------------------------------------------------------------
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
    p.add_argument("--epochs", type=int, default=1,
                   help="consecutive epochs each loader runs per round (median reported)")
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader workers (default 0: iterate in this process)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="DataLoader batch size (default: none, per-sample iteration)")
    p.add_argument("--collate", choices=("count", "list"), default="count",
                   help="what a DataLoader batch carries back: the sample count (default; "
                        "measures the loaders) or the samples (adds pickling them between "
                        "processes)")
    p.add_argument("--engine", default=None, help="auto, uring, threads or python")
    p.add_argument("--chunk-size", default=None, help="read request size, e.g. 4MiB")
    p.add_argument("--queue-depth", type=int, default=None, help="reads in flight")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the drive with the device probe (cached per device) and "
                        "compare every loader with it (default: on)")
    p.add_argument("--probe-size", default="1GiB", help="the probe's temporary file size")
    p.add_argument("--no-webdataset", action="store_true")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--json", type=Path, default=Path("bench-results/epoch.json"))
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of throughput over time and latency CDF (default: beside the JSON)")
    args = p.parse_args(argv)
    for name in ("rounds", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.workers < 0 or (args.batch_size is not None and args.batch_size < 1):
        p.error("--workers must be at least 0 and --batch-size at least 1")
    unknown = set(args.profiles.split(",")) - set(PROFILES)
    if unknown:
        p.error(f"unknown profile(s) {sorted(unknown)}; choose from {', '.join(PROFILES)}")
    args.plot = args.plot or args.json.with_suffix(".png")
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
        with tqdm(desc=f"writing {name} shards", unit="shard", leave=False, disable=None) as bar:
            out[name] = _bench.write_synthetic_shards(
                args.workdir / f"samples-{name}-{total}", sample_size=sample_size,
                total_bytes=total, shard_bytes=min(shard_bytes, max(total // 4, 1 << 20)),
                progress=bar)
    return out


def check_tools(args, info: Dict[str, object]) -> None:
    """Leave out the baselines whose tools are missing, saying so."""
    if not args.no_webdataset:
        try:
            import webdataset  # noqa: F401
        except ImportError:
            print("webdataset is not installed: comparing against fio only", file=sys.stderr)
            args.no_webdataset = True
    if info["fio"] is None and not args.no_fio:
        print("fio is not installed: no drive baseline (apt-get install -y fio)", file=sys.stderr)
        args.no_fio = True


def build_index(paths: List[Path], args) -> Dict[str, float]:
    """Index the shards as the first ShardStream over them does (sidecars, else the index
    cache, else one scan, then cached): a one-time cost, reported apart from the epochs."""
    stream = flashstream.ShardStream([str(p) for p in paths], engine=args.engine,
                                     chunk_size=args.chunk_size, queue_depth=args.queue_depth)
    return dict(stream.index_info)


def run_profile(paths: List[Path], setup: Setup, name: str) -> Dict[str, object]:
    index = build_index(paths, setup.args)
    nbytes = sum(p.stat().st_size for p in paths)
    how = ", ".join(f"{index[k]} from {k}" for k in ("sidecar", "cache", "scan") if index[k])
    rate = f" = {nbytes / index['seconds'] / 1e9:.3f} GB/s" if index["scan"] else ""
    print(f"{name}: shard index of {len(paths)} shards ({how}) in {index['seconds']:.2f} s{rate}")
    steps = setup.args.rounds * (4 - 2 * setup.args.no_webdataset - setup.args.no_fio + 1)
    with tqdm(total=steps, desc=name, unit="step", leave=False, disable=None) as bar:
        def step(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        rounds = [one_round(paths, setup, step) for _ in range(setup.args.rounds)]
    return {"shards": [str(p) for p in paths], "bytes": nbytes, "index": index,
            "rounds": rounds, "median": summarize(rounds)}


def main(argv=None) -> int:
    args = parse_args(argv)
    sets = datasets(args)
    data_dir = next(iter(sets.values()))[0].parent
    info = _bench.environment(data_dir)
    _bench.print_header(info)
    check_tools(args, info)
    loader = {"workers": args.workers, "batch_size": args.batch_size, "epochs": args.epochs,
              "rounds": args.rounds,
              "collate": args.collate if args.workers or args.batch_size else None}
    print("loader: " + ", ".join(f"{k}={v}" for k, v in loader.items()))
    probe = _bench.run_probe(data_dir, args.probe_size) if args.probe else None
    if probe is not None:
        print(_bench.format_probe(probe))
    setup = Setup(args, probe, info.get("device_name"))
    results: Dict[str, Dict[str, object]] = {}
    for name, paths in sets.items():
        results[name] = run_profile(paths, setup, name)
        report(name, results[name])
    verdicts = check_targets(results, args)
    settings = flashstream.settings.resolve(engine=args.engine, chunk_size=args.chunk_size,
                                            queue_depth=args.queue_depth)
    payload = {"environment": info, "settings": vars(settings), "loader": loader,
               "probe": _bench.probe_summary(probe), "results": results, "targets": verdicts}
    _bench.write_outputs(payload, args.json, _plot.plot_epoch, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
