#!/usr/bin/env bash
# Benchmarks; writes the generated sections of docs/benchmarks.md (text outside the
# <!-- BEGIN/END --> markers is kept).
#
#   scripts/bench.sh [all|vm|host|report]   (default: all; report: only rewrite the
#                                           doc from the raw outputs of earlier runs)
#
#   vm:   ONE Soft-RoCE VM boot (../shared/softroce/run-in-softroce-vm.sh): perftest
#         ib_send_lat / ib_write_bw on the guest's rxe device, then target/release/bench
#         over rdma, tcp-fallback and tonic-tcp; ratios against perftest and tonic.
#   host: no device needed: bench over memory, tcp-fallback and tonic-tcp, and
#         callgrind instruction counts per small call (memory path vs tonic-tcp).
#
# Env: SOFTROCE_SCRIPT (VM script), BENCH_OUT (raw outputs, default target/bench),
#      BENCH_VM_ARGS / BENCH_HOST_ARGS (extra bench flags), CG_CALLS (default 2000).
# No figure is checked: the script only measures and writes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
# cargo's target directory (honours CARGO_TARGET_DIR); raw outputs stay in the repo.
TARGET_DIR=${BENCH_TARGET_DIR:-$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')}
export BENCH_TARGET_DIR=$TARGET_DIR
BIN=$TARGET_DIR/release/bench
CG_CALLS=${CG_CALLS:-2000}      # callgrind: N and 2N small calls on the host
CG_VM_CALLS=${CG_VM_CALLS:-200} # ... and in the VM (rdma path; valgrind under TCG is slow)

# ---------------------------------------------------------------- inside the VM
if [ "${1:-}" = "--in-vm" ]; then
  OUT=$2
  D=${SOFTROCE_DEV:?not in the Soft-RoCE VM}
  X=${SOFTROCE_GID_INDEX:-1}
  {
    echo "guest: $(uname -srm), $(nproc) vCPU, device $D (GID index $X), IP $SOFTROCE_IP"
    grep -m1 'model name' /proc/cpuinfo || true
  } >"$OUT/vm-machine.txt"
  # perftest pair: server in the background, client to it over the TCP side channel.
  perf() {
    local name=$1; shift
    local tool=$1; shift
    echo "--- $tool $* (server + client, $D, GID $X)" >&2
    timeout 120 "$tool" -d "$D" -x "$X" "$@" >"$OUT/$name.server.txt" 2>&1 &
    local spid=$!
    sleep 2
    if ! timeout 120 "$tool" -d "$D" -x "$X" "$@" 127.0.0.1 >"$OUT/$name.txt" 2>&1; then
      echo "$tool client failed (see $OUT/$name.txt)" >&2
    fi
    wait "$spid" || echo "$tool server exited $?" >&2
    grep -E '^ *[0-9]+ +[0-9]+ ' "$OUT/$name.txt" >&2 || true
  }
  perf send_lat_64 ib_send_lat -s 64 -n 2000
  perf send_lat_1k ib_send_lat -s 1024 -n 1000
  perf write_bw_64k ib_write_bw -s 65536 -n 500
  perf write_bw_1m ib_write_bw -s 1048576 -n 50
  echo "--- bench" >&2
  # shellcheck disable=SC2086
  timeout 480 "$BIN" --addr "$SOFTROCE_IP:0" --paths rdma,tcp-fallback,tonic-tcp \
    --duration-ms 1000 --max-cell-mib 48 ${BENCH_VM_ARGS:-} \
    --json "$OUT/vm-bench.json" --markdown "$OUT/vm-bench.md" \
    >"$OUT/vm-bench.stdout" 2> >(tee "$OUT/vm-bench.stderr" >&2)
  # Instructions per small call on the rdma path (user space: our code, tokio,
  # tonic, libibverbs + the rxe provider), N and 2N calls as on the host.
  for n in "$CG_VM_CALLS" $((2 * CG_VM_CALLS)); do
    echo "--- callgrind rdma $n calls" >&2
    timeout 400 valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.rdma.$n.out" \
      "$BIN" --addr "$SOFTROCE_IP:0" --paths rdma --payloads 64 --inflight 1 --iters "$n" \
      --warmup 50 --threads 2 >"$OUT/cg.rdma.$n.stdout" 2>"$OUT/cg.rdma.$n.stderr" ||
      echo "callgrind rdma $n failed: see $OUT/cg.rdma.$n.stderr" >&2
  done
  exit 0
fi

MODE=${1:-all}
case $MODE in all | vm | host | report) ;; *) echo "usage: $0 [all|vm|host|report]" >&2; exit 2 ;; esac
OUT=${BENCH_OUT:-$ROOT/target/bench}
mkdir -p "$OUT"
SOFTROCE=${SOFTROCE_SCRIPT:-$ROOT/../shared/softroce/run-in-softroce-vm.sh}

