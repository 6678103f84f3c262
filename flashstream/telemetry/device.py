"""Which block device is behind a path, and what the kernel and nvme-cli say about it.

``device_of(path)`` goes ``os.stat(path).st_dev`` -> ``/sys/dev/block/MAJ:MIN`` -> the whole disk
(through partitions), and for stacked devices also down to what they stack on: device-mapper and
md slaves, and the file behind a loop device. A path with no block device behind it (tmpfs,
overlay, nfs, zfs) gives ``kind="virtual"`` and never an error. Every sysfs attribute is read
on its own, so one unreadable file gives ``None`` for that field and nothing else.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..sizes import format_size
from .nvme_health import not_available, nvme_health

__all__ = ["KINDS", "DeviceInfo", "device_of", "format_device", "online_discard"]

KINDS = ("disk", "dm", "md", "loop", "virtual")
# dm/md stacks deeper than this are cut off rather than followed: real stacks are 2-3 deep
# (LVM on LUKS on a partition), and a cycle in a fake or racing sysfs must not recurse forever.
_MAX_DEPTH = 8


@dataclass(frozen=True)
class DeviceInfo:
    """What is known about the block device behind ``path``; ``None`` where it is not readable."""

    path: str
    dev: str
    kind: str
    name: Optional[str] = None
    partition: Optional[str] = None
    dm_name: Optional[str] = None
    model: Optional[str] = None
    vendor: Optional[str] = None
    serial: Optional[str] = None
    size_bytes: Optional[int] = None
    rotational: Optional[bool] = None
    logical_block_size: Optional[int] = None
    physical_block_size: Optional[int] = None
    max_request_bytes: Optional[int] = None
    max_hw_request_bytes: Optional[int] = None
    queue_depth: Optional[int] = None
    scheduler: Optional[str] = None
    transport: Optional[str] = None
    fstype: Optional[str] = None
    mountpoint: Optional[str] = None
    source: Optional[str] = None
    slaves: Tuple[str, ...] = ()
    disks: Tuple[str, ...] = ()
    backing_file: Optional[str] = None
    backing: Optional[DeviceInfo] = None
    # A dict is not hashable; leaving it out of hash/eq keeps DeviceInfo usable as a dict key.
    nvme_health: Dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-ready dict (tuples become lists, ``backing`` a nested dict)."""
        out = dataclasses.asdict(self)
        out["slaves"] = list(self.slaves)
        out["disks"] = list(self.disks)
        out["backing"] = self.backing.to_dict() if self.backing else None
        return out


@dataclass(frozen=True)
class _Mount:
    dev: str
    mountpoint: str
    fstype: str
    source: str
    options: Tuple[str, ...] = ()  # the mount's own and the superblock's


@dataclass(frozen=True)
class _Roots:
    """Where to read from; tests point sysfs and proc at fake trees in tmp_path."""

    sysfs: str
    proc: str
    health: bool


def device_of(path: str | os.PathLike, *, sysfs_root: str = "/sys", proc_root: str = "/proc",
              health: bool = True) -> DeviceInfo:
    """Describe the block device that holds ``path`` (or that ``path`` is, for a device node).

    ``health=False`` skips running ``nvme smart-log``. Raises ``OSError`` only when ``path``
    itself cannot be stat'ed; everything after that degrades to ``None`` fields.
    """
    return _device_of(os.fspath(path), _Roots(sysfs_root, proc_root, health), seen=())


def online_discard(path: str | os.PathLike, *, proc_root: str = "/proc") -> bool:
    """Whether the filesystem holding ``path`` discards (TRIMs) freed blocks as it frees them:
    mounted with ``discard`` (ext4, xfs; btrfs's ``discard=async`` queues them instead). Then
    removing a large file sends the drive one long discard that reads queue behind
    (benchmarks/reads_beside_writes.py measures it). False when it cannot be told."""
    try:
        dev, is_node = _dev_of(os.fspath(path))
    except OSError:
        return False
    mount = _mount_for(_mounts(proc_root), os.path.realpath(path), dev, is_node)
    return mount is not None and any(o in ("discard", "discard=sync") for o in mount.options)


