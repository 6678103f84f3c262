"""CheckpointWriter and load_checkpoint: round trips, format, retention, ranks, bad input."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import struct
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from ckptgen import assert_same, every_kind, training_state

from flashstream import (
    CheckpointWriter,
    ChecksumError,
    SnapshotLostError,
    engine,
    list_checkpoints,
    load_checkpoint,
)
from flashstream.checkpoint import newest_complete


def save_one(directory, state, step=1, **options):
    with CheckpointWriter(directory, **options) as writer:
        report = writer.save(state, step=step).result()
    return report


def test_round_trip_every_kind(tmp_path, engine):
    state = every_kind(3)
    report = save_one(tmp_path, state)
    assert report.engine == engine and report.bytes == report.path.stat().st_size
    assert_same(state, load_checkpoint(tmp_path))


def test_round_trip_training_state(tmp_path):
    state = training_state(5)
    save_one(tmp_path, state)
    loaded = load_checkpoint(tmp_path)
    assert_same(state, loaded)
    # What training does with it: both state dicts load back into fresh objects.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    model.load_state_dict(loaded["model"])
    torch.optim.Adam(model.parameters()).load_state_dict(loaded["optimizer"])


@pytest.mark.parametrize("mode", ["copy", "cow"])
def test_snapshot_holds_the_step_even_when_training_changes_tensors(tmp_path, mode):
    if mode == "cow" and not engine.cow_available():
        pytest.skip("userfaultfd write-protection is not available here")
    state = training_state(4, width=512)
    state["big"] = torch.arange(24 << 20, dtype=torch.float32)  # 96 MiB: many 2 MiB blocks
    state["tied"] = state["big"][: 1 << 20]  # a view sharing the storage
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    expected["model"] = {k: v.clone() for k, v in state["model"].items()}
    with CheckpointWriter(tmp_path, rate=256 << 20, snapshot=mode) as writer:
        handle = writer.save(state, step=1)
        with torch.no_grad():  # the training step right after save() returned
            state["big"].mul_(-1)
            for t in state["model"].values():
                t.zero_()
        assert not handle.done()
        report = handle.result()
    assert report.snapshot_mode == mode
    loaded = load_checkpoint(tmp_path)
    assert_same(expected["big"], loaded["big"])
    assert_same(expected["tied"], loaded["tied"])
    assert_same(expected["model"], loaded["model"])


@pytest.mark.parametrize("mode", ["copy", "cow"])
def test_lazy_conjugate_and_negative_views_are_saved_as_their_values(tmp_path, mode):
    # Contiguous CPU tensors are copied as raw bytes; a conjugate or negative view has the
    # bytes of its base and a flag, so it must take torch's copy (it saved the base's values).
    z = torch.randn(300_000, dtype=torch.complex64)  # 2.4 MB: past every small-tensor path
    x = torch.randn(300_000)
    state = {"conj": z.conj(), "neg": torch._neg_view(x), "small": z[:10].conj()}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    save_one(tmp_path, state, snapshot=mode)
    assert_same(expected, load_checkpoint(tmp_path))


def test_cow_round_trip_every_kind(tmp_path):
    if not engine.cow_available():
        pytest.skip("userfaultfd write-protection is not available here")
    state = every_kind(5)
    state["big"] = torch.randn(1 << 20)  # tensors under 64 KiB are copied at once anyway
    report = save_one(tmp_path, state, snapshot="cow")
    assert report.snapshot_mode == "cow" and report.cow["protected_bytes"] > 0
    assert_same(state, load_checkpoint(tmp_path))


def test_default_snapshot_is_copy_on_write_where_the_kernel_allows_it(tmp_path, monkeypatch):
    state = {"big": torch.randn(1 << 20), "small": torch.arange(5)}
    report = save_one(tmp_path / "a", state)
    assert report.snapshot_mode == ("cow" if engine.cow_preferred() else "copy")
    # A deadline needs the write to start at once, not after a background copy.
    report = save_one(tmp_path / "deadline", state, within=0.3)
    assert report.snapshot_mode == "copy"
    monkeypatch.setattr(engine, "_kernel_version", lambda: (5, 18))  # fork kept protection
    assert not engine.cow_preferred()
    report = save_one(tmp_path / "b", state, snapshot="auto")
    assert report.snapshot_mode == "copy"
    monkeypatch.setattr(engine, "_kernel_version", lambda: (5, 19))
    assert engine.cow_preferred() == engine.cow_available()
    assert_same(state, load_checkpoint(tmp_path / "a"))
    assert_same(state, load_checkpoint(tmp_path / "b"))


def test_fork_while_the_default_snapshot_copies(tmp_path):
    # DataLoader workers fork at each epoch's start, maybe right after a save: the child must
    # run (its pages are its own and unprotected) and the checkpoint must hold the values as
    # of save(), with the parent and the child both writing their tensors during the copy.
    if not engine.cow_preferred():
        pytest.skip("the default snapshot copies here (no full-mode userfaultfd or kernel < 5.19)")
    state = {f"t{i}": torch.randn(16 << 20) for i in range(6)}  # 6 x 64 MiB
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointWriter(tmp_path) as writer:
        handle = writer.save(state, step=1)
        pid = os.fork()
        if pid == 0:  # numpy, not torch: OpenMP cannot run in a child forked after using it
            try:
                for t in state.values():
                    t.numpy()[:] += 1000.0
                os._exit(0)
            finally:
                os._exit(1)
        copying_at_fork = not handle.wait_snapshot(0)
        for t in state.values():
            t.mul_(2.0)
        deadline = time.monotonic() + 60
        while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.05)  # a child hanging on a protected page fails the test, not CI
        status = ended[1]
        if not ended[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish within 60 s")
        report = handle.result()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert report.snapshot_mode == "cow" and copying_at_fork
    assert report.cow["fault_copies"] > 0  # the parent's writes met protected blocks
    assert_same(expected, load_checkpoint(tmp_path))


def test_cow_source_freed_after_save_fails_that_save_by_name(tmp_path):
    # FSDP frees unsharded storage with resize_(0) right after use. Under snapshot="cow" that
    # memory may not be copied yet: the save must fail naming the tensors (it crashed the
    # process), leave the previous checkpoint as the newest, and wait_snapshot() must make
    # the same pattern safe.
    if not engine.cow_available():
        pytest.skip("userfaultfd write-protection is not available here")
    state = {f"flat{i}": torch.randn(16 << 20) for i in range(4)}  # 4 x 64 MiB
    with CheckpointWriter(tmp_path, snapshot="cow", rate=512 << 20) as writer:
        writer.save({"w": torch.ones(3)}, step=1).result()
        handle = writer.save(state, step=2)
        for t in state.values():
            t.untyped_storage().resize_(0)
        with pytest.raises(SnapshotLostError, match="flat3") as caught:
            handle.result()
        assert caught.value.step == 2 and "flat3" in caught.value.tensors
        assert set(caught.value.tensors) <= set(state)
        assert handle.wait_snapshot(0)
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    assert_same({"w": torch.ones(3)}, load_checkpoint(tmp_path))

    state = {f"flat{i}": torch.randn(16 << 20) for i in range(4)}
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointWriter(tmp_path, snapshot="cow") as writer:
        handle = writer.save(state, step=3)
        assert handle.wait_snapshot(timeout=60)
        for t in state.values():
            t.untyped_storage().resize_(0)
        assert handle.result().snapshot_mode == "cow"
    assert_same(expected, load_checkpoint(tmp_path))


def test_file_is_safetensors_with_an_aligned_data_region(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    state = training_state(1)
    path = save_one(tmp_path, state).path
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["format"] == "pt"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    assert len(raw) == 8 + n + max(ends)  # no padding left at the end
    flat = safetensors.load_file(str(path))
    assert torch.equal(flat["model/0.weight"], state["model"]["0.weight"])
    assert torch.equal(flat["optimizer/state/0/exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_loaded_tensors_own_their_memory_and_mmap_gives_views(tmp_path):
    # A load's tensors must not keep a whole-file buffer alive (an optimizer keeping a few of
    # them kept it all); mmap=True is the opt-in to views of one mapping.
    state = {"a": torch.randn(1000), "b": torch.randn(10, dtype=torch.float64),
             "c": torch.arange(7, dtype=torch.int16)}
    path = save_one(tmp_path, state).path
    loaded = load_checkpoint(path)
    for key in state:
        assert loaded[key].untyped_storage().nbytes() == state[key].nbytes
    mapped = load_checkpoint(path, mmap=True)
    header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    starts = {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    base = mapped["a"].data_ptr() - starts["a"]
    for key in state:
        assert mapped[key].data_ptr() - base == starts[key]  # same mapping, file layout
        assert mapped[key].data_ptr() % mapped[key].element_size() == 0
        assert torch.equal(mapped[key], state[key])


def test_a_dropped_load_is_freed_at_once_not_by_the_cyclic_gc(tmp_path):
    # A reference cycle inside the loader kept every loaded tensor alive until the cyclic GC
    # ran: 800 MiB more RSS after a resume than torch.load's, for as long as it did not.
    import gc
    import weakref

    save_one(tmp_path, {"a": torch.ones(10), "b": {"c": torch.zeros(3)}, "n": np.ones(2)})
    gc.collect()
    gc.disable()
    try:
        loaded = load_checkpoint(tmp_path)
        refs = [weakref.ref(loaded["a"]), weakref.ref(loaded["b"]["c"])]
        del loaded
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_plain_safetensors_file_loads_flat(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = {"x": torch.randn(3, 4), "y": torch.arange(5)}
    safetensors.save_file(tensors, str(tmp_path / "plain.safetensors"))
    loaded = load_checkpoint(tmp_path / "plain.safetensors")
    assert_same(tensors, {k: loaded[k] for k in tensors})
    assert sorted(loaded) == sorted(tensors)


@pytest.mark.parametrize("bad, key", [
    ({"model": {"w": torch.ones(2), "oops": {1, object()}}}, "['model']['oops']"),
    ({"model": {"oops": np.datetime64("2020-01-01")}}, "['model']['oops']"),
    ({"fn": lambda: 0}, "['fn']"),
    ({"sparse": torch.ones(2, 2).to_sparse()}, "['sparse']"),
    ({"meta": torch.empty(2, device="meta")}, "['meta']"),
    ({"opt": [object()]}, "['opt'][0]"),
    ({frozenset([1]): 1}, "dict key"),
])
def test_unsupported_values_raise_type_error_naming_the_key(tmp_path, bad, key):
    with CheckpointWriter(tmp_path) as writer, pytest.raises(TypeError, match=re.escape(key)):
        writer.save(bad, step=1)
    assert list_checkpoints(tmp_path) == []  # nothing was written


def test_cycles_are_refused(tmp_path):
    state: dict = {"a": torch.ones(1)}
    state["self"] = state
    with CheckpointWriter(tmp_path) as writer, pytest.raises(TypeError, match="cycle"):
        writer.save(state, step=1)


@pytest.mark.parametrize("options", [
    {"rate": "fast"}, {"rate": 0}, {"rate": -5}, {"keep": 0}, {"if_busy": "queue"},
    {"chunk_size": 1000}, {"queue_depth": 0}, {"within": 0}, {"engine": "spdk"},
    {"snapshot": "fork"}, {"paced_chunk_size": 1000}, {"paced_chunk_size": 0},
])
def test_bad_arguments_raise_value_error(tmp_path, options):
    with pytest.raises(ValueError):
        CheckpointWriter(tmp_path, **options)


def test_bad_step_and_repeated_step(tmp_path):
    with CheckpointWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="step"):
            writer.save({}, step=-1)
        writer.save({"x": torch.ones(1)}, step=4).result()
        with pytest.raises(ValueError, match="already committed"):
            writer.save({"x": torch.ones(1)}, step=4)


def test_keep_newest_and_latest_pointer(tmp_path):
    with CheckpointWriter(tmp_path, keep=2) as writer:
        for step in (10, 20, 30, 40):
            writer.save(training_state(step), step=step)
    steps = [c.step for c in list_checkpoints(tmp_path)]
    assert steps == [30, 40]
    assert (tmp_path / "latest").read_text().strip() == "step-000000040"
    assert load_checkpoint(tmp_path)["step"] == 40
    assert load_checkpoint(tmp_path / "step-000000030")["step"] == 30


@pytest.mark.parametrize("state", [
    {}, {"epoch": 3, "name": "run-1", "lr": [0.1, 0.01]}, {"empty": torch.zeros(0),
                                                            "none": torch.ones(0, 5)},
], ids=["empty", "python-values", "zero-element-tensors"])
def test_a_state_without_tensor_bytes_saves_and_loads(tmp_path, state):
    with CheckpointWriter(tmp_path) as writer:
        report = writer.save(state, step=1).result()
    assert report.bytes >= 0
    assert_same(load_checkpoint(tmp_path), state)


def test_adamw_before_its_first_step_saves_and_loads(tmp_path):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    with CheckpointWriter(tmp_path) as writer:
        writer.save(state, step=1).result()
    loaded = load_checkpoint(tmp_path)
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(loaded["optim"])
    assert fresh.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    assert_same(loaded["model"], state["model"])


def test_a_paced_save_writes_short_requests(tmp_path):
    # 4 GB/s: faster than this disk, and below the rate at which 1 MiB paced requests grow
    # (4000 a second), so the save paces without slowing the test.
    state = {"w": torch.zeros(16 << 20, dtype=torch.uint8)}
    with CheckpointWriter(tmp_path / "paced", rate=4e9, chunk_size="8MiB",
                          paced_chunk_size="1MiB") as writer:
        paced = writer.save(state, step=1).result()
    with CheckpointWriter(tmp_path / "unpaced", chunk_size="8MiB",
                          paced_chunk_size="1MiB") as writer:
        unpaced = writer.save(state, step=1).result()
    assert paced.latency.count >= 16 and unpaced.latency.count <= 4
    assert load_checkpoint(tmp_path / "paced")["w"].equal(state["w"])


def test_gradual_removal_frees_a_slice_at_a_time_and_markers_first(tmp_path, monkeypatch):
    from flashstream.checkpoint import store

    with CheckpointWriter(tmp_path, keep=None) as writer:
        writer.save({"w": torch.zeros(5 << 20, dtype=torch.uint8)}, step=1)
        writer.save({"w": torch.zeros(1, dtype=torch.uint8)}, step=2)
    old = list_checkpoints(tmp_path)[0]
    file_size = old.rank_file(0).stat().st_size
    sizes, real_ftruncate = [], os.ftruncate

    def ftruncate(fd, size):
        # The marker is gone before any data is freed: a cut-short removal leaves an
        # incomplete step, never a complete one with a short file.
        assert not list(old.path.glob("*.done"))
        sizes.append(size)
        real_ftruncate(fd, size)

    monkeypatch.setattr(store, "TRIM_SLICE", 1 << 20)
    monkeypatch.setattr(store.os, "ftruncate", ftruncate)
    assert store.prune(tmp_path, 1, gradual=True) == [old.path]
    assert sizes == [file_size - k * (1 << 20) for k in range(1, len(sizes) + 1)]
    assert 0 <= sizes[-1] < 1 << 20  # the last slice goes with the unlink
    assert not old.path.exists()
    assert load_checkpoint(tmp_path)["w"].numel() == 1


@pytest.mark.parametrize("keep, kept", [(1, [150]), (2, [150, 200]), (None, [100, 150, 200])])
def test_a_rollback_keeps_the_new_run_and_loads_it(tmp_path, keep, kept):
    """A run resumed from an older step: its checkpoints are the newest, whatever their step
    numbers; keep= counts by commit time, so the abandoned run's later steps go first."""
    with CheckpointWriter(tmp_path, keep=keep) as writer:
        for step in (100, 200):
            writer.save(training_state(step), step=step)
    with CheckpointWriter(tmp_path, keep=keep) as writer:  # resumed from step 100
        writer.save(training_state(150), step=150).result()
    assert [c.step for c in list_checkpoints(tmp_path)] == kept
    assert (tmp_path / "latest").read_text().strip() == "step-000000150"
    assert newest_complete(tmp_path).step == 150
    assert load_checkpoint(tmp_path)["step"] == 150


