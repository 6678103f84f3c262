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
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402
import _emulated
import _learning  # noqa: E402
import _plot  # noqa: E402
import _savers  # noqa: E402

from flashstream.sizes import format_size, parse_size  # noqa: E402

WRITERS = ("torch.save", "dcp", "unpaced", "fixed", "auto", "copy")
OURS = ("unpaced", "fixed", "auto", "copy")  # CheckpointWriter rows ("copy": unpaced, copy)
STALL_SHARE = 1 / 20     # CheckpointWriter's stall at most this share of torch.save's
MANY_SMALL_SHARE = 1 / 10  # the same with --many-small (50,000 tensors of 1 KB)
FIRST_SHARE = 1 / 5      # the first save's stall (1/20 too with --reserve)
FIO_SHARE = 0.85         # unpaced CheckpointWriter's GB/s at least this share of fio's
RATE_TOLERANCE = 0.05    # a paced write's achieved rate within this of the target
IDLE_EPOCHS = 3          # idle reader epochs (their latencies merged)


# -- one writer ---------------------------------------------------------------------------------
def measure(saver, state: _savers.TrainingState, args, reader: Optional[_savers.Reader],
            first_step: int) -> Dict[str, object]:
    """--saves saves one after another (the tensors changed between them), then with --reader
    one more with ShardStream epochs beside it. Each save's output is evicted and deleted
    before the next."""
    saves: List[Dict[str, object]] = []
    step = first_step
    total = args.saves + (reader is not None)
    quiet_step = timed(state.mutate)  # a training step with no save in flight
    with tqdm(total=total, desc=saver.label, unit="save", leave=False, disable=None) as bar:
        for _ in range(args.saves):
            running = saver.save(step)
            # The training step right after save() returns: it overwrites every tensor, which
            # a copy-on-write snapshot makes pay for the blocks not yet copied.
            after = timed(state.mutate)
            run = running.result()
            saves.append({"step": step, **saver.figures(run, step), "step_after_s": after,
                          "step_overhead_s": after - quiet_step})
            _savers.settle(saver.outputs(step))
            step += 1
            bar.update(1)
        result = summarize(saves)
        if reader is not None:
            state.mutate()
            bar.set_postfix_str("with the reader")
            run = saver.save(step, background=True)
            beside = reader.beside(run)
            beside["save"] = saver.figures(run, step)
            _savers.settle(saver.outputs(step))
            result["reader"] = beside
            bar.update(1)
    result["label"] = saver.label
    return result


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def summarize(saves: List[Dict[str, object]]) -> Dict[str, object]:
    """The first save apart; the median of the later ones (the first one alone if only one)."""
    later = saves[1:] or saves

    def median(field: str) -> Optional[float]:
        values = [s[field] for s in later if s.get(field) is not None]
        return statistics.median(values) if values else None

    out = {"stall_first_s": saves[0]["stall_s"], "stall_s": median("stall_s"),
           "gbps": median("gbps"), "write_s": median("write_s"), "bytes": saves[-1]["bytes"]}
    out["step_overhead_s"] = median("step_overhead_s")
    for field in ("durable_stall_s", "achieved_rate", "target_rate", "rate_accuracy"):
        if saves[0].get(field) is not None:
            out[field] = median(field)
    report = saves[-1].get("report")
    if report and report.get("rate_mode") == "auto":
        out.update(peak_rate=report["peak_rate"], sustained_rate=report["sustained_rate"],
                   final_rate=report["final_rate"], cliff=report["sustained_rate"] > 0)
    out["saves"] = saves
    return out


def make_saver(name: str, args, state, device, probe, rate: Optional[float]):
    where = args.dir / name.replace(".", "_")
    if name == "torch.save":
        return _savers.TorchSave(where, state, device)
    if name == "dcp":
        return _savers.DcpAsyncSave(where, state, device)
    options = {"chunk_size": args.chunk_size, "queue_depth": args.queue_depth,
               "snapshot": "copy" if name == "copy" else args.snapshot}
    if args.reserve:
        options["reserve"] = state.state  # staging sized at construction, not in save 1
    if args.engine:
        options["engine"] = args.engine
    return _savers.Flashstream(where, state, device, mode=name,
                               rate={"unpaced": None, "copy": None, "auto": "auto"}.get(name, rate),
                               probe=probe, **options)


def fio_write(args, nbytes: int, when: str) -> Optional[Dict[str, object]]:
    if args.no_fio:
        return None
    with tqdm(desc=f"fio sequential write ({when})", leave=False, disable=None, total=1) as bar:
        result = _bench.fio_sequential_write(args.dir / "fio-write.tmp", nbytes)
        bar.update(1)
    _savers.settle([])
    return result


