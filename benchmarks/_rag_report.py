"""rag_qps.py's tables and target verdicts."""

from __future__ import annotations

from typing import Dict, List, Optional

import _bench

from flashstream.sizes import format_size

MMAP_SHARE = 0.95        # warm mmap QPS at least this share of the in-RAM index's
OPEN_SHARE = 0.02        # mmap open time at most this share of the in-RAM load time
OPEN_MIN_BYTES = 1 << 30  # ... on an index of at least this size
RECORD_US = 2.0          # recording one query's latency costs under this many microseconds
COLD_P95_SHARE = 0.1     # cold direct p95 at most this share of cold mmap p95
CAPPED_QPS_RATIO = 5.0   # QPS at the SLO, larger than memory: direct at least this x mmap's
WARM_P95_RATIO = 1.2     # warm direct p95 within this x warm mmap p95
PAGE_CACHE_SHARE = 0.01  # page cache of the index after a direct run: under this share
INDEX_PER_CACHE = 2.0    # capped runs: index at least this x the memory the process may cache


def sustainable(runs: List[Dict[str, object]], slo_s: float) -> Optional[float]:
    """The highest offered QPS served on time: p95 within the SLO, and at least 95% of the
    rate its Poisson schedule actually offered achieved."""
    ok = [r["offered_qps"] for r in runs
          if r["latency_us"]["p95"] is not None and r["latency_us"]["p95"] <= slo_s * 1e6
          and r["achieved_qps"] >= 0.95 * r.get("scheduled_qps", r["offered_qps"])]
    return max(ok) if ok else None


def table(scenarios: List[Dict[str, object]], slo_s: float) -> None:
    rows = []
    for s in scenarios:
        c = s["closed"]
        rows.append({"scenario": s["name"], "max QPS": c["achieved_qps"],
                     "p50 us": c["latency_us"]["p50"], "p95 us": c["latency_us"]["p95"],
                     "p99 us": c["latency_us"]["p99"], "recall": c["recall"],
                     "cached after": c["residency_after"],
                     f"QPS at p95<={slo_s * 1e3:g}ms": s["sustainable_qps"],
                     "write GB/s": (s.get("write_load") or {}).get("gbps")})
    print("\nclosed loop (max QPS) per scenario:")
    _bench.print_table(rows, list(rows[0]))
    print("\nopen loop (latency from each query's scheduled time):")
    rows = [{"scenario": s["name"], "offered": r["offered_qps"], "achieved": r["achieved_qps"],
             "p50 us": r["latency_us"]["p50"], "p95 us": r["latency_us"]["p95"],
             "p99 us": r["latency_us"]["p99"], "late": r["late"], "recall": r["recall"],
             "cached before": r["residency_before"]}
            for s in scenarios for r in s["open"]]
    _bench.print_table(rows, list(rows[0]))


def cold_and_warm(cold: Dict[str, object], warm: Dict[str, object]) -> None:
    print(f"\ncold, caches emptied before each query, {cold['queries']} queries, batch 1:")
    rows = [{"mode": m, **{p: cold[m]["latency_us"][p] for p in ("p50", "p95", "p99", "max")},
             "wrong": cold[m]["wrong"]} for m in ("mmap", "direct")]
    _bench.print_table(rows, list(rows[0]))
    print(f"  direct / mmap: p50 {cold['p50_ratio']:.3f}, p95 {cold['p95_ratio']:.3f}")
    print(f"warm, everything cached, median of {warm['rounds']} alternating rounds of "
          f"{warm['queries_per_round']} queries: mmap p95 {warm['mmap']['p95_us']:,.0f} us, "
          f"direct p95 {warm['direct']['p95_us']:,.0f} us = {warm['p95_ratio']:.3f}")


def capped(study: Dict[str, object]) -> None:
    print(f"\nlarger than memory, open loop at rising QPS ({study['threads']} threads), "
          f"Zipf {study['zipf']:g} over {study['distinct_queries']:,} distinct queries:")
    rows = []
    for condition, runs in study["runs"].items():
        for io in ("mmap", "direct"):
            run = runs[io]
            for level in run["levels"]:
                rows.append({"beside": condition, "io": io, "offered": level["offered_qps"],
                             "achieved": level["achieved_qps"],
                             "p50 us": level["latency_us"]["p50"],
                             "p95 us": level["latency_us"]["p95"],
                             "p99 us": level["latency_us"]["p99"], "wrong": level["wrong"],
                             "file cached": level["residency"]})
    _bench.print_table(rows, list(rows[0]))
    for condition, runs in study["runs"].items():
        for io in ("mmap", "direct"):
            memory = runs[io].get("memory")
            if memory:
                print(f"  {condition}, {io}: memory cgroup limit set to "
                      f"{memory['limit'] / 2**20:,.0f} MiB = its own "
                      f"{memory['uncached_at_start'] / 2**20:,.0f} MiB (not page cache) + "
                      f"{memory['room'] / 2**20:,.0f} MiB it may cache; the limit was hit "
                      f"{(runs[io].get('memory_after') or {}).get('limit_hits', 0):,} times")
        direct = runs["direct"]
        low = lowest_level_p95(runs)
        if low:
            print(f"  {condition}: at {low['qps']:g} QPS p95 mmap {low['mmap'] / 1e3:,.1f} ms, "
                  f"direct {low['direct'] / 1e3:,.1f} ms ({low['ratio']:.3f} x)")
        print(f"  {condition}: QPS at the SLO mmap {runs['mmap']['sustained_qps']}, direct "
              f"{direct['sustained_qps']} (ratio {_text(runs['ratio'])}); direct's list cache "
              f"hit rate {direct['direct']['list_cache']['hit_rate']:.2f}, page cache it left "
              f"{page_cache_of_direct(direct):.4f} of the index")


