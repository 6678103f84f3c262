"""device_of: the real device under tmp_path, fake sysfs/proc trees, a fake nvme-cli, real loop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Optional

import pytest

from flashstream.telemetry import device as device_mod
from flashstream.telemetry import nvme_health as nvme_health_mod
from flashstream.telemetry.device import DeviceInfo, device_of, format_device, online_discard


def dev_string(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


# --- the real machine ---------------------------------------------------------------------------

def test_tmp_path_resolves_to_its_device(tmp_path):
    info = device_of(tmp_path, health=False)
    assert info.dev == dev_string(tmp_path)
    assert info.path == str(tmp_path)
    assert info.mountpoint is None or str(tmp_path.resolve()).startswith(info.mountpoint)
    if info.kind == "virtual":
        pytest.skip(f"tmp_path is on {info.fstype}, not a block device")
    assert info.kind in ("disk", "dm", "md", "loop")
    lbs = info.logical_block_size
    assert lbs is not None and lbs >= 512 and lbs & (lbs - 1) == 0
    assert info.physical_block_size is None or info.physical_block_size >= lbs
    assert info.size_bytes and info.size_bytes > 0
    assert info.name and info.fstype
    json.dumps(info.to_dict())
    assert info.name in format_device(info)


def test_tmpfs_is_virtual_without_error():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        if os.major(os.stat(f.name).st_dev) != 0:
            pytest.skip("/dev/shm is not a virtual filesystem here")
        info = device_of(f.name)
    assert info.kind == "virtual"
    assert info.fstype == "tmpfs"
    assert info.logical_block_size is None and info.name is None
    assert info.nvme_health["status"] == "not available"
    assert "virtual" in format_device(info)


def test_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        device_of(tmp_path / "nope")


def test_unknown_kind_names_the_allowed_ones():
    with pytest.raises(ValueError, match="disk, dm, md, loop, virtual"):
        DeviceInfo(path="/", dev="0:0", kind="tape")


# --- fake sysfs / proc trees --------------------------------------------------------------------

class FakeSystem:
    """A /sys and /proc under tmp_path; real st_dev numbers are mapped onto fake devices."""

    def __init__(self, root: Path):
        self.sys = root / "sys"
        self.proc = root / "proc"
        (self.proc / "self").mkdir(parents=True)
        self.mountinfo: list = []

    def block(self, devpath: str, attrs: Optional[Dict[str, str]] = None) -> Path:
        """A device dir under sys/devices, its attribute files, and its sys/class/block link."""
        node = self.sys / "devices" / devpath
        node.mkdir(parents=True, exist_ok=True)
        for rel, text in (attrs or {}).items():
            (node / rel).parent.mkdir(parents=True, exist_ok=True)
            (node / rel).write_text(text + "\n")
        link = self.sys / "class" / "block" / node.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(node)
        return node

    def map_dev(self, dev: str, node: Path) -> None:
        link = self.sys / "dev" / "block" / dev
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(node)

    def slave(self, holder: Path, below: Path) -> None:
        (holder / "slaves").mkdir(exist_ok=True)
        (holder / "slaves" / below.name).symlink_to(below)

    def mount(self, dev: str, mountpoint: str, fstype: str, source: str,
              super_options: str = "rw") -> None:
        escaped = mountpoint.replace("\\", "\\134").replace(" ", "\\040")
        n = len(self.mountinfo) + 20
        self.mountinfo.append(f"{n} 1 {dev} / {escaped} rw,relatime shared:{n} - {fstype} "
                              f"{source} {super_options}")
        (self.proc / "self" / "mountinfo").write_text("\n".join(self.mountinfo) + "\n")

    def device_of(self, path, **kwargs) -> DeviceInfo:
        kwargs.setdefault("health", False)
        return device_of(path, sysfs_root=str(self.sys), proc_root=str(self.proc), **kwargs)


DISK_ATTRS = {
    "size": "2097152",
    "serial": "FAKE123",
    "device/model": "Fake Flash 2TB   ",
    "device/vendor": "0x1234",
    "queue/logical_block_size": "4096",
    "queue/physical_block_size": "4096",
    "queue/max_sectors_kb": "1280",
    "queue/max_hw_sectors_kb": "2048",
    "queue/nr_requests": "1023",
    "queue/scheduler": "none [mq-deadline] kyber",
    "queue/rotational": "0",
}


@pytest.fixture
def fake(tmp_path):
    return FakeSystem(tmp_path / "fake")


@pytest.fixture
def target(tmp_path):
    """A real file whose real st_dev the fake tree maps; its dir has a space (mountinfo \\040)."""
    d = tmp_path / "data dir"
    d.mkdir()
    f = d / "shard.tar"
    f.write_bytes(b"x")
    return f


def test_partition_resolves_to_its_disk(fake, target):
    disk = fake.block("pci0000:00/0000:00:04.0/block/fakedisk", DISK_ATTRS)
    part = fake.block("pci0000:00/0000:00:04.0/block/fakedisk/fakedisk1",
                      {"partition": "1", "size": "2000000"})
    fake.map_dev(dev_string(target), part)
    fake.mount("259:1", "/", "ext4", "/dev/other")
    fake.mount(dev_string(target), str(target.parent), "xfs", "/dev/fakedisk1")
    info = fake.device_of(target)
    assert (info.kind, info.name, info.partition) == ("disk", "fakedisk", "fakedisk1")
    assert info.dev == dev_string(target)
    assert info.size_bytes == 2097152 * 512
    assert info.model == "Fake Flash 2TB" and info.vendor == "0x1234" and info.serial == "FAKE123"
    assert (info.logical_block_size, info.physical_block_size) == (4096, 4096)
    assert (info.max_request_bytes, info.max_hw_request_bytes) == (1280 * 1024, 2048 * 1024)
    assert (info.queue_depth, info.scheduler, info.rotational) == (1023, "mq-deadline", False)
    assert (info.fstype, info.mountpoint, info.source) == ("xfs", str(target.parent),
                                                           "/dev/fakedisk1")
    assert info.slaves == () and info.backing is None
    assert disk.name in format_device(info)


@pytest.mark.parametrize("options, expected", [
    ("rw,discard,errors=remount-ro", True), ("rw,discard=sync", True),
    ("rw,discard=async,ssd", False), ("rw,nodiscard", False), ("rw", False)])
def test_online_discard_is_read_from_the_mount_options(fake, target, options, expected):
    fake.mount("259:1", "/", "ext4", "/dev/other", "rw,discard")
    fake.mount(dev_string(target), str(target.parent), "xfs", "/dev/fakedisk1", options)
    assert online_discard(target, proc_root=str(fake.proc)) is expected
    assert online_discard(target.parent / "missing", proc_root=str(fake.proc)) is False


def test_a_mount_path_that_is_not_utf8_spoils_nothing(fake, target):
    fake.mount(dev_string(target), str(target.parent), "xfs", "/dev/fakedisk1", "rw,discard")
    info = fake.proc / "self" / "mountinfo"
    odd = b"77 1 259:9 / /mnt/caf\xe9 rw,relatime - ext4 /dev/odd rw\n"
    info.write_bytes(odd + info.read_bytes())
    assert online_discard(target, proc_root=str(fake.proc)) is True


def test_unreadable_attributes_are_none(fake, target):
    disk = fake.block("virtual/block/bare", {"size": "8", "queue/logical_block_size": "junk"})
    fake.map_dev(dev_string(target), disk)
    info = fake.device_of(target)
    assert (info.kind, info.size_bytes) == ("disk", 4096)
    assert info.logical_block_size is None and info.model is None and info.scheduler is None
    assert info.fstype is None  # an empty mountinfo
    format_device(info)


def test_dm_reports_slaves_and_the_disks_under_them(fake, target):
    sda = fake.block("pci0000:00/ata1/block/sda", DISK_ATTRS)
    sda1 = fake.block("pci0000:00/ata1/block/sda/sda1", {"partition": "1"})
    sdb = fake.block("pci0000:00/ata2/block/sdb", DISK_ATTRS)
    crypt = fake.block("virtual/block/dm-0", {"dm/name": "luks-sdb", "size": "100"})
    fake.slave(crypt, sdb)
    lvm = fake.block("virtual/block/dm-1", {"dm/name": "vg-data", "size": "200",
                                            "queue/scheduler": "none"})
    fake.slave(lvm, sda1)
    fake.slave(lvm, crypt)
    fake.map_dev(dev_string(target), lvm)
    info = fake.device_of(target)
    assert (info.kind, info.name, info.dm_name) == ("dm", "dm-1", "vg-data")
    assert info.slaves == ("dm-0", "sda1")
    assert info.disks == ("sda", "sdb")
    assert info.scheduler == "none" and info.transport == "dm"
    assert device_mod._transport("sda", str(sda)) == "ata"
    assert info.to_dict()["slaves"] == ["dm-0", "sda1"]


def test_md_reports_slaves(fake, target):
    md = fake.block("virtual/block/md0", {"md/level": "raid1", "size": "64"})
    for name in ("nvme0n1", "nvme1n1"):
        fake.slave(md, fake.block(f"pci0000:00/{name}/block/{name}", DISK_ATTRS))
    fake.map_dev(dev_string(target), md)
    info = fake.device_of(target)
    assert (info.kind, info.slaves, info.disks) == ("md", ("nvme0n1", "nvme1n1"),
                                                    ("nvme0n1", "nvme1n1"))


def test_loop_follows_its_backing_file(fake, target):
    """A file on a fake loop0 whose backing file lives on a fake partition of a fake disk."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm as a second filesystem")
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as on_loop:
        if dev_string(Path(on_loop.name)) == dev_string(target):
            pytest.skip("/dev/shm and tmp_path are one filesystem here")
        loop = fake.block("virtual/block/loop0", {"size": "2048",
                                                  "loop/backing_file": str(target)})
        fake.map_dev(dev_string(Path(on_loop.name)), loop)
        fake.block("pci0000:00/block/fakedisk", DISK_ATTRS)
        part = fake.block("pci0000:00/block/fakedisk/fakedisk2", {"partition": "2"})
        fake.map_dev(dev_string(target), part)
        info = fake.device_of(on_loop.name)
    assert (info.kind, info.name, info.backing_file) == ("loop", "loop0", str(target))
    assert info.backing is not None
    assert (info.backing.name, info.backing.partition) == ("fakedisk", "fakedisk2")
    assert json.loads(json.dumps(info.to_dict()))["backing"]["name"] == "fakedisk"
    assert "backing:" in format_device(info)