def run_all(args, state, info, probe, reader) -> Dict[str, object]:
    results: Dict[str, object] = {}
    baseline: Dict[str, object] = {}
    device = info.get("device_name")
    step = 1
    for name in args.writers:
        rate = None
        if name == "fixed":
            rate = args.rate or fixed_rate(results)
            if rate is None:
                results[name] = {"error": "no --rate and no unpaced figure to take half of"}
                continue
        if name == "unpaced":
            baseline["before"] = fio_write(args, state.tensor_bytes, "before")
        try:
            saver = make_saver(name, args, state, device, probe, rate)
        except Exception as e:  # dcp without torch.distributed, say: recorded, and on we go
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: cannot run ({results[name]['error']})", file=sys.stderr)
            continue
        try:
            results[name] = measure(saver, state, args, reader, step)
            if getattr(saver, "process_group", None):
                results[name]["process_group"] = saver.process_group
        except Exception as e:
            traceback.print_exc()
            results[name] = {"label": saver.label, "error": f"{type(e).__name__}: {e}"}
        finally:
            saver.close()
        step += args.saves + 1
        if name == "unpaced":
            baseline["after"] = fio_write(args, state.tensor_bytes, "after")
    runs = [r["gbps"] for r in baseline.values() if r]
    baseline["gbps"] = statistics.mean(runs) if runs else None
    return {"writers": results, "fio": baseline}


def fixed_rate(results: Dict[str, object]) -> Optional[float]:
    """Half the unpaced writer's measured GB/s, in bytes/s."""
    gbps = results.get("unpaced", {}).get("gbps")
    return gbps * 1e9 / 2 if gbps else None


# -- figures and targets ------------------------------------------------------------------------
def ratios(out: Dict[str, object], idle: Optional[Dict[str, object]]) -> None:
    """Add each writer's ratio to fio, to torch.save's stall and of the reader's p95."""
    fio = out["fio"]["gbps"]
    torch_stall = out["writers"].get("torch.save", {}).get("stall_s")
    for result in out["writers"].values():
        if "error" in result:
            continue
        result["gbps_vs_fio"] = result["gbps"] / fio if fio else None
        result["stall_vs_torch_save"] = (result["stall_s"] / torch_stall
                                         if torch_stall else None)
        result["stall_first_vs_torch_save"] = (result["stall_first_s"] / torch_stall
                                               if torch_stall else None)
        beside = result.get("reader")
        if beside and idle and idle.get("p95_us") and beside.get("p95_us"):
            beside["p95_vs_idle"] = beside["p95_us"] / idle["p95_us"]


def table(out: Dict[str, object]) -> None:
    rows = []
    for name, r in out["writers"].items():
        if "error" in r:
            rows.append({"writer": r.get("label", name), "stall first ms": r["error"][:60]})
            continue
        row = {"writer": r["label"], "stall first ms": r["stall_first_s"] * 1e3,
               "stall ms": r["stall_s"] * 1e3, "vs torch.save": _share(r["stall_vs_torch_save"]),
               "next step +ms": r["step_overhead_s"] * 1e3,
               "write GB/s": r["gbps"], "vs fio": r["gbps_vs_fio"],
               "rate accuracy": r.get("rate_accuracy"),
               "reader p95 ms": _get(r, "reader", "p95_us", scale=1e-3),
               "p95 vs idle": _get(r, "reader", "p95_vs_idle")}
        rows.append(row)
        if name == "torch.save":
            rows.append({**row, "writer": "torch.save + fsync",
                         "stall first ms": r["saves"][0]["durable_stall_s"] * 1e3,
                         "stall ms": r["durable_stall_s"] * 1e3, "vs torch.save": None,
                         "next step +ms": None,
                         "reader p95 ms": None, "p95 vs idle": None})
    columns = ["writer", "stall first ms", "stall ms", "vs torch.save", "next step +ms",
               "write GB/s", "vs fio",
               "rate accuracy", "reader p95 ms", "p95 vs idle"]
    if not any(r.get("reader p95 ms") for r in rows):
        columns = columns[:-2]
    print()
    _bench.print_table(rows, columns)
    fio = out["fio"]
    if fio["gbps"]:
        runs = " and ".join(f"{fio[k]['gbps']:.3f}" for k in ("before", "after") if fio.get(k))
        over = [fio[k]["overwrite"]["gbps"] for k in ("before", "after")
                if fio.get(k) and fio[k].get("overwrite")]
        print(f"  fio sequential write (8 MiB x 8, O_DIRECT, end_fsync) into a new file, as a "
              f"checkpoint is written: {fio['gbps']:.3f} GB/s (mean of {runs}); overwriting "
              f"that file: {statistics.mean(over) if over else float('nan'):.3f} GB/s")
    auto = out["writers"].get("auto", {})
    if "peak_rate" in auto:
        print(f"  auto: peak {auto['peak_rate'] / 1e9:.3f} GB/s, " + (
            f"cliff seen: sustained {auto['sustained_rate'] / 1e9:.3f} GB/s, paced at "
            f"{auto['final_rate'] / 1e9:.3f} GB/s" if auto["cliff"] else "no cliff seen"))
    for name in OURS:
        saves = out["writers"].get(name, {}).get("saves")
        if saves:
            print(f"\nCheckpointWriter {name}, last save, SaveReport:")
            print("  " + saves[-1]["report_table"].replace("\n", "\n  "))


