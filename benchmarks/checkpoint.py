#!/usr/bin/env python3
"""Checkpoint saves: torch.save vs torch.distributed.checkpoint.async_save vs CheckpointWriter.

    python benchmarks/checkpoint.py         # a 2 GiB state dict into bench-data/checkpoint
    python benchmarks/checkpoint.py --dir /mnt/plc/ckpt --size 8GiB --reader
    python benchmarks/checkpoint.py --writers unpaced,fixed --rate 1GB --saves 5
    python benchmarks/checkpoint.py --emulate plc   # on an emulated SLC-cache drive (root)

The same generated state dict (Linear layers plus a real Adam state) is saved --saves times by
each writer, the tensors changed between saves as a training step would. Per writer: the
training stall (the first save, which faults staging memory in, apart; then the median of the
others), the end-to-end write GB/s and its ratio to fio's sequential write of the same size
(run right before and right after the unpaced CheckpointWriter), pacing accuracy, and with
--reader the p95 request latency of cold ShardStream epochs run beside one more save, against
their idle p95. A table and the targets go to stdout, everything to JSON, and write GB/s over
time per writer to a PNG.

--emulate plc|qlc|random runs a different benchmark (benchmarks/_emulated.py): the drive throttled
into an SLC-cache drive, repeated saves larger than its cache with deadlines, an open-loop
reader beside them, for unpaced, fixed, auto and auto + read_slo writers.

This module is the command line and the choice of benchmark. The plain comparison's runs are
_checkpoint_runs.py's, its figures, table and targets _checkpoint_report.py's, its writers and
reader _savers.py's and the state dict _training.py's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import List, Optional

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402
import _checkpoint_report  # noqa: E402
import _checkpoint_runs  # noqa: E402
import _emulated  # noqa: E402
import _learning  # noqa: E402
import _plot  # noqa: E402
import _training  # noqa: E402

from flashstream.emulation import PROFILES  # noqa: E402
from flashstream.sizes import parse_size  # noqa: E402


# -- command line -------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("bench-data/checkpoint"),
                   help="where the checkpoints go (on the drive under test)")
    p.add_argument("--size", default=None,
                   help="tensor bytes of the state dict (default 2GiB; with --emulate 1.2 x "
                        "the size at which an unpaced save meets the emulated cliff)")
    p.add_argument("--saves", type=int, default=3,
                   help="saves per writer; the first one is reported apart (default 3)")
    p.add_argument("--busy", action="store_true",
                   help="keep every other core busy (a spinning process each) while the "
                        "writers run, as a training process does")
    p.add_argument("--reserve", action="store_true",
                   help="construct each CheckpointWriter with reserve=the state dict, so the "
                        "first save does not pay for allocating staging")
    p.add_argument("--many-small", type=int, default=0, metavar="N",
                   help="save N tensors of 1 KB instead of the model + Adam state (the "
                        "per-tensor cost of a save; e.g. 50000)")
    p.add_argument("--writers", default=",".join(_checkpoint_runs.WRITERS),
                   help=f"which to run, from {', '.join(_checkpoint_runs.WRITERS)} (dcp: "
                        f"torch.distributed.checkpoint.async_save; unpaced, fixed, auto: "
                        f"CheckpointWriter's rate settings)")
    p.add_argument("--rate", default=None,
                   help="the fixed writer's rate in bytes/s, e.g. 500MB (default: half the "
                        "unpaced writer's measured GB/s)")
    p.add_argument("--snapshot", choices=("auto", "copy", "cow"), default="auto",
                   help="CheckpointWriter's snapshot mode for the unpaced, fixed and auto rows "
                        "(the writer's default 'auto' is 'cow' where the kernel allows it; "
                        "the 'copy' row always copies)")
    p.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="allocate the state dict in transparent huge pages "
                        "(THP_MEM_ALLOC_ENABLE=1, torch's setting), as docs/checkpoint.md "
                        "recommends for snapshot='cow': write-protecting 2 MiB pages is about "
                        "30x cheaper than 4 KiB pages (default: on; every writer saves the "
                        "same memory)")
    p.add_argument("--chunk-size", default="8MiB", help="CheckpointWriter's request size")
    p.add_argument("--queue-depth", type=int, default=8, help="CheckpointWriter's depth")
    p.add_argument("--engine", default=None, help="auto, uring, threads or python")
    p.add_argument("--reader", action="store_true",
                   help="run cold ShardStream epochs beside one more save of each writer and "
                        "compare their p95 request latency with idle epochs")
    p.add_argument("--reader-size", default="1GiB", help="bytes of the reader's shards")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the drive with the device probe (cached per device) and "
                        "attach its write figures to every SaveReport (default: on)")
    p.add_argument("--probe-size", default="1GiB", help="the probe's temporary file size")
    p.add_argument("--no-fio", action="store_true", help="leave out fio's sequential write")
    emulated = p.add_argument_group("--emulate (an emulated SLC-cache drive; needs root)")
    emulated.add_argument("--emulate", choices=("plc", "qlc", "random"), default=None,
                          help="run the emulated-drive benchmark with this profile (random: "
                               "a drive drawn from flashstream.emulation.RANDOM_RANGES)")
    emulated.add_argument("--seed", type=int, default=None,
                          help="--emulate random: the draw's seed (default: a fresh one, "
                               "printed and kept in the JSON)")
    emulated.add_argument("--cache-size", default=None,
                          help="the emulated cache (default: the profile's, scaled)")
    emulated.add_argument("--gap", type=float, default=None,
                          help="seconds between saves (default: saves average 85%% of the "
                               "cache's drain rate)")
    emulated.add_argument("--within", type=float, default=None,
                          help="each save's deadline after it is due (default: 0.8 x the gap)")
    emulated.add_argument("--modes", default=",".join(_emulated.MODES),
                          help=f"writers, from {', '.join(_emulated.MODES)}")
    emulated.add_argument("--reader-rate", type=float, default=250.0,
                          help="the open-loop reader's reads per second")
    emulated.add_argument("--reader-block", default="128KiB", help="bytes per read")
    emulated.add_argument("--reader-file-size", default="1GiB",
                          help="the file the reader reads at random")
    learning = p.add_argument_group("--emulate random --learning (how close auto comes to the "
                                    "best each drive allows: benchmarks/_learning.py)")
    learning.add_argument("--learning", action="store_true",
                          help="with --emulate random: per drive, a fresh start and stored "
                               "models 4 x too slow and too fast (measured minutes ago), a "
                               "reader beside, each save against the shortest cliff-free "
                               "duration")
    learning.add_argument("--drives", type=int, default=10, help="drives drawn (default 10)")
    learning.add_argument("--seeds", default=None,
                          help="the drives' seeds, such as 14,17,20 (instead of --seed and "
                               "--drives: a rerun of chosen drives)")
    learning.add_argument("--scenarios", default="fresh,slow,fast",
                          help="from fresh, slow, fast")
    learning.add_argument("--size-share", type=float, default=1.75,
                          help="each save's bytes as a share of the cache (default 1.75)")
    learning.add_argument("--max-cache", default="1GiB",
                          help="caches drawn larger are scaled down to this (default 1GiB)")
    learning.add_argument("--profiles", default="plc,qlc",
                          help="the profiles run beside the random drives (default plc,qlc; "
                               "'' for none)")
    p.add_argument("--json", type=Path, default=None,
                   help="default: bench-results/checkpoint.json "
                        "(checkpoint-emulated-plc.json with --emulate plc)")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of write GB/s over time per writer (default: beside the JSON)")
    args = p.parse_args(argv)
    if args.saves < 1:
        p.error("--saves must be at least 1")
    if args.learning and args.emulate != "random":
        p.error("--learning goes with --emulate random")
    name = f"checkpoint-emulated-{args.emulate}" if args.emulate else "checkpoint"
    if args.learning:
        name = "checkpoint-learning"
        args.scenarios = _chosen(p, args.scenarios, _learning.SCENARIOS, "--scenarios")
        args.max_cache = parse_size(args.max_cache, name="--max-cache")
        args.profiles = _chosen(p, args.profiles, PROFILES, "--profiles") \
            if args.profiles.strip() else []
        if args.drives < 1 or args.saves < 3 or not 1 <= args.size_share <= 10:
            p.error("--learning needs --drives >= 1, --saves >= 3 and --size-share in [1, 10]")
        if args.seeds is not None:
            try:
                args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
            except ValueError:
                p.error(f"--seeds: integers separated by commas, got {args.seeds!r}")
            if not args.seeds:
                p.error("--seeds: name at least one seed")
            args.seed, args.drives = args.seeds[0], len(args.seeds)
    args.json = args.json or Path(f"bench-results/{name}.json")
    args.plot = args.plot or args.json.with_suffix(".png")
    if args.emulate:
        if args.emulate == "random" and args.seed is None:
            args.seed = random.SystemRandom().randrange(1 << 31)
        args.emulate_size = args.size
        # In MODES' order whatever the order given: 'none' is the baseline auto+read_slo
        # takes its SLO from, so it runs first.
        args.modes = sorted(_chosen(p, args.modes, _emulated.MODES, "--modes"),
                            key=_emulated.MODES.index)
        args.chunk_size = parse_size(args.chunk_size, name="--chunk-size")
    else:
        args.writers = _chosen(p, args.writers, _checkpoint_runs.WRITERS, "--writers")
        if "fixed" in args.writers and args.rate is None and "unpaced" not in args.writers:
            p.error("the fixed writer needs --rate when the unpaced writer does not run")
        args.size = parse_size(args.size or "2GiB", name="--size")
    args.rate = float(parse_size(args.rate, name="--rate")) if args.rate else None
    return args


def _chosen(parser: argparse.ArgumentParser, text: str, allowed, option: str) -> List[str]:
    """The comma-separated names of ``text``, each one of ``allowed`` (else a usage error)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = set(names) - set(allowed)
    if unknown or not names:
        parser.error(f"{option}: unknown {sorted(unknown)}; choose from {', '.join(allowed)}")
    return names



