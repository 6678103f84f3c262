"""CheckpointWriter: snapshot a state dict, return to training, write it in the background.

``save()`` blocks only while it copies the tensors into reused staging memory. A background
thread then writes that memory as one file per rank with large aligned O_DIRECT requests,
paced as configured (``rate="auto"``: auto_pacing.py), checksums every tensor, syncs, and
commits by rename (commit.py; store.py has the directory protocol, format.py the file format).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple, Union

import numpy as np

from .. import engine
from ..errors import SnapshotLostError
from ..sizes import parse_size
from ..telemetry.device import online_discard
from ..telemetry.diskstats import disk_bytes_written
from ..telemetry.histogram import LatencyHistogram
from ..world import process_group
from .arguments import check_directory_name, check_writable, step_number
from .auto_pacing import AutoPacing
from .commit import commit_rank_file, finish_step
from .config import WriterConfig
from .format import FORMAT_VERSION, HEADER_ALIGNMENT, Layout, assemble, header_bytes, plan
from .relayout import Plan, relayout
from .report import SaveReport
from .save_handle import SaveHandle
from .staging import StagingBuffer, lost_tensors, snapshot
from .store import (
    StepDir,
    claim_spare,
    fsync_dir,
    list_checkpoints,
    remove_spares,
    remove_stale_temporaries,
)
from .structure import flatten
from .writer_lock import WriterLock

__all__ = ["CheckpointWriter", "SaveHandle"]

log = logging.getLogger(__name__)


def _world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """This process's rank and the world size: given, else torch.distributed's, else 0 of 1."""
    group = process_group() if rank is None or world_size is None else None
    if group is not None:
        rank = group[0] if rank is None else rank
        world_size = group[1] if world_size is None else world_size
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
        check_directory_name(self.directory)
        self.rank, self.world_size = _world(rank, world_size)
        self._staging = StagingBuffer(pinned=pinned)
        reserved, planned = (None, None) if reserve is None else \
            _reserved(reserve, self._staging.alignment)
        self.directory.mkdir(parents=True, exist_ok=True)
        check_writable(self.directory)
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
        self._auto = AutoPacing(self.directory, self.config,
                                online_discard=self._online_discard)
        self._pending: Optional[SaveHandle] = None
        self._plan: Optional[Plan] = planned  # the last save's layout, for the next (relayout.py)
        self._lock = threading.Lock()
        self._closed = False
        self.reports: List[SaveReport] = []
        self.skipped = 0

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
        step = step_number(step)
        started = time.perf_counter()
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
        # A pruned checkpoint's file, written over: no blocks to allocate, none to discard.
        recycled = cfg.recycle and claim_spare(self.directory, self.rank, tmp)
        try:
            out = engine.open_output(tmp, capacity, engine=cfg.engine, direct=cfg.direct,
                                     existing=recycled)
        except BaseException:
            _unlink(tmp)  # created (or claimed), then the space reservation failed (ENOSPC)
            raise
        # Buffered (no O_DIRECT here), the drive takes the save's bytes when the page cache
        # flushes them, not as they complete, and its counter would count them again as
        # another writer's: only the save's own bytes are counted then.
        auto = self._auto.plan(capacity=capacity, time_left=self._time_left(
            called, layout.file_size), counted=out.direct)
        pacing = auto.pacing if auto is not None else None
        if pacing is not None:
            rate = 0.0  # the controller sets the pace
        write_start, drive_before = time.perf_counter(), disk_bytes_written(self._auto.disk())
        try:
            with pacing or contextlib.nullcontext():
                data = out.write(self._staging.view(layout.header_size, capacity),
                                 layout.header_size, chunk_size=cfg.chunk_size,
                                 queue_depth=cfg.queue_depth, rate=rate,
                                 crc_bounds=layout.segment_bounds(), interval=cfg.interval,
                                 control=pacing.control if pacing else None,
                                 paced_chunk_size=cfg.paced_chunk_size)
            ended, data_end = time.time(), time.perf_counter()
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
        final = commit_rank_file(step_dir, tmp, rank=self.rank, world_size=self.world_size,
                                 file_size=layout.file_size, header=header)
        self._auto.prune_s = 0.0
        if self.rank == 0:
            pruned = finish_step(self.directory, step_dir, world_size=self.world_size,
                                 timeout=cfg.commit_timeout, keep=cfg.keep,
                                 gradual=self._online_discard, recycle=cfg.recycle)
            if pruned is not None:
                self._auto.pruned(pruned, layout.file_size)
        report = self._report(step_dir.step, final, layout, data, head, stall, waited, sync_s,
                              time.perf_counter() - committed)
        drive_after = disk_bytes_written(self._auto.disk())
        if drive_before is not None and drive_after is not None:
            report.drive_bytes = drive_after - drive_before
        if auto is not None:
            report.pacing = self._auto.learn(auto, total=capacity, ended=ended)
            self._auto.tail_s = time.perf_counter() - data_end - self._auto.prune_s
        report.snapshot_mode = "cow" if cow is not None else "copy"
        report.cow = cow
        report.write_start_s = write_start - called
        report.recycled = recycled
        with self._lock:
            self.reports.append(report)
        return report

    def _time_left(self, called: float, file_size: int) -> Optional[float]:
        """rate="auto": seconds the data write has to finish by ``within`` (AutoPacing), with
        removing the oldest checkpoint in the save's tail where ``keep`` will."""
        keep = self.config.keep
        prunes = self.config.within is not None and self.rank == 0 and keep is not None and \
            sum(c.complete for c in list_checkpoints(self.directory)) >= keep
        return self._auto.time_left(
            called, self._auto.prune_s_per_byte * file_size if prunes else 0.0)

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
            latency=latency, timeline=[tuple(row) for row in data["timeline"]],
            written_bytes=int(data["bytes"]) + int(head["bytes"]))

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