def test_if_busy_skip_and_wait(tmp_path):
    big = {"w": torch.randn(4 << 20)}  # 16 MiB at 16 MiB/s: about a second of writing
    with CheckpointWriter(tmp_path / "skip", rate=16 << 20, if_busy="skip") as writer:
        first = writer.save(big, step=1)
        second = writer.save(big, step=2)
        assert second.skipped and second.result() is None and writer.skipped == 1
        first.result()
    assert [c.step for c in list_checkpoints(tmp_path / "skip")] == [1]
    with CheckpointWriter(tmp_path / "wait", rate=16 << 20, if_busy="wait") as writer:
        writer.save(big, step=1)
        report = writer.save(big, step=2).result()
        assert report.busy_wait_s > 0.3
    assert [c.step for c in list_checkpoints(tmp_path / "wait")] == [1, 2]


def test_report_figures(tmp_path):
    report = save_one(tmp_path, {"w": torch.randn(3 << 20)}, chunk_size="1MiB", queue_depth=4)
    assert report.bytes > 12 << 20 and report.gbps > 0 and report.stall_s > 0
    assert report.latency.count >= 12 and report.rate_mode == "none"
    assert sum(row[1] for row in report.timeline) >= 12 << 20
    d = report.to_dict()
    assert d["latency_us"]["p95"] > 0 and json.dumps(d)
    assert "GB/s" in report.format_table()


