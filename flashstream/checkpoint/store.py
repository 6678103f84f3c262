"""The checkpoint directory: names, commit markers, the ``latest`` pointer, retention.

::

    <directory>/
        step-000000100/
            rank-00000-of-00002.safetensors     one file per rank
            rank-00000-of-00002.done            that rank's commit marker (JSON)
            rank-00001-of-00002.safetensors
            rank-00001-of-00002.done
        latest                                  "step-000000100": newest complete checkpoint
        .spare-rank-00000                       a pruned checkpoint's file, kept for the
                                                rank's next save to write over (recycle=True)

A rank's file is written under a temporary name, synced, renamed, and the directory synced;
only then is its marker written (the same way). A checkpoint is complete when every rank's
marker exists, and only complete checkpoints are ever loaded: a crash at any moment leaves at
worst an incomplete step directory or a temporary file, which later saves clean up.

Recycling: pruning a checkpoint renames its files to spares (markers first, so the step is
incomplete before any file leaves it) instead of freeing their blocks, and the rank's next save
renames its spare to its temporary name and writes over it. The drive then never sees the
discards of a large delete nor the extent conversions of writing a new file, both of which
hold up reads beside them (docs/checkpoint.md and benchmarks/reads_beside_writes.py give the
figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import List, Optional, Tuple, Union

from ..mappings import mappings_of

__all__ = ["CheckpointInfo", "StepDir", "atomic_write_text", "by_commit",
           "claim_spare", "fsync_dir", "list_checkpoints", "newest_complete", "prune",
           "read_latest", "remove_spares", "remove_stale_temporaries", "spare_file",
           "write_latest"]

PathLike = Union[str, os.PathLike]
_STEP = re.compile(r"^step-(\d+)$")
_MARKER = re.compile(r"^rank-(\d+)-of-(\d+)\.done$")
_RANK_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.safetensors$")
_SPARE = re.compile(r"^\.spare-rank-(\d+)$")
TEMP_SUFFIX = ".tmp"


def fsync_dir(path: PathLike) -> None:
    """Make renames and creations inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: temporary file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclasses.dataclass(frozen=True)
class StepDir:
    """Names inside one step's directory."""

    root: Path
    step: int

    @property
    def path(self) -> Path:
        return self.root / f"step-{self.step:09d}"

    def rank_file(self, rank: int, world_size: int) -> Path:
        return self.path / f"rank-{rank:05d}-of-{world_size:05d}.safetensors"

    def marker(self, rank: int, world_size: int) -> Path:
        return self.path / f"rank-{rank:05d}-of-{world_size:05d}.done"

    def temp_file(self, rank: int, world_size: int) -> Path:
        final = self.rank_file(rank, world_size)
        return final.with_name(f".{final.name}.{os.getpid()}{TEMP_SUFFIX}")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One step directory and whether every rank committed."""

    step: int
    path: Path
    world_size: Optional[int]  # None when no rank has committed yet
    committed_ranks: tuple
    committed_at: float = 0.0  # time.time() of the last rank's commit (0: none yet)

    @property
    def complete(self) -> bool:
        return self.world_size is not None and len(self.committed_ranks) == self.world_size

    @property
    def missing_ranks(self) -> List[int]:
        if self.world_size is None:
            return []
        return sorted(set(range(self.world_size)) - set(self.committed_ranks))

    def rank_file(self, rank: int) -> Path:
        assert self.world_size is not None
        return StepDir(self.path.parent, self.step).rank_file(rank, self.world_size)

    def marker(self, rank: int) -> dict:
        """The rank's commit marker (file name, size, header checksum)."""
        assert self.world_size is not None
        path = StepDir(self.path.parent, self.step).marker(rank, self.world_size)
        return json.loads(path.read_text(encoding="utf-8"))


def inspect_step(path: Path) -> Optional[CheckpointInfo]:
    match = _STEP.match(path.name)
    if not match or not path.is_dir():
        return None
    world: Optional[int] = None
    ranks = set()
    names = []
    for name in os.listdir(path):
        m = _MARKER.match(name)
        if m:
            rank, size = int(m.group(1)), int(m.group(2))
            if world is None or size == world:  # markers of another world size: stale
                world = size
                ranks.add(rank)
                names.append(name)
    committed = max((_commit_time(path / name) for name in names), default=0.0)
    return CheckpointInfo(int(match.group(1)), path, world, tuple(sorted(ranks)), committed)


def _commit_time(marker: Path) -> float:
    """When a rank committed: its marker's recorded time, else the marker file's mtime."""
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8")).get("time")
        if isinstance(recorded, (int, float)):
            return float(recorded)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return marker.stat().st_mtime
    except OSError:
        return 0.0


