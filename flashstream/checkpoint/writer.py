"""CheckpointWriter: snapshot a state dict, return to training, write it in the background.

``save()`` blocks only while it copies the tensors into reused staging memory. A background
thread then writes that memory as one file per rank with large aligned O_DIRECT requests,
paced as configured, checksums every tensor, syncs, and commits by rename (see store.py for
the directory protocol and format.py for the file format).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import operator
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from .. import engine
from ..errors import SnapshotLostError
from ..sizes import parse_size
from ..telemetry.device import device_of, online_discard
from ..telemetry.diskstats import disk_bytes_written
from ..telemetry.histogram import LatencyHistogram
from ..telemetry.write_model import WriteModel, load_model
from .config import WriterConfig
from .drive_learning import DriveLearner
from .format import FORMAT_VERSION, HEADER_ALIGNMENT, Layout, assemble, header_bytes, plan
from .pacing import PlanSettings
from .relayout import Plan, relayout
from .report import SaveReport
from .save_control import plan_save
from .staging import StagingBuffer, lost_tensors, snapshot
from .store import (
    StepDir,
    WriterLock,
    atomic_write_text,
    claim_spare,
    fsync_dir,
    inspect_step,
    list_checkpoints,
    prune,
    remove_spares,
    remove_stale_temporaries,
    write_latest,
)
from .structure import flatten

__all__ = ["CheckpointWriter", "SaveHandle"]

log = logging.getLogger(__name__)
_POLL_S = 0.05  # how often rank 0 looks for the other ranks' markers
_FIRST_TAIL_S = 0.2  # header, sync and commit of a save before one was timed
# Pruning an older checkpoint before one was timed: unlinking a preallocated 1.3 GB file on
# ext4 took 0.30-0.34 s here (freeing its extents), so ~0.25 s per GB.
_FIRST_PRUNE_S_PER_BYTE = 0.25e-9
# The same, a slice at a time on an online-discard filesystem (store.remove_step): 3.6 GB took
# about 1.2 s on the emulated qlc benchmark here.
_FIRST_GRADUAL_PRUNE_S_PER_BYTE = 0.35e-9
# Recycling the pruned checkpoint's file instead (renames, a scan of /proc for readers of it):
# milliseconds whatever its size; this allows 10 ms per GB.
_FIRST_RECYCLE_S_PER_BYTE = 0.01e-9


class SaveHandle:
    """The pending result of one ``CheckpointWriter.save``."""

    def __init__(self, step: int, future: Optional[Future], path: Optional[Path],
                 copied: Optional[threading.Event] = None) -> None:
        self.step = step
        self.path = path  # this rank's file once committed
        self._future = future
        self._copied = copied
        self.observed = future is None

    def wait_snapshot(self, timeout: Optional[float] = None) -> bool:
        """Until the snapshot holds a copy of every source tensor; False on timeout.

        Returns at once when save() copied everything (``snapshot="copy"``). With the
        copy-on-write snapshot (``"cow"``, and the default ``"auto"`` where the kernel allows
        it) the copy runs in the background: call this before freeing or
        resizing a saved tensor's storage (FSDP's ``resize_(0)``), which would otherwise fail
        the save with ``SnapshotLostError``. Writing to the tensors needs no wait.
        """
        return self._copied is None or self._copied.wait(timeout)

    @property
    def skipped(self) -> bool:
        """True when the save was skipped because the previous one was still writing."""
        return self._future is None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: Optional[float] = None) -> Optional[SaveReport]:
        """Wait for the write and commit; return its report (None when skipped).

        Raises what the background write raised (``OSError`` for a full disk, ...).
        """
        if self._future is None:
            return None
        self.observed = True
        return self._future.result(timeout)

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "done" if self.done() else "writing"
        return f"SaveHandle(step={self.step}, {state})"


def _world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """This process's rank and the world size: given, else torch.distributed's, else 0 of 1."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
    return rank, world_size


