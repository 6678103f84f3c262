"""Examples, the benchmark and the CLI run end to end at tiny sizes, so they never rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env
from shardgen import make_samples, write_tar

from flashstream.cli import main as cli_main
from flashstream.emulation import throttle_support
from flashstream.telemetry.fio import fio_available

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=None):
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                            cwd=cwd, timeout=600, env=child_env())
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_example_read_shards(tmp_path):
    out = run(ROOT / "examples" / "read_shards.py", tmp_path)
    assert "epoch 1: 256 samples" in out


def test_example_checkpoint(tmp_path):
    out = run(ROOT / "examples" / "checkpoint.py", tmp_path)
    assert "resumed at step 30" in out and "GB/s" in out


def test_example_serve_index(tmp_path):
    pytest.importorskip("faiss")
    out = run(ROOT / "examples" / "serve_index.py", tmp_path)
    assert "served direct" in out and "after: 0%" in out and "refreshed: True" in out


def test_epoch_benchmark_generates_data_and_writes_json(tmp_path, monkeypatch):
    pytest.importorskip("webdataset")
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the probe's cache
    out_json = tmp_path / "epoch.json"
    out = run(ROOT / "benchmarks" / "epoch.py", "--size", "3MiB", "--jpeg-size", "1MiB",
              "--rounds", "2", "--workers", "1", "--batch-size", "8", "--probe-size", "16MiB",
              "--workdir", tmp_path / "data", "--json", out_json)
    assert "tensors" in out and "EpochMonitor report" in out and "targets" in out
    result = json.loads(out_json.read_text())
    assert result["loader"] == {"workers": 1, "batch_size": 8, "rounds": 2,
                                "persistent_workers": True}
    assert result["probe"]["best_read_gbps"] > 0
    for profile in ("100KB", "8KB"):
        median = result["results"][profile]["median"]
        samples = median["inprocess"]["samples"]
        assert samples > 0
        assert median["tensors"]["samples"] == median["webdataset"]["samples"] == samples
        assert median["tensors_vs_webdataset"] > 0 and 0.0 <= median["tensors"]["residency"] <= 1
        # CPU of this process and the workers, per GB of shard bytes; speed against the drive
        for name in ("inprocess", "tensors", "webdataset"):
            figures = median[name]
            assert figures["cpu_s"] > 0 and figures["gbps_vs_drive"] > 0, (profile, name)
            assert figures["cpu_s"] == pytest.approx(figures["cpu_main_s"]
                                                     + figures["cpu_others_s"])
            gb = result["results"][profile]["bytes"] / 1e9
            assert figures["cpu_s_per_gb"] == pytest.approx(figures["cpu_s"] / gb, rel=1e-6)
        assert median["tensors"]["cpu_others_s"] > 0  # the persistent worker's share
        assert median["tensors_cpu_vs_webdataset"] > 0
    jpeg = result["results"]["jpeg"]["median"]
    assert jpeg["decode_flashstream"]["samples"] == jpeg["decode_webdataset"]["samples"] > 0
    assert jpeg["decode_flashstream"]["cpu_s_per_gb"] > 0 and jpeg["decode_cpu_vs_webdataset"] > 0
    assert (tmp_path / "epoch.png").stat().st_size > 0
    targets = result["targets"]
    assert any("page cache" in label for label in targets)
    assert all({"value", "target", "met"} <= set(v) for v in targets.values())
    assert {"100KB: tensors(B) core-seconds per GB delivered (this process and the workers)",
            "8KB: tensors(B) / webdataset .map(to_tensor).batched(B), core-seconds per GB",
            "100KB: tensors(B) through DataLoader workers / the drive (fio, else the probe), "
            "GB/s"} <= set(targets)
    # webdataset's speed ratios are context, never a verdict
    assert not any(label.endswith("batched(B), same loader, samples/s") for label in targets)
    assert result["context"]["100KB"]["tensors_vs_webdataset"] > 0
    assert "context, not targets" in out and "core-s/GB" in out


def test_epoch_benchmark_on_existing_data(tmp_path):
    write_tar(tmp_path / "a.tar", make_samples(20, sizes=[5000]))
    out = run(ROOT / "benchmarks" / "epoch.py", "--data", tmp_path, "--rounds", "1",
              "--no-probe", "--no-webdataset", "--no-fio", "--no-persistent-workers",
              "--workers", "1", "--batch-size", "6", "--json", tmp_path / "o.json",
              "--plot", tmp_path / "plots" / "o.png")
    assert "tensors" in out and "probe of" not in out
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["probe"] is None and result["loader"]["persistent_workers"] is False
    median = result["results"][tmp_path.name]["median"]
    assert median["inprocess"]["samples"] == median["tensors"]["samples"] == 20
    assert median["tensors"]["batches"] == 4  # 20 samples in batches of 6
    assert "gbps_vs_probe" not in median["inprocess"] and "webdataset" not in median
    assert "gbps_vs_drive" not in median["tensors"]  # neither fio nor the probe: no drive
    # workers that are not persistent: started and reaped inside the epoch, still counted
    assert median["tensors"]["cpu_others_s"] > 0 and median["tensors"]["cpu_s_per_gb"] > 0
    if "plot:" in out:  # matplotlib installed
        assert (tmp_path / "plots" / "o.png").stat().st_size > 0


def test_checkpoint_benchmark_runs_every_writer(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the probe's cache
    out_json = tmp_path / "checkpoint.json"
    out = run(ROOT / "benchmarks" / "checkpoint.py", "--dir", tmp_path / "ckpt", "--size",
              "48MiB", "--saves", "2", "--probe-size", "16MiB", "--reader", "--reader-size",
              "8MiB", "--json", out_json)
    assert "targets:" in out and "SaveReport" in out
    result = json.loads(out_json.read_text())
    assert result["environment"]["state_bytes"] == pytest.approx(48 << 20, rel=0.01)
    assert result["reader_idle"]["p95_us"] > 0 and result["reader_idle"]["epochs"] == 3
    writers = result["writers"]
    assert list(writers) == ["torch.save", "dcp", "unpaced", "fixed", "auto", "copy"]
    for name, writer in writers.items():
        assert "error" not in writer, (name, writer)
        assert len(writer["saves"]) == 2
        assert writer["stall_first_s"] > 0 and writer["stall_s"] > 0 and writer["gbps"] > 0
        assert writer["bytes"] >= result["environment"]["state_bytes"]
        reader = writer["reader"]
        assert reader["epochs"] >= 1 and reader["p95_us"] > 0 and reader["p95_vs_idle"] > 0
        assert reader["save"]["gbps"] > 0
        assert writer["saves"][-1]["write_timeline"], name
    assert writers["torch.save"]["durable_stall_s"] >= writers["torch.save"]["stall_s"]
    for name in ("unpaced", "fixed", "auto"):
        report = writers[name]["saves"][-1]["report"]
        assert report["rate_mode"] == {"unpaced": "none"}.get(name, name)
        assert report["latency_us"]["count"] > 0 and report["timeline"]
        assert report["probe"]["best_write_gbps"] > 0  # SaveReport.compare(probe)
    fixed = writers["fixed"]
    assert fixed["target_rate"] == pytest.approx(writers["unpaced"]["gbps"] * 1e9 / 2, rel=0.01)
    assert fixed["rate_accuracy"] > 0
    # peak_rate stays 0 when a write is shorter than one 0.1 s window, as at this size
    assert writers["auto"]["peak_rate"] >= 0 and isinstance(writers["auto"]["cliff"], bool)
    if result["fio"]["gbps"] is not None:  # fio installed, and the run long enough to time
        assert writers["unpaced"]["gbps_vs_fio"] > 0
    assert {"value", "target", "met"} <= set(next(iter(result["targets"].values())))
    left = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert left == ["reader-100KB-8388608"]  # every checkpoint and fio file removed
    png = tmp_path / "checkpoint.png"  # beside the JSON by default
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.skipif(throttle_support() is None,
                    reason="needs root and a cgroup block-I/O controller")
def test_emulated_checkpoint_benchmark_runs_auto_and_fio_at_its_pace(tmp_path):
    """checkpoint.py --emulate end to end at a tiny size: the model is learned, auto and fio
    at auto's pace run the same schedule, and the reader's ratios are set side by side (their
    figures are the benchmark's to judge, not this test's)."""
    pytest.importorskip("matplotlib")
    out_json = tmp_path / "emulated.json"
    out = run(ROOT / "benchmarks" / "checkpoint.py", "--emulate", "plc", "--dir",
              tmp_path / "ckpt", "--modes", "fio-paced,auto", "--saves", "2", "--cache-size",
              "48MiB", "--size", "64MiB", "--reader-file-size", "32MiB", "--json", out_json)
    assert "emulated plc drive" in out and "write model of" in out and "after the probe" in out
    result = json.loads(out_json.read_text())
    settle = result["settle"]  # the runs waited for reads to be back to their speed
    assert settle["before_p95_s"] > 0 and settle["samples_p95_s"] and settle["waited_s"] > 0
    modes = result["modes"]
    assert list(modes) == ["auto", "fio-paced"][:len(modes)]  # auto first: fio takes its pace
    auto = modes["auto"]
    assert [s["step"] for s in auto["saves"]] == [1, 2]
    assert auto["writer"] == {"rate": "auto", "within": result["schedule"]["within"]}
    assert auto["reader"]["quiet"]["reads"] > 0 and auto["timeline"]
    # the read calls alone (the drive's share of each read) beside the latency from due
    calls = auto["reader"]["read_calls"]["quiet"]
    assert calls["reads"] == auto["reader"]["quiet"]["reads"]
    assert 0 < calls["p50_s"] <= auto["reader"]["quiet"]["p50_s"]
    assert all(len(r) == 3 and -1e-3 <= r[2] <= r[1] + 1e-6 for r in auto["reads"])
    if fio_available():
        assert "per save at auto's pace" in out
        fio = modes["fio-paced"]
        pace = fio["writer"]["fio"]
        assert pace["source"] == "auto"
        assert pace["nbytes"] == pytest.approx(auto["saves"][0]["bytes"], rel=0.01)
        assert [s["pacing"]["new_file"] for s in fio["saves"]] == [True, False]
        inodes = {s["pacing"]["inode"] for s in fio["saves"]}
        assert len(inodes) == 1  # the second save wrote over the first one's file
        for save in fio["saves"]:
            assert save["pacing"]["writer"] == "fio" and save["bytes"] >= pace["nbytes"]
            # fio kept the pace: no faster than the rate, by its clock and by ours
            assert save["write_s"] >= 0.8 * save["bytes"] / pace["rate"]
            assert save["pacing"]["fio_gbps"] <= 1.25 * pace["rate"] / 1e9
        reference = result["against_fio"]
        assert reference is not None and reference["rate"] == pace["rate"]
        assert set(reference["auto"]["over_fio"]) == {"saves", "saves_2_plus", "data_write",
                                                      "read_calls"}
    assert result["targets"] and (tmp_path / "emulated.png").stat().st_size > 10_000


def test_cli_scan_and_info(tmp_path, capsys):
    good = write_tar(tmp_path / "a.tar", make_samples(12))
    assert cli_main(["scan", str(good), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == 12 and summary["errors"] == []
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar file" * 100)
    assert cli_main(["scan", str(good), str(bad)]) == 1
    assert "bad.tar at byte offset 0" in capsys.readouterr().out
    assert cli_main(["info"]) == 0
    assert "engine" in capsys.readouterr().out
    assert cli_main(["device", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dev"]


def test_checkpoint_benchmark_busy_and_many_small(tmp_path):
    out_json = tmp_path / "small.json"
    out = run(ROOT / "benchmarks" / "checkpoint.py", "--dir", tmp_path / "ckpt", "--many-small",
              "2000", "--busy", "--writers", "torch.save,unpaced", "--saves", "2",
              "--no-probe", "--no-fio", "--json", out_json)
    assert "other core(s) kept busy" in out and "2000 tensors" in out
    result = json.loads(out_json.read_text())
    env = result["environment"]
    assert env["tensors"] == 2000 and env["busy_cores"] == (os.cpu_count() or 1) - 1
    assert result["config"]["many_small"] == 2000 and result["config"]["busy"] is True
    assert result["writers"]["unpaced"]["stall_vs_torch_save"] > 0


def test_startup_benchmark_compares_methods_and_ranks(tmp_path):
    data = tmp_path / "set"
    data.mkdir()
    for s in range(3):
        write_tar(data / f"s{s}.tar", make_samples(6, sizes=[300_000], seed=s,
                                                   prefix=f"s{s}-"))
    out = run(ROOT / "benchmarks" / "startup.py", "--data", data, "--rounds", "1",
              "--ranks", "1,2", "--sources", "sidecar,scan", "--batch-size", "4", "--workers", "1",
              "--workdir", tmp_path / "work", "--json", tmp_path / "o.json")
    assert "scan methods" in out and "first batch s" in out
    result = json.loads((tmp_path / "o.json").read_text())["results"]["set"]
    median = result["methods"]["median"]
    assert {m: v["samples"] for m, v in median.items()} == dict.fromkeys(
        ("full", "sequential", "hop", "auto"), 18)
    assert median["hop"]["methods"]["hop"] == 3 and median["hop"]["bytes"] < result["bytes"] / 10
    rows = {(r["source"], r["ranks"]): r for r in result["ranks"]}
    assert set(rows) == {("sidecar", 1), ("sidecar", 2), ("scan", 1), ("scan", 2)}
    assert rows[("sidecar", 2)]["index_share"] < 0.01  # only the small sidecar files
    assert all(r["samples"] == r["loader_samples"] == 4
               for row in rows.values() for r in row["per_rank"])
    assert not list(data.glob("*.fsidx"))  # sidecars went beside links in the workdir


def test_reads_beside_writes_benchmark_runs_every_condition(tmp_path):
    out_json = tmp_path / "o.json"
    out = run(ROOT / "benchmarks" / "reads_beside_writes.py", "--dir", tmp_path / "d",
              "--rounds", "2", "--window", "0.3", "--rate", "40MB", "--json", out_json)
    assert "p95 x idle" in out
    result = json.loads(out_json.read_text())
    conditions = result["conditions"]
    assert list(conditions) == ["idle", "write-new", "write-over", "free-unlink",
                                "free-gradual"]
    assert conditions["idle"]["p95_x_idle"] == 1.0
    assert all(c["reads"] > 0 and len(c["p95_x_idle_per_round"]) == 2
               for c in conditions.values())
    assert not (tmp_path / "d" / "files").exists()  # its scratch files are gone


def test_reads_beside_writes_sweeps_the_pace(tmp_path):
    out_json = tmp_path / "o.json"
    out = run(ROOT / "benchmarks" / "reads_beside_writes.py", "--dir", tmp_path / "d",
              "--rounds", "2", "--window", "0.3", "--rate", "20MB,40MB",
              "--conditions", "write-over", "--json", out_json)
    assert "write-over 20 MB/s" in out and "write-over 40 MB/s" in out
    result = json.loads(out_json.read_text())
    assert result["rates"] == [20e6, 40e6]
    conditions = result["conditions"]
    assert list(conditions) == ["idle", "write-over 20 MB/s", "write-over 40 MB/s"]
    assert [(c["condition"], c["rate"]) for c in conditions.values()] == [
        ("idle", 0.0), ("write-over", 20e6), ("write-over", 40e6)]
    assert all(c["reads"] > 0 for c in conditions.values())
    if "plot skipped" not in out:
        assert out_json.with_suffix(".png").stat().st_size > 0
    assert sorted(w[1] for w in result["windows"]) == sorted(list(conditions) * 2)


def test_reads_beside_writes_sweeps_the_request_size(tmp_path):
    """Each write condition once per --request size, and the read calls apart from the wait
    before them (the drive's share of each read's latency)."""
    out_json = tmp_path / "o.json"
    out = run(ROOT / "benchmarks" / "reads_beside_writes.py", "--dir", tmp_path / "d",
              "--rounds", "2", "--window", "0.3", "--rate", "40MB", "--request", "64KiB,1MiB",
              "--conditions", "write-over", "--json", out_json)
    assert "read calls" in out
    conditions = json.loads(out_json.read_text())["conditions"]
    assert list(conditions) == ["idle", "write-over in 64.0 KiB", "write-over in 1.0 MiB"]
    assert [c["request"] for c in conditions.values()] == [0, 64 << 10, 1 << 20]
    for c in conditions.values():
        assert c["read_calls"]["reads"] == c["reads"] > 0
        assert c["read_calls"]["p50_s"] <= c["p50_s"]
        assert c["read_calls_p95_x_idle_round_median"] > 0


def test_reads_beside_writes_rejects_a_bad_rate_list(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reads_beside_writes.py"),
                           "--dir", str(tmp_path / "d"), "--rate", "20MB,20MB"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "distinct positive" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reads_beside_writes.py"),
                           "--dir", str(tmp_path / "d"), "--request", "1000"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "multiples of 4KiB" in proc.stderr
