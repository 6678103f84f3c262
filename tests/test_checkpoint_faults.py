"""Crash safety: a full disk and SIGKILL at random moments never lose the previous checkpoint."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_child import state_for
from ckptgen import assert_same
from conftest import child_env

from flashstream import CheckpointWriter, list_checkpoints, load_checkpoint

CHILD = Path(__file__).with_name("ckpt_child.py")
KILL_ROUNDS = int(os.environ.get("FLASHSTREAM_KILL_ROUNDS", "12"))


def temporaries(directory: Path):
    return [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


def test_disk_full_raises_and_keeps_the_previous_checkpoint(small_fs):
    directory = small_fs("24m")
    small = {"w": torch.randn(2 << 20)}  # 8 MiB
    large = {"w": torch.randn(5 << 20)}  # 20 MiB: does not fit beside the first
    with CheckpointWriter(directory, keep=3) as writer:
        writer.save(small, step=1).result()
        with pytest.raises(OSError) as info:
            writer.save(large, step=2).result()
        assert info.value.errno == errno.ENOSPC and ".tmp" in str(info.value.filename)
        assert temporaries(directory) == []
        assert_same(small, load_checkpoint(directory))
        # An error nobody collected surfaces at the next save instead of vanishing.
        writer.save(large, step=3)
        with pytest.raises(RuntimeError, match="step 3 failed") as info:
            writer.save(small, step=4)
        assert isinstance(info.value.__cause__, OSError)
    assert [c.step for c in list_checkpoints(directory) if c.complete] == [1]
    assert_same(small, load_checkpoint(directory))


def test_sigkill_at_random_moments_never_loses_a_checkpoint(tmp_path):
    rng = random.Random(1234)
    directory = tmp_path / "ckpt"
    next_step, committed = 1, 0
    loads = 0
    for round_ in range(KILL_ROUNDS):
        keep, mode = 1 + round_ % 2, ("copy", "cow")[round_ // 2 % 2]
        child = subprocess.Popen([sys.executable, str(CHILD), str(directory), str(next_step),
                                  str(keep), mode], stdout=subprocess.PIPE, text=True,
                                 env=child_env())
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.6))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        reported = [int(line.split()[1]) for line in out.splitlines() if line.startswith("commit")]
        committed = max([committed] + reported)
        try:
            state = load_checkpoint(directory)
        except FileNotFoundError:
            assert committed == 0, "a committed checkpoint was lost"
            continue
        loads += 1
        step = state["step"]
        assert step >= committed  # never older than one the child saw complete
        assert_same(state_for(step), state, f"step {step}")
        next_step = max(next_step, step + 1) + 10  # steps only grow, as in training
    assert loads > 0


# -- what the loader trusts, and what it says about files it cannot read ----------------------

def _saved_file(directory: Path, state: dict) -> Path:
    with CheckpointWriter(directory) as writer:
        writer.save(state, step=1).result()
    return list_checkpoints(directory)[0].rank_file(0)


def _edit(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) >= 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new, 1))


def test_a_newer_format_version_is_refused(tmp_path):
    file = _saved_file(tmp_path, {"w": torch.ones(3)})
    _edit(file, b'"flashstream.version":"1"', b'"flashstream.version":"9"')
    with pytest.raises(ValueError, match="format version '9'.*reads version '1'"):
        load_checkpoint(tmp_path)


def test_a_header_edited_in_a_copy_without_its_marker_is_caught(tmp_path):
    file = _saved_file(tmp_path / "ckpt", {"w": torch.ones(3), "v": torch.zeros(2)})
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(file.read_bytes())
    _edit(copy, b'"dtype":"F32"', b'"dtype":"I32"')  # still valid JSON, same sizes
    from flashstream import ChecksumError
    with pytest.raises(ChecksumError, match="<header>"):
        load_checkpoint(copy)
    assert load_checkpoint(copy, verify=False)["w"].dtype == torch.int32  # what verify catches


def test_a_top_level_metadata_key_round_trips_and_safetensors_reads_the_file(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    state = {"__metadata__": torch.arange(3), "step": 7}
    file = _saved_file(tmp_path, state)
    assert_same(load_checkpoint(tmp_path), state)
    assert list(safetensors.load_file(file)) == ["__metadata__~1"]


def test_an_unknown_structure_node_names_the_file(tmp_path):
    file = _saved_file(tmp_path, {"a": [1, 2]})
    _edit(file, b'\\"L\\"', b'\\"Q\\"')
    with pytest.raises(ValueError, match=f"{file}.*unknown node"):
        load_checkpoint(file, verify=False)


@pytest.mark.parametrize("zipfile", [True, False])
def test_a_torch_save_file_is_named_as_such(tmp_path, zipfile):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=zipfile)
    with pytest.raises(ValueError, match="torch.save file.*torch.load"):
        load_checkpoint(path)


def test_a_header_past_safetensors_limit_warns(tmp_path, monkeypatch):
    from flashstream.checkpoint import format as ckpt_format
    monkeypatch.setattr(ckpt_format, "SAFETENSORS_MAX_HEADER", 4096)
    state = {f"layer.{i}.a_rather_long_parameter_name": torch.zeros(1) for i in range(200)}
    with CheckpointWriter(tmp_path) as writer, pytest.warns(UserWarning, match="safetensors"):
        writer.save(state, step=1).result()
    assert_same(load_checkpoint(tmp_path), state)  # flashstream itself still loads it


def test_a_read_only_directory_fails_at_construction(tmp_path):
    point = tmp_path / "ro"
    point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(point)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        with pytest.raises(OSError, match="not writable") as caught:
            CheckpointWriter(point)
        assert caught.value.errno == errno.EROFS
    finally:
        subprocess.run(["umount", str(point)], check=False)


_HOLDER = """
import sys, time
from flashstream import CheckpointWriter
writer = CheckpointWriter(sys.argv[1])
print("ready", flush=True)
time.sleep(120)
"""


def test_a_second_writer_of_one_rank_is_refused_until_the_first_is_gone(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], env=child_env(),
                             stdout=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        assert child.stdout.readline().strip() == "ready"
        # A temporary file as the other writer's save in flight would have it.
        step = tmp_path / "step-000000001"
        step.mkdir()
        in_flight = step / f".rank-00000-of-00001.safetensors.{child.pid}.tmp"
        in_flight.write_bytes(b"x")
        with pytest.raises(RuntimeError, match=f"pid {child.pid}.*rank 0"):
            CheckpointWriter(tmp_path)
        assert in_flight.exists()  # the refused writer deleted nothing
        with CheckpointWriter(tmp_path, rank=1, world_size=2):
            pass  # another rank is another writer
    finally:
        child.kill()  # SIGKILL: the kernel drops the lock with the process
        child.wait()
    with CheckpointWriter(tmp_path) as writer:
        assert not in_flight.exists()  # now stale: removed
        writer.save({"w": torch.ones(2)}, step=2).result()
    with CheckpointWriter(tmp_path):  # closed writers release the rank
        pass


def test_two_writers_in_one_process_are_refused_too(tmp_path):
    with CheckpointWriter(tmp_path), pytest.raises(RuntimeError, match="another CheckpointWriter"):
        CheckpointWriter(tmp_path)


# -- review cases: clocks, mapped readers, leaked locks, headers that look like pickles --------

def test_the_step_just_committed_survives_a_marker_clock_ahead(tmp_path):
    import json as _json
    with CheckpointWriter(tmp_path, keep=1) as writer:
        writer.save({"step": 300}, step=300).result()
    marker = next((tmp_path / "step-000000300").glob("*.done"))
    fields = _json.loads(marker.read_text())
    fields["time"] += 60  # the old run's host clock ran ahead
    marker.write_text(_json.dumps(fields))
    with CheckpointWriter(tmp_path, keep=1) as writer:
        writer.save({"step": 310}, step=310).result()
    assert [c.step for c in list_checkpoints(tmp_path)] == [310]
    assert (tmp_path / "latest").read_text().strip() == "step-000000310"
    assert load_checkpoint(tmp_path)["step"] == 310


_MAPPED_READER = """
import sys
from flashstream import load_checkpoint, list_checkpoints
from flashstream.checkpoint import store
directory = sys.argv[1]
state = load_checkpoint(directory, mmap=True)
step = list_checkpoints(directory)[0]
store.remove_step(step.path, gradual=True)  # as a writer's keep= would, beside this reader
print(float(state["w"].sum()), flush=True)  # the mapped pages must still be there
"""


def test_gradual_removal_leaves_a_file_whole_while_another_reader_maps_it(tmp_path):
    with CheckpointWriter(tmp_path) as writer:
        writer.save({"w": torch.ones(4 << 20)}, step=1).result()
    out = subprocess.run([sys.executable, "-c", _MAPPED_READER, str(tmp_path)],
                         env=child_env(), capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert float(out.stdout) == 4 << 20
    assert list_checkpoints(tmp_path) == []


def test_loading_into_a_state_reads_into_its_tensors(tmp_path):
    # into=: matching tensors are filled where they are (no second copy of the state in
    # memory), the others get memory of their own, a wrong shape is named.
    with CheckpointWriter(tmp_path) as writer:
        writer.save({"model": {"w": torch.arange(8.0), "b": torch.ones(3)},
                     "new": torch.arange(5)}, step=1).result()
    w, b = torch.zeros(8), torch.zeros(3)
    w_at = w.data_ptr()
    target = {"model": {"w": w, "b": b}}
    out = load_checkpoint(tmp_path, into=target)
    assert out is target and out["model"]["w"] is w and w.data_ptr() == w_at
    assert torch.equal(w, torch.arange(8.0)) and torch.equal(b, torch.ones(3))
    assert out["new"].untyped_storage().nbytes() == 5 * 8
    with pytest.raises(ValueError, match=r"\['w'\].*float64"):
        load_checkpoint(tmp_path, into={"model": {"w": torch.zeros(8, dtype=torch.float64)}})


def test_loading_into_a_state_leaves_no_export_of_the_read_buffer(tmp_path, monkeypatch):
    import gc
    import mmap as mmap_module

    from flashstream.checkpoint import loader
    with CheckpointWriter(tmp_path) as writer:
        writer.save({"model": {"w": torch.ones(8)}, "new": torch.arange(5),
                     "arr": np.arange(3.0)}, step=1).result()
    buffers = []

    class Recording(mmap_module.mmap):
        def __new__(cls, *args, **kwargs):
            buffers.append(super().__new__(cls, *args, **kwargs))
            return buffers[-1]

    monkeypatch.setattr(loader._mmap, "mmap", Recording)
    target = {"model": {"w": torch.zeros(8)}}
    out = load_checkpoint(tmp_path, into=target, mmap=True)
    assert torch.equal(out["new"], torch.arange(5)) and list(out["arr"]) == [0.0, 1.0, 2.0]
    gc.collect()
    assert len(buffers) == 1
    buffers[0].close()  # BufferError if any loaded value were still a view of it


def test_a_writer_dropped_without_close_frees_its_rank(tmp_path):
    import gc
    writer = CheckpointWriter(tmp_path)
    writer._executor.shutdown(wait=True)
    del writer
    gc.collect()
    CheckpointWriter(tmp_path).close()


def test_a_safetensors_header_of_640_bytes_is_not_taken_for_a_pickle(tmp_path):
    import json as _json
    import struct
    header = _json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    body = header.encode().ljust(640, b" ")  # 640 = 0x0280: starts like a pickle
    path = tmp_path / "plain.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + struct.pack("<f", 2.5))
    assert load_checkpoint(path)["x"].item() == 2.5


def test_numpy_scalars_keep_their_type_and_long_double_is_refused(tmp_path):
    state = {"f64": np.float64(0.25), "c128": np.complex128(1j), "i8": np.int8(-3)}
    with CheckpointWriter(tmp_path) as writer:
        writer.save(state, step=1).result()
        if np.dtype(np.longdouble).itemsize > 8:  # x86: 80-bit, no Python float holds it
            with pytest.raises(TypeError, match=r"\['ld'\]"):
                writer.save({"ld": np.longdouble(1) / 3}, step=2)
    loaded = load_checkpoint(tmp_path)
    assert loaded == state and all(type(loaded[k]) is type(v) for k, v in state.items())