def _share(value: Optional[float]) -> Optional[str]:
    if value is None:
        return None
    return f"1/{1 / value:,.1f}" if value < 0.5 else f"{value:.2f}x"


def _get(result: Dict[str, object], *keys: str, scale: float = 1.0) -> Optional[float]:
    for key in keys:
        result = (result or {}).get(key)
    return None if result is None else result * scale


def check_targets(out: Dict[str, object], args) -> Dict[str, object]:
    writers = out["writers"]
    ours = {k: v for k, v in writers.items() if k in OURS[:3] and "error" not in v}
    verdicts: Dict[str, object] = {}
    stalls = [v["stall_vs_torch_save"] for v in ours.values()
              if v.get("stall_vs_torch_save") is not None]
    share = MANY_SMALL_SHARE if args.many_small else STALL_SHARE
    if stalls:
        # OURS[:3]: the copy row is a comparison with snapshot="copy", not a target.
        verdicts["CheckpointWriter stall / torch.save blocking time (worst of unpaced, fixed, "
                 "auto)"] = {
            "value": max(stalls), "target": f"<= {share:.2f}", "met": max(stalls) <= share}
    firsts = [v["stall_first_vs_torch_save"] for v in ours.values()
              if v.get("stall_first_vs_torch_save") is not None]
    if firsts:
        first = share if args.reserve else FIRST_SHARE
        verdicts["CheckpointWriter first save's stall / torch.save's (worst of unpaced, "
                 "fixed, auto)"] = {
            "value": max(firsts), "target": f"<= {first:.2f}", "met": max(firsts) <= first}
    unpaced = ours.get("unpaced", {}).get("gbps_vs_fio")
    if unpaced is not None:
        verdicts["unpaced CheckpointWriter GB/s / fio sequential write GB/s"] = {
            "value": unpaced, "target": f">= {FIO_SHARE}", "met": unpaced >= FIO_SHARE}
    accuracy = ours.get("fixed", {}).get("rate_accuracy")
    if accuracy is not None:
        verdicts["paced CheckpointWriter achieved rate / target rate"] = {
            "value": accuracy, "target": f"1 +- {RATE_TOLERANCE}",
            "met": abs(accuracy - 1) <= RATE_TOLERANCE}
    if verdicts:
        print("\ntargets:")
        _bench.print_verdicts(verdicts)
    return verdicts


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
    p.add_argument("--writers", default=",".join(WRITERS),
                   help=f"which to run, from {', '.join(WRITERS)} (dcp: "
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
                               "models 4 x too slow and too fast, each save against the "
                               "shortest cliff-free duration")
    learning.add_argument("--drives", type=int, default=10, help="drives drawn (default 10)")
    learning.add_argument("--scenarios", default="fresh,slow,fast",
                          help="from fresh, slow, fast")
    learning.add_argument("--size-share", type=float, default=1.75,
                          help="each save's bytes as a share of the cache (default 1.75)")
    learning.add_argument("--max-cache", default="1GiB",
                          help="caches drawn larger are scaled down to this (default 1GiB)")
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
        if args.drives < 1 or args.saves < 3 or not 1 <= args.size_share <= 10:
            p.error("--learning needs --drives >= 1, --saves >= 3 and --size-share in [1, 10]")
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
        args.writers = _chosen(p, args.writers, WRITERS, "--writers")
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


def start_reader(args):
    if not args.reader:
        return None, None
    total = parse_size(args.reader_size, name="--reader-size")
    with tqdm(desc="writing reader shards", unit="shard", leave=False, disable=None) as bar:
        paths = _bench.write_synthetic_shards(
            args.dir / f"reader-100KB-{total}", sample_size=100_000, total_bytes=total,
            shard_bytes=min(128 << 20, max(total // 4, 1 << 20)), progress=bar)
    reader = _savers.Reader(paths)
    with tqdm(desc="reader, idle", total=1, leave=False, disable=None) as bar:
        idle = reader.idle(IDLE_EPOCHS)
        bar.update(1)
    print(f"reader: {len(paths)} shards, {format_size(sum(p.stat().st_size for p in paths))}; "
          f"idle cold epochs ({idle['epochs']}): p95 request latency {idle['p95_us']:,.0f} us, "
          f"{idle['gbps']:.3f} GB/s")
    return reader, idle


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
        state = (_savers.ManySmallState(args.many_small) if args.many_small
                 else _savers.TrainingState(args.size))
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
    reader, idle = start_reader(args)
    with _savers.busy_cores(busy):
        out = run_all(args, state, info, probe, reader)
    ratios(out, idle)
    table(out)
    verdicts = check_targets(out, args)
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
