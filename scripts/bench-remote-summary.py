#!/usr/bin/env python3
"""Summarizes a scripts/bench-remote.sh run (its BENCH_OUT directory, default
target/bench-remote): per cell the median over the rounds with the spread,
and the median of the per-round ratios to perftest (same size, same round).
perftest's MB (2^20 bytes) are converted to 10^6 bytes, as the bench's.

    python3 scripts/bench-remote-summary.py [target/bench-remote]
"""
import glob
import os
import re
import statistics
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else "target/bench-remote"
ROW = re.compile(
    r"\| (\S+ \S+) \| (\d+) \| (remote-read|unary-fetch) \| (\d+) \| (\S+ \S+) \| (\S+ \S+) \| "
    r"(\S+ \S+) \| (\S+) \| (\S+) (\S+) \| (\S+) µs \(server (\S+) µs\) \| (\S+) \| (\S+) \| (.*) \|"
)


def rounds(prefix):
    n = len(glob.glob(os.path.join(OUT, prefix + "_*.txt")))
    return [r for r in range(1, n + 1) if os.path.exists(os.path.join(OUT, f"{prefix}_{r}.txt"))]


def perftest(name, col):
    """The last result line's column `col` of each round of `name`."""
    out = []
    for r in rounds(name):
        last = None
        for line in open(os.path.join(OUT, f"{name}_{r}.txt")):
            if re.match(r"^\s*\d+\s+\d+\s", line):
                last = line.split()
        out.append(float(last[col]) if last else float("nan"))
    return out


def rows(path):
    d = {}
    if os.path.exists(path):
        for line in open(path):
            m = ROW.match(line)
            if m:
                d[(m.group(1), m.group(2), m.group(3))] = m.groups()
    return d


def us(v):
    n, unit = v.split()
    return float(n) * {"ms": 1000.0, "s": 1e6}.get(unit, 1.0)


def spread(v):
    return f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"


MB = 1.048576
bw = {"1 MiB": [x * MB for x in perftest("read_bw_1m", 3)],
      "16 MiB": [x * MB for x in perftest("read_bw_16m", 3)]}
lat = perftest("read_lat", 4)  # t_typical
for size, v in bw.items():
    print(f"ib_read_bw {size}: {spread(v)} MB/s")
print(f"ib_read_lat 64 B p50: {spread(lat)} us")
for size in ("1 MiB", "16 MiB"):
    for inflight in ("1", "8"):
        for path in ("remote-read", "unary-fetch"):
            vals, ratios, server = [], [], []
            for r in rounds("bench_bulk"):
                g = rows(os.path.join(OUT, f"bench_bulk_{r}.txt")).get((size, inflight, path))
                if g:
                    vals.append(float(g[8]))
                    server.append(float(g[11].replace(",", "")))
                    ratios.append(float(g[8]) / bw[size][r - 1])
            if vals:
                print(f"{size} x{inflight} {path}: {spread(vals)} MB/s, "
                      f"{statistics.median(ratios):.2f}x ib_read_bw [{min(ratios):.2f}-{max(ratios):.2f}], "
                      f"server CPU {spread(server)} us/fetch; last round: ctx sw {g[12]}, allocs {g[13]} ({g[14]})")
for prefix, what in (("bench_small", "default runtime"), ("bench_small_t1", "one thread")):
    for path in ("remote-read", "unary-fetch"):
        vals, ratios = [], []
        for r in rounds(prefix):
            g = rows(os.path.join(OUT, f"{prefix}_{r}.txt")).get(("64 B", "1", path))
            if g and r <= len(lat):
                vals.append(us(g[4]))
                ratios.append(us(g[4]) / lat[r - 1])
        if vals:
            print(f"64 B {path}, {what}: p50 {spread(vals)} us, "
                  f"{statistics.median(ratios):.2f}x ib_read_lat [{min(ratios):.2f}-{max(ratios):.2f}] "
                  f"(ratio of medians {statistics.median(vals) / statistics.median(lat):.2f}x); "
                  f"last round: ctx sw {g[12]}, allocs {g[13]} ({g[14]})")