[ "$MODE" = report ] || cargo build --release -p rpc-examples --bin bench
[ "$MODE" = report ] || {
  echo "built from: $(git log -1 --format='%h %s')"
  dirty=$(git status --short -- rpc-core rdma-transport examples codegen | wc -l)
  echo "uncommitted files in rpc-core/ rdma-transport/ examples/ codegen/ at build time: $dirty"
} >"$OUT/build.txt"

if [ "$MODE" = all ] || [ "$MODE" = vm ]; then
  [ -x "$SOFTROCE" ] || { echo "missing $SOFTROCE (set SOFTROCE_SCRIPT)" >&2; exit 1; }
  rm -f "$OUT"/vm-* "$OUT"/send_lat_* "$OUT"/write_bw_* "$OUT"/cg.rdma.*
  t0=$SECONDS
  # One boot: perftest and the bench binary. CWD (the repo) is shared read-write.
  SOFTROCE_VM_TIMEOUT=${SOFTROCE_VM_TIMEOUT:-900} "$SOFTROCE" "$ROOT/scripts/bench.sh" --in-vm "$OUT"
  echo "VM run: $((SECONDS - t0)) s" | tee "$OUT/vm-time.txt"
fi

if [ "$MODE" = all ] || [ "$MODE" = host ]; then
  rm -f "$OUT"/host-* "$OUT"/cg.memory.* "$OUT"/cg.tonic-tcp.*
  {
    echo "host: $(uname -srm), $(nproc) cores"
    grep -m1 'model name' /proc/cpuinfo || true
  } >"$OUT/host-machine.txt"
  # shellcheck disable=SC2086
  "$BIN" --paths memory,tcp-fallback,tonic-tcp --duration-ms 1000 --payloads 64,1k,64k,1m \
    ${BENCH_HOST_ARGS:-} --json "$OUT/host-bench.json" --markdown "$OUT/host-bench.md" \
    >"$OUT/host-bench.stdout"
  # Instructions per small call: two runs of N and 2N calls, the difference
  # cancels start-up (runtime, server, connection, warm-up).
  for path in memory tonic-tcp; do
    for n in "$CG_CALLS" $((2 * CG_CALLS)); do
      echo "--- callgrind $path $n calls" >&2
      valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$path.$n.out" \
        "$BIN" --paths "$path" --payloads 64 --inflight 1 --iters "$n" --warmup 200 --threads 2 \
        >"$OUT/cg.$path.$n.stdout" 2>"$OUT/cg.$path.$n.stderr"
    done
  done
fi
for f in "$OUT"/cg.*.out; do
  [ -s "$f" ] || continue
  callgrind_annotate --inclusive=no --threshold=99 "$f" >"${f%.out}.self.txt"
  callgrind_annotate --inclusive=yes --threshold=99 "$f" >"${f%.out}.incl.txt"
done

# ---------------------------------------------------------------- docs/benchmarks.md
python3 - "$OUT" "$MODE" "$CG_CALLS" "$CG_VM_CALLS" <<'PY'
import json, os, re, sys, collections

out, mode, cg_calls, cg_vm_calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
doc = "docs/benchmarks.md"

def read(name, default=""):
    p = os.path.join(out, name)
    return open(p).read() if os.path.exists(p) else default

def perftest_row(name):
    """First finite result row of a perftest output (client side, else the
    server side: both time the same ping-pong; under TCG one side sometimes
    prints inf), as a list of floats, or None."""
    for n in (name, name.replace(".txt", ".server.txt")):
        for line in read(n).splitlines():
            f = line.split()
            if len(f) >= 5 and all(re.fullmatch(r"[0-9.]+", x) for x in f[:5]):
                return [float(x) for x in f]
    return None

