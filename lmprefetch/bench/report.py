"""The report of ``lmprefetch bench``: the text table and the plot."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["format_report", "plot"]

def format_report(r: dict[str, Any]) -> str:
    rep = r["replay"]
    disk_gbps = r["tier_gbps"].get("disk")
    raw = r["raw_disk_read_gbps"]
    lines = [
        "lmprefetch bench — synthetic multi-turn chat, "
        f"{r['options']['workers']} workers over {r['options']['transport']}, CPU + disk tiers",
        "",
        f"  lookup round trip (full miss)   {r['miss_rtt_us']:9.1f} µs   raw pyzmq round trip "
        f"{r['raw_rtt_us']:.1f} µs   ratio {r['miss_rtt_ratio']:.2f}× (target ≤ 1.5×)",
        f"    (a thread blocked in wait() has the answer after {r['miss_rtt_woken_us']:.1f} µs; "
        f"an echo on Trio-native sockets, the floor for any Trio worker, takes "
        f"{r['trio_echo_rtt_us']:.1f} µs)",
        f"  scheduler submit (128 chunks)   {r['submit_us']:9.2f} µs   (target ≤ 50 µs; "
        "LMCache sleeps 10 000 µs)",
        f"  scheduler pending poll          {r['poll_us']:9.3f} µs   (target ≤ 1 µs; "
        "LMCache sleeps 10 000 µs)",
        f"  full-miss lookups per worker    {r['miss_lookups_per_s_per_worker']:9.0f} /s   "
        "(target ≥ 20 000 /s)",
        f"  chat replay: {rep['lookups']} lookups, {r['options']['concurrency']} in flight, "
        f"{rep['aborted']} aborted",
        f"    lookup latency p50 / p99      {rep['latency_p50_ms']:9.3f} / "
        f"{rep['latency_p99_ms']:.3f} ms",
        f"    hit ratio                     {rep['hit_ratio']:9.1%}",
    ]
    for name, gbps in r["tier_gbps"].items():
        moved = r["tier_bytes_loaded"][name] / 1e6
        if name == "cpu":
            lines.append(f"    prefetch from cpu             zero-copy ({moved:.0f} MB handed out)")
        elif gbps is not None:
            extra = ""
            verified = r.get("raw_disk_read_verified_gbps", math.nan)
            if name == "disk" and verified == verified:
                extra = (
                    f"   raw read + xxh3 of the same files {verified:.2f} GB/s "
                    f"(unverified {raw:.2f})   ratio {gbps / verified:.2f}×"
                )
            lines.append(f"    prefetch from {name:<15} {gbps:9.2f} GB/s ({moved:.0f} MB){extra}")
    lines += [
        f"  cancel in-flight disk prefetch → released   p50 {r['cancel_release_ms_p50']:.3f} ms, "
        f"max {r['cancel_release_ms_max']:.3f} ms (target ≤ 1 ms)",
        f"  leak check: {'OK' if r['leak_free'] else 'LEAK'} — "
        + ", ".join(
            f"rank {w['rank']}: pinned {w['pinned_chunks']}, held {w['held_lookups']}, "
            f"limiter {w['limiter_used']}"
            for w in r["workers"]
        ),
    ]
    _ = disk_gbps
    return "\n".join(lines)


def plot(r: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'lmprefetch[plot]'") from exc
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lat = sorted(r["replay"]["latencies_ms"])
    if lat:
        a.plot(lat, [i / len(lat) for i in range(1, len(lat) + 1)])
    a.set_xscale("log")
    a.set_xlabel("lookup latency (ms)")
    a.set_ylabel("fraction of lookups")
    a.set_title("Chat replay: lookup latency CDF")
    names, values = [], []
    for name, gbps in r["tier_gbps"].items():
        if gbps is not None and name != "cpu":
            names.append(f"{name} prefetch")
            values.append(gbps)
    if r["raw_disk_read_gbps"] == r["raw_disk_read_gbps"]:
        names.append("raw disk read")
        values.append(r["raw_disk_read_gbps"])
    b.bar(names, values)
    b.set_ylabel("GB/s")
    b.set_title("Prefetch throughput vs the raw read")
    fig.tight_layout()
    fig.savefig(path)
