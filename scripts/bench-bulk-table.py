"""Tables for docs/benchmarks.md from scripts/bench-bulk.sh's output directory
(default target/bench-bulk): before/after (medians of the rounds, with the
spread), ratios to ib_write_bw and tonic-tcp in the same boot, the
notification comparison, the rendezvous sweep and the streaming cells."""
import glob, json, re, statistics as st, sys

O = sys.argv[1] if len(sys.argv) > 1 else "target/bench-bulk"


def bw(size):
    """ib_write_bw average at `size` in MB/s of 10^6 bytes (all runs of that size in the boot)."""
    out = []
    for f in sorted(glob.glob(f"{O}/bw-{size}.txt") + glob.glob(f"{O}/bw-{size}-*.txt")):
        if f.endswith(".server.txt"):
            continue
        for line in open(f):
            m = re.match(r"^ *(\d+) +(\d+) +([\d.]+) +([\d.]+)", line)
            if m and int(m.group(1)) == size:
                # perftest's MB is 2^20 bytes; ours (bytes_per_s / 1e6) is 10^6.
                out.append(float(m.group(4)) * 1048576 / 1e6)
    return out


def cells(pattern):
    out = {}
    for f in sorted(glob.glob(f"{O}/{pattern}.json")):
        try:
            doc = json.load(open(f))
        except (OSError, ValueError):
            continue
        for c in doc["cells"]:
            if c.get("error"):
                continue
            out.setdefault((c["path"], c["payload"], c["inflight"]), []).append(c)
    return out


def med(cs, k):
    return st.median(c[k] for c in cs)


def runs(cs):
    return ", ".join("{:.1f}".format(c["bytes_per_s"] / 1e6) for c in cs)


def size(p):
    return f"{p >> 20} MiB" if p >= 1 << 20 else f"{p >> 10} KiB"


raw = {s: bw(s) for s in (1 << 20, 16 << 20)}
for s, v in raw.items():
    print(f"ib_write_bw {size(s)}: {', '.join(f'{x:.1f}' for x in v)} MB/s (average column, each run)")
B, A = cells("before-[0-9]"), cells("after-[0-9]")
print()
print("| payload × in flight | rdma MB/s before → after (spread after) | / ib_write_bw before → after | rdma / tonic-tcp calls/s before → after | p50 before → after | allocs/call before → after | alloc bytes/call before → after | CPU ms/call before → after | ctx sw/call before → after |")
print("|---|---|---|---|---|---|---|---|---|")
for k in sorted(A):
    path, payload, infl = k
    if path != "rdma":
        continue
    a = A[k]
    b = B.get(k)
    ref = st.median(raw[payload]) if raw.get(payload) else None
    ta, tb = A.get(("tonic-tcp", payload, infl)), B.get(("tonic-tcp", payload, infl))

    def mb(cs):
        return med(cs, "bytes_per_s") / 1e6

    def f(cs, k, scale=1.0, fmt="{:.1f}"):
        return fmt.format(med(cs, k) * scale) if cs else "–"

    ratio_b = f"{mb(b) / ref:.2f}×" if b and ref else "–"
    ratio_a = f"{mb(a) / ref:.2f}×" if ref else "–"
    tr_b = f"{med(b, 'calls_per_s') / med(tb, 'calls_per_s'):.2f}×" if b and tb else "–"
    tr_a = f"{med(a, 'calls_per_s') / med(ta, 'calls_per_s'):.2f}×" if ta else "–"
    print(
        f"| {size(payload)} × {infl} | {f(b, 'bytes_per_s', 1e-6)} → **{mb(a):.1f}** ({runs(a)}) "
        f"| {ratio_b} → **{ratio_a}** | {tr_b} → **{tr_a}** "
        f"| {f(b, 'p50_us', 1e-3)} → {f(a, 'p50_us', 1e-3)} ms "
        f"| {f(b, 'allocs_per_call', 1, '{:.0f}')} → {f(a, 'allocs_per_call', 1, '{:.0f}')} "
        f"| {f(b, 'alloc_bytes_per_call', 1 / (1 << 20), '{:.2f}')} → {f(a, 'alloc_bytes_per_call', 1 / (1 << 20), '{:.2f}')} MiB "
        f"| {f(b, 'cpu_us_per_call', 1e-3)} → {f(a, 'cpu_us_per_call', 1e-3)} "
        f"| {f(b, 'ctx_switches_per_call')} → {f(a, 'ctx_switches_per_call')} |"
    )
print()
print("tonic-tcp in the same runs (calls/s, median): " + ", ".join(
    f"{size(p)} × {i}: {med(c, 'calls_per_s'):.2f}" for (path, p, i), c in sorted(A.items()) if path == "tonic-tcp"))

print("\nChunk notification and rendezvous sweep (1 MiB, rdma; one run each):\n")
print("| run | 1 MiB × 1 MB/s | 1 MiB × 8 MB/s | / ib_write_bw (× 8) | rdv writes/call | credit msgs/call |")
print("|---|---:|---:|---:|---:|---:|")
ref = st.median(raw[1 << 20]) if raw.get(1 << 20) else None
names = ["notify-send", "notify-imm"] + [f"sweep-{b}-{n}" for b in ("64k", "256k", "1m") for n in (4, 8, 16)]
for name in names:
    c = cells(name)
    one, eight = c.get(("rdma", 1 << 20, 1)), c.get(("rdma", 1 << 20, 8))
    if not one and not eight:
        print(f"| {name} | failed | | | | |")
        continue
    x8 = med(eight, "bytes_per_s") / 1e6 if eight else None
    rd = (eight or one)[0].get("rdma") or {}
    print(
        f"| {name} | {med(one, 'bytes_per_s') / 1e6 if one else float('nan'):.1f} | {x8 if x8 else float('nan'):.1f} "
        f"| {f'{x8 / ref:.2f}×' if x8 and ref else '–'} | {rd.get('rendezvous_writes', float('nan')):.2f} | {rd.get('credit_msgs', float('nan')):.2f} |"
    )
print("\nEcho both ways and streaming (1 MiB messages; rdma vs tonic-tcp, one run each):\n")
print("| run | in flight | rdma MB/s | tonic-tcp MB/s | rdma / tonic |")
print("|---|---:|---:|---:|---:|")
for name in ("echo-both-ways", "client-stream", "server-stream"):
    c = cells(name)
    for (path, p, i), r in sorted(c.items()):
        if path != "rdma":
            continue
        t = c.get(("tonic-tcp", p, i))
        rm = med(r, "bytes_per_s") / 1e6
        tm = med(t, "bytes_per_s") / 1e6 if t else float("nan")
        print(f"| {name} | {i} | {rm:.1f} | {tm:.1f} | {rm / tm:.2f}× |")