def cell(cells, path, payload, inflight):
    for c in cells:
        if c["path"] == path and c["payload"] == payload and c["inflight"] == inflight and not c["error"]:
            return c
    return None

def fmt_us(us):
    return f"{us/1000:.2f} ms" if us >= 1000 else f"{us:.1f} µs"

def replace_section(text, name, body):
    begin, end = f"<!-- BEGIN {name} (generated by scripts/bench.sh) -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        a = text.index(begin); b = text.index(end) + len(end)
        return text[:a] + block + text[b:]
    return text.rstrip() + "\n\n" + block + "\n"

text = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"

if mode in ("all", "vm", "report") and os.path.exists(os.path.join(out, "vm-bench.json")):
    j = json.loads(read("vm-bench.json"))
    cells = j["cells"]
    s = []
    s.append("### Soft-RoCE VM run\n")
    s.append("Command: `scripts/bench.sh vm` (one VM boot: perftest, then "
             "`target/release/bench --addr $SOFTROCE_IP:0 --paths rdma,tcp-fallback,tonic-tcp "
             "--duration-ms 1000 --max-cell-mib 48`).\n")
    s.append("```text\n" + read("build.txt") + read("host-machine.txt", "") + read("vm-machine.txt") + read("vm-time.txt") + "```\n")
    s.append("**These are emulated numbers** (QEMU TCG, no KVM; rdma_rxe in the guest kernel: "
             "~35 µs SEND latency, ~15 MB/s RDMA bandwidth). They say nothing about RDMA hardware; "
             "only the ratios to perftest on the same emulated device, and to tonic over the "
             "guest's TCP, mean anything.\n")
    lat64, lat1k = perftest_row("send_lat_64.txt"), perftest_row("send_lat_1k.txt")
    bw64k, bw1m = perftest_row("write_bw_64k.txt"), perftest_row("write_bw_1m.txt")
    s.append("#### Raw verbs (perftest, same device, same boot)\n")
    s.append("| test | result |\n|---|---|")
    for name, r in (("`ib_send_lat -s 64 -n 2000`", lat64), ("`ib_send_lat -s 1024 -n 1000`", lat1k)):
        if r:
            s.append(f"| {name} | t_typical {r[4]:.2f} µs one-way (= RTT/2), t_avg {r[5]:.2f} µs, "
                     f"p99 {r[7]:.2f} µs → round trip {2*r[4]:.2f} µs |")
        else:
            s.append(f"| {name} | no result (see raw output) |")
    for name, r in (("`ib_write_bw -s 65536 -n 500`", bw64k), ("`ib_write_bw -s 1048576 -n 50`", bw1m)):
        if r:
            s.append(f"| {name} | BW average {r[3]:.2f} MB/sec (perftest MB = 2^20 B) = {r[3]*1048576/1e6:.1f} MB/s |")
        else:
            s.append(f"| {name} | no result (see raw output) |")
    s.append("")
    s.append("#### Ratios\n")
    s.append("ib_send_lat is a ping-pong and reports half the round trip (t_typical = median RTT/2); "
             "our unary call is a round trip (request SEND(s), 1-byte reply), so it is compared "
             "with 2 × t_typical (from the client's output, or the server's when the client printed `inf`, "
             "which perftest sometimes does under TCG). ib_write_bw is one-way RDMA WRITE streaming (128 outstanding); "
             "our bandwidth counts request payload bytes per second (1-byte replies).\n")
    s.append("| ratio | value |\n|---|---|")
    for payload, r in ((64, lat64), (1024, lat1k)):
        c = cell(cells, "rdma", payload, 1)
        if c and r:
            s.append(f"| our rdma p50 / raw SEND round trip, {payload} B | {fmt_us(c['p50_us'])} / {2*r[4]:.2f} µs = **{c['p50_us']/(2*r[4]):.2f}×** |")
    if bw1m:
        raw = bw1m[3] * 1048576
        for payload, infl in ((1 << 20, 1), (1 << 20, 8), (16 << 20, 1), (16 << 20, 8)):
            c = cell(cells, "rdma", payload, infl)
            if c:
                s.append(f"| our rdma bandwidth / ib_write_bw 1 MiB, {payload>>20} MiB × {infl} in flight | "
                         f"{c['bytes_per_s']/1e6:.1f} / {raw/1e6:.1f} MB/s = **{c['bytes_per_s']/raw:.2f}×** |")
    for payload in (64, 1024, 16 << 10, 64 << 10, 1 << 20, 16 << 20):
        a, b = cell(cells, "rdma", payload, 1), cell(cells, "tonic-tcp", payload, 1)
        if a and b:
            label = f"{payload} B" if payload < 1024 else (f"{payload>>10} KiB" if payload < 1 << 20 else f"{payload>>20} MiB")
            s.append(f"| our rdma p50 / tonic-tcp p50, {label} | {fmt_us(a['p50_us'])} / {fmt_us(b['p50_us'])} = **{a['p50_us']/b['p50_us']:.2f}×** |")
    skipped = [p for p in j["paths"] if p.get("skipped")]
    for p in skipped:
        s.append(f"\n**{p['path']} skipped**: {p['skipped']}")
    s.append("\n#### Table (bench output)\n")
    s.append(read("vm-bench.md"))
    text = replace_section(text, "vm", "\n".join(s))

