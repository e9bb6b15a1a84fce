"""Table for docs/benchmarks.md from scripts/bench-compare.sh's output
(default target/bench-compare): per bench binary (in BENCHES order, given as
arguments after the directory), medians over the rounds of p50, calls/s,
allocations, context switches and CPU per call; ratios to perftest's polling
round trip (2 x ib_send_lat t_typical), ib_write_bw and tonic-tcp."""
import glob, json, re, statistics as st, sys

O = sys.argv[1] if len(sys.argv) > 1 else "target/bench-compare"
names = sys.argv[2:] or ["after"]
pt = [l.split() for l in open(f"{O}/perftest.txt") if re.match(r"^ *64 +\d+ ", l)]
rtt = 2 * float(pt[0][4]) if pt else float("nan")
bw = [float(m.group(4)) for l in open(f"{O}/bw-1048576.txt")
      if (m := re.match(r"^ *(\d+) +(\d+) +([\d.]+) +([\d.]+)", l)) and m.group(1) == "1048576"]
bw = bw[0] if bw else float("nan")
print(f"perftest: ib_send_lat 64 B polling round trip {rtt:.1f} µs; ib_write_bw 1 MiB {bw:.1f} MB/s\n")


def cells(pat):
    out = {}
    for f in sorted(glob.glob(f"{O}/{pat}.json")):
        for c in json.load(open(f))["cells"]:
            if not c["error"]:
                out.setdefault((c["path"], c["payload"], c["inflight"]), []).append(c)
    return out


def med(cs, k):
    return st.median(c[k] for c in cs)


def merged(*pats):
    out = {}
    for p in pats:
        for k, v in cells(p).items():
            out.setdefault(k, []).extend(v)
    return out


data = {n: (merged(f"{n}-[0-9]", f"{n}-1m-[0-9]"), cells(f"{n}-ct-[0-9]")) for n in names}
print("| cell | " + " | ".join(names) + " |")
print("|---|" + "---|" * len(names))
keys = sorted({k for n in names for k in data[n][0]})
for label, pick in (("", 0), (" (current_thread)", 1)):
    ks = sorted({k for n in names for k in data[n][pick]})
    for k in ks:
        path, payload, infl = k
        if path != "rdma":
            continue
        sz = "64 B" if payload == 64 else f"{payload >> 20} MiB"
        row = []
        for n in names:
            c = data[n][pick].get(k)
            t = data[n][pick].get(("tonic-tcp", payload, infl))
            if not c:
                row.append("–")
                continue
            p50 = med(c, "p50_us")
            parts = [f"p50 {p50 / 1e3:.2f} ms" if p50 >= 1000 else f"p50 {p50:.0f} µs"]
            if payload == 64 and infl == 1:
                parts.append(f"{p50 / rtt:.0f}× perftest")
            if payload >= 1 << 20:
                parts.append(f"{med(c, 'bytes_per_s') / 1e6:.1f} MB/s = {med(c, 'bytes_per_s') / 1e6 / bw:.2f}× ib_write_bw")
            if t:
                parts.append(f"{med(c, 'calls_per_s') / med(t, 'calls_per_s'):.2f}× tonic calls/s")
            parts.append(f"{med(c, 'allocs_per_call'):.0f} allocs")
            parts.append(f"{med(c, 'ctx_switches_per_call'):.1f} ctx sw")
            parts.append(f"CPU {med(c, 'cpu_us_per_call'):.0f} µs")
            row.append(", ".join(parts))
        print(f"| rdma {sz} × {infl}{label} | " + " | ".join(row) + " |")