def test_within_spreads_the_write(tmp_path):
    # 8 MiB in 1 MiB requests over 1 s: the pacer starts the last one after 7/8 s.
    report = save_one(tmp_path, {"w": torch.randn(2 << 20)}, within=1.0, chunk_size="1MiB")
    assert report.rate_mode == "fixed"
    assert report.target_rate == pytest.approx((8 << 20) / 1.0, rel=0.01)
    assert report.write_s > 0.7


def test_checksum_error_names_the_tensor(tmp_path):
    state = {"first": torch.randn(1000), "second": torch.randn(1000)}
    path = save_one(tmp_path, state).path
    header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    begin, _ = header["second"]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(8 + n + begin + 17)
        byte = f.read(1)
        f.seek(8 + n + begin + 17)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match="'second'") as info:
        load_checkpoint(tmp_path)
    assert info.value.tensor == "second" and str(path) in str(info.value)
    assert load_checkpoint(tmp_path, verify=False)["first"].equal(state["first"])


def test_checksum_error_for_a_flipped_header_byte(tmp_path):
    path = save_one(tmp_path, {"w": torch.ones(8)}).path
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"shape":[8]') + len('"shape":[')
    raw[at] = ord("4")  # still valid JSON, now lying about the shape
    path.write_bytes(bytes(raw))
    with pytest.raises((ChecksumError, ValueError), match="header|shape"):
        load_checkpoint(tmp_path)


def test_missing_and_incomplete_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path)
    # Rank 1 of 2 commits; rank 0 never does: the step is not complete and never loads.
    with CheckpointWriter(tmp_path, rank=1, world_size=2) as writer:
        writer.save({"x": torch.ones(1)}, step=7).result()
    assert newest_complete(tmp_path) is None
    with pytest.raises(FileNotFoundError, match=r"ranks \[0\]"):
        load_checkpoint(tmp_path / "step-000000007")


