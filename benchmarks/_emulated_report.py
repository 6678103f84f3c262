"""What the emulated checkpoint benchmark (_emulated.py) reports: the reader's latency in the
windows around each save, the ratios the targets judge, the table, and the targets."""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Tuple

import _bench
from _open_loop import latency_summary

from flashstream.sizes import format_size

__all__ = ["BASELINE", "FIO", "against_fio", "baseline_p95", "check_targets", "complement",
           "per_save", "phases", "print_against_fio", "slo_reference", "table"]

FIO = "fio-paced"      # fio at auto's pace: what a plain write at that pace costs the reader
BASELINE = "none"      # the schedule's training steps without a writer: the reader's baseline
MIN_QUIET_READS = 100  # per_save: a save's neighbouring quiet windows need this many reads
P95_TARGET = 1.2       # auto's reader p95 while saving at most this many times the quiet p95
MODEL_TOLERANCE = 0.10  # the learned cache size and post-cache rate within this of the settings


# -- the reader's windows -----------------------------------------------------------------------
def complement(start: float, end: float, holes: List[Tuple[float, float]]) -> List[float]:
    """Bounds (flat: a, b, a, b, ...) of [start, end) less the ``holes``."""
    bounds, at = [], start
    for a, b in sorted(holes):
        if a > at:
            bounds += [at, min(a, end)]
        at = max(at, b)
        if at >= end:
            break
    if at < end:
        bounds += [at, end]
    return bounds


def per_save(reads, writing: List[Tuple[float, float]],
             quiet: List[float]) -> List[Dict[str, object]]:
    """Each save's reader p95 against the quiet windows next to it (from the end of the save
    before it to the start of the one after): seconds apart instead of a run's length, so the
    disk's minute-to-minute drift cancels. Their median beside the pooled ratio says whether
    one bad stretch of the disk or every save set it."""
    spans = list(zip(quiet[::2], quiet[1::2]))
    out = []
    for i, (start, end) in enumerate(writing):
        low = writing[i - 1][1] if i else -math.inf
        high = writing[i + 1][0] if i + 1 < len(writing) else math.inf
        near = [t for a, b in spans if b > low and a < high for t in (max(a, low), min(b, high))]
        saving = latency_summary(reads, start, end)["p95_s"]
        quiet_near = latency_summary(reads, *near) if near else {"reads": 0}
        # A few hundred ms between back-to-back saves give too few reads for a p95.
        around = quiet_near["p95_s"] if quiet_near["reads"] >= MIN_QUIET_READS else None
        out.append({"p95_s": saving, "quiet_p95_s": around, "ratio": _ratio(saving, around)})
    return out


def per_save_median(modes: Dict[str, Dict[str, object]], mode: str) -> Optional[float]:
    """The median over ``mode``'s saves of :func:`per_save`'s ratios."""
    ratios = [s["ratio"] for s in modes[mode]["reader"].get("per_save", []) if s["ratio"]]
    return round(statistics.median(ratios), 3) if ratios else None


def phases(reads, saves: List[Dict[str, object]], zero: float, start: float,
            end: float) -> Dict[str, Dict[str, object]]:
    """The saving window's reads by what the writer was doing: the snapshot (inside save(),
    then the copy-on-write snapshot's background copy), the data write, the tail (header,
    sync, commit, pruning), and between saves."""
    spans: Dict[str, List[float]] = {"snapshot": [], "write": [], "tail": []}
    for s in saves:
        called = s["called_s"] + zero
        started = called + (s["write_start_s"] or s["stall_s"])
        written = started + s["write_s"]
        spans["snapshot"] += [called, started]
        spans["write"] += [started, written]
        spans["tail"] += [written, s["done_s"] + zero]
    busy = [span for bounds in spans.values() for span in zip(bounds[::2], bounds[1::2])]
    out = {name: latency_summary(reads, *bounds) for name, bounds in spans.items()}
    out["between"] = latency_summary(reads, *complement(start, end, busy))
    return out


# -- report -------------------------------------------------------------------------------------
def slo_reference(modes: Dict[str, Dict[str, object]]) -> Optional[float]:
    """What ``auto+read_slo``'s SLO is a multiple of: the median of the quiet p95 of every run
    so far (the no-writer run's and each writer's quiet windows), so that one run that met a
    stall of the drive does not set an SLO nothing misses (one no-writer run's was 3.4 s)."""
    quiet = [m["reader"]["quiet"]["p95_s"] for m in modes.values()
             if m["reader"]["quiet"].get("p95_s")]
    return statistics.median(quiet) if quiet else None


def baseline_p95(modes: Dict[str, Dict[str, object]]) -> Optional[float]:
    """The no-writer run's quiet p95 (``none``, if it ran): the cross-run reference."""
    return modes[BASELINE]["reader"]["quiet"]["p95_s"] if BASELINE in modes else None


def p95_ratio(modes: Dict[str, Dict[str, object]], mode: str,
              window: str = "writing") -> Optional[float]:
    """The targets' measure: ``mode``'s reader p95 while its saves were written (``window``
    "writing_later": from the second save on) against the same run's quiet windows,
    interleaved with them."""
    reader = modes[mode]["reader"]
    return _ratio((reader.get(window) or {}).get("p95_s"), reader["quiet"]["p95_s"])


def read_call_ratio(modes: Dict[str, Dict[str, object]], mode: str) -> Optional[float]:
    """As :func:`p95_ratio`, for the read calls alone (``_open_loop.read_calls``): what the
    writes cost the reads in the drive, without what the writer's CPU use costs the reader's
    timer and threads."""
    calls = modes[mode]["reader"].get("read_calls")
    return _ratio(calls["writing"]["p95_s"], calls["quiet"]["p95_s"]) if calls else None


