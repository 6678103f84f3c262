"""A block-I/O throttling group: the kernel mechanism the drive emulator drives.

cgroup v1's ``blkio.throttle.{read,write}_bps_device`` or cgroup v2's ``io.max``, detected at
run time; either needs root. The group is created per emulator, limits are rewritten as the
emulated cache fills and drains, and :meth:`ThrottleGroup.remove` moves every task back where it
came from and deletes the group (it is called from ``finally`` blocks; groups left by a killed
run are removed by the next one).

What the throttle slows: direct and synchronous I/O issued by tasks in the group. On cgroup v1,
buffered writeback is issued by the kernel's flusher threads and is not slowed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil

__all__ = ["SLICE_S", "ThrottleGroup", "ThrottleUnavailable", "throttle_support"]

PREFIX = "flashstream-emu-"

#: The kernel's throttling slice (blk-throttle's ``DFL_THROTL_SLICE``, HZ/10; kernels before
#: 6.10 took HZ/50 on non-rotational disks). Each new limit, read or write, restarts the
#: slices of both directions, and each slice lets its ``limit x slice`` bytes through at
#: once: a throttled writer runs in bursts.
SLICE_S = 0.1
V1_ROOT = Path("/sys/fs/cgroup/blkio")
V2_ROOT = Path("/sys/fs/cgroup")


class ThrottleUnavailable(RuntimeError):
    """No writable cgroup block-I/O throttle here (not root, or no such controller)."""


def throttle_support(v1_root: Path = V1_ROOT, v2_root: Path = V2_ROOT) -> Optional[str]:
    """"v1" or "v2" when a block-I/O throttle can be used here, else None."""
    if (v1_root / "blkio.throttle.write_bps_device").exists() and os.access(v1_root, os.W_OK):
        return "v1"
    controllers = v2_root / "cgroup.controllers"
    if controllers.exists() and "io" in controllers.read_text().split() and os.access(
            v2_root, os.W_OK):
        return "v2"
    return None


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _ids(path: Path) -> List[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except FileNotFoundError:
        return []


class ThrottleGroup:
    """One throttling group for one block device (``"MAJ:MIN"`` of a whole disk)."""

    def __init__(self, device: str, *, v1_root: Path = V1_ROOT, v2_root: Path = V2_ROOT) -> None:
        self.version = throttle_support(v1_root, v2_root)
        if self.version is None:
            raise ThrottleUnavailable(
                "no writable cgroup block-I/O throttle: the drive emulator needs root and "
                f"cgroup v1's blkio controller ({v1_root}) or cgroup v2's io controller "
                f"({v2_root}/cgroup.controllers)")
        self.device = device
        self.root = v1_root if self.version == "v1" else v2_root
        self._homes: Dict[int, Path] = {}  # v2: each process's cgroup before it was added
        remove_stale(self.root, self.version)
        if self.version == "v2":
            with contextlib.suppress(OSError):  # already enabled, or the kernel refuses
                _write(self.root / "cgroup.subtree_control", "+io")
        serial = 0
        while True:
            self.path = self.root / f"{PREFIX}{os.getpid()}-{serial}"
            try:
                self.path.mkdir()
                break
            except FileExistsError:
                serial += 1
        self._limits = (0.0, 0.0)

    # -- limits ---------------------------------------------------------------------------
    def set_limits(self, read_bps: float, write_bps: float) -> None:
        """Bytes/s for reads and writes of the group's tasks on the device; 0: unlimited."""
        read_bps, write_bps = int(max(0.0, read_bps)), int(max(0.0, write_bps))
        if (read_bps, write_bps) == self._limits:
            return
        if self.version == "v1":
            # Writing 0 removes the rule.
            _write(self.path / "blkio.throttle.read_bps_device", f"{self.device} {read_bps}")
            _write(self.path / "blkio.throttle.write_bps_device", f"{self.device} {write_bps}")
        else:
            def v2(value: int) -> str:
                return str(value) if value else "max"
            _write(self.path / "io.max",
                   f"{self.device} rbps={v2(read_bps)} wbps={v2(write_bps)}")
        self._limits = (read_bps, write_bps)

    @property
    def limits(self):
        return self._limits

    # -- members --------------------------------------------------------------------------
    def add_process(self, pid: int) -> None:
        """Moves a process (all its threads) into the group."""
        if self.version == "v2":
            self._homes.setdefault(pid, _v2_cgroup_of(pid, self.root))
        _write(self.path / "cgroup.procs", str(pid))

    def add_thread(self, tid: int) -> None:
        """Moves one thread into the group (cgroup v1 only: v2's io controller is not
        threaded)."""
        if self.version != "v1":
            raise ThrottleUnavailable("placing single threads needs cgroup v1's blkio "
                                      "controller; use add_process on cgroup v2")
        _write(self.path / "tasks", str(tid))

    def members(self) -> List[int]:
        return _ids(self.path / ("tasks" if self.version == "v1" else "cgroup.procs"))

    # -- removal --------------------------------------------------------------------------
    def remove(self) -> None:
        """Moves every task back and deletes the group. Safe to call twice."""
        if not self.path.exists():
            return
        _evacuate(self.path, self.root, self.version, self._homes)


def _v2_cgroup_of(pid: int, root: Path) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return root


def _evacuate(group: Path, root: Path, version: Optional[str],
              homes: Optional[Dict[int, Path]] = None) -> None:
    homes = homes or {}
    member_file = "tasks" if version == "v1" else "cgroup.procs"
    for attempt in range(50):
        for task in _ids(group / member_file):
            home = homes.get(task, root)
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                try:
                    _write(home / member_file, str(task))
                except OSError as exn:
                    if exn.errno != errno.ESRCH:
                        _write(root / member_file, str(task))
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exn:
            if exn.errno != errno.EBUSY or attempt == 49:
                raise
            time.sleep(0.02)  # a task exiting or being moved; try again


def remove_stale(root: Path, version: str) -> None:
    """Removes groups that emulators killed before cleaning up left behind."""
    for group in root.glob(f"{PREFIX}*"):
        try:
            owner = int(group.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if owner != os.getpid() and not psutil.pid_exists(owner):
            with contextlib.suppress(OSError):
                _evacuate(group, root, version)
