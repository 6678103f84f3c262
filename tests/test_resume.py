"""Exact mid-epoch resume: stop after k samples, save the state, load it, get exactly the rest.

Every resumable configuration goes through ``resume_child.check_resume``: both plans (no
index: shard plan; index: sample plan), with and without shuffling, iterated directly, through
torchdata's StatefulDataLoader with 0, 1 and 2 workers, on simulated ranks, and on real gloo
ranks in separate processes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import child_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_child import (
    UNEVEN,
    capture,
    check_resume,
    epoch_keys,
    gloo_resume,
    keys,
    resume_keys,
    spread,
    write_uneven,
)

from flashstream import CheckpointWriter, ShardStream, load_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")
from torch.utils.data import DataLoader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N = sum(UNEVEN)
PLANS = {"shards": dict(index=False), "samples": dict(index=True)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_uneven(tmp_path_factory.mktemp("uneven"))


def maker(paths, **kw):
    kw.setdefault("chunk_size", "4KiB")  # members straddle chunks: resume points mid-chunk
    return lambda: ShardStream(paths, **kw)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("shuffle", [False, 5, True])
def test_every_stopping_point_in_process(shards, plan, shuffle):
    check_resume(maker(shards, shuffle=shuffle, seed=3, **PLANS[plan]), workers=None,
                 stops=range(N + 1))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("shuffle", [False, 5])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_stateful_dataloader(shards, plan, shuffle, workers):
    make = maker(shards, shuffle=shuffle, seed=3, **PLANS[plan])
    check_resume(make, workers=workers, stops=spread(N))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       buffer=st.integers(0, 7), seed=st.integers(0, 3), epoch=st.integers(0, 2),
       plan=st.sampled_from(sorted(PLANS)), data=st.data())
def test_random_configurations(tmp_path_factory, counts, buffer, seed, epoch, plan, data):
    paths = write_uneven(tmp_path_factory.mktemp("random"), counts, sizes=[10, 700])

    def make():
        stream = ShardStream(paths, shuffle=buffer, seed=seed, chunk_size="4KiB", **PLANS[plan])
        stream.set_epoch(epoch)
        return stream

    k = data.draw(st.integers(0, sum(counts)), label="k")
    check_resume(make, workers=None, stops=[k])


def test_other_worker_counts_with_an_index(shards):
    """The sample plan resumes a state saved with 2 workers with 0, 1 or 3 (any count)."""
    make = maker(shards, shuffle=4, seed=1, index=True)
    check_resume(make, workers=2, stops=[0, 1, 5, 17, N - 1, N], resume_workers=[None, 1, 3])
    check_resume(make, workers=None, stops=[0, 9, N], resume_workers=[2])


def test_batched_states_resume_with_other_worker_counts(shards):
    """Two workers batching 3 at a time deliver positions 0,2,4 | 1,3,5 | 6,8,10 ...: what was
    delivered is no prefix of the sequence. Every other worker count still gets the rest."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    make = maker(shards, shuffle=4, seed=3, index=True)
    everything = sorted(epoch_keys(make, None))
    for batches in (1, 3, 5):
        loader = StatefulDataLoader(make(), batch_size=3, num_workers=2,
                                    collate_fn=lambda b: [s["__key__"] for s in b])
        it = iter(loader)
        before = [k for _ in range(batches) for k in next(it)]
        state = ShardStream.collect_states(json.loads(json.dumps(loader.state_dict())))
        del it, loader
        assert state["done_below"] == 0 and state["num_workers"] == 2
        for workers in (0, 3):
            stream = make()
            stream.load_state_dict(state)
            after = keys(DataLoader(stream, batch_size=None, num_workers=workers))
            assert sorted(before + after) == everything, (batches, workers)
            if workers == 3:  # and the state of a resumed pass resumes again
                stream = make()
                stream.load_state_dict(state)
                it = iter(stream)
                middle = [next(it)["__key__"] for _ in range(4)]
                again = make()
                again.load_state_dict(stream.state_dict())
                assert before + middle + keys(again) == before + after


def test_shard_plan_refuses_another_worker_count(shards):
    make = maker(shards, shuffle=4, seed=1, index=False)
    (_, state), = capture(make, 2, [5]).values()
    stream = make()
    stream.load_state_dict(ShardStream.collect_states(state))
    with pytest.raises(ValueError, match="saved with 2 DataLoader worker.*resume with "
                                         "num_workers=2"):
        next(iter(stream))


