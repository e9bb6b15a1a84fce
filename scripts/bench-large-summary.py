#!/usr/bin/env python3
"""Summary of scripts/bench-large.sh: per cell, the per-round ratio of the
bench's request bandwidth to ib_write_bw at the same size (the mean of the
round's two perftest runs), their median, and the medians of CQ events
(client / server) and context switches per call.

    python3 scripts/bench-large-summary.py [target/bench-large]
"""
import json
import re
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "target/bench-large")
perf = {}
line = re.compile(r"(ib_write_bw|ib_read_bw) (1m|16m) r(\d+) ([ab]):\s+\d+\s+\d+\s+[\d.]+\s+([\d.]+)")
for m in line.finditer((out / "perftest.txt").read_text()):
    # perftest's average MiB/s, as bytes per second
    perf.setdefault((m[1], m[2], int(m[3])), []).append(float(m[5]) * 1048576)
ref = {k: sum(v) / len(v) for k, v in perf.items()}
rounds = sorted({k[2] for k in ref})
for tool, size in (("ib_write_bw", "1m"), ("ib_read_bw", "1m"), ("ib_write_bw", "16m")):
    vals = [ref.get((tool, size, r)) for r in rounds]
    print(f"{tool} {size}, MB/s per round:", " ".join("-" if v is None else f"{v / 1e6:.1f}" for v in vals))
rows = {}
for f in sorted(out.glob("*-r*.json")):
    path, way, r = re.fullmatch(r"(\w+)-(\w+)-r(\d+)\.json", f.name).groups()
    for c in json.loads(f.read_text())["cells"]:
        size = {1 << 20: "1m", 16 << 20: "16m"}.get(c["payload"])
        if size is None:
            continue
        if c.get("error"):
            print(f"{path} {way} round {r} {size} x{c['inflight']}: {c['error']}")
            continue
        w = ref.get(("ib_write_bw", size, int(r)))
        if not w:
            continue
        cq = c["rdma"]["cq_events"]
        server = c["rdma"].get("cq_events_server") or 0.0
        rows.setdefault((size, c["inflight"], path, way), []).append(
            (c["bytes_per_s"] / w, cq - server, server, c.get("ctx_switches_per_call") or 0.0)
        )
print("| payload x in flight | path | way | ratio to ib_write_bw per round: median | CQ events client / server | ctx sw per call |")
print("|---|---|---|---|---|---|")
for (size, k, path, way), v in sorted(rows.items()):
    ratios = " ".join(f"{x[0]:.2f}" for x in v)
    med = lambda i: statistics.median(x[i] for x in v)
    print(f"| {size} x {k} | {path} | {way} | {ratios}: **{med(0):.2f}** | {med(1):.2f} / {med(2):.2f} | {med(3):.1f} |")