def _dev_of(path: str) -> Tuple[str, bool]:
    """("MAJ:MIN", is a device node) for ``path``."""
    st = os.stat(path)
    # A device node's own st_dev is devtmpfs; the device it names is st_rdev.
    is_node = stat.S_ISBLK(st.st_mode)
    number = st.st_rdev if is_node else st.st_dev
    return f"{os.major(number)}:{os.minor(number)}", is_node


def _device_of(path: str, roots: _Roots, seen: Tuple[str, ...]) -> DeviceInfo:
    dev, is_node = _dev_of(path)
    mount = _mount_for(_mounts(roots.proc), os.path.realpath(path), dev, is_node)
    mount_fields = {
        "fstype": mount.fstype if mount else None,
        "mountpoint": mount.mountpoint if mount else None,
        "source": mount.source if mount else None,
    }
    sys_dir = _sysfs_dir(roots.sysfs, dev) or _source_dir(roots.sysfs, mount)
    if sys_dir is None:
        return DeviceInfo(path=path, dev=dev, kind="virtual", nvme_health=not_available(
            "no block device behind this path"), **mount_fields)
    return _block_info(path, dev, sys_dir, mount_fields, roots, seen + (dev,))


def _block_info(path: str, dev: str, sys_dir: str, mount_fields: Dict[str, Any], roots: _Roots,
                seen: Tuple[str, ...]) -> DeviceInfo:
    disk_dir, partition = _whole_disk(sys_dir)
    name = os.path.basename(disk_dir)
    kind = _kind(disk_dir, name)
    slaves = _slaves(disk_dir) if kind in ("dm", "md") else ()
    backing_file = _read(os.path.join(disk_dir, "loop", "backing_file"))
    return DeviceInfo(
        path=path, dev=dev, kind=kind, name=name, partition=partition,
        dm_name=_read(os.path.join(disk_dir, "dm", "name")),
        **_identity(disk_dir), **_queue(disk_dir),
        # sysfs "size" counts 512-byte sectors whatever the logical block size is.
        size_bytes=_read_int(os.path.join(disk_dir, "size"), 512),
        transport=_transport(name, disk_dir), **mount_fields,
        slaves=slaves, disks=_underlying_disks(disk_dir, depth=0) if slaves else (),
        backing_file=backing_file, backing=_backing(backing_file, roots, seen),
        nvme_health=nvme_health(name) if roots.health else not_available("health=False"),
    )


# --- sysfs -------------------------------------------------------------------------------------