def lowest_level_p95(runs: Dict[str, object]) -> Optional[Dict[str, float]]:
    """Both modes' p95 (us) at the lowest level both ran: the comparison that remains when
    neither meets the SLO (beside a load that saturates the drive)."""
    mmap, direct = (runs[io]["levels"] for io in ("mmap", "direct"))
    if not (mmap and direct and mmap[0]["latency_us"]["p95"] and direct[0]["latency_us"]["p95"]):
        return None
    m, d = mmap[0]["latency_us"]["p95"], direct[0]["latency_us"]["p95"]
    return {"qps": mmap[0]["offered_qps"], "mmap": m, "direct": d, "ratio": d / m}


def page_cache_of_direct(run: Dict[str, object]) -> float:
    """The page cache a direct serving process left, as a share of the index: the index
    file's residency once it had warmed up (before the mmap process started), and what its
    memory cgroup was charged for page cache over the whole run (any file; capped runs)."""
    return max(run["residency_after_warmup"], run.get("page_cache_added") or 0.0)


def _text(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def check_targets(record: Dict[str, float], opened: List[Dict[str, object]],
                  warm_ram: Dict[str, object], cold: Optional[Dict[str, object]],
                  warm: Optional[Dict[str, object]], study: Optional[Dict[str, object]],
                  wrong: int) -> Dict[str, Dict[str, object]]:
    verdicts = {
        "warm mmap QPS / warm in-RAM QPS": {"value": warm_ram["ratio"],
                                            "target": f">= {MMAP_SHARE}",
                                            "met": warm_ram["ratio"] >= MMAP_SHARE},
        "recording latency, us per query": {"value": record["record_us"],
                                            "target": f"< {RECORD_US}",
                                            "met": record["record_us"] < RECORD_US},
        "results differing from FAISS in RAM (queries)": {"value": float(wrong),
                                                          "target": "0", "met": wrong == 0}}
    for o in opened:
        big = o["bytes"] >= OPEN_MIN_BYTES
        verdicts[f"mmap open time / in-RAM load time, {o['type']}"] = {
            "value": o["ratio"],
            "target": f"<= {OPEN_SHARE}" + ("" if big else
                                            f" (not applicable: {format_size(o['bytes'])} "
                                            f"< {format_size(OPEN_MIN_BYTES)})"),
            "met": o["ratio"] <= OPEN_SHARE or not big}
    if cold is not None:
        verdicts["cold p95 direct / mmap, batch 1"] = {
            "value": cold["p95_ratio"], "target": f"<= {COLD_P95_SHARE}",
            "met": cold["p95_ratio"] <= COLD_P95_SHARE}
    if warm is not None:
        verdicts["warm p95 direct / mmap"] = {"value": warm["p95_ratio"],
                                              "target": f"<= {WARM_P95_RATIO}",
                                              "met": warm["p95_ratio"] <= WARM_P95_RATIO}
    if study is not None:
        verdicts.update(_capped_targets(study))
    print("\ntargets:")
    _bench.print_verdicts(verdicts)
    return verdicts


def _capped_targets(study: Dict[str, object]) -> Dict[str, Dict[str, object]]:
    out = {}
    share = study["index_bytes"] / study["room"]
    capped = bool(study["capped"])
    note = "" if capped else " (not applicable: no memory cgroup, the index was not capped)"
    out["capped runs: index / memory the process may cache"] = {
        "value": share, "target": f">= {INDEX_PER_CACHE}" + note,
        "met": share >= INDEX_PER_CACHE and capped}
    levels = study["levels_qps"]
    for condition, runs in study["runs"].items():
        m, d = runs["mmap"]["sustained_qps"], runs["direct"]["sustained_qps"]
        # mmap on time at no level: its QPS is below the lowest, so d / lowest is a floor.
        ratio = (d / m if m else d / min(levels)) if d else 0.0
        floor = "" if m else " (mmap met no level: a lower bound)"
        out[f"QPS at the SLO direct / mmap, larger than memory, {condition}"] = {
            "value": ratio, "target": f">= {CAPPED_QPS_RATIO}" + floor + (
                "" if condition == "alone" else " (reported; the target is for alone)"),
            "met": ratio >= CAPPED_QPS_RATIO}
        after = page_cache_of_direct(runs["direct"])
        out[f"page cache the direct run left, share of the index, {condition}"] = {
            "value": after, "target": f"< {PAGE_CACHE_SHARE}", "met": after < PAGE_CACHE_SHARE}
    return out