def by_commit(checkpoints: List[CheckpointInfo]) -> List[CheckpointInfo]:
    """Complete checkpoints, first committed first. After a rollback (a run resumed from an
    older step) the new run's checkpoints are the newest, whatever their step numbers."""
    return sorted((c for c in checkpoints if c.complete),
                  key=lambda c: (c.committed_at, c.step))


def list_checkpoints(directory: PathLike) -> List[CheckpointInfo]:
    """Every step directory under ``directory``, oldest first, complete or not."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [inspect_step(root / name) for name in os.listdir(root)]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def newest_complete(directory: PathLike) -> Optional[CheckpointInfo]:
    """The last complete checkpoint committed: the one ``latest`` names when it is complete
    (the writer points it at each commit), else the last by the markers' commit times (see
    :func:`by_commit`)."""
    checkpoints = list_checkpoints(directory)
    named = read_latest(directory)
    for c in checkpoints:
        if c.complete and c.path.name == named:
            return c
    complete = by_commit(checkpoints)
    return complete[-1] if complete else None


def read_latest(directory: PathLike) -> Optional[str]:
    try:
        return (Path(directory) / "latest").read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def write_latest(directory: PathLike, info: CheckpointInfo) -> None:
    atomic_write_text(Path(directory) / "latest", info.path.name + "\n")


#: Bytes freed per step by a gradual removal: small enough that reads beside it keep their
#: tail latency on a filesystem with online discard, where one unlink of a large file stalls
#: them (benchmarks/reads_beside_writes.py measures both).
TRIM_SLICE = 8 << 20


def remove_step(path: Path, *, gradual: bool = False, recycle: bool = False) -> None:
    """Markers first, so a removal cut short leaves an incomplete step, never a broken one.

    ``gradual``: shrink each large file by :data:`TRIM_SLICE` at a time, syncing each step,
    before unlinking it. On a filesystem mounted with online discard, freeing a whole
    checkpoint at once sends the drive one long discard, and reads on it queue behind that;
    in slices the discards interleave with the reads. It takes about as long as the unlink.

    ``recycle``: each rank's file becomes that rank's spare (:func:`spare_file`) where the rank
    has none yet, to be written over by its next save; nothing is freed. A file some process of
    this machine has open or mapped is never recycled (writing over it would change the bytes
    under that reader): it is removed like the rest; so is every file when some process could
    not be looked at.
    """
    for name in sorted(os.listdir(path)):
        if _MARKER.match(name):
            os.unlink(path / name)
    if gradual or recycle:
        files = [path / name for name in sorted(os.listdir(path))]
        busy, seen_all = _open_elsewhere(files)
        left = [f for f in files
                if f in busy or not (recycle and seen_all and _to_spare(f))]
        if gradual:
            _shrink_idle(left, busy)
    shutil.rmtree(path, ignore_errors=True)


def spare_file(directory: PathLike, rank: int) -> Path:
    """Where a pruned checkpoint's file for ``rank`` waits to be written over."""
    return Path(directory) / f".spare-rank-{rank:05d}"


def _to_spare(file: Path) -> bool:
    """Rename a rank's checkpoint file to that rank's spare, unless the rank has one, or the
    file has another name too (a hard link someone kept: writing over it would change that
    copy, which an unlink leaves whole)."""
    match = _RANK_FILE.match(file.name)
    try:
        if not match or os.lstat(file).st_nlink != 1:
            return False
    except OSError:
        return False
    spare = spare_file(file.parent.parent, int(match.group(1)))
    if spare.exists():
        return False
    try:
        os.rename(file, spare)
    except OSError:
        return False
    return True


def claim_spare(directory: PathLike, rank: int, target: Path) -> bool:
    """Move ``rank``'s spare (if any) to ``target``, a temporary name of the next save.
    Atomic: of two claimers one gets the file, the other False. A reader that opened the
    pruned file after the pruning's scan and before its rename still holds it: looked for again
    here, and such a file is unlinked (whole, for that reader) instead of written over."""
    try:
        os.rename(spare_file(directory, rank), target)
    except FileNotFoundError:
        return False
    busy, seen_all = _open_elsewhere([target])
    if busy or not seen_all:
        os.unlink(target)
        return False
    return True


def remove_spares(directory: PathLike, rank: Optional[int] = None, *,
                  gradual: bool = False) -> List[Path]:
    """Delete ``rank``'s spare under ``directory`` (None: every rank's); ``gradual`` as in
    :func:`remove_step`. Returns what was removed."""
    root = Path(directory)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    spares = [root / name for name in names if (match := _SPARE.match(name))
              and (rank is None or int(match.group(1)) == rank)]
    return _remove_files(spares, gradual)


