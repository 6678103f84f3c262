#!/usr/bin/env python3
"""Cold epochs the way training scripts read them: flashstream vs webdataset vs fio, in one run.

    python benchmarks/epoch.py                  # generates 100 KB, 8 KB and JPEG shard sets
    python benchmarks/epoch.py --data /mnt/plc  # the shards already in a directory
    python benchmarks/epoch.py --workers 4 --batch-size 64 --rounds 5

Each round times one cold epoch of every loader (the shards evicted from the page cache
first), in an order that rotates from round to round:

    inprocess   ShardStream in this process, sample by sample            (a)
    tensors     ShardStream(...).tensors(B) through DataLoader workers    (b)
    webdataset  webdataset's .map(to_tensor).batched(B), same loader      (c)
    decode_*    .decode("torchrgb8").to_tuple("jpg", "cls").batched(B) on small JPEGs,
                flashstream.WebDataset vs webdataset.WebDataset, same loader  (d)
    fio         a sequential O_DIRECT read of the same files

The DataLoaders keep their workers from epoch to epoch (``persistent_workers=True``, as long
training runs do; ``--no-persistent-workers`` starts them anew for every epoch): they are
started once, untimed, before the first round. Figures: seconds (the whole epoch), time to
the first item, samples/s and GB/s of shard bytes, the share of the drive's speed (fio in the
same round, else the device probe's best sequential read), and the CPU it took: core-seconds
(user + system, of this process and every DataLoader worker) per GB of shard bytes delivered.
Ratios are taken within each round and their median reported. The verdicts judge each path
against the drive and against CPU per GB; webdataset's speed ratios are printed as context.
flashstream's epochs run under EpochMonitor (request latency, batch wait, device counters) and
the page cache is checked after each. A table goes to stdout, everything to JSON, and a
figure to a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402
import _loaders  # noqa: E402
import _plot  # noqa: E402
import _verdicts  # noqa: E402
from _epoch_data import JPEG, PROFILES, DataSet, data_sets  # noqa: E402

import flashstream  # noqa: E402
from flashstream.pagecache import evict, residency  # noqa: E402
from flashstream.telemetry.diskstats import DiskSampler  # noqa: E402
from flashstream.telemetry.probe import ProbeResult  # noqa: E402
from flashstream.telemetry.report import EpochMonitor  # noqa: E402

SAMPLE_INTERVAL = 0.1  # seconds between device-counter samples: the plot's time resolution
FIGURES = ("seconds", "first_item_s", "samples", "batches", "bytes_read", "gbps",
           "samples_per_s", "gbps_vs_probe", "gbps_vs_drive", "cpu_s", "cpu_main_s",
           "cpu_others_s", "cpu_s_per_gb", "fio_cpu_s_per_gb", "residency")


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


# -- one epoch ----------------------------------------------------------------------------------
def timed(items, count) -> Dict[str, float]:
    """Iterate ``items`` once: seconds, time to the first item, samples and items."""
    start = time.perf_counter()
    first: Optional[float] = None
    samples = batches = 0
    for item in items:
        if first is None:
            first = time.perf_counter() - start
        samples += count(item)
        batches += 1
    return {"seconds": time.perf_counter() - start, "first_item_s": first or 0.0,
            "samples": samples, "batches": batches}


def cold_epoch(name: str, data: DataSet, setup: Setup,
               loader: Optional[_loaders.Loader]) -> Dict[str, object]:
    """One cold epoch of loader ``name`` (``loader``: the one kept from epoch to epoch, else a
    new one): evicted first, monitored, page cache checked after."""
    if name == "fio":
        evict(data.paths)
        meter = _bench.CpuMeter()
        fio = _bench.fio_sequential_read(data.paths)
        if not fio:
            return {}
        own = fio.pop("cpu_s", None)  # fio's count of its job; the meter's has its start-up
        return {**fio, **meter.stop(), "fio_cpu_s": own}
    if loader is None:
        loader = _loaders.make_loader(name, data.paths, setup.args)
    evict(data.paths)
    if loader.dataset is None:  # webdataset keeps no statistics: sample the device
        sampler = DiskSampler(setup.device, SAMPLE_INTERVAL).start()
        meter = _bench.CpuMeter()
        result: Dict[str, object] = dict(timed(loader.items, loader.count))
        result.update(meter.stop())
        disk = sampler.stop()
        result.update(disk=disk.to_dict() if disk else None, disk_timeline=sampler.timeline)
        return result
    monitor = EpochMonitor(loader.dataset, probe=setup.probe, device=setup.device,
                           sample_interval=SAMPLE_INTERVAL)
    meter = _bench.CpuMeter()
    result = dict(timed(monitor.track(loader.items), loader.count))
    result.update(meter.stop())
    result["residency"] = residency(data.paths)  # first, before anything else reads them
    totals = loader.dataset.stats()  # summed over DataLoader workers
    result.update(bytes_read=totals["bytes_read"],
                  direct=totals["direct_files"] > 0 and totals["buffered_files"] == 0)
    result.update(monitored(monitor))
    return result


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


def with_rates(result: Dict[str, object], nbytes: int, probe_gbps: Optional[float]) -> Dict:
    """GB/s, samples/s, the share of the probe's best read and core-seconds per GB, all of the
    data set's shard bytes (what every loader delivers)."""
    if not result:
        return result
    result.setdefault("gbps", nbytes / max(result["seconds"], 1e-9) / 1e9)
    if "samples" in result:
        result["samples_per_s"] = result["samples"] / max(result["seconds"], 1e-9)
    if probe_gbps:
        result["gbps_vs_probe"] = result["gbps"] / probe_gbps
    if "cpu_s" in result:
        result["cpu_s_per_gb"] = result["cpu_s"] / (nbytes / 1e9)
    if result.get("fio_cpu_s") is not None:  # fio's own count, its start-up left out
        result["fio_cpu_s_per_gb"] = result["fio_cpu_s"] / (nbytes / 1e9)
    return result