def _layout(state_dict: Any, step: int, rank: int, world_size: int,
            previous: Optional[Plan] = None) -> Tuple[Layout, Plan]:
    """The file ``state_dict`` makes as checkpoint ``step`` of ``rank``: where every tensor
    goes, and the header's size (raises TypeError naming anything that cannot be saved).
    ``previous``: the last save's plan, reused when the state kept its shape (relayout.py).
    Returns the layout and the plan to pass next time."""
    fit = relayout(state_dict, previous) if previous is not None else None
    if fit is not None:
        skeleton, slots = fit
    else:
        skeleton, entries = flatten(state_dict)
    metadata = {"format": "pt", "flashstream.version": FORMAT_VERSION,
                "flashstream.structure": json.dumps(skeleton, separators=(",", ":")),
                "flashstream.step": str(step), "flashstream.rank": str(rank),
                "flashstream.world_size": str(world_size)}
    if fit is not None:
        layout = assemble(slots, metadata, like=previous.layout)
        return layout, Plan(skeleton, layout, previous.slot_of)
    layout = plan(entries, metadata)
    return layout, Plan.of(skeleton, layout)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic GC: walking a 50,000-tensor state dict allocates enough containers to
    trigger collections that traverse the whole heap (the training state included), which
    doubled the stall of some saves. Nothing made here is cyclic."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _reserved(reserve: Any, alignment: int) -> Tuple[int, Optional[Plan]]:
    """Staging bytes for ``reserve=``: a size (tensor bytes; a header's worth more), or the
    file a state dict like it would make (with the longest step number). For a state dict
    also its plan, so the first save of a state of that shape reuses the layout (planning
    50,000 small tensors from scratch took most of a first save's second)."""
    if isinstance(reserve, (int, str)) and not isinstance(reserve, bool):
        size, plan = parse_size(reserve, name="reserve") + HEADER_ALIGNMENT, None
    else:
        with _no_cyclic_gc():
            layout, plan = _layout(reserve, 10 ** 19, 0, 1)
        layout.forget_sources()  # the plan must not keep the caller's tensors alive
        size = layout.file_size
    return -(-size // alignment) * alignment, plan


def _step_number(step: Any) -> int:
    """An int from any integer a training loop holds: an int, a numpy integer, or a
    one-element tensor holding a whole number (AdamW keeps its step as a float32 one)."""
    if isinstance(step, torch.Tensor):
        value = step.item() if step.numel() == 1 and step.dtype != torch.bool else None
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value):
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        step = int(value)
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return step


#: Names that say "a file": torch.save's habits. CheckpointWriter takes a directory.
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".tar")


def _check_directory_name(directory: Path) -> None:
    if directory.suffix.lower() in _FILE_SUFFIXES and not directory.is_dir():
        raise ValueError(f"CheckpointWriter writes a directory of step directories, and "
                         f"{str(directory)!r} names a file (torch.save writes one file); give a "
                         f"directory such as {str(directory.with_suffix(''))!r}")