def test_ranks_commit_together(tmp_path):
    errors = []

    def rank(r):
        try:
            with CheckpointWriter(tmp_path, rank=r, world_size=3, commit_timeout=30) as w:
                w.save({"rank": torch.tensor(r)}, step=1).result()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert newest_complete(tmp_path).world_size == 3
    for r in range(3):
        assert int(load_checkpoint(tmp_path, rank=r)["rank"]) == r
    with pytest.raises(ValueError, match="rank 3"):
        load_checkpoint(tmp_path, rank=3)


def test_rank_zero_times_out_when_a_rank_never_commits(tmp_path):
    with CheckpointWriter(tmp_path, rank=0, world_size=2, commit_timeout=0.3) as writer:
        handle = writer.save({"x": torch.ones(1)}, step=1)
        with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
            handle.result()
    assert newest_complete(tmp_path) is None


def test_buffered_fallback(no_direct_dir):
    report = save_one(no_direct_dir, every_kind(1))
    assert report.direct is False
    assert_same(every_kind(1), load_checkpoint(no_direct_dir))


def test_stale_temporaries_are_removed(tmp_path):
    save_one(tmp_path, {"x": torch.ones(1)}, step=1)
    stale = tmp_path / "step-000000001" / ".rank-00000-of-00001.safetensors.99999.tmp"
    stale.write_bytes(b"partial")
    save_one(tmp_path, {"x": torch.ones(1)}, step=2)
    assert not stale.exists()


