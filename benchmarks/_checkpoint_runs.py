"""checkpoint.py's runs: every writer (torch.save, dcp.async_save, CheckpointWriter's rate
settings) saving the same state dict --saves times, fio's sequential write of the same bytes
before and after the unpaced writer, and with --reader cold ShardStream epochs idle and beside
one more save. The figures each run returns are judged in _checkpoint_report.py."""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from typing import Dict, List, Optional

import _bench
import _savers
import _training
from tqdm import tqdm

from flashstream.sizes import format_size, parse_size

__all__ = ["WRITERS", "run_all", "start_reader"]

WRITERS = ("torch.save", "dcp", "unpaced", "fixed", "auto", "copy")
IDLE_EPOCHS = 3  # idle reader epochs (their latencies merged)


# -- one writer ---------------------------------------------------------------------------------
def measure(saver, state: _training.TrainingState, args, reader: Optional[_savers.Reader],
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


# -- the reader ---------------------------------------------------------------------------------
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