def _check_writable(directory: Path) -> None:
    """Raise now, not from the first save's result(), when nothing can be written here (a
    read-only filesystem, no permission)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".flashstream-writable-", dir=directory)
    except OSError as err:
        raise OSError(err.errno, f"checkpoint directory {directory} is not writable: "
                                 f"{err.strerror}", str(directory)) from None
    os.close(fd)
    os.unlink(name)


class CheckpointWriter:
    """Asynchronous, paced, crash-safe checkpoints of training state.

    >>> writer = CheckpointWriter("ckpt", rate="auto", keep=2)
    >>> handle = writer.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=100)
    >>> ...  # training goes on; the tensors may change now
    >>> handle.result()  # optional: wait for this one (writer.close() waits for all)

    Keyword arguments are those of :class:`WriterConfig` (rate, within, keep, recycle, if_busy,
    chunk_size, paced_chunk_size, queue_depth, engine, direct, commit_timeout, interval,
    adaptive, snapshot, read_slo, deadline_policy), plus ``rank``
    and ``world_size`` (default: torch.distributed's when initialized, else 0 of 1),
    ``pinned`` (staging in page-locked memory; default: when CUDA is available) and
    ``reserve`` (a state dict like the ones to be saved, or a size such as ``"2GiB"``: the
    staging memory is allocated and faulted in now, and a state dict's layout planned, so the
    first save is not the slow one).
    """

    def __init__(self, directory: Union[str, os.PathLike], *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, pinned: Optional[bool] = None,
                 reserve: Any = None, **options: Any) -> None:
        self.config = WriterConfig(**options)
        self.directory = Path(directory)
        _check_directory_name(self.directory)
        self.rank, self.world_size = _world(rank, world_size)
        self._staging = StagingBuffer(pinned=pinned)
        reserved, planned = (None, None) if reserve is None else \
            _reserved(reserve, self._staging.alignment)
        self.directory.mkdir(parents=True, exist_ok=True)
        _check_writable(self.directory)
        self._lock_file = WriterLock(self.directory, self.rank)
        try:
            # Online discard: remove old checkpoints a slice at a time (store.remove_step).
            self._online_discard = online_discard(self.directory)
            remove_stale_temporaries(self.directory, self.rank, gradual=self._online_discard)
            if reserved is not None:
                self._staging.reserve(reserved)
        except BaseException:
            self._lock_file.release()
            raise
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashstream-ckpt")
        self.learner = DriveLearner(self.directory, self._executor)  # rate="auto"
        self._pending: Optional[SaveHandle] = None
        self._plan: Optional[Plan] = planned  # the last save's layout, for the next (relayout.py)
        self._lock = threading.Lock()
        self._closed = False
        self.reports: List[SaveReport] = []
        self.skipped = 0
        self._disk_name: Optional[str] = None
        # Seconds from the last data byte to the save's end (header, sync, commit): with
        # rate="auto" the data write must leave that much of ``within`` over.
        self._tail_s = _FIRST_TAIL_S
        # (time.time(), the drive's written bytes) when the last save's data ended (rate="auto")
        self._disk_mark: Optional[Tuple[float, Optional[int]]] = None
        self._prune_s_per_byte = (_FIRST_RECYCLE_S_PER_BYTE if self.config.recycle
                                  else _FIRST_GRADUAL_PRUNE_S_PER_BYTE if self._online_discard
                                  else _FIRST_PRUNE_S_PER_BYTE)
        self._prune_s = 0.0  # the last save's pruning (part of its tail, timed apart)

    # -- saving ---------------------------------------------------------------------------

    def save(self, state_dict: Any, step: int) -> SaveHandle:
        """Snapshot ``state_dict`` now and write it in the background as checkpoint ``step``.

        Returns once the snapshot is taken: the caller may then change its tensors. Raises
        TypeError naming the key of anything that cannot be saved (before anything is
        written), ValueError if ``step`` was already committed by this rank, and the error of
        an earlier save that nobody collected with ``result()``.
        """
        if self._closed:
            raise ValueError("save() on a closed CheckpointWriter")
        step = _step_number(step)
        started = time.perf_counter()
        self.learner.interrupt()  # a refill measurement after the last save ends now
        previous = self._pending
        if previous is not None and not previous.done():
            if self.config.if_busy == "skip":
                self.skipped += 1
                return SaveHandle(step, None, None)
            previous._future.exception()  # wait; the error surfaces below
        self._raise_unobserved(previous)
        waited = time.perf_counter() - started
        if StepDir(self.directory, step).marker(self.rank, self.world_size).exists():
            raise ValueError(f"step {step} is already committed in {self.directory}")
        with _no_cyclic_gc():  # the walk makes ~2 containers per tensor: full collections
            layout, self._plan = _layout(state_dict, step, self.rank, self.world_size,
                                         self._plan)
        pending = snapshot(layout, self._staging, self.config.snapshot_mode)
        copied = threading.Event()
        if pending is None:
            layout.forget_sources()
            copied.set()
        stall = time.perf_counter() - started - waited
        step_dir = StepDir(self.directory, step)
        future = self._executor.submit(self._write, layout, step_dir, stall, waited,
                                       (pending, copied), started)
        handle = SaveHandle(step, future, step_dir.rank_file(self.rank, self.world_size), copied)
        future.add_done_callback(lambda f: self._on_done(f, step))
        self._pending = handle
        return handle

    def _raise_unobserved(self, handle: Optional[SaveHandle]) -> None:
        if handle is None or handle.observed or handle._future is None:
            return
        handle.observed = True
        error = handle._future.exception()
        if error is not None:
            raise RuntimeError(f"checkpoint step {handle.step} failed in the background: "
                               f"{error}") from error

    def _on_done(self, future: Future, step: int) -> None:
        if future.exception() is not None:
            log.error("flashstream: checkpoint step %d failed: %s", step, future.exception())

    # -- the background write ---------------------------------------------------------------

    def _write(self, layout: Layout, step_dir: StepDir, stall: float, waited: float,
               snapshotting: Tuple[Optional[Any], threading.Event], called: float) -> SaveReport:
        cfg = self.config
        cow = None
        pending, copied = snapshotting
        if pending is not None:  # copy-on-write: the staging copy is still running
            try:
                pending.wait()
            finally:
                copied.set()
            cow = pending.stats()
            layout.forget_sources()
            if cow["lost_bytes"]:
                raise SnapshotLostError(int(layout.metadata["flashstream.step"]),
                                        lost_tensors(pending, layout, self._staging))
        step_dir.path.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.directory)
        tmp = step_dir.temp_file(self.rank, self.world_size)
        capacity = -(-layout.file_size // self._staging.alignment) * self._staging.alignment
        rate = cfg.pacing(layout.data_size)
        model = load_model(self.directory) if cfg.rate == "auto" else None
        written_since = self._written_since(model)
        controller = None if model is None else plan_save(
            model, total=capacity, within=self._time_left(called, layout.file_size),
            settings=PlanSettings(deadline_policy=cfg.deadline_policy), read_slo=cfg.read_slo,
            disk=self._disk(), lead=cfg.chunk_size * cfg.queue_depth,
            min_rate=cfg.adaptive.min_rate, written_since=written_since)
        if controller is not None:
            rate = 0.0  # the controller sets the pace
        start_fill = model.fill_at(written=written_since) if model else 0.0
        # A pruned checkpoint's file, written over: no blocks to allocate, none to discard.
        recycled = cfg.recycle and claim_spare(self.directory, self.rank, tmp)
        try:
            out = engine.open_output(tmp, capacity, engine=cfg.engine, direct=cfg.direct,
                                     existing=recycled)
        except BaseException:
            _unlink(tmp)  # created (or claimed), then the space reservation failed (ENOSPC)
            raise
        # Buffered (no O_DIRECT here): the drive takes the save's bytes when the page cache
        # flushes them, not as they complete, so its counter would count them again as
        # another writer's. Only the save's own bytes are counted then.
        counted_disk = self._disk() if out.direct else None
        if controller is not None:
            controller.disk = counted_disk
        write_start, began = time.perf_counter(), time.time()
        try:
            with controller or contextlib.nullcontext():
                data = out.write(self._staging.view(layout.header_size, capacity),
                                 layout.header_size, chunk_size=cfg.chunk_size,
                                 queue_depth=cfg.queue_depth, rate=rate,
                                 crc_bounds=layout.segment_bounds(), interval=cfg.interval,
                                 control=controller.control if controller else None,
                                 paced_chunk_size=cfg.paced_chunk_size)
            ended, data_end, full_at = time.time(), time.perf_counter(), time.monotonic()
            if model is not None:  # what the drive takes from here on fills the next estimate
                self._disk_mark = (ended, disk_bytes_written(counted_disk))
            header = header_bytes(layout, data["crcs"])
            self._staging.view(0, layout.header_size)[:] = np.frombuffer(header, np.uint8)
            head = out.write(self._staging.view(0, layout.header_size), 0,
                             chunk_size=cfg.chunk_size, queue_depth=cfg.queue_depth)
            sync_s = out.commit(layout.file_size)
        except BaseException:
            out.close()
            _unlink(tmp)
            raise
        committed = time.perf_counter()
        final = step_dir.rank_file(self.rank, self.world_size)
        os.replace(tmp, final)
        fsync_dir(step_dir.path)
        marker = {"file": final.name, "size": layout.file_size, "step": step_dir.step,
                  "rank": self.rank, "world_size": self.world_size,
                  "header_crc32c": f"{engine.crc32c(header):08x}", "time": time.time()}
        atomic_write_text(step_dir.marker(self.rank, self.world_size), json.dumps(marker))
        self._prune_s = 0.0
        if self.rank == 0:
            self._finish_step(step_dir, layout.file_size)
        report = self._report(step_dir.step, final, layout, data, head, stall, waited, sync_s,
                              time.perf_counter() - committed)
        if model is not None:
            report.pacing = self.learner.learn(
                model, controller, data, total=capacity, start_fill=start_fill, ended=ended,
                written_since=written_since, began=began, full_at=full_at,
                deadline=cfg.within)
            self._tail_s = time.perf_counter() - data_end - self._prune_s
        report.snapshot_mode = "cow" if cow is not None else "copy"
        report.cow = cow
        report.write_start_s = write_start - called
        report.recycled = recycled
        with self._lock:
            self.reports.append(report)
        return report

    def _time_left(self, called: float, file_size: int) -> Optional[float]:
        """rate="auto": seconds the data write has to finish by ``within`` (counted from the
        save() call), less the time already gone and what the save does after its data
        (header, sync, commit, and removing the oldest checkpoint where ``keep`` will)."""
        if self.config.within is None:
            return None
        tail = self._tail_s
        keep = self.config.keep
        if self.rank == 0 and keep is not None and sum(
                c.complete for c in list_checkpoints(self.directory)) >= keep:
            tail += self._prune_s_per_byte * file_size
        left = self.config.within - (time.perf_counter() - called) - tail
        return max(left, 1e-3)

    def _written_since(self, model: Optional[WriteModel]) -> float:
        """Bytes the drive took since this writer's last save ended its data (this writer's
        header, sync and pruning, other processes' writes), where the model's fill estimate
        dates from then: they fill the drive's cache too. 0 when unknown."""
        mark = self._disk_mark
        if model is None or mark is None or mark[1] is None or model.fill_time != mark[0]:
            return 0.0
        now = disk_bytes_written(self._disk())
        return float(max(0, now - mark[1])) if now is not None else 0.0

    def _disk(self) -> Optional[str]:
        if self._disk_name is None:
            try:
                self._disk_name = device_of(self.directory, health=False).name or ""
            except OSError:
                self._disk_name = ""
        return self._disk_name or None

    def _finish_step(self, step_dir: StepDir, file_size: int) -> None:
        """Rank 0: once every rank's marker is there, point ``latest`` at it and prune."""
        deadline = time.monotonic() + self.config.commit_timeout
        while True:
            info = inspect_step(step_dir.path)
            if info is not None and info.complete:
                break
            if time.monotonic() > deadline:
                missing = info.missing_ranks if info else list(range(self.world_size))
                raise TimeoutError(f"checkpoint step {step_dir.step}: ranks {missing} did not "
                                   f"commit within {self.config.commit_timeout} s; the step "
                                   f"stays incomplete")
            time.sleep(_POLL_S)
        write_latest(self.directory, info)
        started = time.perf_counter()
        if prune(self.directory, self.config.keep, gradual=self._online_discard,
                 newest=step_dir.step, recycle=self.config.recycle):
            self._prune_s = time.perf_counter() - started
            self._prune_s_per_byte = self._prune_s / max(file_size, 1)

    def _report(self, step: int, path: Path, layout: Layout, data: dict, head: dict,
                stall: float, waited: float, sync_s: float, commit_s: float) -> SaveReport:
        latency = LatencyHistogram.from_core(data)
        cfg = self.config
        return SaveReport(
            step=step, path=path, bytes=layout.file_size, stall_s=stall, busy_wait_s=waited,
            write_s=data["seconds"] + head["seconds"], sync_s=sync_s, commit_s=commit_s,
            paused_s=data["paused"], rate_mode=cfg.rate_mode,
            target_rate=cfg.pacing(layout.data_size), final_rate=data["final_rate"],
            peak_rate=data["peak"], sustained_rate=data["sustained"], engine=data["engine"],
            direct=data["direct"], chunk_size=cfg.chunk_size, queue_depth=cfg.queue_depth,
            latency=latency, timeline=[tuple(row) for row in data["timeline"]])

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a save is still being written."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> Optional[SaveReport]:
        """Wait for the save in progress (if any); raise its error; return its report."""
        handle = self._pending
        return handle.result() if handle is not None else None

    def close(self) -> None:
        """Wait for every save, free the staging memory, and raise a background error that
        nobody collected."""
        if self._closed:
            return
        self._closed = True
        self.learner.interrupt()
        try:
            self._executor.shutdown(wait=True)
            self._remove_spares()
        finally:
            self._lock_file.release()
        self._staging.release()
        self._raise_unobserved(self._pending)

    def _remove_spares(self) -> None:
        """A finished writer leaves only checkpoints: its rank's spare goes, and on rank 0
        every rank's (rank 0 prunes, so it makes the other ranks' spares, often after those
        ranks have closed). Also with recycle=False: an earlier run's spares."""
        try:
            remove_spares(self.directory, None if self.rank == 0 else self.rank,
                          gradual=self._online_discard)
        except OSError as exn:  # spares are scratch space: never fail a close over one
            log.warning("flashstream: could not remove the spare checkpoint file: %s", exn)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CheckpointWriter({str(self.directory)!r}, rank={self.rank}/{self.world_size},"
                f" rate={self.config.rate!r}, keep={self.config.keep})")


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