def cg_summary(path):
    for line in read(path).splitlines():
        if line.startswith("summary:") or line.startswith("totals:"):
            return int(line.split()[1])
    return None

def cg_calls_by_callee(path):
    """Sum of call counts per callee name in a callgrind output file."""
    names, calls = {}, collections.Counter()
    cfn = None
    p = os.path.join(out, path)
    if not os.path.exists(p):
        return calls
    def name(spec):
        m = re.match(r"\((\d+)\)(?: (.*))?", spec)
        if not m:
            return spec
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "?")
    for line in open(p, errors="replace"):
        if line.startswith("fn="):
            name(line[3:].strip())
        elif line.startswith("cfn="):
            cfn = name(line[4:].strip())
        elif line.startswith("calls=") and cfn is not None:
            calls[cfn] += int(line[6:].split()[0])
    return calls

def cg_fn_costs(path):
    """function -> self Ir from callgrind_annotate output."""
    costs = {}
    for line in read(path).splitlines():
        m = re.match(r"\s*([\d,]+)(?: \([ \d.]+%\))?\s+(\S.*?)(?: \[[^\]]*\])?$", line)
        if m and ":" in m.group(2):
            fn = m.group(2).split(":", 1)[1]
            costs[fn] = costs.get(fn, 0) + int(m.group(1).replace(",", ""))
    return costs

CATS = [
    ("allocator (malloc/free/realloc)", r"^(_int_|malloc|free|realloc|cfree|unlink_chunk|malloc_consolidate|tcache|__libc_|_int_memalign|arena|__rustc::__r)"),
    ("memcpy/memset/memcmp", r"^__(mem|str)"),
    ("rpc_core", r"rpc_core"),
    ("rdma_transport", r"rdma_transport"),
    ("libibverbs + rxe provider", r"rxe|ibv_|verbs"),
    ("h2", r"\bh2::"),
    ("hyper", r"hyper"),
    ("tonic", r"tonic"),
    ("http / http_body", r"\bhttp(_body)?(_util)?::"),
    ("tokio", r"tokio"),
    ("prost", r"prost"),
    ("bytes", r"\bbytes::"),
    ("hashing", r"hashbrown|core::hash|std::hash|sip"),
    ("bench + hdrhistogram", r"bench::|hdrhistogram"),
]

runs = [("memory", "host", cg_calls), ("tonic-tcp", "host", cg_calls), ("rdma", "Soft-RoCE VM", cg_vm_calls)]
have = [(p, where, n) for p, where, n in runs
        if cg_summary(f"cg.{p}.{n}.out") is not None and cg_summary(f"cg.{p}.{2*n}.out") is not None]
