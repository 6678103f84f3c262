"""The ``flashstream`` command line: engine info, checking, listing and indexing shards."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from tqdm import tqdm

from . import __version__, settings
from .engine import engine_name, uring_available
from .pipeline import ShardStream
from .stream.index import read_sidecar, sidecar_path, write_sidecar
from .stream.index_jobs import check_sidecars, default_jobs, scan_parallel
from .stream.urls import expand_urls
from .telemetry import device_of, format_device
from .telemetry.probe import ProbeConfig, probe

__all__ = ["main"]


def cmd_info(args: argparse.Namespace) -> int:
    now = settings.current()
    info = {
        "flashstream": __version__,
        "io_uring_available": uring_available(),
        "engine": f"{now.engine} -> {engine_name(now.engine)}",
        "chunk_size": now.chunk_size,
        "queue_depth": now.queue_depth,
        "direct": now.direct,
    }
    from .telemetry.gpu import gpu_info  # torch.cuda queries: only for this command

    gpu = gpu_info()
    info["cuda"] = ", ".join(c["name"] for c in gpu["cards"]) if gpu["cards"] else \
        "not available"
    gds = gpu["gds"]
    info["gds"] = (f"kvikio {gds['kvikio'] or 'not installed'}, libcufile "
                   f"{gds['libcufile'] or 'not found'}; not used ({gds['why']})")
    print(json.dumps(info, indent=2) if args.json else
          "\n".join(f"{k:20s} {v}" for k, v in info.items()))
    return 0


def cmd_device(args: argparse.Namespace) -> int:
    info = device_of(args.path, health=not args.no_health)
    print(json.dumps(info.to_dict(), indent=2) if args.json else format_device(info))
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    """Measure the drive behind a directory (cached per device; --refresh measures again)."""
    # --sustained is measured once, by the write model's probe below (not also by the grid).
    config = ProbeConfig(size=args.size, seconds=args.seconds)
    with tqdm(desc="probe", bar_format="{desc}: {elapsed} {postfix}",
              disable=args.json or not sys.stderr.isatty()) as bar:
        result = probe(args.path, config=config, engine_kind=args.engine, refresh=args.refresh,
                       progress=lambda step: bar.set_postfix_str(step))
    if args.sustained:
        from .checkpoint.drive_probe import measure_sustained

        model = measure_sustained(args.path, args.sustained)
    else:
        from .telemetry.drive_model import load_model

        model = load_model(args.path)
    if args.json:
        out = result.to_dict()
        out["write_model"] = model.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(result.format_table())
        print(model.describe())
    return 0


def cmd_emulate(args: argparse.Namespace) -> int:
    """Run a command on an emulated dense drive (see docs/emulation.md)."""
    from .emulation import DriveEmulator

    if not args.cmd:
        raise ValueError("give the command to run after --, e.g. flashstream emulate -- "
                         "python train.py")
    command = args.cmd[1:] if args.cmd[0] == "--" else args.cmd
    overrides = {k: getattr(args, k) for k in ("cache_size", "post_cache_rate", "drain_rate",
                                               "fast_rate", "fold_read_rate")
                 if getattr(args, k) is not None}
    emulator = DriveEmulator(args.path, profile=args.profile, **overrides)
    print(f"flashstream emulate: {args.profile} on {emulator.disk}: "
          f"{emulator.settings.describe()}", file=sys.stderr)
    with emulator:
        status = emulator.run(command)
    summary = emulator.summary()
    print(f"flashstream emulate: {summary['seconds']:.1f} s, "
          f"{summary['cliff_seconds']:.1f} s in the cliff, "
          f"{summary['written_bytes'] / 1e9:.2f} GB written", file=sys.stderr)
    if args.timeline:
        emulator.save_timeline(args.timeline)
    return status


def cmd_scan(args: argparse.Namespace) -> int:
    """Read every sample of every shard; report counts, speed and each bad shard."""
    errors: List[str] = []

    def record(exn: BaseException) -> bool:
        errors.append(str(exn))
        return True

    stream = ShardStream(args.shards, handler=record, split_by_rank=False,
                         split_by_worker=False, engine=args.engine)
    start = time.perf_counter()
    samples = payload = 0
    for sample in stream:
        samples += 1
        payload += sum(len(v) for k, v in sample.items() if not k.startswith("__"))
        if args.list:
            fields = " ".join(f"{k}:{len(v)}" for k, v in sample.items() if not k.startswith("__"))
            print(f"{sample['__key__']}  {fields}")
    seconds = time.perf_counter() - start
    stats = stream.last_stats
    summary = {"shards": len(stream.urls), "samples": samples, "payload_bytes": payload,
               "bytes_read": stats.bytes_read, "seconds": round(seconds, 3),
               "gbps": round(stats.bytes_read / seconds / 1e9, 3) if seconds else None,
               "engine": stats.engine, "o_direct": stats.direct, "errors": errors}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            if key != "errors":
                print(f"{key:14s} {value}")
        for error in errors:
            print(f"error          {error}")
    return 1 if errors else 0


def cmd_index(args: argparse.Namespace) -> int:
    """Write each shard's sample index (SHARD.fsidx), or --check the ones there."""
    urls = expand_urls(args.shards)
    settings_now = settings.resolve(engine=args.engine)
    jobs = args.jobs or default_jobs()
    if args.check:
        return _check(urls, settings_now, jobs, args.json)
    todo = []
    for url in urls:
        try:
            current = None if args.force else read_sidecar(url)
        except ValueError:  # stale or malformed: rewrite it
            current = None
        if current is None:
            todo.append(url)
    start = time.perf_counter()
    indexes, errors = scan_parallel(todo, settings_now, jobs=jobs)
    seconds = time.perf_counter() - start
    rows = []
    for i, (url, index) in enumerate(zip(todo, indexes)):
        if index is None:
            rows.append({"shard": url, "error": str(errors[i])})
            continue
        write_sidecar(url, index)
        rows.append({"shard": url, "samples": index.count, "index": sidecar_path(url),
                     "compression": index.compression})
    summary = {"shards": len(urls), "indexed": sum("error" not in r for r in rows),
               "up_to_date": len(urls) - len(todo), "seconds": round(seconds, 3),
               "jobs": jobs, "samples": sum(r.get("samples", 0) for r in rows),
               "results": rows}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for row in rows:
            print(f"error          {row['error']}" if "error" in row else
                  f"{row['samples']:>10} samples  {row['index']}")
        print(f"indexed {summary['indexed']} of {len(urls)} shards "
              f"({summary['up_to_date']} already up to date) in {seconds:.2f} s, "
              f"{jobs} group(s) at a time")
    return 1 if errors else 0


