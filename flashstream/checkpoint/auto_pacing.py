"""``rate="auto"`` for one CheckpointWriter: what it carries from one save to the next.

A save's data write is paced by a :class:`~flashstream.checkpoint.save_control.SaveController`
planned from the drive's write model. Between saves the writer keeps what that plan needs and
no single save knows: when the last save's data ended and how many bytes the drive had taken
then (other writers fill the cache too), how long a save's tail took (header, sync, commit,
pruning: ``within`` must leave it over), and the learner that refreshes the model after each
save (checkpoint/drive_learning.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Executor
from typing import Dict, Optional, Tuple

from ..telemetry.device import device_of
from ..telemetry.diskstats import disk_bytes_written
from ..telemetry.write_model import WriteModel, load_model
from .config import WriterConfig
from .drive_learning import DriveLearner
from .pacing import PlanSettings
from .save_control import SaveController, plan_save

__all__ = ["AutoPacing", "AutoSave"]

#: Seconds of a save's tail (header, sync, commit) before one was timed.
FIRST_TAIL_S = 0.2
# Seconds per byte of pruning an older checkpoint before one was timed, by how it is removed:
# unlinked at once (freeing its extents), a slice at a time on an online-discard filesystem
# (store.remove_step), or recycled (renames and a scan of /proc for readers: milliseconds
# whatever its size). Measured figures: docs/benchmarks.md, "Figures behind the defaults".
FIRST_PRUNE_S_PER_BYTE = 0.25e-9
FIRST_GRADUAL_PRUNE_S_PER_BYTE = 0.35e-9
FIRST_RECYCLE_S_PER_BYTE = 0.01e-9


@dataclasses.dataclass
class AutoSave:
    """One save's plan: the model it planned from, its controller, the bytes other writers
    gave the drive since the last save, and the cache fill it starts from. ``planned``: the
    model's figures as the save planned (the learner updates ``model`` after it)."""

    model: WriteModel
    controller: SaveController
    written_since: float
    start_fill: float
    planned: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)


class AutoPacing:
    """The writer's side of ``rate="auto"`` (see the module docstring); with another rate it
    only keeps the tail and pruning estimates (``time_left`` is for ``within``)."""

    def __init__(self, directory: os.PathLike, config: WriterConfig, executor: Executor, *,
                 online_discard: bool) -> None:
        self.directory, self.config = directory, config
        self.learner = DriveLearner(directory, executor)
        self.tail_s = FIRST_TAIL_S
        # (time.time(), the drive's written bytes) when the last save's data ended
        self.disk_mark: Optional[Tuple[float, Optional[int]]] = None
        self.prune_s_per_byte = (FIRST_RECYCLE_S_PER_BYTE if config.recycle
                                 else FIRST_GRADUAL_PRUNE_S_PER_BYTE if online_discard
                                 else FIRST_PRUNE_S_PER_BYTE)
        self.prune_s = 0.0  # the last save's pruning (part of its tail, timed apart)
        self._disk_name: Optional[str] = None

    def plan(self, *, capacity: int, time_left: Optional[float]) -> Optional[AutoSave]:
        """The plan of the save about to write ``capacity`` bytes (None: not rate="auto")."""
        cfg = self.config
        if cfg.rate != "auto":
            return None
        model = load_model(self.directory)
        written_since = self._written_since(model)
        controller = plan_save(
            model, total=capacity, within=time_left,
            settings=PlanSettings(deadline_policy=cfg.deadline_policy), read_slo=cfg.read_slo,
            disk=self.disk(), lead=cfg.chunk_size * cfg.queue_depth,
            min_rate=cfg.adaptive.min_rate, written_since=written_since)
        start_fill = model.fill_at(written=written_since)
        planned = {"fast_rate": model.fast_rate, "cache_size": model.cache_size,
                   "post_cache_rate": model.post_cache_rate,
                   "recovery_rate": model.planning_recovery, "fill": start_fill}
        return AutoSave(model, controller, written_since, start_fill, planned)

    def time_left(self, called: float, tail_extra: float) -> Optional[float]:
        """Seconds the data write has to finish by ``within`` (counted from the save() call,
        time.perf_counter()), less the time already gone and the save's tail (header, sync,
        commit), plus ``tail_extra`` (pruning the oldest checkpoint where ``keep`` will)."""
        if self.config.within is None:
            return None
        left = self.config.within - (time.perf_counter() - called) - self.tail_s - tail_extra
        return max(left, 1e-3)

    def data_ended(self, ended: float, disk: Optional[str]) -> None:
        """The save's data ended at ``ended`` (time.time()): what the drive takes from here
        on fills the next save's estimate."""
        self.disk_mark = (ended, disk_bytes_written(disk))

    def learn(self, save: AutoSave, data: dict, *, total: int, ended: float, began: float,
              full_at: float) -> Dict[str, object]:
        """After the commit: the model learns from this save (the report's ``pacing``, with
        the figures it planned from under ``"model"``)."""
        pacing = self.learner.learn(
            save.model, save.controller, data, total=total, start_fill=save.start_fill,
            ended=ended, written_since=save.written_since, began=began, full_at=full_at,
            deadline=self.config.within)
        pacing["model"] = save.planned
        return pacing

    def pruned(self, seconds: float, file_size: int) -> None:
        self.prune_s = seconds
        self.prune_s_per_byte = seconds / max(file_size, 1)

    def disk(self) -> Optional[str]:
        """The block device under the checkpoints (None: unknown)."""
        if self._disk_name is None:
            try:
                self._disk_name = device_of(self.directory, health=False).name or ""
            except OSError:
                self._disk_name = ""
        return self._disk_name or None

    def _written_since(self, model: WriteModel) -> float:
        """Bytes the drive took since this writer's last save ended its data (this writer's
        header, sync and pruning, other processes' writes), where the model's fill estimate
        dates from then: they fill the drive's cache too. 0 when unknown."""
        mark = self.disk_mark
        if mark is None or mark[1] is None or model.fill_time != mark[0]:
            return 0.0
        now = disk_bytes_written(self.disk())
        return float(max(0, now - mark[1])) if now is not None else 0.0
