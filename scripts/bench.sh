#!/usr/bin/env bash
# Benchmarks; writes the generated sections of docs/benchmarks.md (text outside the
# <!-- BEGIN/END --> markers is kept).
#
#   scripts/bench.sh [all|vm|decomp|host|report]   (default: all; report: only rewrite
#                                           the doc from the raw outputs of earlier runs)
#
#   vm:     ONE Soft-RoCE VM boot (../shared/softroce/run-in-softroce-vm.sh): perftest
#           ib_send_lat (polling and -e) / ib_write_bw (64 KiB, 1 MiB, 16 MiB) on the
#           guest's rxe device, rdma_pingpong (rdma-transport alone), then
#           target/release/bench over rdma, tcp-fallback and tonic-tcp (+ the memory
#           path and a current_thread run for the small call), strace syscall counts
#           and callgrind instruction counts per 64 B call, DHAT copy profile of 1 MiB
#           calls; the decomposition table and the ratios to the targets.
#   decomp: the same boot without the large cells, callgrind and DHAT (~4 min): the
#           decomposition table only, for repeated boots.
#   host:   no device needed: bench over memory, tcp-fallback and tonic-tcp, strace
#           syscall counts, callgrind instruction counts per small call (memory path vs
#           tonic-tcp), DHAT copy profile (bytes copied per payload byte, 1 MiB calls).
#
# Env: SOFTROCE_SCRIPT (VM script), BENCH_OUT (raw outputs, default target/bench),
#      BENCH_VM_ARGS / BENCH_HOST_ARGS (extra bench flags), CG_CALLS (default 2000),
#      CG_VM_CALLS (200), ST_CALLS / ST_VM_CALLS (strace: 2000 / 200), CP_CALLS /
#      CP_VM_CALLS (DHAT copy profile, 1 MiB calls: 20 / 3), BENCH_DOC (the doc to
#      rewrite, default docs/benchmarks.md), BENCH_BUILT_FROM (commit line, when the
#      tree is not a git checkout, e.g. a `git archive` of a commit).
# No figure is checked: the script only measures and writes. Every step runs
# under `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
# cargo's target directory (honours CARGO_TARGET_DIR); raw outputs stay in the repo.
TARGET_DIR=${BENCH_TARGET_DIR:-$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')}
export BENCH_TARGET_DIR=$TARGET_DIR
BIN=$TARGET_DIR/release/bench
PINGPONG=$TARGET_DIR/release/examples/rdma_pingpong
CG_CALLS=${CG_CALLS:-2000}      # callgrind: N and 2N small calls on the host
CG_VM_CALLS=${CG_VM_CALLS:-200} # ... and in the VM (rdma path; valgrind under TCG is slow)
ST_CALLS=${ST_CALLS:-2000}      # strace -c: N and 2N small calls on the host
ST_VM_CALLS=${ST_VM_CALLS:-200} # ... and in the VM
CP_CALLS=${CP_CALLS:-20}        # DHAT copy profile: N and 2N 1 MiB calls on the host
CP_VM_CALLS=${CP_VM_CALLS:-3}   # ... and in the VM (rdma path)

# Syscalls per call: `strace -f -c` over N and 2N 64 B calls at one in flight;
# per call = (count(2N) - count(N)) / N for each syscall (start-up cancels).
# strace sees real syscalls only (not vDSO clock reads; in the TCG guest there is
# no usable TSC, so clock_gettime is a real syscall there).
strace_runs() { # where n path extra-bench-args...
  local where=$1 n=$2 path=$3; shift 3
  if ! command -v strace >/dev/null; then
    echo "strace not installed: no syscall counts" | tee "$OUT/strace.$where.missing.txt" >&2
    return 0
  fi
  for k in "$n" $((2 * n)); do
    echo "--- strace $where $path $k calls" >&2
    timeout 300 strace -f -c -o "$OUT/strace.$where.$path.$k.txt" \
      "$BIN" "$@" --paths "$path" --payloads 64 --inflight 1 --iters "$k" --warmup 50 \
      >"$OUT/strace.$where.$path.$k.stdout" 2>"$OUT/strace.$where.$path.$k.stderr" ||
      echo "strace $where $path $k failed: see $OUT/strace.$where.$path.$k.stderr" >&2
  done
}

# Bytes copied per payload byte: valgrind's DHAT in copy mode records every
# memcpy/memmove (and friends) with its size and call stack; N and 2N calls of
# 1 MiB at one in flight, per call = difference / N. The report attributes each
# copy to the innermost frame of a known crate (see the python below).
copy_runs() { # where n path extra-bench-args...
  local where=$1 n=$2 path=$3; shift 3
  for k in "$n" $((2 * n)); do
    echo "--- dhat copy $where $path $k calls" >&2
    timeout 600 valgrind --tool=dhat --mode=copy --num-callers=40 \
      --dhat-out-file="$OUT/copy.$where.$path.$k.json" \
      "$BIN" "$@" --paths "$path" --payloads 1m --inflight 1 --iters "$k" --warmup 2 --threads 2 \
      >"$OUT/copy.$where.$path.$k.stdout" 2>"$OUT/copy.$where.$path.$k.stderr" ||
      echo "dhat $where $path $k failed: see $OUT/copy.$where.$path.$k.stderr" >&2
  done
}

load() { # label: host load, for the record
  echo "$1: $(uptime | sed 's/^ *//'); rustc processes: $(pgrep -c -x rustc || true); qemu processes: $(pgrep -c -f qemu-system || true)"
}

# ---------------------------------------------------------------- inside the VM
if [ "${1:-}" = "--in-vm" ]; then
  OUT=$2
  WHAT=$3 # vm | decomp
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
  perf send_lat_64_ev ib_send_lat -s 64 -n 2000 -e
  # rdma-transport alone: a 64 B ping-pong, both ends in one process.
  for rt in multi current; do
    echo "--- rdma_pingpong $rt" >&2
    timeout 120 "$PINGPONG" --loopback "$SOFTROCE_IP" --iters 1000 --bw-iters 0 --runtime "$rt" \
      >"$OUT/pingpong_$rt.txt" 2>&1 || echo "rdma_pingpong $rt failed: see $OUT/pingpong_$rt.txt" >&2
    grep PINGPONG "$OUT/pingpong_$rt.txt" >&2 || true
    # The polling mode (PollMode::Spin): no completion-channel sleeps.
    timeout 120 "$PINGPONG" --loopback "$SOFTROCE_IP" --iters 1000 --bw-iters 0 --runtime "$rt" \
      --poll-mode spin >"$OUT/pingpong_${rt}_spin.txt" 2>&1 ||
      echo "rdma_pingpong $rt spin failed: see $OUT/pingpong_${rt}_spin.txt" >&2
    grep PINGPONG "$OUT/pingpong_${rt}_spin.txt" >&2 || true
    # Polling mode, answered from the inline handler on the driver (no task
    # between the completion and the reply, as rpc-core's sessions run).
    timeout 120 "$PINGPONG" --loopback "$SOFTROCE_IP" --iters 1000 --bw-iters 0 --runtime "$rt" \
      --poll-mode spin --deliver inline >"$OUT/pingpong_${rt}_spin_inline.txt" 2>&1 ||
      echo "rdma_pingpong $rt spin inline failed: see $OUT/pingpong_${rt}_spin_inline.txt" >&2
    grep PINGPONG "$OUT/pingpong_${rt}_spin_inline.txt" >&2 || true
  done
  # The small call on the other layers: memory path and current_thread runtime.
  echo "--- bench, small calls: memory path; current_thread runtime" >&2
  timeout 120 "$BIN" --addr "$SOFTROCE_IP:0" --paths memory --payloads 64 --duration-ms 1000 \
    --json "$OUT/vm-bench-memory.json" --markdown "$OUT/vm-bench-memory.md" \
    >"$OUT/vm-bench-memory.stdout" 2>"$OUT/vm-bench-memory.stderr" || echo "bench memory failed" >&2
  timeout 120 "$BIN" --addr "$SOFTROCE_IP:0" --current-thread --paths rdma,tonic-tcp,memory \
    --payloads 64 --inflight 1 --duration-ms 1000 \
    --json "$OUT/vm-bench-ct.json" --markdown "$OUT/vm-bench-ct.md" \
    >"$OUT/vm-bench-ct.stdout" 2>"$OUT/vm-bench-ct.stderr" || echo "bench current_thread failed" >&2
  echo "--- bench, small calls, polling mode (--poll-mode spin)" >&2
  for rt in multi current; do
    ctflag=""
    [ "$rt" = current ] && ctflag=--current-thread
    # shellcheck disable=SC2086
    timeout 120 "$BIN" --addr "$SOFTROCE_IP:0" $ctflag --paths rdma --poll-mode spin \
      --payloads 64 --inflight 1 --duration-ms 1000 --json "$OUT/vm-bench-spin-$rt.json" \
      >"$OUT/vm-bench-spin-$rt.stdout" 2>"$OUT/vm-bench-spin-$rt.stderr" ||
      echo "bench spin $rt failed" >&2
  done
  if [ "$WHAT" = decomp ]; then
    timeout 240 "$BIN" --addr "$SOFTROCE_IP:0" --paths rdma,tonic-tcp --payloads 64 \
      --duration-ms 1000 ${BENCH_VM_ARGS:-} \
      --json "$OUT/vm-bench.json" --markdown "$OUT/vm-bench.md" \
      >"$OUT/vm-bench.stdout" 2> >(tee "$OUT/vm-bench.stderr" >&2) || echo "bench failed" >&2
    for path in rdma tonic-tcp memory; do
      strace_runs vm "$ST_VM_CALLS" "$path" --addr "$SOFTROCE_IP:0"
    done
    exit 0
  fi
  perf send_lat_1k ib_send_lat -s 1024 -n 1000
  perf write_bw_64k ib_write_bw -s 65536 -n 500
  perf write_bw_1m ib_write_bw -s 1048576 -n 50
  perf write_bw_16m ib_write_bw -s 16777216 -n 8
  echo "--- bench" >&2
  # shellcheck disable=SC2086
  timeout 480 "$BIN" --addr "$SOFTROCE_IP:0" --paths rdma,tcp-fallback,tonic-tcp \
    --duration-ms 1000 --max-cell-mib 48 ${BENCH_VM_ARGS:-} \
    --json "$OUT/vm-bench.json" --markdown "$OUT/vm-bench.md" \
    >"$OUT/vm-bench.stdout" 2> >(tee "$OUT/vm-bench.stderr" >&2) || echo "bench failed" >&2
  for path in rdma tcp-fallback tonic-tcp memory; do
    strace_runs vm "$ST_VM_CALLS" "$path" --addr "$SOFTROCE_IP:0"
  done
  # Instructions per small call on the rdma path (user space: our code, tokio,
  # tonic, libibverbs + the rxe provider), N and 2N calls as on the host.
  for n in "$CG_VM_CALLS" $((2 * CG_VM_CALLS)); do
    echo "--- callgrind rdma $n calls" >&2
    timeout 400 valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.rdma.$n.out" \
      "$BIN" --addr "$SOFTROCE_IP:0" --paths rdma --payloads 64 --inflight 1 --iters "$n" \
      --warmup 50 --threads 2 >"$OUT/cg.rdma.$n.stdout" 2>"$OUT/cg.rdma.$n.stderr" ||
      echo "callgrind rdma $n failed: see $OUT/cg.rdma.$n.stderr" >&2
  done
  copy_runs vm "$CP_VM_CALLS" rdma --addr "$SOFTROCE_IP:0"
  exit 0
fi

MODE=${1:-all}
case $MODE in all | vm | decomp | host | report) ;; *) echo "usage: $0 [all|vm|decomp|host|report]" >&2; exit 2 ;; esac
OUT=${BENCH_OUT:-$ROOT/target/bench}
mkdir -p "$OUT"
SOFTROCE=${SOFTROCE_SCRIPT:-$ROOT/../shared/softroce/run-in-softroce-vm.sh}