def _check(urls: List[str], settings_now: settings.IOSettings, jobs: int, as_json: bool) -> int:
    rows = check_sidecars(urls, settings_now, jobs=jobs)
    bad = [r for r in rows if r["status"] != "ok"]
    if as_json:
        print(json.dumps({"shards": len(urls), "ok": len(urls) - len(bad), "results": rows},
                         indent=2))
    else:
        for row in rows:
            detail = f"  ({row['detail']})" if row.get("detail") else ""
            print(f"{row['status']:8s} {row['shard']}{detail}")
        print(f"{len(urls) - len(bad)} of {len(urls)} sidecars match their shards")
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashstream", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flashstream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="engine and settings in force")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    device = sub.add_parser("device", help="the block device behind a path, and its health")
    device.add_argument("path", nargs="?", default=".")
    device.add_argument("--no-health", action="store_true", help="skip nvme-cli")
    device.add_argument("--json", action="store_true")
    device.set_defaults(func=cmd_device)
    prb = sub.add_parser("probe", help="measure the drive: sequential GB/s, random IOPS, latency")
    prb.add_argument("path", nargs="?", default=".", help="a directory on the drive")
    prb.add_argument("--size", default="1GiB", help="temporary file size (default 1GiB)")
    prb.add_argument("--sustained", default=None,
                     help="also learn the drive's write model: write this much (more than its "
                     "write cache, e.g. 64GiB) into a new file, idle, write again")
    prb.add_argument("--seconds", type=float, default=2.0, help="time cap per measurement")
    prb.add_argument("--engine", choices=("auto", "uring", "threads"), default=None)
    prb.add_argument("--refresh", action="store_true", help="measure even if cached")
    prb.add_argument("--json", action="store_true")
    prb.set_defaults(func=cmd_probe)
    emu = sub.add_parser("emulate", help="run a command on an emulated dense (SLC-cache) drive",
                         description="Run COMMAND with the drive under --path behaving like a "
                         "dense drive: writes slow to the post-cache rate once the emulated SLC "
                         "cache is full, reads are held back while it folds. Needs root and a "
                         "cgroup block-I/O controller.")
    emu.add_argument("--profile", choices=("plc", "qlc"), default="plc")
    emu.add_argument("--path", default=".", help="a directory on the drive to emulate on")
    for name, text in (("cache-size", "SLC cache bytes (e.g. 1.2GiB)"),
                       ("post-cache-rate", "write bytes/s once full (e.g. 300MB)"),
                       ("drain-rate", "bytes/s folded out of the cache"),
                       ("fast-rate", "write bytes/s before the cliff"),
                       ("fold-read-rate", "read bytes/s in the cliff")):
        emu.add_argument(f"--{name}", default=None, help=f"{text}; default: the profile's")
    emu.add_argument("--timeline", default=None, help="write the cache timeline as JSON here")
    emu.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    emu.set_defaults(func=cmd_emulate)
    scan = sub.add_parser("scan", help="read shards end to end; report samples, speed, errors")
    scan.add_argument("shards", nargs="+", help="shard paths, globs or brace patterns")
    scan.add_argument("--list", action="store_true", help="print each sample's key and fields")
    scan.add_argument("--engine", choices=settings.ENGINES, default=None)
    scan.add_argument("--json", action="store_true")
    scan.set_defaults(func=cmd_scan)
    idx = sub.add_parser("index", help="write each shard's sample index (SHARD.fsidx)")
    idx.add_argument("shards", nargs="+", help="shard paths, globs or brace patterns")
    idx.add_argument("--force", action="store_true", help="rewrite up-to-date indexes too")
    idx.add_argument("--check", action="store_true",
                     help="write nothing: verify existing sidecars against their shards "
                          "(exit 1 if any is missing, stale or differs)")
    idx.add_argument("--jobs", type=int, default=None,
                     help="groups of up to 64 shards scanned at once (default: min(4, CPUs))")
    idx.add_argument("--engine", choices=settings.ENGINES, default=None)
    idx.add_argument("--json", action="store_true")
    idx.set_defaults(func=cmd_index)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exn:
        print(f"flashstream: error: {exn}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