def test_a_stale_temporary_is_freed_a_slice_at_a_time_on_online_discard(tmp_path,
                                                                         monkeypatch):
    """A killed save leaves a temporary as large as a checkpoint (a claimed spare, a new file
    reserved in full); on an online-discard filesystem the next writer frees it as pruning
    does, a slice at a time, not with one long discard the drive's reads queue behind."""
    from flashstream.checkpoint import store
    from flashstream.checkpoint import writer as writer_module

    save_one(tmp_path, {"x": torch.ones(1)}, step=1)
    stale = tmp_path / "step-000000001" / ".rank-00000-of-00001.safetensors.99999.tmp"
    stale.write_bytes(os.urandom(3 << 20))
    other_rank = stale.with_name(".rank-00001-of-00002.safetensors.99999.tmp")
    other_rank.write_bytes(b"another rank's, not this writer's")
    sizes, real_ftruncate = [], os.ftruncate

    def ftruncate(fd, size):
        if os.readlink(f"/proc/self/fd/{fd}") == str(stale):  # not the writer's lock file
            sizes.append(size)
        real_ftruncate(fd, size)

    monkeypatch.setattr(writer_module, "online_discard", lambda _directory: True)
    monkeypatch.setattr(store, "TRIM_SLICE", 1 << 20)
    monkeypatch.setattr(store.os, "ftruncate", ftruncate)
    CheckpointWriter(tmp_path).close()
    assert sizes == [2 << 20, 1 << 20]  # the last slice goes with the unlink
    assert not stale.exists() and other_rank.exists()
    assert load_checkpoint(tmp_path)["x"].equal(torch.ones(1))


def test_a_hard_linked_checkpoint_file_is_unlinked_whole_not_shrunk(tmp_path, monkeypatch):
    """Someone kept a checkpoint with cp -al (a second name for the same file): freeing the
    step a slice at a time would cut that copy short; it is only unlinked."""
    from flashstream.checkpoint import store

    save_one(tmp_path / "run", {"w": torch.arange(3 << 18, dtype=torch.int32)}, step=1)
    step = list_checkpoints(tmp_path / "run")[0]
    kept = tmp_path / "kept.safetensors"
    os.link(step.rank_file(0), kept)
    expected = kept.read_bytes()
    monkeypatch.setattr(store, "TRIM_SLICE", 1 << 20)
    store.remove_step(step.path, gradual=True)
    assert not step.path.exists() and kept.read_bytes() == expected


