#!/usr/bin/env bash
# The small call on the direct path against tonic's path and tonic over TCP,
# in ONE Soft-RoCE VM boot (docs/benchmarks.md, "The direct path"):
#
#   scripts/bench-direct.sh            # builds the release bench, boots the VM
#
# Inside the VM, ROUNDS (default 3) interleaved rounds of: perftest
# ib_send_lat 64 B (polling, then -e), the bench over direct, rdma and
# tonic-tcp (64 B, 1 and 64 in flight, default poll mode), and direct and
# rdma in polling mode (--poll-mode spin); then callgrind (instructions) and
# strace -c (syscalls) per 64 B call at one in flight, N and 2N calls
# (per call = difference / N). Raw outputs go to BENCH_OUT (default
# target/bench-direct). No figure is checked: the script only measures.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${BENCH_OUT:-target/bench-direct}
ROUNDS=${ROUNDS:-3}
N=${CG_VM_CALLS:-200}
if [ "${1:-}" != "--in-vm" ]; then
  SOFTROCE=${SOFTROCE_SCRIPT:-../shared/softroce/run-in-softroce-vm.sh}
  cargo build --release -p rpc-examples --bin bench
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
  mkdir -p "$OUT"
  BENCH_BIN=$TARGET_DIR/release/bench BENCH_OUT=$OUT ROUNDS=$ROUNDS CG_VM_CALLS=$N \
    timeout 3600 "$SOFTROCE" bash scripts/bench-direct.sh --in-vm
  exit
fi
B=${BENCH_BIN:?}
D=${SOFTROCE_DEV:?not in the Soft-RoCE VM}
X=${SOFTROCE_GID_INDEX:-1}
mkdir -p "$OUT"
echo "guest $(uname -r), $(nproc) vCPU, device $D, IP $SOFTROCE_IP" >"$OUT/machine.txt"
perf() { # name tool args...: server in the background, client over the TCP side channel
  local name=$1 tool=$2; shift 2
  timeout 120 "$tool" -d "$D" -x "$X" "$@" >"$OUT/$name.server.txt" 2>&1 &
  local spid=$!
  sleep 2
  timeout 120 "$tool" -d "$D" -x "$X" "$@" 127.0.0.1 >"$OUT/$name.txt" 2>&1 || echo "$tool failed" >&2
  wait "$spid" || true
  grep -E '^ *[0-9]+ +[0-9]+ ' "$OUT/$name.txt" | tail -1
}
for r in $(seq "$ROUNDS"); do
  echo "=== round $r"
  perf "lat_poll_$r" ib_send_lat -s 64 -n 5000
  perf "lat_ev_$r" ib_send_lat -s 64 -n 5000 -e
  timeout 400 "$B" --addr "$SOFTROCE_IP:0" --paths direct,rdma,tonic-tcp --payloads 64 \
    --inflight 1,64 --duration-ms 2000 >"$OUT/bench_default_$r.txt" 2>"$OUT/bench_default_$r.err" ||
    echo "bench (default) failed: $OUT/bench_default_$r.err" >&2
  grep -E '^\| 64' "$OUT/bench_default_$r.txt" || true
  timeout 300 "$B" --addr "$SOFTROCE_IP:0" --paths direct,rdma --payloads 64 --inflight 1 \
    --duration-ms 2000 --poll-mode spin >"$OUT/bench_spin_$r.txt" 2>"$OUT/bench_spin_$r.err" ||
    echo "bench (spin) failed: $OUT/bench_spin_$r.err" >&2
  grep -E '^\| 64' "$OUT/bench_spin_$r.txt" || true
done
for p in direct rdma; do
  for n in "$N" $((2 * N)); do
    timeout 900 valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$p.$n" "$B" \
      --addr "$SOFTROCE_IP:0" --paths "$p" --payloads 64 --inflight 1 --iters "$n" --warmup 50 \
      --threads 2 >/dev/null 2>"$OUT/cg.$p.$n.err" || echo "callgrind $p $n failed" >&2
    timeout 300 strace -f -c -o "$OUT/strace.$p.$n.txt" "$B" --addr "$SOFTROCE_IP:0" --paths "$p" \
      --payloads 64 --inflight 1 --iters "$n" --warmup 50 >/dev/null 2>&1 ||
      echo "strace $p $n failed" >&2
  done
  a=$(grep -m1 -E '^(summary|totals):' "$OUT/cg.$p.$N" | awk '{print $2}')
  b=$(grep -m1 -E '^(summary|totals):' "$OUT/cg.$p.$((2 * N))" | awk '{print $2}')
  [ -n "$a" ] && [ -n "$b" ] && echo "callgrind $p: $(((b - a) / N)) instructions per call"
done