@pytest.mark.parametrize("plan", PLANS)
def test_every_engine(shards, plan, engine):
    """Resume offsets are 512-byte aligned, not 4 KiB: each engine reads from mid-block."""
    check_resume(maker(shards, shuffle=4, **PLANS[plan]), workers=None, stops=spread(N))


def test_resume_reads_only_what_was_not_delivered(tmp_path):
    """Seeks to the byte offset of the next sample: the consumed part is never read again."""
    paths = write_uneven(tmp_path, (40,), sizes=[64 << 10])
    total = Path(paths[0]).stat().st_size
    stream = ShardStream(paths, chunk_size="64KiB", index=False)
    it = iter(stream)
    for _ in range(30):
        next(it)
    state = stream.state_dict()
    offset = state["workers"]["0"]["offset"]
    assert offset > 30 * (64 << 10)
    resumed = ShardStream(paths, chunk_size="64KiB", index=False)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 10
    # only the rest, plus at most one alignment block before the offset
    assert resumed.last_stats.bytes_read <= total - offset + 4096


@pytest.mark.parametrize("plan", PLANS)
def test_gzip_shards_restart_at_their_start(tmp_path, plan):
    paths = write_uneven(tmp_path, (6, 5, 7), gzip=(1,))
    check_resume(maker(paths, shuffle=3, **PLANS[plan]), workers=None, stops=range(19))
    check_resume(maker(paths, **PLANS[plan]), workers=2, stops=[0, 7, 9, 18])


@pytest.mark.parametrize("plan", PLANS)
def test_resume_around_a_bad_shard_the_handler_skips(tmp_path, plan):
    paths = write_uneven(tmp_path, (5, 6, 4))
    cut = Path(paths[1])
    cut.write_bytes(cut.read_bytes()[:5000])  # truncated inside a member
    make = maker(paths, shuffle=3, handler="ignore", **PLANS[plan])
    reference = epoch_keys(make, None)
    assert 9 < len(reference) < 15  # the samples before the cut are kept
    check_resume(make, workers=None, stops=range(len(reference) + 1), reference=reference)


def test_samples_lost_with_their_file_do_not_stall_the_sample_plan(tmp_path):
    paths = write_uneven(tmp_path, (5, 6, 4))
    stream = ShardStream(paths, shuffle=4, handler="ignore", index=True)  # indexed now
    Path(paths[1]).unlink()
    for workers in (0, 2):
        got = keys(DataLoader(stream, batch_size=None, num_workers=workers))
        assert sorted(got) == sorted(f"sh{s}/k{i:06d}" for s, n in ((0, 5), (2, 4))
                                     for i in range(n))


def test_later_epochs_resume_their_own_order(shards):
    def make():
        stream = ShardStream(shards, shuffle=6, seed=5, index=False)
        stream.set_epoch(2)
        return stream

    reference = check_resume(make, workers=1, stops=[0, 4, 20, N])
    first = ShardStream(shards, shuffle=6, seed=5, index=False)
    assert keys(first) != reference  # epoch 0 is ordered differently
    (_, state), = capture(make, None, [4]).values()
    assert state["epoch"] == 2
    fresh = ShardStream(shards, shuffle=6, seed=5, index=False)
    fresh.load_state_dict(state)  # takes the state's epoch
    assert fresh.epoch == 2
    fresh.set_epoch(2)  # the usual loop calls this: the loaded position stays
    assert keys(fresh) == reference[4:]
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # another epoch: the loaded position is dropped
    assert len(keys(fresh)) == N