if [ "$MODE" != report ]; then
  cargo build --release -p rpc-examples --bin bench
  cargo build --release -p rdma-transport --example rdma_pingpong
  {
    if git rev-parse --git-dir >/dev/null 2>&1; then
      echo "built from: $(git log -1 --format='%h %s')"
      dirty=$(git status --short -- rpc-core rdma-transport examples codegen | wc -l)
      echo "uncommitted files in rpc-core/ rdma-transport/ examples/ codegen/ at build time: $dirty"
    else
      echo "built from: ${BENCH_BUILT_FROM:-unknown (not a git checkout; set BENCH_BUILT_FROM)}"
    fi
  } >"$OUT/build.txt"
fi

if [ "$MODE" = all ] || [ "$MODE" = vm ] || [ "$MODE" = decomp ]; then
  [ -x "$SOFTROCE" ] || { echo "missing $SOFTROCE (set SOFTROCE_SCRIPT)" >&2; exit 1; }
  rm -f "$OUT"/vm-* "$OUT"/send_lat_* "$OUT"/write_bw_* "$OUT"/cg.rdma.* "$OUT"/pingpong_* \
    "$OUT"/strace.vm.* "$OUT"/copy.vm.*
  load "before the VM run" >"$OUT/vm-load.txt"
  t0=$SECONDS
  # One boot: perftest, rdma_pingpong and the bench binary. CWD (the repo) is shared read-write.
  SOFTROCE_VM_TIMEOUT=${SOFTROCE_VM_TIMEOUT:-1080} "$SOFTROCE" "$ROOT/scripts/bench.sh" --in-vm "$OUT" "$MODE"
  load "after the VM run" >>"$OUT/vm-load.txt"
  echo "VM run ($MODE): $((SECONDS - t0)) s" | tee "$OUT/vm-time.txt"
