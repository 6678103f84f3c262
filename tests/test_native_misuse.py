"""The native core under misuse: fork(), views kept past close(), fed buffers resized, two threads.

The failures these guard against were a segfault or a hang, so the risky parts run in a child
Python with a timeout: a regression fails the test instead of killing or stalling the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import child_env

from flashstream.engine import Scanner

HERE = Path(__file__).resolve().parent


def run_child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout, env=child_env(),
                          cwd=HERE)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom((3 << 20) + 4321))
    return path


def test_a_forked_child_is_refused_and_the_parent_reads_on(data_file, engine):
    """Before: the child segfaulted joining threads it does not have (threads), or reaped the
    parent's completions from the shared ring so the parent hung in next() forever (uring)."""
    done = subprocess.run([sys.executable, str(HERE / "fork_check.py"), engine, str(data_file)],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result == {"child_signal": 0, "child_exit": 0, "parent_equal": True}, done.stderr


READ_VIEWS_AFTER_CLOSE = """
    import sys
    from flashstream import settings
    from flashstream.engine import TO_END, open_reader

    path, engine = sys.argv[1], sys.argv[2]
    data = open(path, "rb").read()
    reader = open_reader([(path, 0, TO_END)],
                         settings.resolve(engine=engine, chunk_size=1 << 20, queue_depth=4))
    first = reader.next()   # a buffer since handed back to the reader
    second = reader.next()  # the buffer the reader still holds
    reader.close()
    del reader
    assert first[2].nbytes == second[2].nbytes == 1 << 20
    assert bytes(second[2]) == data[1 << 20:2 << 20]
    assert len(bytes(first[2])) == 1 << 20  # readable (it may hold a later chunk's bytes)
    print("ok")
"""


def assert_child_ok(script: str, data_file, kind: str) -> None:
    """Runs ``script`` on ``data_file`` with the C++ engine ``kind``; it must print "ok"."""
    import flashstream

    if kind == "uring" and not flashstream.uring_available():
        pytest.skip("io_uring is not available in this process")
    done = run_child(script, str(data_file), kind)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("kind", ["uring", "threads"])
def test_views_stay_readable_after_close(data_file, kind):
    """Before: close() freed the chunk buffers, and a view read afterwards hit freed memory."""
    assert_child_ok(READ_VIEWS_AFTER_CLOSE, data_file, kind)


def test_closed_reader_refuses_use(data_file, engine):
    from flashstream import settings
    from flashstream.engine import TO_END, open_reader

    reader = open_reader([(str(data_file), 0, TO_END)], settings.resolve(engine=engine))
    reader.next()
    reader.close()
    reader.close()  # idempotent
    if engine != "python":
        assert reader.closed
        assert reader.stats()["bytes_read"] > 0  # statistics outlive close()
        with pytest.raises(ValueError, match="closed"):
            reader.next()
        with pytest.raises(ValueError, match="closed"):
            reader.skip_extent()


NEXT_AGAINST_CLOSE = """
    import sys, threading
    from flashstream import settings
    from flashstream.engine import TO_END, open_reader

    path, engine = sys.argv[1], sys.argv[2]
    for attempt in range(40):
        reader = open_reader([(path, 0, TO_END)] * 8,
                             settings.resolve(engine=engine, chunk_size=4096, queue_depth=16))
        errors, chunks = [], []
        def consume():
            try:
                while (chunk := reader.next()) is not None:
                    chunks.append(bytes(chunk[2][:16]))
            except ValueError as exn:
                errors.append(str(exn))
        worker = threading.Thread(target=consume)
        worker.start()
        reader.close()  # while the other thread is in next(): waits for it, then closes
        worker.join()
        assert all("closed" in e for e in errors), errors
    print("ok")
"""


@pytest.mark.parametrize("kind", ["uring", "threads"])
def test_close_while_another_thread_reads(data_file, kind):
    """Before: close() freed the reader while next() ran on another thread without the GIL."""
    assert_child_ok(NEXT_AGAINST_CLOSE, data_file, kind)


def _member(name: str, payload: bytes) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
        end = tar.offset  # header and padded data, without the end-of-archive blocks
    return buf.getvalue()[:end]


def test_a_fed_buffer_cannot_be_resized_while_samples_point_into_it():
    """Before: feed() kept the object but not its buffer export, so resizing a bytearray before
    take() freed the memory the samples pointed into (garbage or a crash)."""
    payload = os.urandom(100_000)
    fed = bytearray(_member("s1.bin", payload) + _member("s2.bin", b"x"))
    scanner = Scanner()
    scanner.begin_shard("mem", None, 0)
    scanner.feed(fed)
    with pytest.raises(BufferError):
        fed.extend(b"\0" * (1 << 20))  # would move the bytes the samples point into
    [sample] = scanner.take()
    assert sample["bin"] == payload
    scanner.end_shard()
    assert [s["bin"] for s in scanner.take()] == [b"x"]
    fed.extend(b"\0" * 1024)  # every sample taken: the export is gone


def test_a_second_feed_keeps_the_first_buffer_alive():
    """Samples of two feeds not yet taken point into both buffers."""
    a, b, c = os.urandom(50_000), os.urandom(60_000), os.urandom(70_000)
    first = bytearray(_member("a.bin", a) + _member("b.bin", b))
    second = bytearray(_member("c.bin", c) + _member("d.bin", b"d"))
    scanner = Scanner()
    scanner.begin_shard("mem", None, 0)
    scanner.feed(first)  # completes a, in place in `first`
    scanner.feed(second)  # completes b and c
    with pytest.raises(BufferError):
        first.extend(b"\0" * (1 << 20))
    assert [s["bin"] for s in scanner.take()] == [a, b, c]
    first.extend(b"\0")