def test_state_inside_a_checkpoint(shards, tmp_path):
    """A StatefulDataLoader's state, with our states inside, is a plain checkpoint value."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    make = maker(shards, shuffle=5, seed=2, index=True)
    reference = epoch_keys(make, 2)
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=2)
    it = iter(loader)
    before = [next(it)["__key__"] for _ in range(11)]
    model = torch.nn.Linear(4, 2)
    with CheckpointWriter(tmp_path / "ckpt") as writer:
        writer.save({"model": model.state_dict(), "loader": loader.state_dict()}, step=1)
    del it, loader
    state = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(state["model"]["weight"], model.weight)
    assert before + resume_keys(make, state["loader"], 2) == reference


def test_state_is_json_and_small(shards):
    make = maker(shards, shuffle=True, seed=2, index=False)
    (_, state), = capture(make, None, [12]).values()
    assert json.loads(json.dumps(state)) == state
    assert state["plan"] == "shards" and state["epoch"] == 0
    entry = state["workers"]["0"]
    assert set(entry) == {"position", "shard", "offset", "buffer", "draws", "finished"}
    assert entry["finished"] is False
    # A buffer of 1000 took in all 32 samples; the 20 not delivered are held by reference
    # (shard, offset, end), not by copy.
    assert len(entry["buffer"]) == 3 * (N - 12) and entry["position"] == len(shards)
    (_, state), = capture(maker(shards, shuffle=True, index=True), None, [12]).values()
    assert state["workers"] == {"0": {"cursor": 12, "finished": False}}


def test_mismatched_states_are_refused(shards, monkeypatch):
    make = maker(shards, shuffle=4, seed=1, index=True)
    (_, state), = capture(make, None, [6]).values()
    cases = [
        (ShardStream(shards, shuffle=4, seed=2, index=True), "different stream settings: seed=1"),
        (ShardStream(shards, shuffle=5, seed=1, index=True), "shuffle=4"),
        (ShardStream(shards[:-1], shuffle=4, seed=1, index=True), "different shard list"),
        (ShardStream(shards, shuffle=4, seed=1, index=False), "sample plan"),
    ]
    for stream, message in cases:
        with pytest.raises(ValueError, match=message):
            stream.load_state_dict(state)
    with pytest.raises(ValueError, match="not a ShardStream state"):
        make().load_state_dict({"epoch": 1})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="rank 0 of 1, this is rank 1 of 2"):
        make().load_state_dict(state)


def test_main_process_cannot_know_plain_worker_positions(shards):
    from torch.utils.data import DataLoader

    stream = ShardStream(shards)
    assert stream.state_dict()["num_workers"] == 0  # nothing delivered yet: fine
    it = iter(DataLoader(stream, batch_size=None, num_workers=1))
    next(it)
    with pytest.raises(RuntimeError, match="StatefulDataLoader"):
        stream.state_dict()
    del it
    stream.set_epoch(1)  # at an epoch boundary the position is known again
    assert stream.state_dict()["epoch"] == 1


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks(shards, monkeypatch, world):
    """RANK/WORLD_SIZE without a process group: each rank resumes its own share exactly."""
    everything = sorted(epoch_keys(maker(shards), None))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    seen = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        for kw in (dict(index=False, shuffle=3), dict(index=True, shuffle=3),
                   dict(equal_ranks="repeat")):
            if kw.get("index") is False and world > len(shards):
                continue
            reference = epoch_keys(maker(shards, **kw), None)
            check_resume(maker(shards, **kw), workers=None, stops=range(len(reference) + 1),
                         reference=reference)
            check_resume(maker(shards, **kw), workers=1, stops=spread(len(reference)),
                         reference=reference)
            if kw.get("index") is True:
                seen.extend(reference)
    assert sorted(seen) == everything


def test_real_gloo_ranks_resume(shards, tmp_path):
    world = 3
    torch.multiprocessing.spawn(gloo_resume, args=(world, str(tmp_path / "store"), shards,
                                                   str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    everything = sorted(epoch_keys(maker(shards), None))
    for plan in ("shards", "samples"):  # every sample once, on exactly one rank
        assert sorted(k for r in results for k in r[plan]) == everything
    equal = [len(r["equal"]) for r in results]
    assert equal == [N // world] * world


@pytest.mark.parametrize("page", ["shardstream.md", "pipeline.md", "tensors.md",
                                  "migrating.md", "checkpoint.md"])
def test_docs_examples_run(tmp_path, monkeypatch, page):
    """The blocks of a docs page marked ``<!-- test: run -->``, in order, on the data the
    pages describe."""
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    train.write_shards(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"<!-- test: run -->\n( *)```python\n(.*?)\n *```", text, re.S)
    assert len(blocks) >= (5 if page == "shardstream.md" else 1)
    namespace: dict = {}
    for _indent, code in blocks:
        exec(compile(textwrap.dedent(code), f"docs/{page}", "exec"), namespace)


def test_example_train_resumes(tmp_path):
    script = ROOT / "examples" / "train.py"
    run = [sys.executable, str(script), "--workdir", str(tmp_path), "--epochs", "2"]
    first = subprocess.run(run + ["--stop-after", "7"], capture_output=True, text=True,
                           env=child_env(), timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "stopped after step 7" in first.stdout
    second = subprocess.run(run + ["--resume"], capture_output=True, text=True,
                            env=child_env(), timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed at epoch 0 step 7" in second.stdout
    assert "matches the uninterrupted run" in second.stdout