fi

if [ "$MODE" = all ] || [ "$MODE" = host ]; then
  rm -f "$OUT"/host-* "$OUT"/cg.memory.* "$OUT"/cg.tonic-tcp.* "$OUT"/strace.host.* "$OUT"/copy.host.*
  {
    echo "host: $(uname -srm), $(nproc) cores"
    grep -m1 'model name' /proc/cpuinfo || true
  } >"$OUT/host-machine.txt"
  load "before the host run" >"$OUT/host-load.txt"
  # shellcheck disable=SC2086
  timeout 600 "$BIN" --paths memory,tcp-fallback,tonic-tcp --duration-ms 1000 --payloads 64,1k,64k,1m \
    ${BENCH_HOST_ARGS:-} --json "$OUT/host-bench.json" --markdown "$OUT/host-bench.md" \
    >"$OUT/host-bench.stdout"
  for path in memory tcp-fallback tonic-tcp; do
    strace_runs host "$ST_CALLS" "$path"
  done
  # Instructions per small call: two runs of N and 2N calls, the difference
  # cancels start-up (runtime, server, connection, warm-up).
  for path in memory tonic-tcp; do
    for n in "$CG_CALLS" $((2 * CG_CALLS)); do
      echo "--- callgrind $path $n calls" >&2
      timeout 900 valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$path.$n.out" \
        "$BIN" --paths "$path" --payloads 64 --inflight 1 --iters "$n" --warmup 200 --threads 2 \
        >"$OUT/cg.$path.$n.stdout" 2>"$OUT/cg.$path.$n.stderr"
    done
  done
  for path in memory tonic-tcp; do
    copy_runs host "$CP_CALLS" "$path"
  done
  load "after the host run" >>"$OUT/host-load.txt"
