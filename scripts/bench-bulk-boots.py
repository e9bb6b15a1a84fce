"""Issue 12's targets over several boots: for each output directory of
`BULK_MAIN_ONLY=1 scripts/bench-bulk.sh` (one boot each), the rdma request
MB/s of 1 MiB and 16 MiB unary calls at 1 and 8 in flight (median of the
boot's rounds), as ratios to the boot's ib_write_bw at that size (the higher
of its runs: the conservative choice) and rdma / tonic-tcp calls/s; then the
median and spread over the boots.
Usage: python3 scripts/bench-bulk-boots.py target/bulk-b2 target/bulk-b3 ..."""
import glob, json, re, statistics as st, sys

dirs = sys.argv[1:] or sys.exit(__doc__)


def ib_write_bw(d, size):
    out = []
    for f in glob.glob(f"{d}/bw-{size}*.txt"):
        if f.endswith(".server.txt"):
            continue
        for line in open(f):
            m = re.match(r"^ *(\d+) +(\d+) +([\d.]+) +([\d.]+)", line)
            if m and int(m.group(1)) == size:
                # perftest's MB is 2^20 bytes; ours (bytes_per_s / 1e6) is 10^6.
                out.append(float(m.group(4)) * 1048576 / 1e6)
    return max(out) if out else None


def cells(d):
    out = {}
    for f in sorted(glob.glob(f"{d}/after-[0-9].json")):
        for c in json.load(open(f))["cells"]:
            if not c.get("error"):
                out.setdefault((c["path"], c["payload"], c["inflight"]), []).append(c)
    return out


rows = {}
for d in dirs:
    cs = cells(d)
    for size in (1 << 20, 16 << 20):
        ref = ib_write_bw(d, size)
        for k in (1, 8):
            r, t = cs.get(("rdma", size, k)), cs.get(("tonic-tcp", size, k))
            if not r:
                continue
            mb = st.median(c["bytes_per_s"] for c in r) / 1e6
            vs_tonic = (st.median(c["calls_per_s"] for c in r) /
                        st.median(c["calls_per_s"] for c in t)) if t else None
            rows.setdefault((size, k), []).append((d, mb, ref, mb / ref if ref else None, vs_tonic))

print("| payload × in flight | " + " | ".join(f"boot {i + 1}: MB/s (ib_write_bw) = ratio; vs tonic" for i in range(len(dirs))) +
      " | median ratio to ib_write_bw [range] | median rdma / tonic calls/s |")
print("|---|" + "---|" * len(dirs) + "---:|---:|")
for (size, k), v in sorted(rows.items()):
    cellstr = [f"{mb:.1f} ({ref:.1f}) = {r:.2f}×; {t:.2f}×" if r and t else "–" for _, mb, ref, r, t in v]
    ratios = [r for *_, r, _ in v if r]
    tonic = [t for *_, t in v if t]
    print(f"| {size >> 20} MiB × {k} | " + " | ".join(cellstr) +
          f" | **{st.median(ratios):.2f}×** [{min(ratios):.2f}–{max(ratios):.2f}] | {st.median(tonic):.2f}× |")
