"""checkpoint.py's writers and reader: the ways of saving a state dict behind one interface
(torch.save, torch.distributed.checkpoint.async_save, CheckpointWriter), each save timed and
its device counters sampled, and the ShardStream reader that runs beside a save. The state
dict they save is _training.py's."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from _training import TrainingState

import flashstream
from flashstream.pagecache import evict
from flashstream.telemetry.diskstats import DiskSampler
from flashstream.telemetry.histogram import LatencyHistogram
from flashstream.telemetry.probe import ProbeResult

SAMPLE_INTERVAL = 0.05  # seconds between device-counter samples (CheckpointWriter's default)


# -- a save in progress -------------------------------------------------------------------------
class Running:
    """One save: ``stall_s`` is how long the call blocked the caller; the write goes on (on a
    thread, for a blocking writer run in the background) until ``wait`` returns. The device
    counters are sampled from the call until then."""

    def __init__(self, sampler: DiskSampler, started: float, returned: float,
                 wait: Callable[[], object]) -> None:
        self.sampler, self.started, self.returned = sampler, started, returned
        self.value: object = None
        self.error: Optional[BaseException] = None
        self.ended = 0.0
        self.disk = None
        self._done = threading.Event()
        threading.Thread(target=self._wait, args=(wait,), daemon=True).start()

    def _wait(self, wait: Callable[[], object]) -> None:
        try:
            self.value = wait()
        except BaseException as e:  # re-raised in the caller's thread by result()
            self.error = e
        finally:
            self.ended = time.perf_counter()
            self.disk = self.sampler.stop()
            self._done.set()

    @property
    def stall_s(self) -> float:
        return self.returned - self.started

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Running:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self

    def disk_figures(self) -> Dict[str, object]:
        """The device's write GB/s over time (seconds since the call; the last, shorter
        interval from the totals) and its totals."""
        end = self.ended - self.started
        rows, previous = [], 0.0
        for t, _, w in self.sampler.timeline:
            if t <= end:
                rows.append((t, w * 1e9 * (t - previous)))
                previous = t
        if self.disk is not None and end > previous:
            rows.append((end, max(0.0, self.disk.write_bytes - sum(b for _, b in rows))))
        return {"write_timeline": rates(rows),
                "disk": self.disk.to_dict() if self.disk else None}


def rates(rows, offset: float = 0.0, min_width: float = SAMPLE_INTERVAL / 2) -> List[List[float]]:
    """``(end of interval, bytes in it)`` rows as ``[offset + end, GB/s]``; an interval narrower
    than ``min_width`` is folded into the one before (a tail of a few milliseconds would
    otherwise show as a spike)."""
    spans: List[List[float]] = []  # [start, end, bytes]
    start = 0.0
    for t, nbytes in rows:
        if spans and t - start < min_width:
            spans[-1][1:] = [t, spans[-1][2] + nbytes]
        else:
            spans.append([start, t, nbytes])
        start = max(start, t)
    return [[round(offset + e, 4), round(b / (e - s) / 1e9, 4)] for s, e, b in spans if e > s]


def _sampler(device: Optional[str]) -> DiskSampler:
    return DiskSampler(device, SAMPLE_INTERVAL).start()


def settle(paths: List[Path]) -> None:
    """Drop what a save left in the page cache, delete it, and let the deletion reach the drive
    (so the next writer starts from the same state)."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        evict(files)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    os.sync()


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- the writers --------------------------------------------------------------------------------
class TorchSave:
    """torch.save into the page cache (what blocks training), then os.fsync (durable)."""

    key, label = "torch_save", "torch.save"

    def __init__(self, directory: Path, state: TrainingState, device: Optional[str]) -> None:
        self.directory, self.state, self.device = directory, state, device
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.pt"

    def save(self, step: int, *, background: bool = False) -> Running:
        path = self.path(step)
        times: Dict[str, float] = {}

        def write() -> Dict[str, float]:
            t0 = time.perf_counter()
            torch.save(self.state.state, path)
            t1 = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            times.update(save_s=t1 - t0, fsync_s=time.perf_counter() - t1)
            return times

        sampler, started = _sampler(self.device), time.perf_counter()
        if background:
            return Running(sampler, started, started, write)
        write()
        return Running(sampler, started, started + times["save_s"], lambda: times)

    def figures(self, run: Running, step: int) -> Dict[str, object]:
        t = run.value
        nbytes = _du(self.path(step))
        durable = t["save_s"] + t["fsync_s"]
        return {"stall_s": t["save_s"], "durable_stall_s": durable, "fsync_s": t["fsync_s"],
                "write_s": durable, "bytes": nbytes, "gbps": nbytes / durable / 1e9,
                "page_cache_gbps": nbytes / t["save_s"] / 1e9, **run.disk_figures()}

    def outputs(self, step: int) -> List[Path]:
        return [self.path(step)]

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class DcpAsyncSave(TorchSave):
    """torch.distributed.checkpoint.async_save (FileSystemWriter, fsync on): the stall is the
    call, the write ends when its future completes. Runs in a one-rank gloo process group
    (FileStore in a temporary directory) unless one is already initialized."""

    key, label = "dcp_async_save", "dcp.async_save"

    def __init__(self, directory: Path, state: TrainingState, device: Optional[str]) -> None:
        super().__init__(directory, state, device)
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.dist, self.dcp = dist, dcp
        self.own_group = not dist.is_initialized()
        self.store_dir = None
        if self.own_group:
            self.store_dir = tempfile.mkdtemp(prefix="flashstream-dcp-")
            store = dist.FileStore(os.path.join(self.store_dir, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        self.process_group = ("gloo, 1 rank, FileStore (made by the benchmark)"
                              if self.own_group else f"existing ({dist.get_backend()})")

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}"

    def save(self, step: int, *, background: bool = False) -> Running:
        sampler, started = _sampler(self.device), time.perf_counter()
        future = self.dcp.async_save(self.state.state, checkpoint_id=str(self.path(step)))
        returned = time.perf_counter()
        return Running(sampler, started, returned, future.result)

    def figures(self, run: Running, step: int) -> Dict[str, object]:
        nbytes = _du(self.path(step))
        write_s = run.ended - run.returned
        return {"stall_s": run.stall_s, "write_s": write_s, "bytes": nbytes,
                "gbps": nbytes / write_s / 1e9, "total_s": run.ended - run.started,
                **run.disk_figures()}

    def close(self) -> None:
        super().close()
        if self.own_group and self.dist.is_initialized():
            self.dist.destroy_process_group()
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)