def test_a_writer_that_cannot_be_built_frees_its_rank(tmp_path, monkeypatch):
    from flashstream.checkpoint import writer as writer_module

    def broken(_directory):
        raise ValueError("an unreadable mount table")

    monkeypatch.setattr(writer_module, "online_discard", broken)
    with pytest.raises(ValueError, match="mount table"):
        CheckpointWriter(tmp_path)
    monkeypatch.undo()
    CheckpointWriter(tmp_path).close()  # the rank's lock went with the failed one


def test_map_location_cpu_and_saved_device(tmp_path):
    save_one(tmp_path, {"x": torch.ones(2)})
    assert load_checkpoint(tmp_path, map_location="cpu")["x"].device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip(tmp_path):
    state = {"w": torch.randn(1 << 20, device="cuda"), "h": torch.randn(7, 3, device="cuda").t()}
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointWriter(tmp_path) as writer:
        handle = writer.save(state, step=1)
        state["w"].zero_()
        handle.result()
    loaded = load_checkpoint(tmp_path)
    assert loaded["w"].is_cuda
    assert_same(expected, loaded)
    assert_same({k: v.cpu() for k, v in expected.items()},
                load_checkpoint(tmp_path, map_location="cpu"))


def test_env_engine_python_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSTREAM_ENGINE", "python")
    report = save_one(tmp_path, training_state(2))
    assert report.engine == "python"
    assert_same(training_state(2), load_checkpoint(tmp_path))
    assert os.listdir(tmp_path / "step-000000001")