def cross_run_ratio(modes: Dict[str, Dict[str, object]], mode: str) -> Optional[float]:
    """``mode``'s reader p95 while writing against the no-writer run's quiet p95, taken
    minutes apart (so it carries the disk's drift between the runs)."""
    return _ratio(modes[mode]["reader"]["writing"]["p95_s"], baseline_p95(modes))


def against_fio(modes: Dict[str, Dict[str, object]]) -> Optional[Dict[str, object]]:
    """Each auto writer's reader ratio over fio-paced's, both against their own run's quiet
    windows: over the saves (from the call to the commit: auto's include its snapshot and its
    tail, fio's its start), and over the data writes alone (``phases["write"]``). 1.0: the
    writer costs the reads what fio writing the same bytes at the same pace does. None without
    a fio-paced run."""
    if FIO not in modes or p95_ratio(modes, FIO) is None:
        return None
    out: Dict[str, object] = {**modes[FIO]["writer"]["fio"], FIO: _ratios(modes, FIO)}
    for mode in ("auto", "auto+read_slo"):
        if mode in modes:
            mine, fio = _ratios(modes, mode), out[FIO]
            out[mode] = {**mine, "over_fio": {k: _ratio(v, fio[k]) for k, v in mine.items()}}
    return out


def _ratios(modes: Dict[str, Dict[str, object]], mode: str) -> Dict[str, Optional[float]]:
    reader = modes[mode]["reader"]
    quiet = reader["quiet"]["p95_s"]
    return {"saves": p95_ratio(modes, mode),
            "saves_2_plus": p95_ratio(modes, mode, "writing_later"),
            "data_write": _ratio(reader["phases"]["write"].get("p95_s"), quiet),
            "read_calls": read_call_ratio(modes, mode)}


def print_against_fio(reference: Optional[Dict[str, object]]) -> None:
    if reference is None:
        return
    fio = reference[FIO]
    source = {"auto": "auto's", "deadline": "the deadline's"}[reference["source"]]
    print(f"fio writing {format_size(reference['nbytes'])} per save at {source} pace "
          f"({reference['rate'] / 1e9:.3f} GB/s) put the reader's p95 at {fio['saves']} x quiet "
          f"(saves 2+: {fio['saves_2_plus']}; data writes: {fio['data_write']}; read calls: "
          f"{fio['read_calls']})")
    for mode in ("auto", "auto+read_slo"):
        if mode in reference:
            over = reference[mode]["over_fio"]
            print(f"  {mode}: {over['saves']} x fio's (saves 2+: {over['saves_2_plus']}; "
                  f"data writes: {over['data_write']}; read calls: {over['read_calls']})")


def table(modes: Dict[str, Dict[str, object]], schedule: Any) -> None:
    rows = []
    for mode, result in modes.items():
        quiet, writing = result["reader"]["quiet"], result["reader"]["writing"]
        saves = result["saves"]
        rows.append({
            "writer": mode,
            "cliff s": round(result["cliff_seconds"], 2),
            "cliff s per save": " ".join(f"{s['cliff_seconds']:.1f}" for s in saves),
            f"done (deadline {schedule.within:.1f} s)": " ".join(
                f"{s['completion_s']:.1f}" for s in saves),
            "deadlines met": f"{sum(s['met'] for s in saves)}/{len(saves)}",
            "reader p95 ms quiet/writing": f"{_ms(quiet['p95_s'])} / {_ms(writing['p95_s'])}",
            "p95 x quiet": p95_ratio(modes, mode),
            "saves 2+": p95_ratio(modes, mode, "writing_later"),
            "per-save median": per_save_median(modes, mode),
            "read calls p95 x quiet": read_call_ratio(modes, mode),
            "p95 x no-writer run": cross_run_ratio(modes, mode),
            "reader p99 ms writing": _ms(writing["p99_s"])})
    _bench.print_table(rows, list(rows[0]) if rows else [])


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if not a or not b else round(a / b, 3)


def check_targets(modes: Dict[str, Dict[str, object]],
                  learned: Dict[str, object]) -> Dict[str, Dict[str, object]]:
    out: Dict[str, Dict[str, object]] = {}
    for key in ("cache_size", "post_cache_rate"):
        err = learned["errors"].get(key)
        out[f"model {key}: error against the emulator"] = {
            "value": err if err is not None else float("nan"),
            "target": f"within +-{MODEL_TOLERANCE}",
            "met": err is not None and abs(err) <= MODEL_TOLERANCE}
    for mode in ("auto", "auto+read_slo"):
        if mode not in modes:
            continue
        result = modes[mode]
        later = sum(s["cliff_seconds"] for s in result["saves"][1:])
        out[f"{mode}: seconds in the cliff from the second save"] = {
            "value": later, "target": "0", "met": later == 0}
        met = [s["met"] for s in result["saves"]]
        out[f"{mode}: saves done by their deadline"] = {
            "value": float(sum(met)), "target": f"{len(met)} of {len(met)}", "met": all(met)}
        ratio = p95_ratio(modes, mode)
        out[f"{mode}: reader p95 while saving / quiet (same run)"] = {
            "value": ratio if ratio is not None else float("nan"),
            "target": f"<= {P95_TARGET}", "met": ratio is not None and ratio <= P95_TARGET}
    if "unpaced" in modes:
        result = modes["unpaced"]
        ratio = p95_ratio(modes, "unpaced")
        out["unpaced: seconds in the cliff (visible)"] = {
            "value": result["cliff_seconds"], "target": "> 0",
            "met": result["cliff_seconds"] > 0}
        out["unpaced: reader p95 while saving / quiet (visible)"] = {
            "value": ratio if ratio is not None else float("nan"),
            "target": f"> {P95_TARGET}", "met": ratio is not None and ratio > P95_TARGET}
    return out
