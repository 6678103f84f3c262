"""The fio baseline's command line, its pacing, and reading its result."""

from __future__ import annotations

import subprocess
import time

import pytest
from conftest import direct_io_works

from flashstream.telemetry import fio
from flashstream.telemetry.fio import fio_available, fio_command, fio_result

needs_fio = pytest.mark.skipif(not fio_available(), reason="fio is not installed")


def test_the_command_paces_and_writes_its_json_where_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(fio.shutil, "which", lambda _name: "/usr/bin/fio")
    out = tmp_path / "out.json"
    cmd = fio_command([tmp_path / "a:b.bin"], rw="write", bs="1M", iodepth=8,
                      end_fsync=True, size=4 << 20, rate=2.5e6, output=out)
    assert "--rate=2500000" in cmd and f"--output={out}" in cmd
    assert "--end_fsync=1" in cmd and "--size=4194304" in cmd and "--direct=1" in cmd
    assert any(a.startswith("--filename=") and a.endswith("a\\:b.bin") for a in cmd)


def test_bad_arguments_are_refused_with_the_allowed_values(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="read, write, randread, randwrite"):
        fio_command([tmp_path / "f"], rw="trim")
    with pytest.raises(ValueError, match="positive"):
        fio_command([tmp_path / "f"], rw="write", rate=0)
    monkeypatch.setattr(fio.shutil, "which", lambda _name: None)
    with pytest.raises(RuntimeError, match="apt-get install -y fio"):
        fio_command([tmp_path / "f"], rw="write")
    assert fio.run_fio([tmp_path / "f"], rw="write") is None
    with pytest.raises(ValueError, match="randwrite"):  # refused with or without fio
        fio.run_fio([tmp_path / "f"], rw="trim")


@pytest.mark.timing
@needs_fio
def test_a_paced_write_takes_as_long_as_its_rate_says(tmp_path):
    """8 MiB at 16 MiB/s: 7/16 s (the first request goes at once), where the drive alone
    takes a few milliseconds."""
    if not direct_io_works(tmp_path):
        pytest.skip("O_DIRECT is refused here")
    out = tmp_path / "out.json"
    cmd = fio_command([tmp_path / "paced.bin"], rw="write", bs="1M", iodepth=8,
                      size=8 << 20, rate=16 << 20, output=out)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    result = fio_result(out.read_text(), cmd)
    assert result["bytes"] == 8 << 20
    assert seconds >= 0.4 and result["seconds"] >= 0.4  # fio's own clock agrees
    assert result["runtime_s"] >= 0.4
    assert result["gbps"] <= 1.25 * (16 << 20) / 1e9
    assert (tmp_path / "paced.bin").stat().st_size == 8 << 20