fi
for f in "$OUT"/cg.*.out; do
  [ -s "$f" ] || continue
  callgrind_annotate --inclusive=no --threshold=99 "$f" >"${f%.out}.self.txt"
  callgrind_annotate --inclusive=yes --threshold=99 "$f" >"${f%.out}.incl.txt"
done

# ---------------------------------------------------------------- docs/benchmarks.md
python3 - "$OUT" "$MODE" "$CG_CALLS" "$CG_VM_CALLS" "$ST_CALLS" "$ST_VM_CALLS" "$CP_CALLS" "$CP_VM_CALLS" <<'PY'
import json, os, re, sys, collections

out, mode = sys.argv[1], sys.argv[2]
cg_calls, cg_vm_calls, st_calls, st_vm_calls, cp_calls, cp_vm_calls = (int(x) for x in sys.argv[3:9])
doc = os.environ.get("BENCH_DOC", "docs/benchmarks.md")

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

def bytes_h(b):
    return f"{b/1048576:.2f} MiB" if b >= 1048576 else (f"{b/1024:.1f} KiB" if b >= 10240 else f"{b:.0f} B")

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
             "25–50 µs SEND round trips and 15–40 MB/s RDMA WRITE bandwidth from boot to boot, see perftest below). They say nothing about RDMA hardware; "
             "only the ratios to perftest on the same emulated device, and to tonic over the "
             "guest's TCP, mean anything.\n")
    lat64, lat1k = perftest_row("send_lat_64.txt"), perftest_row("send_lat_1k.txt")
    lat64ev = perftest_row("send_lat_64_ev.txt")
    bw64k, bw1m = perftest_row("write_bw_64k.txt"), perftest_row("write_bw_1m.txt")
    bw16m = perftest_row("write_bw_16m.txt")
    s.append("#### Raw verbs (perftest, same device, same boot)\n")
    s.append("| test | result |\n|---|---|")
    for name, r in (("`ib_send_lat -s 64 -n 2000`", lat64), ("`ib_send_lat -s 64 -n 2000 -e`", lat64ev),
                    ("`ib_send_lat -s 1024 -n 1000`", lat1k)):
        if r:
            s.append(f"| {name} | t_typical {r[4]:.2f} µs one-way (= RTT/2), t_avg {r[5]:.2f} µs, "
                     f"p99 {r[7]:.2f} µs → round trip {2*r[4]:.2f} µs |")
        else:
            s.append(f"| {name} | no result (see raw output) |")
    for name, r in (("`ib_write_bw -s 65536 -n 500`", bw64k), ("`ib_write_bw -s 1048576 -n 50`", bw1m),
                    ("`ib_write_bw -s 16777216 -n 8`", bw16m)):
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
        for payload, infl in ((1 << 20, 1), (1 << 20, 8), (16 << 20, 1), (16 << 20, 8)):
            # ib_write_bw at the same message size when measured (16 MiB), else 1 MiB.
            same = bw16m if payload == 16 << 20 and bw16m else bw1m
            raw, rawname = same[3] * 1048576, ("16 MiB" if same is bw16m else "1 MiB")
            c = cell(cells, "rdma", payload, infl)
            if c:
                s.append(f"| our rdma bandwidth / ib_write_bw {rawname}, {payload>>20} MiB × {infl} in flight | "
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

# ---------------------------------------------------------------- counters: syscalls, copies
def strace_counts(name):
    """syscall -> calls from a `strace -c` summary, or None."""
    t = read(name, None)
    if t is None:
        return None
    c = {}
    for line in t.splitlines():
        f = line.split()
        if len(f) >= 5 and re.fullmatch(r"[0-9.]+", f[0]) and f[-1] != "total":
            c[f[-1]] = c.get(f[-1], 0) + int(f[3])
    return c or None

def strace_per_call(where, path, n):
    """syscall -> calls per call from the N and 2N runs (start-up cancels), or None."""
    a, b = strace_counts(f"strace.{where}.{path}.{n}.txt"), strace_counts(f"strace.{where}.{path}.{2*n}.txt")
    if not a or not b:
        return None
    return {k: (b.get(k, 0) - a.get(k, 0)) / n for k in set(a) | set(b)}

def strace_cells(d):
    if d is None:
        return "–", "–", "–"
    tot = sum(d.values())
    clk = d.get("clock_gettime", 0) + d.get("clock_gettime64", 0)
    top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:5] if v >= 0.05)
    return f"{tot:.1f}", f"{clk:.1f} ({100*clk/tot:.0f} %)" if tot > 0 else "0", top