def against_drive(run: Dict[str, object], probe_gbps: Optional[float]) -> None:
    """Each loader's GB/s as a share of the drive's: fio's in the same round where fio ran (the
    same files, the same minute), else the probe's best sequential read."""
    drive = (run.get("fio") or {}).get("gbps") or probe_gbps
    if not drive:
        return
    for name in run["order"]:
        result = run.get(name)
        if result and name != "fio" and result.get("gbps"):
            result["gbps_vs_drive"] = result["gbps"] / drive


# -- rounds -------------------------------------------------------------------------------------
def one_round(data: DataSet, setup: Setup, number: int, step,
              kept: Dict[str, _loaders.Loader]) -> Dict[str, object]:
    """Every loader once, starting with a different one each round (rotated order)."""
    order = list(data.loaders)
    order = order[number % len(order):] + order[:number % len(order)]
    run: Dict[str, object] = {"order": order}
    for name in order:
        step(name)
        run[name] = with_rates(cold_epoch(name, data, setup, kept.get(name)), data.bytes,
                               setup.probe_gbps)
    against_drive(run, setup.probe_gbps)
    run.update(_verdicts.ratios(run))
    return run


def summarize(rounds: List[Dict[str, object]]) -> Dict[str, object]:
    """Medians over rounds of every loader's figures and of every ratio."""
    summary: Dict[str, object] = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            summary[key] = {f: statistics.median(r[key][f] for r in rounds if r[key].get(f)
                                                 is not None)
                            for f in FIGURES if value.get(f) is not None}
        elif isinstance(value, float):
            summary[key] = statistics.median(r[key] for r in rounds if r.get(key) is not None)
    return summary