def _gloo_rank(rank: int, world: int, init: str, directory: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        with CheckpointWriter(directory, commit_timeout=60) as writer:  # rank from the group
            assert (writer.rank, writer.world_size) == (rank, world)
            writer.save({"rank": torch.tensor(rank), "w": torch.full((1000,), float(rank))},
                        step=3).result()
        dist.barrier()
        assert int(load_checkpoint(directory)["rank"]) == rank  # each rank loads its own file
    finally:
        dist.destroy_process_group()


def test_real_gloo_ranks_write_their_own_files(tmp_path):
    world = 2
    init = f"file://{tmp_path / 'store'}"
    torch.multiprocessing.spawn(_gloo_rank, args=(world, init, str(tmp_path / "ckpt")),
                                nprocs=world, join=True)
    info = newest_complete(tmp_path / "ckpt")
    assert info.step == 3 and info.world_size == world and info.committed_ranks == (0, 1)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == info.path.name


# -- torch.save / torch.load parity -------------------------------------------------------------

def test_values_torch_save_takes_round_trip(tmp_path):
    state = {"c": 1 + 2j, "s": {1, 2, (3, "a")}, "f": frozenset({"x"}), "dtype": torch.bfloat16,
             "device": torch.device("cuda:1"),
             "np": [np.float32(0.5), np.int64(3), np.complex64(1 - 1j), np.bool_(True)]}
    with CheckpointWriter(tmp_path) as writer:
        writer.save(state, step=1).result()
    loaded = load_checkpoint(tmp_path)
    assert loaded == state
    assert [type(v) for v in loaded["np"]] == [type(v) for v in state["np"]]
    assert type(loaded["f"]) is frozenset


def test_step_may_be_any_integer_a_training_loop_holds(tmp_path):
    with CheckpointWriter(tmp_path, keep=None) as writer:
        writer.save({"x": 1}, step=torch.tensor(5.0))  # AdamW's step: a float32 0-dim tensor
        writer.save({"x": 2}, step=np.int64(6))
        writer.save({"x": 2}, step=torch.tensor([7]))
        for bad in (torch.tensor(1.5), 2.0, "7", torch.tensor([1, 2])):
            with pytest.raises(ValueError, match="non-negative integer"):
                writer.save({"x": 3}, step=bad)
    assert [c.step for c in list_checkpoints(tmp_path)] == [5, 6, 7]


def test_shared_storage_is_stored_once_and_loads_shared(tmp_path):
    # Tied input/output embeddings and views of a base: torch.save stores such storage once
    # and torch.load gives it back shared; so must we (they were stored twice, loaded apart).
    embed = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    big = torch.randn(64, 100)
    state = {"model": model.state_dict(), "big": big, "rows": big[3:9], "cols": big[:, 5],
             "t": big.t(), "cast": big.view(torch.int32), "alone": torch.randn(4)}
    with CheckpointWriter(tmp_path) as writer:
        report = writer.save(state, step=1).result()
    assert report.bytes < (1000 * 64 + 64 * 100 * 2 + 4) * 4 + 64 * 1024  # each stored once
    for kwargs in ({}, {"mmap": True}):
        loaded = load_checkpoint(tmp_path, **kwargs)
        assert_same(state, loaded)
        m = loaded["model"]
        assert m["embed.weight"].untyped_storage().data_ptr() == \
            m["head.weight"].untyped_storage().data_ptr()
        storage = loaded["big"].untyped_storage().data_ptr()
        for key in ("rows", "cols", "t"):
            assert loaded[key].untyped_storage().data_ptr() == storage, key
        assert loaded["cols"].stride() == big[:, 5].stride()
        assert loaded["cast"].untyped_storage().data_ptr() != storage  # another dtype: apart
    model2 = torch.nn.ModuleDict({"embed": torch.nn.Embedding(1000, 64),
                                  "head": torch.nn.Linear(64, 1000, bias=False)})
    model2["head"].weight = model2["embed"].weight
    load_checkpoint(tmp_path, into={"model": model2.state_dict()})
    assert torch.equal(model2["head"].weight, embed.weight)


def test_repeated_saves_reuse_the_layout_only_while_the_state_keeps_its_shape(tmp_path):
    # Later saves reuse the previous layout (relayout.py) when keys, shapes, dtypes and
    # shared storage are unchanged; every other change must still be saved exactly.
    from flashstream.checkpoint.format import plan as plan_layout
    from flashstream.checkpoint.relayout import Plan, relayout
    from flashstream.checkpoint.structure import flatten

    big = torch.randn(64, 8)
    state = {"model": {"w": big, "w_rows": big[2:5], "b": torch.zeros(3)},
             "sched": {"last_epoch": 1, "lrs": [0.1, 0.2]}, "step": torch.tensor(1.0)}
    skeleton, entries = flatten(state)
    previous = Plan.of(skeleton, plan_layout(entries, {}))
    assert relayout(state, previous) is not None
    changes = [
        lambda s: s["sched"].update(last_epoch=2, lrs=[0.05, 0.1]),    # values: reused
        lambda s: s["model"].update(b=torch.zeros(4)),                  # a shape
        lambda s: s["model"].update(w_rows=big[3:6].clone()),           # no longer a view
        lambda s: s["model"].update(extra=torch.ones(2)),               # a new key
        lambda s: s["sched"].update(lrs=(0.1, 0.2)),                    # list -> tuple
        lambda s: s.update(step=torch.tensor(2, dtype=torch.int64)),    # a dtype
        lambda s: s["model"].update(b=np.arange(4)),                    # numpy: flatten's
        lambda s: s["sched"].update(last_epoch=torch.tensor(3)),        # scalar -> tensor
    ]
    with CheckpointWriter(tmp_path, keep=2) as writer:
        for step, change in enumerate(changes, start=1):
            previous = writer._plan or previous
            change(state)
            for t in state["model"].values():
                if isinstance(t, torch.Tensor):
                    t.add_(step)
            writer.save(state, step=step).result()
            assert_same(state, load_checkpoint(tmp_path))
            fits = relayout(state, previous) is not None
            assert fits == (step == 1), step
    loaded = load_checkpoint(tmp_path)
    assert loaded["model"]["w_rows"].untyped_storage().data_ptr() != \
        loaded["model"]["w"].untyped_storage().data_ptr()


@pytest.mark.parametrize("how", ["tied after a save", "reserve= built with empty_like"])
def test_weights_tied_after_the_layout_was_planned_are_stored_once(tmp_path, how):
    # The reused layout stored embed and head apart; once they share memory it must not be
    # reused, or every later save stores them twice and they load untied.
    embed, head = torch.randn(1000, 64), torch.randn(1000, 64)
    untied = {"embed": embed, "head": head, "step": 1}
    reserve = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
               for k, v in untied.items()} if how.startswith("reserve") else None
    with CheckpointWriter(tmp_path, keep=None, reserve=reserve) as writer:
        if reserve is None:
            writer.save(untied, step=1).result()
        tied = {"embed": embed, "head": embed, "step": 2}
        report = writer.save(tied, step=2).result()
    assert report.bytes < embed.nbytes * 1.5  # stored once
    loaded = load_checkpoint(tmp_path)
    assert loaded["head"].data_ptr() == loaded["embed"].data_ptr()
    assert torch.equal(loaded["head"], embed)


def test_map_location_as_torch_load_takes_it(tmp_path):
    with CheckpointWriter(tmp_path) as writer:
        writer.save({"w": torch.ones(2)}, step=1).result()
    assert load_checkpoint(tmp_path, map_location={"cpu": "cpu"})["w"].device.type == "cpu"
    assert load_checkpoint(tmp_path, map_location={"cuda:0": "cpu"})["w"].equal(torch.ones(2))
    seen = []

    def keep(storage, location):
        seen.append((type(storage).__name__, location))
        return storage

    assert load_checkpoint(tmp_path, map_location=keep)["w"].equal(torch.ones(2))
    assert seen == [("UntypedStorage", "cpu")]
    assert load_checkpoint(tmp_path, map_location=lambda s, loc: None)["w"].equal(torch.ones(2))
    with pytest.raises(TypeError, match="must return a torch storage"):
        load_checkpoint(tmp_path, map_location=lambda s, loc: "cpu")
    with pytest.raises(ValueError, match="map_location must be"):
        load_checkpoint(tmp_path, map_location=3)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="map_location 'cuda:0' needs CUDA"):
            load_checkpoint(tmp_path, map_location="cuda:0")