# Copy attribution: the innermost frame of a crate we name; frames of std/core/alloc
# and of container crates (bytes) are skipped, so BytesMut::extend_from_slice called
# by rpc_core counts for rpc-core, BufMut::put_slice called by a prost encoder for prost.
OWNERS = [
    ("rdma-transport", r"rdma_transport"),
    ("rpc-core", r"rpc_core"),
    ("prost (message encode/decode)", r"prost|rpc_examples::pb::"),
    ("tonic", r"tonic"),
    ("h2 / hyper", r"\bh2::|hyper"),
    ("tokio", r"tokio"),
    ("bench", r"\bbench::|hdrhistogram"),
    ("libibverbs / rxe / libc", r"ibv_|rxe|verbs|^_IO_|^__libc|^_dl_|^ld-linux"),
]
GENERIC = r"^<?(core::|alloc::|std::|bytes::|hashbrown::|__mem|mem(cpy|move|set)|_platform|\?\?\?|0x[0-9A-Fa-f]+$|vg_|_vgr)"
OURS = ("rdma-transport", "rpc-core")

# Direction of a copy: the innermost frame (from the copy outward) whose name says
# encode/send or decode/receive. With a 1-byte reply the payload only goes from the
# client (send side) to the server (receive side). `Engine::progress` is where
# rdma-transport copies an outgoing message into a registered staging buffer.
SEND_RX = r"encode|Encoder|send|writer|post_|staging|EncodeBody|put_slice|Engine::progress"
RECV_RX = r"decode|Decoder|recv|reader|on_completion|deliver|Streaming|replace_with|merge"

def direction(frames):
    for name in frames:
        if re.search(RECV_RX, name):
            return "receive"
        if re.search(SEND_RX, name):
            return "send"
    return "?"

def frame_name(fr):
    m = re.match(r"0x[0-9A-Fa-f]+: (.*?)(?: \((?:in )?[^()]*\))?$", fr)
    return (m.group(1) if m else fr).strip()

def copy_profile(where, path, n):
    """(owner, function, direction) -> [bytes, copies] copied per run, from a DHAT copy profile."""
    t = read(f"copy.{where}.{path}.{n}.json", None)
    if not t:
        return None
    j = json.loads(t)
    ftbl, sites = j["ftbl"], collections.defaultdict(lambda: [0, 0])
    for pp in j["pps"]:
        frames = [frame_name(ftbl[i]) for i in pp["fs"]]
        owner, fn = "other", frames[1] if len(frames) > 1 else "?"
        for name in frames:
            if re.search(GENERIC, name):
                continue
            for o, rx in OWNERS:
                if re.search(rx, name):
                    owner, fn = o, name
                    break
            else:
                continue
            break
        key = (owner, fn, direction(frames[1:]))
        sites[key][0] += pp["tb"]
        sites[key][1] += pp["tbk"]
    return sites

def copy_per_call(where, path, n):
    a, b = copy_profile(where, path, n), copy_profile(where, path, 2 * n)
    if a is None or b is None:
        return None
    keys = set(a) | set(b)
    return {k: ((b.get(k, [0, 0])[0] - a.get(k, [0, 0])[0]) / n,
                (b.get(k, [0, 0])[1] - a.get(k, [0, 0])[1]) / n) for k in keys}