def _anon_huge_bytes() -> Optional[int]:
    """Bytes of this process's memory in transparent huge pages (None where Linux won't say)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.learning:
        return _learning.run(args)
    if args.emulate:
        return _emulated.run(args)
    info = _bench.environment(args.dir)
    if info["fio"] is None and not args.no_fio:
        print("fio is not installed: no drive baseline (apt-get install -y fio)", file=sys.stderr)
        args.no_fio = True
    if args.huge_pages:
        # torch reads this once, at its first large allocation: before the state is built.
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    with tqdm(desc="building the state dict", total=1, leave=False, disable=None) as bar:
        state = (_training.ManySmallState(args.many_small) if args.many_small
                 else _training.TrainingState(args.size))
        bar.update(1)
    import torch

    busy = (os.cpu_count() or 1) - 1 if args.busy else 0
    info.update(torch=torch.__version__, **state.describe(), saves=args.saves,
                reader_size=args.reader_size if args.reader else None,
                huge_pages=args.huge_pages, anon_huge_bytes=_anon_huge_bytes(),
                busy_cores=busy)
    _bench.print_header(info)
    print(f"state dict: {state.summary()}" + (f"; {busy} other core(s) kept busy" if busy
                                                 else ""))
    probe = _bench.run_probe(args.dir, args.probe_size) if args.probe else None
    if probe is not None:
        print(_bench.format_probe(probe, "write"))
    reader, idle = _checkpoint_runs.start_reader(args)
    with _training.busy_cores(busy):
        out = _checkpoint_runs.run_all(args, state, info, probe, reader)
    _checkpoint_report.ratios(out, idle)
    _checkpoint_report.table(out)
    verdicts = _checkpoint_report.check_targets(out, args)
    payload = {"environment": info, "probe": _bench.probe_summary(probe),
               "config": {"size": args.size, "saves": args.saves, "rate": args.rate,
                          "chunk_size": args.chunk_size, "queue_depth": args.queue_depth,
                          "writers": args.writers, "busy": args.busy,
                          "many_small": args.many_small, "reserve": args.reserve},
               "fio": out["fio"], "reader_idle": idle, "writers": out["writers"],
               "targets": verdicts}
    _bench.write_outputs(payload, args.json, _plot.plot_checkpoint, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