class Flashstream:
    """flashstream.CheckpointWriter with one rate setting (keep=1, if_busy="wait")."""

    def __init__(self, directory: Path, state: TrainingState, device: Optional[str], *,
                 mode: str, rate, probe: Optional[ProbeResult], **options) -> None:
        self.key = f"flashstream_{mode}"
        shown = ("None" if rate is None else repr(rate) if isinstance(rate, str)
                 else f"{rate / 1e9:.3f} GB/s")
        self.label = f"CheckpointWriter(rate={shown}, snapshot={options.get('snapshot')!r})"
        self.directory, self.state, self.device, self.probe = directory, state, device, probe
        self.writer = flashstream.CheckpointWriter(directory, rate=rate, keep=1,
                                                   if_busy="wait", **options)

    def save(self, step: int, *, background: bool = False) -> Running:
        sampler, started = _sampler(self.device), time.perf_counter()
        handle = self.writer.save(self.state.state, step=step)
        returned = time.perf_counter()
        return Running(sampler, started, returned, handle.result)

    def figures(self, run: Running, step: int) -> Dict[str, object]:
        report = run.value.compare(self.probe)
        offset = run.stall_s  # the writer's timeline starts at its first request
        timeline = rates([(t, nbytes) for t, nbytes, _ in report.timeline], offset)
        return {"stall_s": run.stall_s, "report_stall_s": report.stall_s, "write_start_s": offset,
                "write_s": report.write_s + report.sync_s, "bytes": report.bytes,
                "gbps": report.gbps, "achieved_rate": report.achieved_rate,
                "target_rate": report.target_rate,
                "rate_accuracy": (report.achieved_rate / report.target_rate
                                  if report.rate_mode == "fixed" and report.target_rate
                                  else None),
                "rate_timeline": [[round(offset + t, 4), r / 1e9] for t, _, r in
                                  report.timeline],
                "report": report.to_dict(), "report_table": report.format_table(),
                **run.disk_figures(), "write_timeline": timeline}

    def outputs(self, step: int) -> List[Path]:
        return []  # keep=1: the writer removes the previous step itself

    def close(self) -> None:
        self.writer.close()
        shutil.rmtree(self.directory, ignore_errors=True)


# -- the reader ---------------------------------------------------------------------------------
class Reader:
    """Cold ShardStream epochs (evicted first) over generated shards; request latency from the
    stream's own histogram."""

    def __init__(self, paths: List[Path]) -> None:
        self.paths = paths
        self.stream = flashstream.ShardStream([str(p) for p in paths], split_by_rank=False)

    def epoch(self) -> Dict[str, object]:
        evict(self.paths)
        self.stream.reset_stats()
        start = time.perf_counter()
        samples = sum(1 for _ in self.stream)
        end = time.perf_counter()
        totals = self.stream.stats()
        return {"start": start, "end": end, "seconds": end - start, "samples": samples,
                "bytes_read": int(totals["bytes_read"]), "latency": totals["latency"]}

    def idle(self, epochs: int) -> Dict[str, object]:
        return _summary([self.epoch() for _ in range(epochs)])

    def beside(self, run: Running) -> Dict[str, object]:
        """Epochs one after another while ``run`` writes (at least one)."""
        epochs = [self.epoch()]
        while not run.done():
            epochs.append(self.epoch())
        run.result()
        for e in epochs:  # how much of each epoch the write was going on for
            e["overlap_s"] = max(0.0, min(e["end"], run.ended) - max(e["start"], run.started))
        out = _summary(epochs)
        out["write_overlap"] = sum(e["overlap_s"] for e in epochs) / sum(e["seconds"]
                                                                         for e in epochs)
        return out


def _summary(epochs: List[Dict[str, object]]) -> Dict[str, object]:
    """The request-latency figures of all the epochs together, and each epoch's."""
    merged = LatencyHistogram.merged(e["latency"] for e in epochs)
    kept = [{**{k: v for k, v in e.items() if k not in ("latency", "start", "end")},
             "p95_us": _p95(e["latency"])} for e in epochs]
    seconds = sum(e["seconds"] for e in epochs)
    return {"epochs": len(epochs), "p95_us": _p95(merged),
            "latency_us": merged.summary("us"),
            "gbps": sum(e["bytes_read"] for e in epochs) / seconds / 1e9,
            "median_epoch_s": statistics.median(e["seconds"] for e in epochs),
            "per_epoch": kept}


def _p95(hist: LatencyHistogram) -> Optional[float]:
    value = hist.percentile(95)
    return None if value is None else value / 1e3