def _remove_files(files: List[Path], gradual: bool) -> List[Path]:
    """Unlink ``files`` (already gone is fine); ``gradual``: shrink them first, as
    :func:`remove_step` does. Returns ``files``."""
    if gradual and files:
        _shrink_idle(files, _open_elsewhere(files)[0])
    for file in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)
    return files


def _shrink_idle(files: List[Path], busy: set) -> None:
    """Shrink each of ``files`` a slice at a time before it is unlinked, except those some
    process has open or mapped (``busy``): shrinking a file another process maps would SIGBUS
    it, while an unlinked file keeps its bytes for that reader; nor one with another name (see
    :func:`_shrink`). Failures leave the rest to the unlink."""
    for file in files:
        if file not in busy:
            with contextlib.suppress(OSError):
                _shrink(file)


def _open_elsewhere(files: List[Path], proc: str = "/proc") -> Tuple[set, bool]:
    """(those of ``files`` that a process of this machine has open or mapped, whether every
    process could be looked at). An eval job that loaded with mmap=True, a loader mid-read:
    such files are unlinked whole, which keeps their data for those readers; shrinking them
    would cut it away under them, writing over them would change it. A process whose open
    files this one may not list (another user's, without root) leaves the answer incomplete:
    any file might be its."""
    stats = {}
    for file in files:
        with contextlib.suppress(OSError):
            stats[file] = os.stat(file)
    ids = {(st.st_dev, st.st_ino): file for file, st in stats.items()}
    busy: set = set()
    complete = True
    if not ids:
        return busy, complete
    for pid in filter(str.isdigit, os.listdir(proc)):
        maps = os.path.join(proc, pid, "maps")
        busy.update(f for f, st in stats.items() if f not in busy and mappings_of(st, maps))
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            complete = False
            continue
        except OSError:
            continue  # the process has exited
        for fd in fds:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(fd_dir, fd))
                if (st.st_dev, st.st_ino) in ids:
                    busy.add(ids[(st.st_dev, st.st_ino)])
    return busy, complete


def _shrink(file: Path) -> None:
    fd = os.open(file, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        # A file with another name (a hard-linked copy someone kept: cp -al, rsync
        # --link-dest) is only unlinked: shrinking it would cut that copy short.
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return
        size = st.st_size
        while size > TRIM_SLICE:
            size -= TRIM_SLICE
            os.ftruncate(fd, size)
            os.fdatasync(fd)  # commits the journal, which issues this slice's discard now
    finally:
        os.close(fd)


def prune(directory: PathLike, keep: Optional[int], *, gradual: bool = False,
          newest: Optional[int] = None, recycle: bool = False) -> List[Path]:
    """Keep the newest ``keep`` complete checkpoints; remove older ones and older incomplete
    leftovers. Incomplete steps newer than the newest complete one may still be in progress
    on other ranks and are left alone. Returns what was removed. ``gradual``: see
    :func:`remove_step`. ``newest``: the step just committed, the newest whatever the
    markers' clocks say (they come from other hosts and runs), so it is never removed.
    ``recycle``: a complete checkpoint's files become spares (see :func:`remove_step`)."""
    checkpoints = list_checkpoints(directory)
    complete = by_commit(checkpoints)
    if newest is not None:
        complete = ([c for c in complete if c.step != newest]
                    + [c for c in complete if c.step == newest])
    if not complete:
        return []
    newest = complete[-1].step
    keep_steps = {c.step for c in complete[-keep:]} if keep else {c.step for c in complete}
    removed = []
    for c in checkpoints:
        # Complete ones beyond `keep` by commit time (after a rollback, the abandoned run's
        # higher steps go first); incomplete ones only below the newest step committed.
        if c.step in keep_steps or (not c.complete and c.step >= newest):
            continue
        remove_step(c.path, gradual=gradual, recycle=recycle and c.complete)
        removed.append(c.path)
    return removed


def remove_stale_temporaries(directory: PathLike, rank: int, *,
                             gradual: bool = False) -> List[Path]:
    """Delete temporary files a killed earlier run of this rank left behind (call it holding
    the rank's writer lock, checkpoint/writer_lock.py: then no live writer owns them);
    ``gradual`` as in :func:`remove_step`: such a file is often a whole checkpoint's size (a
    claimed spare, or a new file reserved in full before the kill). Returns what was
    removed."""
    prefix = f".rank-{rank:05d}-of-"
    stale = [info.path / name for info in list_checkpoints(directory)
             for name in sorted(os.listdir(info.path))
             if name.startswith(prefix) and name.endswith(TEMP_SUFFIX)]
    return _remove_files(stale, gradual)
