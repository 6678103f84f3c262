from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import flashstream  # noqa: E402
from flashstream import settings  # noqa: E402
from flashstream.stream.index import CACHE_ENV  # noqa: E402

# Scanned shard indexes go to a cache of this test session, never the user's ~/.cache (child
# processes inherit it).
os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="flashstream-index-cache-")



@pytest.fixture(autouse=True)
def own_drive_caches(tmp_path, monkeypatch):
    """Probe results and drive write models (under XDG_CACHE_HOME) are per test: a test never
    reads nor teaches the user's, and rate="auto" saves start from an unknown drive."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


ENGINES = ["uring", "threads", "python"]

# -- one suite, every engine ------------------------------------------------------------------
# `pytest -q` runs everything on the default engine (auto). `.ci/run` then runs the suite again
# once per other engine, as FLASHSTREAM_ENGINE=<engine> pytest --per-engine, which leaves out:
#  - modules that move no bytes through an engine (ENGINE_INDEPENDENT, or the marker
#    `engine_independent`): they would only repeat themselves;
#  - tests that take the `engine` fixture: they already run on every engine;
#  - tests marked `timing`: assertions on wall time or rates, kept to the one default run, where
#    they are already at the mercy of a shared machine;
#  - tests marked `machine_wide`: they check state every process shares (what is left in
#    /dev/shm), so they cannot run beside another session, as the per-engine reruns do;
#  - on the python engine, tests marked `native_engine`: they check what only the C++ engines
#    do (the header-hopping index scan, for one), which the python engine leaves to a full scan.

#: Test modules that do not read or write through the engine in force (settings.engine), and
#: test_entry_points.py: smoke runs of the examples and benchmarks, which check that the scripts
#: run (the engines' behaviour is what the other modules rerun).
ENGINE_INDEPENDENT = {
    "test_cow_snapshot.py", "test_decompress.py", "test_device.py", "test_emulation.py",
    "test_entry_points.py", "test_fio.py", "test_histogram.py", "test_keys.py", "test_layers.py",
    "test_learning.py", "test_pacing.py", "test_settings.py",
}


def pytest_addoption(parser):
    parser.addoption("--per-engine", action="store_true",
                     help="rerun only the engine-dependent tests, on FLASHSTREAM_ENGINE "
                          "(see tests/conftest.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "engine_independent: moves no bytes through an engine; "
                                       "not rerun per engine")
    config.addinivalue_line("markers", "timing: asserts on wall time or rates; run once, on "
                                       "the default engine, never in --per-engine reruns")
    config.addinivalue_line("markers", "native_engine: checks what only the C++ engines do; not "
                                       "rerun on the python engine")
    config.addinivalue_line("markers", "machine_wide: checks state every process shares; not in "
                                       "the per-engine reruns, which run side by side")


def _engine_independent(item) -> bool:
    return (item.path.name in ENGINE_INDEPENDENT or "benchmarks" in item.path.parts
            or item.get_closest_marker("engine_independent") is not None)


def _drives_the_emulator(item) -> bool:
    """Whether the test runs an emulated drive (flashstream.emulation.DriveEmulator)."""
    code = getattr(getattr(item, "function", None), "__code__", None)
    return code is not None and "DriveEmulator" in code.co_names + code.co_varnames


def pytest_collection_modifyitems(config, items):
    # An emulated drive's cache fills from every writer of the disk it runs on, as a real
    # drive's does: on a shared machine another tenant's burst can fill it under a test.
    # Such a test gets a second run (pytest-rerunfailures; the summary lists each rerun); a
    # fault of the code fails both.
    if config.pluginmanager.hasplugin("rerunfailures"):
        for item in items:
            if _drives_the_emulator(item):
                item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=2))
    if not config.getoption("--per-engine"):
        return
    if not os.environ.get("FLASHSTREAM_ENGINE"):
        raise pytest.UsageError("--per-engine reruns the suite on FLASHSTREAM_ENGINE: set it")
    python = os.environ["FLASHSTREAM_ENGINE"] == "python"
    keep, drop = [], []
    for item in items:
        rerun = not (_engine_independent(item) or "engine" in getattr(item, "fixturenames", ())
                     or item.get_closest_marker("timing") is not None
                     or item.get_closest_marker("machine_wide") is not None
                     or (python and item.get_closest_marker("native_engine") is not None))
        (keep if rerun else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
PEER_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "peer-data" / "webdataset"


def child_env() -> dict:
    """Environment for a child Python that must import the flashstream these tests import."""
    return dict(os.environ, PYTHONPATH=str(Path(flashstream.__file__).resolve().parents[1]))


def available_engines():
    return [e for e in ENGINES if e != "uring" or flashstream.uring_available()]


@pytest.fixture(params=ENGINES)
def engine(request):
    """Runs a test once per engine; uring is skipped where the kernel or seccomp refuses it."""
    if request.param == "uring" and not flashstream.uring_available():
        pytest.skip("io_uring is not available in this process")
    with settings.override(engine=request.param):
        yield request.param


def direct_io_works(directory: Path) -> bool:
    probe = directory / ".odirect-probe"
    probe.write_bytes(b"x" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    os.close(fd)
    return True


@pytest.fixture
def no_direct_dir(tmp_path):
    """A directory whose filesystem refuses O_DIRECT: a ramfs we mount (root), else /dev/shm
    where the kernel's tmpfs still refuses it (tmpfs accepts O_DIRECT since Linux 6.6)."""
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "none", str(mount_point)],
                      capture_output=True).returncode == 0:
        yield mount_point
        subprocess.run(["umount", str(mount_point)], check=False)
        return
    shm = Path("/dev/shm") / f"flashstream-test-{os.getpid()}"
    shm.mkdir(exist_ok=True)
    try:
        if direct_io_works(shm):
            pytest.skip("no filesystem here refuses O_DIRECT (need root for ramfs)")
        yield shm
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def small_fs(tmp_path):
    """A factory for a size-limited tmpfs (root only; skips otherwise): small_fs("8m")."""
    mounts = []

    def mount(size: str) -> Path:
        point = tmp_path / f"small-fs-{len(mounts)}"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "none",
                                 str(point)], capture_output=True)
        if result.returncode != 0:
            pytest.skip("mounting a size-limited tmpfs needs root")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", str(point)], check=False)


@pytest.fixture
def peer_data():
    if not PEER_DATA.is_dir():
        pytest.skip(f"peer data not found at {PEER_DATA}")
    return PEER_DATA