def run_data_set(data: DataSet, setup: Setup) -> Dict[str, object]:
    index = None
    if "inprocess" in data.loaders or "tensors" in data.loaders:
        index = build_index(data.paths, setup.args)
        how = ", ".join(f"{index[k]} from {k}" for k in ("sidecar", "cache", "scan") if index[k])
        rate = f" = {data.bytes / index['seconds'] / 1e9:.3f} GB/s" if index["scan"] else ""
        print(f"{data.name}: shard index of {len(data.paths)} shards ({how}) in "
              f"{index['seconds']:.2f} s{rate}")
    kept: Dict[str, _loaders.Loader] = {}
    if setup.args.persistent_workers:
        for name in data.loaders:
            if name != "fio":
                kept[name] = _loaders.make_loader(name, data.paths, setup.args)
                kept[name].start_workers()
    steps = setup.args.rounds * len(data.loaders)
    with tqdm(total=steps, desc=data.name, unit="epoch", leave=False, disable=None) as bar:
        def step(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        rounds = [one_round(data, setup, r, step, kept) for r in range(setup.args.rounds)]
    kept.clear()  # stops the workers
    return {"shards": [str(p) for p in data.paths], "bytes": data.bytes, "index": index,
            "loaders": list(data.loaders), "rounds": rounds, "median": summarize(rounds)}


def build_index(paths: List[Path], args) -> Dict[str, float]:
    """Index the shards as the first ShardStream over them does (sidecars, else the index
    cache, else one scan, then cached): a one-time cost, reported apart from the epochs."""
    stream = flashstream.ShardStream([str(p) for p in paths], engine=args.engine,
                                     chunk_size=args.chunk_size, queue_depth=args.queue_depth)
    return dict(stream.index_info)


# -- output -------------------------------------------------------------------------------------
def report(name: str, result: Dict[str, object]) -> None:
    summary = result["median"]
    print(f"\n== {name}: {len(result['shards'])} shards, {result['bytes'] / 1e9:.3f} GB ==")
    rows = []
    for key in result["loaders"]:
        figures = summary.get(key)
        if not figures:
            continue
        share = figures.get("gbps_vs_probe")
        # fio's own count of its job: the process tree's adds fio's start-up
        cpu = figures.get("fio_cpu_s_per_gb", figures.get("cpu_s_per_gb"))
        rows.append({"loader": key, **figures, "x drive": figures.get("gbps_vs_drive"),
                     "% of probe": None if share is None else f"{share:.0%}",
                     "core-s/GB": cpu})
    _bench.print_table(rows, ["loader", "seconds", "first_item_s", "samples_per_s", "gbps",
                              "x drive", "% of probe", "core-s/GB", "residency"])
    fio = summary.get("fio") or {}
    if fio.get("fio_cpu_s_per_gb") is not None:
        print(f"  fio's core-s/GB is its job's, as fio counts it; with its start-up "
              f"{fio['cpu_s_per_gb']:.3f}")
    for key in _verdicts.RATIOS:
        if summary.get(key) is not None:
            print(f"  {key:28s} {summary[key]:8.3f}")
    monitored_key = "tensors" if "tensors" in result["loaders"] else "decode_flashstream"
    index = _bench.median_round(result["rounds"], monitored_key)
    run = result["rounds"][index].get(monitored_key) or {}
    if run.get("report_table"):
        print(f"\n{monitored_key} cold epoch through {result.get('workers', '')} DataLoader "
              f"workers (round {index + 1}), EpochMonitor report:")
        print("  " + run["report_table"].replace("\n", "\n  "))


# -- command line -------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="directory of existing shards (*.tar, *.tgz, ...)")
    p.add_argument("--workdir", type=Path, default=Path("bench-data"),
                   help="where generated shards go (on the drive under test)")
    p.add_argument("--profiles", default=f"100KB,8KB,{JPEG}",
                   help=f"generated data sets, from {', '.join([*PROFILES, JPEG])}")
    p.add_argument("--size", default=None,
                   help="bytes of each generated 100KB/8KB data set (default: 1GiB for 100KB "
                        "samples, 384MiB for 8KB)")
    p.add_argument("--jpeg-size", default=None, help="bytes of the JPEG data set (64MiB)")
    p.add_argument("--rounds", type=int, default=3, help="measurement rounds (median reported)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="samples per batch of the loaders (default 256)")
    p.add_argument("--persistent-workers", action=argparse.BooleanOptionalAction, default=True,
                   help="keep DataLoader workers from epoch to epoch, started before the "
                        "first round (default: on); off: every epoch starts its own")
    p.add_argument("--engine", default=None, help="auto, uring, threads or python")
    p.add_argument("--chunk-size", default=None, help="read request size, e.g. 4MiB")
    p.add_argument("--queue-depth", type=int, default=None, help="reads in flight")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the drive with the device probe (cached per device) and "
                        "compare every loader with it (default: on)")
    p.add_argument("--probe-size", default="1GiB", help="the probe's temporary file size")
    p.add_argument("--no-webdataset", action="store_true", help="leave out webdataset's loaders")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--json", type=Path, default=Path("bench-results/epoch.json"))
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of throughput over time, samples/s and latency (default: beside "
                        "the JSON)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.workers < 1 or args.batch_size < 1:
        p.error("--workers and --batch-size must be at least 1 (the loaders under test run "
                "through DataLoader workers)")
    unknown = set(args.profiles.split(",")) - {*PROFILES, JPEG}
    if unknown:
        p.error(f"unknown profile(s) {sorted(unknown)}; choose from "
                f"{', '.join([*PROFILES, JPEG])}")
    args.plot = args.plot or args.json.with_suffix(".png")
    return args


def check_tools(args, info: Dict[str, object]) -> None:
    """Leave out the baselines whose tools are missing, saying so."""
    if info["fio"] is None and not args.no_fio:
        print("fio is not installed: no drive baseline (apt-get install -y fio)", file=sys.stderr)
        args.no_fio = True


def main(argv=None) -> int:
    args = parse_args(argv)
    sets = data_sets(args)
    data_dir = sets[0].paths[0].parent
    info = _bench.environment(data_dir)
    _bench.print_header(info)
    check_tools(args, info)
    sets = [dataclasses.replace(d, loaders=tuple(x for x in d.loaders
                                                 if x != "fio" or not args.no_fio))
            for d in sets]
    loader = {"workers": args.workers, "batch_size": args.batch_size, "rounds": args.rounds,
              "persistent_workers": args.persistent_workers}
    print("loader: " + ", ".join(f"{k}={v}" for k, v in loader.items()))
    probe = _bench.run_probe(data_dir, args.probe_size) if args.probe else None
    if probe is not None:
        print(_bench.format_probe(probe))
    setup = Setup(args, probe, info.get("device_name"))
    results: Dict[str, Dict[str, object]] = {}
    for data in sets:
        results[data.name] = run_data_set(data, setup)
        results[data.name]["workers"] = args.workers
        report(data.name, results[data.name])
    verdicts = _verdicts.check_targets(results)
    beside = _verdicts.context(results)
    settings = flashstream.settings.resolve(engine=args.engine, chunk_size=args.chunk_size,
                                            queue_depth=args.queue_depth)
    payload = {"environment": info, "settings": vars(settings), "loader": loader,
               "probe": _bench.probe_summary(probe), "results": results, "targets": verdicts,
               "context": beside}
    _bench.write_outputs(payload, args.json, _plot.plot_epoch, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
