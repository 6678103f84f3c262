"""A memory cgroup that caps what one process may keep in memory, its page cache included.

rag_qps.py serves an index larger than the memory the serving process may cache the way a
RAG service meets one in production: the kernel charges the page cache a process brings in to
the process's memory cgroup, and reclaims within the group's limit. The group is made under
this process's own memory cgroup (cgroup v1's memory controller, or cgroup v2's memory.max),
needs root, and is removed afterwards; the serving process joins it itself before it loads
anything, then sets the limit from its own memory other than the page cache (see
_rag_serve.py).

    cap = MemoryCap.create()            # in the benchmark
    ... child: MemoryCap(path).join(); cap.set_limit(cap.uncached() + room)
    cap.remove()
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Dict, Optional

__all__ = ["MemoryCap", "memcap_support"]

PREFIX = "flashstream-rag-"
V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


def _own_group(version: str) -> Path:
    """This process's memory cgroup directory."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == "v1" and "memory" in controllers.split(",")) or (
                version == "v2" and controllers == ""):
            root = V1_ROOT if version == "v1" else V2_ROOT
            return root / path.lstrip("/")
    raise RuntimeError(f"no {version} memory cgroup in /proc/self/cgroup")


def memcap_support() -> Optional[str]:
    """"v1" or "v2" when a memory cgroup can be made here (root, a memory controller), else
    None."""
    if os.geteuid() != 0:
        return None
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        return "v1"
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return "v2"
    return None


class MemoryCap:
    """One memory cgroup (``path``); ``create()`` makes a new one under this process's."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.version = "v1" if (self.path / "memory.limit_in_bytes").exists() else "v2"

    @classmethod
    def create(cls) -> MemoryCap:
        version = memcap_support()
        if version is None:
            raise PermissionError("a memory cgroup needs root and a memory controller")
        parent = _own_group(version)
        for stale in parent.glob(f"{PREFIX}*"):  # left by a killed run
            with contextlib.suppress(OSError):
                stale.rmdir()
        if version == "v2":
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text("+memory")
        path = parent / f"{PREFIX}{os.getpid()}-{time.monotonic_ns()}"
        path.mkdir()
        return cls(path)

    def join(self, pid: Optional[int] = None) -> None:
        """Move a process (default: this one) into the group; what it brings into memory from
        now on is charged here."""
        (self.path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def set_limit(self, limit: int) -> None:
        name = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
        (self.path / name).write_text(str(int(limit)))

    def stat(self) -> Dict[str, int]:
        out = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, value = line.split()
            out[key] = int(value)
        return out

    def anon(self) -> int:
        """Anonymous memory charged here (the processes' own, not their page cache)."""
        stat = self.stat()
        return stat["total_rss"] if self.version == "v1" else stat["anon"]

    def uncached(self) -> int:
        """Everything charged here but the page cache: anonymous and kernel memory (page
        tables, slabs), which the limit has to leave room for as well."""
        usage = self.usage()
        return usage["usage"] - usage["cache"]

    def usage(self) -> Dict[str, int]:
        """Charged bytes now and at the peak, page cache, and how often the limit was hit."""
        stat = self.stat()
        if self.version == "v1":
            read = lambda name: int((self.path / name).read_text())  # noqa: E731
            return {"usage": read("memory.usage_in_bytes"),
                    "peak": read("memory.max_usage_in_bytes"),
                    "cache": stat["total_cache"], "anon": stat["total_rss"],
                    "limit_hits": read("memory.failcnt")}
        peak = self.path / "memory.peak"
        events = dict(line.split() for line in
                      (self.path / "memory.events").read_text().splitlines())
        return {"usage": int((self.path / "memory.current").read_text()),
                "peak": int(peak.read_text()) if peak.exists() else None,
                "cache": stat["file"], "anon": stat["anon"],
                "limit_hits": int(events.get("max", 0))}

    def remove(self) -> None:
        """Delete the group (its processes must have exited; their charges move up)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # the last process is still exiting
        self.path.rmdir()