if have:
    s = []
    s.append("### Instructions per small call (callgrind)\n")
    s.append("`valgrind --tool=callgrind target/release/bench --paths P --payloads 64 --inflight 1 --iters N "
             "--warmup 200 --threads 2` (rdma: in the VM, `--addr $SOFTROCE_IP:0 --warmup 50`), once with N "
             "and once with 2N calls; per call = (Ir(2N) − Ir(N)) / N, so start-up, connection set-up and "
             "warm-up cancel. 64-byte request, 1-byte reply; client + server; user-space instructions only "
             "(callgrind does not see the kernel: tonic-tcp's socket calls and rxe's kernel work are not in "
             "the count). Counts of calls (malloc, memcpy...) are per RPC the same way.\n")
    s.append("| path | where | N | Ir (N) | Ir (2N) | **Ir per call** | malloc/call | free/call | memcpy+memmove/call | tasks spawned/call |")
    s.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    per_fn, per_cat = {}, {}
    for path, where, n in have:
        fa_, fb_ = f"cg.{path}.{n}", f"cg.{path}.{2*n}"
        a, b = cg_summary(fa_ + ".out"), cg_summary(fb_ + ".out")
        ca, cb = cg_calls_by_callee(fa_ + ".out"), cg_calls_by_callee(fb_ + ".out")
        def pc(pred):
            return (sum(v for k, v in cb.items() if pred(k)) - sum(v for k, v in ca.items() if pred(k))) / n
        base = lambda k: k.split("'")[0]
        mal = pc(lambda k: base(k) == "malloc")
        fre = pc(lambda k: base(k) in ("free", "cfree"))
        cpy = pc(lambda k: re.match(r"__mem(cpy|move)", base(k)) is not None)
        spw = pc(lambda k: re.search(r"tokio::runtime::task::core::Cell<.*>::new$", base(k)) is not None)
        s.append(f"| {path} | {where} | {n} | {a:,} | {b:,} | **{(b-a)/n:,.0f}** | {mal:.1f} | {fre:.1f} | {cpy:.1f} | {spw:.1f} |")
        fa, fb = cg_fn_costs(fa_ + ".self.txt"), cg_fn_costs(fb_ + ".self.txt")
        diffs = {k: (fb.get(k, 0) - fa.get(k, 0)) / n for k in set(fa) | set(fb)}
        per_fn[path] = sorted(((v, k) for k, v in diffs.items()), reverse=True)
        cat = collections.Counter()
        for k, v in diffs.items():
            for name, rx in CATS:
                if re.search(rx, k):
                    cat[name] += v
                    break
            else:
                cat["other"] += v
        per_cat[path] = cat
    names = [c for c, _ in CATS] + ["other"]
    s.append("\nSelf instructions per call by component (share of the path's total):\n")
    s.append("| component | " + " | ".join(p for p, _, _ in have) + " |")
    s.append("|---|" + "---:|" * len(have))
    for c in names:
        if all(abs(per_cat[p].get(c, 0)) < 50 for p, _, _ in have):
            continue
        cells = []
        for p, _, _ in have:
            v, t = per_cat[p].get(c, 0), sum(per_cat[p].values()) or 1
            cells.append(f"{v:,.0f} ({100*v/t:.0f} %)")
        s.append(f"| {c} | " + " | ".join(cells) + " |")
    for path, rows in per_fn.items():
        s.append(f"\n<details><summary>Top 25 functions by self instructions per call, {path}</summary>\n")
        s.append("| Ir/call | function |\n|---:|---|")
        for v, k in rows[:25]:
            k = k if len(k) < 140 else k[:137] + "..."
            s.append(f"| {v:,.0f} | `{k}` |")
        s.append("\n</details>")
    text = replace_section(text, "callgrind", "\n".join(s))

if mode in ("all", "host", "report") and os.path.exists(os.path.join(out, "host-bench.json")):
    s = []
    s.append("### Host run (no device)\n")
    s.append("Command: `scripts/bench.sh host`, i.e. `target/release/bench --paths memory,tcp-fallback,tonic-tcp "
             "--duration-ms 1000 --payloads 64,1k,64k,1m`. The `memory` path is the call protocol "
             "(rpc-core session, frames, per-call tasks) over an in-memory connection: the framework's own "
             "cost without any transport.\n")
    s.append("```text\n" + read("build.txt") + read("host-machine.txt") + "```\n")
    s.append("The machine is shared with other builds (2 cores): latencies are noisy, compare paths within one run.\n")
    s.append(read("host-bench.md"))
    text = replace_section(text, "host", "\n".join(s))
open(doc, "w").write(text)
print(f"wrote {doc}")
PY
