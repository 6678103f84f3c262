"""benchmarks/gpu.py on a machine without a GPU: its arguments, sizing, verdicts and JSON, the
clean exit without CUDA, and a smoke run of its parts on the CPU (figures not judged)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu  # noqa: E402

from flashstream.telemetry.gpu import gpu_info  # noqa: E402

GiB = 1 << 30

pytestmark = pytest.mark.engine_independent


def test_arguments():
    args = gpu.parse_args(["--out", "x", "--sizes", "1GiB,512MiB", "--parts", "load,loop"])
    assert args.sizes == [GiB, 512 << 20] and args.parts == ["load", "loop"]
    with pytest.raises(SystemExit):
        gpu.parse_args(["--parts", "checkpoint,bogus"])
    assert gpu.parse_args(["--windows", "16MiBx16,4MiBx32"]).windows == [(16 << 20, 16),
                                                                       (4 << 20, 32)]
    assert gpu.parse_args(["--windows", ""]).windows == []
    for bad in ("16MiB", "16MiBx0", "x8"):
        with pytest.raises(SystemExit):
            gpu.parse_args(["--windows", bad])


def test_sizes_fit_card_host_disk_and_time():
    wanted = [2 * GiB, 8 * GiB, 16 * GiB]
    kept, dropped = gpu.plan_sizes(wanted, card_bytes=80 * GiB, host_bytes=128 * GiB,
                                   disk_bytes=64 * GiB, budget_s=600)
    assert kept == wanted and dropped == {}
    kept, dropped = gpu.plan_sizes(wanted, card_bytes=24 * GiB, host_bytes=128 * GiB,
                                   disk_bytes=64 * GiB, budget_s=600)
    assert kept == [2 * GiB, 8 * GiB] and dropped == {str(16 * GiB): "card memory"}
    kept, dropped = gpu.plan_sizes(wanted, card_bytes=80 * GiB, host_bytes=32 * GiB,
                                   disk_bytes=20 * GiB, budget_s=600)
    assert kept == [2 * GiB] and dropped == {str(8 * GiB): "disk", str(16 * GiB): "host memory"}
    kept, dropped = gpu.plan_sizes(wanted, card_bytes=80 * GiB, host_bytes=128 * GiB,
                                   disk_bytes=64 * GiB, budget_s=50)
    assert kept == [2 * GiB] and set(dropped.values()) == {"time budget"}


def results(stall=0.5, torch_save=20.0, d2h=20.0, pinned=24.0, ours_load=4.0, torch_load=8.0,
            busy=(0.9, 0.6), step=(0.1, 0.12)):
    return {
        "checkpoint": {"pinned_copy": {"gbps": pinned}, "sizes": {
            str(GiB): {"flashstream": {"stall_s": 9.9, "d2h_gbps": 1.0},
                       "torch_save": {"seconds": 1.0}},
            str(8 * GiB): {"flashstream": {"stall_s": stall, "d2h_gbps": d2h},
                           "torch_save": {"seconds": torch_save}}}},
        "load": {"flashstream": {"seconds": ours_load}, "torch_load": {"seconds": torch_load}},
        "loop": {"flashstream": {"busy_fraction": busy[0], "step_s": step[0]},
                 "webdataset": {"busy_fraction": busy[1], "step_s": step[1]}},
    }


def test_verdicts_judge_the_largest_size_and_each_ratio():
    table = {v["key"]: v for v in gpu.verdicts(results(), judged=True).values()}
    assert table["stall_vs_torch_save"]["value"] == pytest.approx(0.5 / 20)
    assert table["d2h_vs_pinned"]["value"] == pytest.approx(20 / 24)
    assert table["load_speedup_vs_torch_load"]["value"] == pytest.approx(2.0)
    assert table["busy_vs_webdataset"]["value"] == pytest.approx(1.5)
    assert table["step_time_vs_webdataset"]["value"] == pytest.approx(0.1 / 0.12)
    assert all(v["met"] is True for v in table.values())
    bad = {v["key"]: v["met"] for v in gpu.verdicts(
        results(stall=2.0, d2h=10.0, ours_load=8.0, busy=(0.5, 0.6), step=(0.2, 0.1)),
        judged=True).values()}
    assert not any(bad.values())


def test_nothing_is_judged_without_a_gpu_or_without_figures():
    assert all(v["met"] is None for v in gpu.verdicts(results(), judged=False).values())
    empty = gpu.verdicts({"load": {"error": "x"}}, judged=True).values()
    assert all(v["value"] is None and v["met"] is None for v in empty)
    gpu.print_verdicts(gpu.verdicts({}, judged=True))


def test_junit_summary(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="a" name="err"><error message="x"/></testcase>'
        '<testcase classname="b" name="skip"><skipped message="needs CUDA"/></testcase>'
        '</testsuite></testsuites>')
    assert gpu.junit_summary(xml) == {"passed": 1, "failed": ["a::bad", "a::err"], "skipped": 1}


def test_results_are_written_after_every_part(tmp_path):
    results = gpu.Results(tmp_path / "out" / "gpu.json", {"environment": {}})
    results.set("load", {"flashstream": {"seconds": 1.0}})
    assert json.loads((tmp_path / "out" / "gpu.json").read_text())["load"] == \
        {"flashstream": {"seconds": 1.0}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")
def test_without_cuda_it_says_so_and_exits_cleanly(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "gpu.json").read_text())
    assert payload["environment"]["cuda_available"] is False
    assert payload["skipped"].startswith("no GPU") and "checkpoint" in payload["skipped"]
    assert payload["environment"]["gds"]["used"] is False
    assert "no GPU" in capsys.readouterr().out


def test_cpu_smoke_run_of_every_measuring_part(tmp_path):
    pytest.importorskip("webdataset")
    pytest.importorskip("safetensors")
    out = tmp_path / "out"
    assert gpu.main(["--out", str(out), "--device", "cpu", "--workdir", str(tmp_path / "w"),
                     "--sizes", "4MiB,8MiB", "--parts", "checkpoint,load,loop",
                     "--steps", "3", "--warmup", "1", "--batch-size", "8", "--workers", "1",
                     "--side", "8", "--windows", "8MiBx2"]) == 0
    payload = json.loads((out / "gpu.json").read_text())
    assert payload["smoke"] is True
    sizes = payload["checkpoint"]["sizes"]
    assert set(sizes) == {str(4 << 20), str(8 << 20)}
    for figures in sizes.values():
        assert figures["flashstream"]["stall_s"] > 0 and figures["torch_save"]["seconds"] > 0
        assert "stall_s" in figures["dcp_async_save"] or "error" in figures["dcp_async_save"]
    for way in ("flashstream", "torch_load", "safetensors", "flashstream_window_8MiBx2"):
        assert payload["load"][way]["seconds"] > 0, payload["load"]
    drive = payload["load"]["drive"]
    for read in ("direct 4 MiB x 8", "direct 8 MiB x 2", "buffered 16 MiB"):
        assert drive[read]["gbps"] > 0, drive
    for loader in ("flashstream", "webdataset"):
        assert payload["loop"][loader]["steps"] == 3
        assert 0 < payload["loop"][loader]["busy_fraction"] <= 1
    assert all(v["met"] is None for v in payload["verdicts"].values())


def test_gpu_info_without_a_gpu_says_no_gds_path():
    info = gpu_info()
    assert info["gds"]["used"] is False and "no GPUDirect Storage path" in info["gds"]["why"]
    if not torch.cuda.is_available():
        assert info["cards"] == [] and info["cuda_available"] is False