def test_loop_cycle_stops(fake, target):
    loop = fake.block("virtual/block/loop3", {"loop/backing_file": str(target)})
    fake.map_dev(dev_string(target), loop)
    info = fake.device_of(target)
    assert info.kind == "loop" and info.backing_file == str(target) and info.backing is None


def test_anonymous_dev_resolves_through_mount_source(fake, target):
    """btrfs gives files a major-0 st_dev; the mount's source still names the partition."""
    fake.block("pci0000:00/block/fakedisk", DISK_ATTRS)
    fake.block("pci0000:00/block/fakedisk/fakedisk3", {"partition": "3"})
    fake.mount("0:55", str(target.parent), "btrfs", "/dev/fakedisk3")
    info = fake.device_of(target)
    assert (info.kind, info.name, info.partition, info.fstype) == (
        "disk", "fakedisk", "fakedisk3", "btrfs")
    assert info.dev == dev_string(target)


def test_virtual_mount_keeps_its_fstype(fake, target):
    fake.mount("0:56", str(target.parent), "zfs", "tank/data")
    info = fake.device_of(target)
    assert (info.kind, info.fstype, info.source) == ("virtual", "zfs", "tank/data")
    assert info.mountpoint == str(target.parent)


# --- NVMe health through a fake nvme-cli --------------------------------------------------------