def copy_table(s, where, path, n, payload=1 << 20):
    d = copy_per_call(where, path, n)
    if d is None:
        return None
    by_owner, ours_dir = collections.Counter(), collections.Counter()
    for (o, _, dr), (b, _) in d.items():
        by_owner[o] += b
        if o in OURS:
            ours_dir[dr] += b
    s.append(f"\n**{path}** ({where}, {n} and {2*n} calls of 1 MiB; bytes copied per payload byte, per call):\n")
    s.append("| copied by | bytes / payload byte |\n|---|---:|")
    for o, b in sorted(by_owner.items(), key=lambda kv: -kv[1]):
        if b / payload >= 0.005:
            s.append(f"| {o} | {b/payload:.2f} |")
    ours = sum(by_owner.get(o, 0) for o in OURS) / payload
    ours = 0.0 if abs(ours) < 0.005 else ours
    s.append(f"| **our code (rpc-core + rdma-transport)** | **{ours:.2f}** |")
    for dr in ("send", "receive", "?"):
        if dr != "?" or ours_dir.get(dr, 0) / payload >= 0.005:
            s.append(f"| our code, {dr} side | {ours_dir.get(dr, 0)/payload:.2f} |")
    s.append(f"\n<details><summary>Copy sites, {path} ({where}): function, bytes per payload byte, copies per call</summary>\n")
    s.append("| owner | function | side | bytes / payload byte | copies / call |\n|---|---|---|---:|---:|")
    for (o, fn, dr), (b, c) in sorted(d.items(), key=lambda kv: -kv[1][0]):
        if b / payload < 0.005:
            continue
        fn = fn if len(fn) < 140 else fn[:137] + "..."
        s.append(f"| {o} | `{fn}` | {dr} | {b/payload:.2f} | {c:.1f} |")
    s.append("\n</details>")
    return ours, by_owner

def load_json(name):
    t = read(name, None)
    return json.loads(t)["cells"] if t else []

def pingpong(rt):
    m = re.search(r"PINGPONG .*?p50_us=([0-9.]+)", read(f"pingpong_{rt}.txt", ""))
    return float(m.group(1)) if m else None

def cg_per_call(path, n):
    a, b = cg_summary(f"cg.{path}.{n}.out"), cg_summary(f"cg.{path}.{2*n}.out")
    if a is None or b is None:
        return None, None
    ca, cb = cg_calls_by_callee(f"cg.{path}.{n}.out"), cg_calls_by_callee(f"cg.{path}.{2*n}.out")
    mal = (sum(v for k, v in cb.items() if k.split("'")[0] == "malloc") -
           sum(v for k, v in ca.items() if k.split("'")[0] == "malloc")) / n
    return (b - a) / n, mal

def x(a, b, digits=2):
    return f"**{a/b:.{digits}f}×**" if a and b else "–"