def _read(path: str) -> Optional[str]:
    """One sysfs attribute as stripped text; ``None`` if missing, unreadable or empty."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return None
    return text or None


def _read_int(path: str, scale: int = 1) -> Optional[int]:
    text = _read(path)
    try:
        return int(text) * scale if text is not None else None
    except ValueError:
        return None


def _sysfs_dir(sysfs: str, dev: str) -> Optional[str]:
    link = os.path.join(sysfs, "dev", "block", dev)
    return os.path.realpath(link) if os.path.isdir(link) else None


def _source_dir(sysfs: str, mount: Optional[_Mount]) -> Optional[str]:
    """btrfs gives files an anonymous st_dev (major 0); its mount source still names the disk."""
    if mount is None or not mount.source.startswith("/dev/"):
        return None
    # /dev/mapper/vg-root is a link to ../dm-0, and sysfs knows the device as dm-0.
    name = os.path.basename(os.path.realpath(mount.source))
    link = os.path.join(sysfs, "class", "block", name)
    return os.path.realpath(link) if os.path.isdir(link) else None


def _whole_disk(sys_dir: str) -> Tuple[str, Optional[str]]:
    """(disk dir, partition name or None): a partition's sysfs dir sits inside its disk's."""
    if os.path.exists(os.path.join(sys_dir, "partition")):
        return os.path.dirname(sys_dir), os.path.basename(sys_dir)
    return sys_dir, None


def _kind(disk_dir: str, name: str) -> str:
    for kind in ("dm", "md", "loop"):
        if os.path.isdir(os.path.join(disk_dir, kind)):
            return kind
    # An unbound loop device has no loop/ dir; its name still says what it is.
    return "loop" if name.startswith("loop") else "disk"


def _slaves(disk_dir: str) -> Tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(os.path.join(disk_dir, "slaves"))))
    except OSError:
        return ()


def _underlying_disks(disk_dir: str, depth: int) -> Tuple[str, ...]:
    """Whole disks at the bottom of a dm/md stack (LVM on LUKS on a partition -> the disk)."""
    found: List[str] = []
    for slave in _slaves(disk_dir):
        slave_disk, _ = _whole_disk(os.path.realpath(os.path.join(disk_dir, "slaves", slave)))
        name = os.path.basename(slave_disk)
        below = _underlying_disks(slave_disk, depth + 1) if depth < _MAX_DEPTH else ()
        found.extend(below or (name,))
    return tuple(sorted(set(found)))


def _identity(disk_dir: str) -> Dict[str, Optional[str]]:
    dev_dir = os.path.join(disk_dir, "device")
    return {
        "model": _read(os.path.join(dev_dir, "model")),
        # NVMe controllers have no vendor file of their own; their PCI function does.
        "vendor": _read(os.path.join(dev_dir, "vendor"))
        or _read(os.path.join(dev_dir, "device", "vendor")),
        # virtio-blk puts serial beside size; NVMe and some SCSI drivers under device/.
        "serial": _read(os.path.join(disk_dir, "serial")) or _read(os.path.join(dev_dir, "serial")),
    }


def _queue(disk_dir: str) -> Dict[str, Any]:
    q = os.path.join(disk_dir, "queue")
    rotational = _read_int(os.path.join(q, "rotational"))
    return {
        "rotational": bool(rotational) if rotational is not None else None,
        "logical_block_size": _read_int(os.path.join(q, "logical_block_size")),
        "physical_block_size": _read_int(os.path.join(q, "physical_block_size")),
        "max_request_bytes": _read_int(os.path.join(q, "max_sectors_kb"), 1024),
        "max_hw_request_bytes": _read_int(os.path.join(q, "max_hw_sectors_kb"), 1024),
        "queue_depth": _read_int(os.path.join(q, "nr_requests")),
        "scheduler": _scheduler(_read(os.path.join(q, "scheduler"))),
    }


def _scheduler(text: Optional[str]) -> Optional[str]:
    """The active scheduler is the bracketed one; dm devices print a bare ``none``."""
    if text is None:
        return None
    match = re.search(r"\[([^\]]+)\]", text)
    return match.group(1) if match else text.split()[0]


_NAME_TRANSPORTS = (("nvme", "nvme"), ("vd", "virtio"), ("xvd", "xen"), ("mmcblk", "mmc"),
                    ("loop", "loop"), ("dm-", "dm"), ("md", "md"), ("zram", "zram"),
                    ("nbd", "nbd"), ("rbd", "rbd"), ("pmem", "pmem"))


def _transport(name: str, disk_dir: str) -> Optional[str]:
    """A guess from the kernel name, then from where the disk hangs in the device tree."""
    for prefix, transport in _NAME_TRANSPORTS:
        if name.startswith(prefix):
            return transport
    # Only the part below /sys/devices counts: the tests' tmp_path could contain "/usb" too.
    where = "/" + os.path.realpath(disk_dir).split("/devices/", 1)[-1]
    for part, transport in (("/usb", "usb"), ("/ata", "ata"), ("/virtio", "virtio-scsi")):
        if part in where:
            return transport
    subsystem = os.path.join(disk_dir, "device", "subsystem")
    if os.path.islink(subsystem):
        return os.path.basename(os.readlink(subsystem))
    return "scsi" if name.startswith(("sd", "sr")) else None


def _backing(backing_file: Optional[str], roots: _Roots,
             seen: Tuple[str, ...]) -> Optional[DeviceInfo]:
    """The device under a loop device's file; ``None`` if deleted, unreachable or a cycle."""
    if backing_file is None:
        return None
    try:
        # The kernel refuses loop cycles, but a fake or racing sysfs could still show one.
        if _dev_of(backing_file)[0] in seen:
            return None
        return _device_of(backing_file, roots, seen)
    except OSError:  # "(deleted)" files, or a file in another mount namespace
        return None


