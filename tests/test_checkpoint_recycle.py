"""recycle=True: a pruned checkpoint's file is written over by the next save instead of being
freed (no discards, no block allocation), without ever changing bytes a reader still holds."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys

import pytest
import torch
from ckptgen import assert_same
from conftest import child_env

from flashstream import CheckpointWriter, engine, list_checkpoints, load_checkpoint
from flashstream.checkpoint import store


def _state(step: int, numel: int = 1 << 20) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(numel, generator=g), "step": step}


def _inode(path) -> int:
    return os.stat(path).st_ino


def test_the_pruned_file_becomes_the_next_checkpoint(tmp_path):
    with CheckpointWriter(tmp_path, keep=1) as writer:
        reports, inodes = [], []
        for step in range(1, 6):
            reports.append(writer.save(_state(step), step=step).result())
            inodes.append(_inode(reports[-1].path))
            assert_same(_state(step), load_checkpoint(tmp_path), f"step {step}")
            spare = store.spare_file(tmp_path, 0)
            if step >= 2:  # step - 1 was pruned into the spare
                assert _inode(spare) == inodes[-2]
        # The first two saves allocate (nothing pruned yet); from then on each one writes
        # over the file of the checkpoint pruned before it: two files, used in turn.
        assert [r.recycled for r in reports] == [False, False, True, True, True]
        assert inodes[2] == inodes[0] and inodes[3] == inodes[1] and inodes[4] == inodes[2]
    # close() leaves only checkpoints.
    assert not store.spare_file(tmp_path, 0).exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [5]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".writer")) == [
        "latest", "step-000000005"]


@pytest.mark.parametrize("numels", [(1 << 20, 3 << 20, 3 << 20), (3 << 20, 3 << 20, 1000)])
def test_a_recycled_file_of_another_size_holds_exactly_the_new_checkpoint(tmp_path, numels):
    """Growing extends the spare; shrinking cuts its old bytes off at commit."""
    with CheckpointWriter(tmp_path, keep=1) as writer:
        for step, numel in enumerate(numels, 1):
            report = writer.save(_state(step, numel), step=step).result()
        assert report.recycled
        assert report.path.stat().st_size == report.bytes
        assert_same(_state(3, numels[2]), load_checkpoint(tmp_path))


def test_recycle_false_frees_the_pruned_file(tmp_path):
    with CheckpointWriter(tmp_path, keep=1, recycle=False) as writer:
        reports = [writer.save(_state(step), step=step).result() for step in range(1, 4)]
        assert not any(r.recycled for r in reports)
        assert not store.spare_file(tmp_path, 0).exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]


def test_recycle_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="recycle must be True or False"):
        CheckpointWriter(tmp_path, recycle="yes")


def test_a_file_this_process_maps_is_never_written_over(tmp_path):
    with CheckpointWriter(tmp_path, keep=1) as writer:
        first = writer.save(_state(1), step=1).result()
        with open(first.path, "rb") as f:
            held = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        before = bytes(held[:1 << 16]), bytes(held[-4096:])
        reports = [writer.save(_state(step), step=step).result() for step in range(2, 5)]
        # Step 1 was pruned while mapped: unlinked whole, not made a spare, so step 3 had
        # none and allocated; step 2's file was free to recycle for step 4.
        assert [r.recycled for r in reports] == [False, False, True]
        assert (bytes(held[:1 << 16]), bytes(held[-4096:])) == before
        held.close()
    assert_same(_state(4), load_checkpoint(tmp_path))


_MAPPED_READER = """
import sys
from flashstream import load_checkpoint
state = load_checkpoint(sys.argv[1], mmap=True)
print(float(state["w"].sum()), flush=True)
sys.stdin.readline()  # the parent saves twice more meanwhile (pruning this step)
print(float(state["w"].sum()), flush=True)
"""


def test_a_checkpoint_another_process_maps_keeps_its_bytes(tmp_path):
    with CheckpointWriter(tmp_path, keep=1) as writer:
        writer.save(_state(1), step=1).result()
        writer.save(_state(2), step=2).result()  # step 1 is now the spare
        reader = subprocess.Popen([sys.executable, "-c", _MAPPED_READER, str(tmp_path)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=child_env(), cwd=str(tmp_path))
        try:
            mapped = float(reader.stdout.readline())
            spare = _inode(store.spare_file(tmp_path, 0))
            third = writer.save(_state(3), step=3).result()  # prunes the mapped step 2
            assert third.recycled and _inode(third.path) == spare
            # Step 2 was mapped: it was not made a spare, so step 4 allocates a new file.
            assert not store.spare_file(tmp_path, 0).exists()
            fourth = writer.save(_state(4), step=4).result()
            assert not fourth.recycled
            out, _ = reader.communicate("\n", timeout=120)
        finally:
            reader.kill()
    assert reader.returncode == 0
    assert float(out) == mapped == float(_state(2)["w"].sum())


def test_a_spare_left_by_a_killed_run_is_written_over_by_the_next_writer(tmp_path):
    # What a run killed between a prune and its next save leaves: a spare beside the
    # checkpoints (close() never ran to remove it).
    spare = store.spare_file(tmp_path, 0)
    spare.write_bytes(os.urandom(1 << 20))
    spare_inode = _inode(spare)
    with CheckpointWriter(tmp_path, keep=1) as writer:
        report = writer.save(_state(3), step=3).result()
    assert report.recycled and _inode(report.path) == spare_inode
    assert_same(_state(3), load_checkpoint(tmp_path))


def test_rank_zero_recycles_each_ranks_file_for_that_rank(tmp_path):
    writers = [CheckpointWriter(tmp_path, keep=1, rank=r, world_size=2) for r in (1, 0)]
    try:
        inodes = {}
        for step in (1, 2, 3):
            handles = [w.save({"r": torch.full((1 << 18,), 10 * step + w.rank)}, step=step)
                       for w in writers]
            reports = {w.rank: h.result() for w, h in zip(writers, handles)}
            inodes[step] = {r: _inode(rep.path) for r, rep in reports.items()}
        # Rank 0 pruned step 1 after step 2 committed: each rank's file went to that rank's
        # spare, and each rank's step 3 was written over its own step 1 file.
        assert inodes[3] == inodes[1]
        assert all(reports[r].recycled for r in (0, 1))
    finally:
        for w in writers:
            w.close()
    assert not list(tmp_path.glob(".spare-*"))
    state = [load_checkpoint(tmp_path, rank=r) for r in (0, 1)]
    assert [int(s["r"][0]) for s in state] == [30, 31]


def test_disk_full_while_a_recycled_file_grows_keeps_the_previous_checkpoint(small_fs):
    directory = small_fs("24m")
    small, large = _state(1, 2 << 20), _state(3, 4 << 20)  # 8 MiB, then 16 MiB
    with CheckpointWriter(directory, keep=1) as writer:
        writer.save(small, step=1).result()
        writer.save(_state(2, 2 << 20), step=2).result()  # step 1's file is the spare
        with pytest.raises(OSError) as info:
            writer.save(large, step=3).result()  # 8 MiB held + 16 MiB needed > 24 MiB
        assert info.value.errno == errno.ENOSPC
        assert [p for p in directory.rglob("*") if p.name.endswith(".tmp")] == []
    assert_same(_state(2, 2 << 20), load_checkpoint(directory))
    assert [c.step for c in list_checkpoints(directory) if c.complete] == [2]


@pytest.mark.parametrize("name", ["uring", "threads", "python"])
def test_open_output_existing_writes_over_a_file_and_cuts_it_at_commit(tmp_path, name):
    if name == "uring" and not engine.uring_available():
        pytest.skip("io_uring is not available here")
    path = tmp_path / "f"
    path.write_bytes(b"\xff" * (3 << 20))
    data = mmap.mmap(-1, 1 << 20)
    data[:] = b"\x01" * (1 << 20)
    out = engine.open_output(path, 1 << 20, engine=name, direct=True, existing=True)
    out.write(data, 0, chunk_size=256 << 10, queue_depth=4)
    out.commit(1000)
    assert path.read_bytes() == b"\x01" * 1000
    with pytest.raises(FileNotFoundError):
        engine.open_output(tmp_path / "missing", 4096, engine=name, direct=True, existing=True)
    with pytest.raises(OSError):
        engine.open_output(tmp_path, 4096, engine=name, direct=True, existing=True)
    assert tmp_path.is_dir()  # a refused open removes nothing


def test_a_hard_linked_checkpoint_is_never_written_over(tmp_path):
    with CheckpointWriter(tmp_path / "ckpt", keep=1) as writer:
        first = writer.save(_state(1), step=1).result()
        kept = tmp_path / "kept.safetensors"
        os.link(first.path, kept)  # a copy someone kept, sharing the blocks
        before = kept.read_bytes()
        reports = [writer.save(_state(step), step=step).result() for step in range(2, 5)]
        assert [r.recycled for r in reports] == [False, False, True]
    assert kept.read_bytes() == before


def test_a_spare_someone_opened_after_the_prune_is_not_written_over(tmp_path):
    with CheckpointWriter(tmp_path, keep=1) as writer:
        writer.save(_state(1), step=1).result()
        writer.save(_state(2), step=2).result()  # step 1 is now the spare
        with open(store.spare_file(tmp_path, 0), "rb") as late_reader:
            before = late_reader.read(1 << 16)
            report = writer.save(_state(3), step=3).result()
            assert not report.recycled
            late_reader.seek(0)
            assert late_reader.read(1 << 16) == before
    assert_same(_state(3), load_checkpoint(tmp_path))


def test_spares_are_gone_whichever_rank_closes_first(tmp_path):
    """Rank 0 prunes, so it makes rank 1's spare, possibly after rank 1 closed."""
    writers = {r: CheckpointWriter(tmp_path, keep=1, rank=r, world_size=2) for r in (0, 1)}
    for step in (1, 2, 3):
        writers[1].save({"r": torch.full((1 << 16,), 1)}, step=step).result()
        if step == 3:
            writers[1].close()  # done before rank 0 commits and prunes step 2
        writers[0].save({"r": torch.full((1 << 16,), 0)}, step=step).result()
    assert store.spare_file(tmp_path, 1).exists()  # made by rank 0's last prune
    writers[0].close()
    assert not list(tmp_path.glob(".spare-*"))


def test_removing_spares_slice_by_slice_leaves_a_mapped_spare_whole(tmp_path):
    """close() on an online-discard filesystem frees spares a slice at a time; a spare some
    reader still maps (it opened the pruned file just before the rename) is unlinked whole,
    never shrunk under it."""
    spare = store.spare_file(tmp_path, 0)
    spare.write_bytes(os.urandom(3 * store.TRIM_SLICE))
    expected = spare.read_bytes()
    with open(spare, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert store.remove_spares(tmp_path, gradual=True) == [spare]
        assert not spare.exists()
        assert mapped[:] == expected  # a shrunk file would SIGBUS here