if mode in ("vm", "decomp", "all", "report") and os.path.exists(os.path.join(out, "vm-bench.json")):
    vm = load_json("vm-bench.json")
    mem = load_json("vm-bench-memory.json")
    ct = load_json("vm-bench-ct.json")
    lat, lat_ev = perftest_row("send_lat_64.txt"), perftest_row("send_lat_64_ev.txt")
    rtt = 2 * lat[4] if lat else None
    s = []
    s.append("### Decomposition of the small call (Soft-RoCE VM, one boot)\n")
    s.append("```text\n" + read("build.txt") + read("vm-machine.txt") + read("vm-time.txt") + read("vm-load.txt") + "```\n")
    s.append("64 B request, one call in flight, round trip p50. perftest reports half a round trip "
             "(t_typical), so its round trip is 2 × t_typical. `rdma_pingpong` is rdma-transport alone "
             "(64 B message each way, both ends in one process, 1000 round trips). The bench rows are the "
             "full unary call (64 B request, 1 B reply) through the in-process echo server; their "
             "counters are per call, client + server, over the timed phase: heap allocations (counting "
             "global allocator), context switches and CPU time (/proc/self/task), syscalls "
             f"(`strace -f -c`, {st_vm_calls} and {2*st_vm_calls} calls, difference / {st_vm_calls}; "
             "strace slows each syscall, so these runs are not timed).\n")
    s.append("| layer, 64 B, one in flight | round trip p50 | × perftest polling RTT | allocs/call | alloc bytes/call | ctx sw/call | CPU/call | syscalls/call | clock_gettime/call | top syscalls/call |")
    s.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    def row(label, p50, c=None, st=None):
        r = f"{p50/rtt:.1f}×" if p50 and rtt else "–"
        p = fmt_us(p50) if p50 else "no result"
        if c:
            a, ab, cs, cpu = f"{c['allocs_per_call']:.1f}", f"{c['alloc_bytes_per_call']:,.0f}", f"{c['ctx_switches_per_call']:.2f}", fmt_us(c['cpu_us_per_call'])
        else:
            a = ab = cs = cpu = "–"
        tot, clk, top = strace_cells(st)
        s.append(f"| {label} | {p} | {r} | {a} | {ab} | {cs} | {cpu} | {tot} | {clk} | {top} |")
    row("perftest `ib_send_lat` (polling)", rtt)
    row("perftest `ib_send_lat -e` (completion events)", 2 * lat_ev[4] if lat_ev else None)
    row("`rdma_pingpong` (rdma-transport only), multi-thread runtime", pingpong("multi"))
    row("`rdma_pingpong`, `current_thread` runtime", pingpong("current"))
    row("`rdma_pingpong`, multi-thread, polling mode (`PollMode::Spin`)", pingpong("multi_spin"))
    row("`rdma_pingpong`, `current_thread`, polling mode", pingpong("current_spin"))
    row("`rdma_pingpong`, multi-thread, polling mode, inline delivery (`--deliver inline`)", pingpong("multi_spin_inline"))
    row("`rdma_pingpong`, `current_thread`, polling mode, inline delivery", pingpong("current_spin_inline"))
    c = cell(vm, "rdma", 64, 1)
    row("bench, full gRPC call over RDMA (multi-thread, as shipped)", c and c["p50_us"], c, strace_per_call("vm", "rdma", st_vm_calls))
    c = cell(ct, "rdma", 64, 1)
    row("same, `current_thread`", c and c["p50_us"], c)
    c = cell(load_json("vm-bench-spin-multi.json"), "rdma", 64, 1)
    row("same, multi-thread, polling mode (`--poll-mode spin`)", c and c["p50_us"], c)
    c = cell(load_json("vm-bench-spin-current.json"), "rdma", 64, 1)
    row("same, `current_thread`, polling mode", c and c["p50_us"], c)
    c = cell(vm, "tonic-tcp", 64, 1)
    row("tonic over the guest's TCP (multi-thread)", c and c["p50_us"], c, strace_per_call("vm", "tonic-tcp", st_vm_calls))
    c = cell(ct, "tonic-tcp", 64, 1)
    row("same, `current_thread`", c and c["p50_us"], c)
    c = cell(vm, "tcp-fallback", 64, 1)
    if c:
        row("our Channel over TCP (tcp-fallback, multi-thread)", c["p50_us"], c, strace_per_call("vm", "tcp-fallback", st_vm_calls))
    c = cell(mem, "memory", 64, 1)
    row("memory path (call protocol, no transport), multi-thread", c and c["p50_us"], c, strace_per_call("vm", "memory", st_vm_calls))
    c = cell(ct, "memory", 64, 1)
    row("same, `current_thread`", c and c["p50_us"], c)

    s.append("\n#### Targets (small call)\n")
    s.append("| measure | target | this run |\n|---|---:|---|")
    r1, t1 = cell(vm, "rdma", 64, 1), cell(vm, "tonic-tcp", 64, 1)
    if r1 and rtt:
        s.append(f"| rdma p50 / perftest polling RTT, 64 B | ≤ 3× | {fmt_us(r1['p50_us'])} / {fmt_us(rtt)} = {x(r1['p50_us'], rtt, 1)} |")
    for rt in ("multi", "current", "multi_spin", "current_spin", "multi_spin_inline", "current_spin_inline"):
        pp = pingpong(rt)
        if pp and rtt:
            s.append(f"| rdma_pingpong ({rt}) p50 / perftest polling RTT | ≤ 1.5× | {fmt_us(pp)} / {fmt_us(rtt)} = {x(pp, rtt, 1)} |")
    if r1 and t1:
        s.append(f"| rdma p50 / tonic-tcp p50, 64 B, 1 in flight | ≤ 0.1× | {fmt_us(r1['p50_us'])} / {fmt_us(t1['p50_us'])} = {x(r1['p50_us'], t1['p50_us'])} |")
    for infl in (8, 64):
        a, b = cell(vm, "rdma", 64, infl), cell(vm, "tonic-tcp", 64, infl)
        if a and b:
            s.append(f"| rdma calls/s / tonic-tcp calls/s, 64 B, {infl} in flight | ≥ 5× | {a['calls_per_s']:.0f} / {b['calls_per_s']:.0f} = {x(a['calls_per_s'], b['calls_per_s'])} |")
    ir_r, mal_r = cg_per_call("rdma", cg_vm_calls)
    ir_t, _ = cg_per_call("tonic-tcp", cg_calls)
    if ir_r and ir_t:
        s.append(f"| instructions per 64 B call, rdma (callgrind, VM) / tonic-tcp (callgrind, host) | ≤ 0.2× | {ir_r:,.0f} / {ir_t:,.0f} = {x(ir_r, ir_t)} |")
    if r1:
        extra = f"; callgrind: {mal_r:.1f} malloc/call" if mal_r is not None else ""
        s.append(f"| heap allocations per call, rdma, 1 in flight (bench counter) | ≤ 8 | {r1['allocs_per_call']:.1f} ({r1['alloc_bytes_per_call']:,.0f} B){extra} |")
    st = strace_per_call("vm", "rdma", st_vm_calls)
    if st:
        tot, clk, _ = strace_cells(st)
        s.append(f"| syscalls per call, rdma (strace) | ≤ 6 | {tot}, of which clock_gettime {clk} |")
    if r1:
        s.append(f"| context switches per call, rdma, 1 in flight | ≤ 0.2 | {r1['ctx_switches_per_call']:.2f} |")

    bw1m, bw16m = perftest_row("write_bw_1m.txt"), perftest_row("write_bw_16m.txt")
    rows12 = []
    for payload, raw in ((1 << 20, bw1m), (16 << 20, bw16m)):
        for infl in (1, 8):
            a, b = cell(vm, "rdma", payload, infl), cell(vm, "tonic-tcp", payload, infl)
            if a:
                rawbps = raw[3] * 1048576 if raw else None
                bwr = f"{a['bytes_per_s']/1e6:.1f} / {rawbps/1e6:.1f} MB/s = {x(a['bytes_per_s'], rawbps)}" if rawbps else "no ib_write_bw result"
                cr = f"{a['calls_per_s']:.2f} / {b['calls_per_s']:.2f} = {x(a['calls_per_s'], b['calls_per_s'])}" if b else "–"
                rows12.append(f"| {payload>>20} MiB × {infl} | {bwr} | {cr} | {fmt_us(a['p50_us'])} | {a['allocs_per_call']:,.0f} | {bytes_h(a['alloc_bytes_per_call'])} | {a['ctx_switches_per_call']:.1f} |")
    if rows12:
        s.append("\n#### Targets (large calls)\n")
        s.append(f"Request bytes per second against `ib_write_bw` at the same message size in the same boot "
                 f"(`-s 1048576 -n 50`, `-s 16777216 -n 8`; target ≥ 0.9×), calls/s against tonic-tcp "
                 f"(target for 1 MiB ≥ 2×); allocations and context switches per call from the bench counters.\n")
        s.append("| payload × in flight | rdma / ib_write_bw (same size) | rdma calls/s / tonic-tcp calls/s | rdma p50 | allocs/call | alloc bytes/call | ctx sw/call |")
        s.append("|---|---|---|---:|---:|---:|---:|")
        s.extend(rows12)
    if copy_per_call("vm", "rdma", cp_vm_calls) is not None:
        s.append("\n#### Bytes copied per payload byte, rdma path (DHAT copy profile, in the VM)\n")
        copy_table(s, "vm", "rdma", cp_vm_calls)
    text = replace_section(text, "decomposition", "\n".join(s))