# --- /proc/self/mountinfo ----------------------------------------------------------------------

def _unescape(field_text: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as \040-style octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def _mounts(proc: str) -> List[_Mount]:
    try:
        # surrogateescape: a mount path that is not UTF-8 decodes as os.fsdecode decodes the
        # paths it is compared with, instead of raising for the whole table
        with open(os.path.join(proc, "self", "mountinfo"), encoding="utf-8",
                  errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        # id parent MAJ:MIN root mountpoint options [optional...] - fstype source superoptions
        fields = line.split()
        sep = fields.index("-", 6) if "-" in fields[6:] else len(fields)
        if len(fields) < sep + 3:
            continue
        options = fields[5].split(",") + (fields[sep + 3].split(",") if len(fields) > sep + 3
                                          else [])
        mounts.append(_Mount(dev=fields[2], mountpoint=_unescape(fields[4]),
                             fstype=fields[sep + 1], source=_unescape(fields[sep + 2]),
                             options=tuple(options)))
    return mounts


def _under(target: str, mountpoint: str) -> bool:
    return mountpoint == "/" or target == mountpoint or target.startswith(mountpoint + "/")


def _mount_for(mounts: List[_Mount], target: str, dev: str, is_node: bool) -> Optional[_Mount]:
    """The mount that ``target`` lives on, or for a device node the mount of that device."""
    if is_node:
        return next((m for m in mounts if m.dev == dev), None)
    candidates = [(i, m) for i, m in enumerate(mounts) if _under(target, m.mountpoint)]
    # Same device first (a path under a btrfs subvolume has its own st_dev, so fall back to the
    # longest prefix), then the deepest mount point, then the latest: later mounts hide earlier.
    same = [c for c in candidates if c[1].dev == dev] or candidates
    if not same:
        return None
    return max(same, key=lambda c: (len(c[1].mountpoint), c[0]))[1]


# --- text --------------------------------------------------------------------------------------

def _size(n: Optional[int]) -> str:
    return "-" if n is None else f"{format_size(n)} ({n})"


def _health_text(health: Dict[str, Any]) -> str:
    if health.get("status") != "ok":
        return f"{health.get('status', '-')}: {health.get('reason', '')}"
    shown = (("percent_used", "wear {}%"), ("bytes_written", "{} written"),
             ("temperature_c", "{} C"), ("critical_warning", "critical_warning {}"),
             ("power_on_hours", "{} h powered on"))
    return ", ".join(text.format(_size(health[key]) if key == "bytes_written" else health[key])
                     for key, text in shown if health.get(key) is not None)


# Rows that only apply to some kinds; left out of the text when empty.
_OPTIONAL_ROWS = ("partition", "dm_name", "slaves", "disks", "backing_file")
_SIZE_ROWS = ("size_bytes", "max_request_bytes", "max_hw_request_bytes")


def _rows(info: DeviceInfo) -> List[Tuple[str, str]]:
    rows = []
    for name in (f.name for f in dataclasses.fields(info)):
        value = getattr(info, name)
        if name in ("backing", "nvme_health") or (name in _OPTIONAL_ROWS and not value):
            continue
        if name in _SIZE_ROWS:
            value = _size(value)
        rows.append((name, ", ".join(value) if isinstance(value, tuple) else
                     "-" if value is None else str(value)))
    return rows + [("nvme_health", _health_text(info.nvme_health))]


def format_device(info: DeviceInfo, *, indent: str = "") -> str:
    """A two-column text table of ``info`` for the CLI; a loop's backing device is indented."""
    lines = [f"{indent}{key:21s} {value}" for key, value in _rows(info)]
    if info.backing is not None:
        lines.append(f"{indent}backing:")
        lines.append(format_device(info.backing, indent=indent + "  "))
    return "\n".join(lines)