def fake_nvme(bin_dir: Path, body: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvme"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def nvme_target(fake, target):
    node = fake.block("pci0000:00/nvme/nvme0/nvme0n1", DISK_ATTRS)
    fake.map_dev(dev_string(target), node)
    return target


NVME_1X = {"critical_warning": 0, "temperature": 310, "percent_used": 3,
           "data_units_written": 1000, "power_on_hours": 42}
NVME_2X = {"critical_warning": {"value": 0}, "temperature": 37, "percentage_used": 3,
           "data_units_written": "1000", "power_on_hours": "42"}


@pytest.mark.parametrize("log", [NVME_1X, NVME_2X], ids=["nvme-cli-1", "nvme-cli-2"])
def test_nvme_health_from_fake_cli(fake, nvme_target, tmp_path, monkeypatch, log):
    args = tmp_path / "args"
    log_file = tmp_path / "log.json"
    log_file.write_text(json.dumps(log))
    fake_nvme(tmp_path / "bin", f'echo "$@" > "{args}"\ncat "{log_file}"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    health = fake.device_of(nvme_target, health=True).nvme_health
    assert args.read_text().split() == ["smart-log", "/dev/nvme0n1", "-o", "json"]
    assert health == {"status": "ok", "device": "/dev/nvme0n1", "percent_used": 3,
                      "data_units_written": 1000, "bytes_written": 512_000_000,
                      "temperature_c": 37, "critical_warning": 0, "power_on_hours": 42}


@pytest.mark.parametrize("body, reason", [
    ('echo "permission denied" >&2; exit 1', "exited 1: permission denied"),
    ("echo not json", "did not print a JSON object"),
    ("exec sleep 10", "took longer than"),
])
def test_nvme_cli_failures_are_not_available(fake, nvme_target, tmp_path, monkeypatch, body,
                                             reason):
    fake_nvme(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(nvme_health_mod, "NVME_TIMEOUT_S", 0.5)
    health = fake.device_of(nvme_target, health=True).nvme_health
    assert health["status"] == "not available"
    assert reason in health["reason"]


def test_nvme_cli_missing_is_not_available(fake, nvme_target, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    health = fake.device_of(nvme_target, health=True).nvme_health
    assert health == {"status": "not available",
                      "reason": "nvme-cli is not installed (no 'nvme' on PATH)"}


def test_non_nvme_is_not_available(fake, target):
    fake.map_dev(dev_string(target), fake.block("virtual/block/vdz", DISK_ATTRS))
    health = fake.device_of(target, health=True).nvme_health
    assert health == {"status": "not available", "reason": "vdz is not an NVMe device"}


# --- a real loop device, where this machine lets us make one ------------------------------------

def run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout


def test_real_loop_device(tmp_path):
    if not all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount", "umount")):
        pytest.skip("losetup, mkfs.ext4, mount or umount is missing")
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    try:
        node = run("losetup", "-f", "--show", str(image)).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"losetup refused: {exc}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = False
    try:
        info = device_of(node, health=False)
        assert (info.kind, info.name) == ("loop", os.path.basename(node))
        assert info.size_bytes == 32 << 20
        assert info.backing_file == str(image.resolve())
        assert info.backing is not None and info.backing.dev == dev_string(image)
        try:
            run("mkfs.ext4", "-q", node)
            run("mount", node, str(mnt))
            mounted = True
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot make or mount ext4 on {node}: {exc}")
        (mnt / "f").write_bytes(b"x")
        on_fs = device_of(mnt / "f", health=False)
        assert (on_fs.kind, on_fs.name, on_fs.fstype) == ("loop", info.name, "ext4")
        assert on_fs.mountpoint == str(mnt.resolve()) and on_fs.dev == dev_string(mnt / "f")
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False, timeout=60)
        subprocess.run(["losetup", "-d", node], check=False, timeout=60)