if mode in ("all", "host", "report") and any(f.startswith(("strace.host.", "copy.host.")) for f in os.listdir(out)):
    s = []
    s.append("### Syscalls and copies per call (host)\n")
    s.append("```text\n" + read("build.txt") + read("host-load.txt") + "```\n")
    if read("strace.host.missing.txt"):
        s.append("strace not installed: no syscall counts.\n")
    else:
        s.append(f"`strace -f -c` over {st_calls} and {2*st_calls} calls of 64 B at one in flight "
                 f"(`bench --paths P --payloads 64 --inflight 1 --iters N --warmup 50`), per call = "
                 f"difference / {st_calls}, client + server. On the host `clock_gettime` goes through "
                 "the vDSO and is not a syscall (it is in the VM, see the decomposition).\n")
        s.append("| path | syscalls/call | clock_gettime/call | top syscalls/call |\n|---|---:|---:|---|")
        for path in ("memory", "tcp-fallback", "tonic-tcp"):
            d = strace_per_call("host", path, st_calls)
            if d is not None:
                tot, clk, top = strace_cells(d)
                s.append(f"| {path} | {tot} | {clk} | {top} |")
    have_copy = False
    for path in ("memory", "tonic-tcp"):
        if copy_per_call("host", path, cp_calls) is not None:
            if not have_copy:
                s.append("\n#### Bytes copied per payload byte (DHAT copy profile)\n")
                s.append("`valgrind --tool=dhat --mode=copy` records every memcpy/memmove (and strcpy-like) "
                         "call with its size and call stack. Runs of N and 2N unary calls of 1 MiB at one in "
                         f"flight (reply 1 byte; N = {cp_calls}); per call = difference / N, divided by the "
                         "payload size. A copy is charged to the innermost frame of a named crate on its "
                         "stack, skipping std/core/alloc and `bytes` (a `BytesMut::extend_from_slice` called "
                         "from rpc_core is rpc-core's; `BufMut::put_slice` called from a prost encoder is "
                         "prost's). In this direction the client sends and the server receives the payload, "
                         "so every payload copy is either on the send side or on the receive side: the "
                         "sites table says which.\n")
                have_copy = True
            copy_table(s, "host", path, cp_calls)
    text = replace_section(text, "host-counters", "\n".join(s))

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