def test_weights_only_is_accepted_and_mmap_maps_the_file(tmp_path):
    state = training_state(3)
    with CheckpointWriter(tmp_path) as writer:
        writer.save(state, step=3).result()
    assert_same(load_checkpoint(tmp_path, weights_only=True), state)
    mapped = load_checkpoint(tmp_path, mmap=True)
    assert_same(mapped, state)
    mapped["model"]["0.weight"].add_(1)  # private pages: the file is not changed
    assert_same(load_checkpoint(tmp_path), state)


def test_a_file_name_is_not_taken_for_a_directory(tmp_path):
    with pytest.raises(ValueError, match="names a file"):
        CheckpointWriter(tmp_path / "ckpt.pt")
    assert not (tmp_path / "ckpt.pt").exists()
    (tmp_path / "run.v2").mkdir()
    CheckpointWriter(tmp_path / "run.v2").close()  # not a checkpoint file suffix


def test_loading_into_a_state_copies_in_place_and_keeps_no_view_of_the_read_buffer(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    saved = {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 4}
    with CheckpointWriter(tmp_path) as writer:
        writer.save(saved, step=1).result()
    expected = load_checkpoint(tmp_path)
    # A fresh run: same shapes, other values, an optimizer that has not stepped yet.
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optim2 = torch.optim.AdamW(model2.parameters())
    target = {"model": model2.state_dict(), "optim": optim2.state_dict(), "epoch": 0}
    pointers = {k: v.data_ptr() for k, v in target["model"].items()}
    out = load_checkpoint(tmp_path, into=target)
    assert out is target and out["epoch"] == 4
    for key, tensor in model2.state_dict().items():
        assert tensor.data_ptr() == pointers[key]  # the parameters themselves were written
        assert torch.equal(tensor, expected["model"][key])
    optim2.load_state_dict(out["optim"])
    for state in optim2.state.values():  # new entries own their memory
        for value in state.values():
            assert value.untyped_storage().nbytes() == value.nbytes
    assert_same(out["optim"], expected["optim"])
    with pytest.raises(ValueError, match=r"\['model'\]\['0.weight'\].*float32 \[8, 8\]"):
        load_checkpoint(tmp_path, into={"model": {"0.weight": torch.zeros(4, 8)}})


@pytest.mark.parametrize("reserve", ["state", "size"])
def test_staging_reserved_at_construction_serves_the_first_save(tmp_path, reserve):
    state = training_state(1, width=256)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values()) * 3
    with CheckpointWriter(tmp_path, reserve=state if reserve == "state" else nbytes) as writer:
        assert writer._staging.allocations == 1 and writer._staging.capacity >= nbytes
        writer.save(state, step=1).result()
        writer.save(state, step=2).result()
        assert writer._staging.allocations == 1  # no save had to allocate
    assert_same(load_checkpoint(tmp_path), state)
    with pytest.raises(ValueError, match="reserve"):
        CheckpointWriter(tmp_path / "bad", reserve="lots")


def test_a_state_dict_reserved_at_construction_plans_the_first_saves_layout(tmp_path,
                                                                           monkeypatch):
    # Planning 50,000 small tensors from scratch is most of a first save's stall: reserve=
    # plans it at construction, and the first save only checks that its state still fits.
    from flashstream.checkpoint import writer as writer_module
    state = training_state(2, width=64)
    with CheckpointWriter(tmp_path / "plain") as writer:
        plain = writer.save(state, step=1).result().path.read_bytes()
    with CheckpointWriter(tmp_path / "reserved", reserve=state) as writer:
        def planned_afresh(*args, **kwargs):
            raise AssertionError("the first save planned its layout afresh")
        monkeypatch.setattr(writer_module, "plan", planned_afresh)
        reserved = writer.save(state, step=1).result().path.read_bytes()
        monkeypatch.undo()
        state["model"]["extra"] = torch.ones(3)  # another shape: planned afresh, still right
        writer.save(state, step=2).result()
    assert reserved == plain  # byte for byte the file a save without reserve= writes
    assert_same(load_checkpoint(tmp_path / "reserved"), state)

    # The writer keeps the plan, not the reserve dict's tensors.
    like = {"w": torch.zeros(1 << 16)}
    alive = weakref.ref(like["w"])
    with CheckpointWriter(tmp_path / "released", reserve=like):
        del like
        gc.collect()
        assert alive() is None
