#!/usr/bin/env bash
# Remote memory against perftest in ONE Soft-RoCE VM boot (docs/benchmarks.md,
# "Remote memory"):
#
#   scripts/bench-remote.sh            # builds the release bench, boots the VM
#
# Inside the VM, ROUNDS (default 3) interleaved rounds of: perftest
# ib_read_bw at 1 MiB and 16 MiB; the bench's remote-read path (one Get,
# then one-sided reads) and unary-fetch path (the same bytes as
# BlobStore.Read unary calls, direct path) at 1 MiB and 16 MiB with 1 and 8
# in flight. Then SMALL_ROUNDS (default 5) interleaved rounds of: perftest
# ib_read_lat 64 B (polling), and both paths at 64 B with 1 in flight in
# polling mode (--one-sided-poll-mode spin; the client on the default
# runtime, and remote-read also on one worker thread). The
# server runs on a runtime of its own (--server-threads 1), so its CPU per
# fetch is reported apart. Raw outputs go to BENCH_OUT (default
# target/bench-remote). No figure is checked: the script only measures.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${BENCH_OUT:-target/bench-remote}
ROUNDS=${ROUNDS:-3}
SMALL_ROUNDS=${SMALL_ROUNDS:-5}
if [ "${1:-}" != "--in-vm" ]; then
  SOFTROCE=${SOFTROCE_SCRIPT:-../shared/softroce/run-in-softroce-vm.sh}
  cargo build --release -p rpc-examples --bin bench
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
  mkdir -p "$OUT"
  BENCH_BIN=$TARGET_DIR/release/bench BENCH_OUT=$OUT ROUNDS=$ROUNDS SMALL_ROUNDS=$SMALL_ROUNDS \
    timeout 3600 "$SOFTROCE" bash scripts/bench-remote.sh --in-vm
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
  perf "read_bw_1m_$r" ib_read_bw -s 1048576 -n 400
  perf "read_bw_16m_$r" ib_read_bw -s 16777216 -n 40
  timeout 600 "$B" --addr "$SOFTROCE_IP:0" --paths remote-read,unary-fetch --payloads 1m,16m \
    --inflight 1,8 --duration-ms 2000 --max-cell-mib 512 --server-threads 1 \
    >"$OUT/bench_bulk_$r.txt" 2>"$OUT/bench_bulk_$r.err" ||
    echo "bench (bulk) failed: $OUT/bench_bulk_$r.err" >&2
  grep -E '^\| (1|16) MiB' "$OUT/bench_bulk_$r.txt" || true
done
# 64 B: more rounds, each perftest's latency right before ours (perftest's
# own round-to-round spread is what limits a ratio here).
for r in $(seq "$SMALL_ROUNDS"); do
  echo "=== 64 B round $r"
  perf "read_lat_$r" ib_read_lat -s 64 -n 5000
  # 64 B: the reading side polls (the caller of a lone READ polls the side
  # CQ until it completes; the connections' drivers stay adaptive), with the
  # client on the default runtime and on one worker thread.
  timeout 300 "$B" --addr "$SOFTROCE_IP:0" --paths remote-read,unary-fetch --payloads 64 \
    --inflight 1 --duration-ms 2000 --one-sided-poll-mode spin --server-threads 1 \
    >"$OUT/bench_small_$r.txt" 2>"$OUT/bench_small_$r.err" ||
    echo "bench (small) failed: $OUT/bench_small_$r.err" >&2
  grep -E '^\| 64' "$OUT/bench_small_$r.txt" || true
  timeout 300 "$B" --addr "$SOFTROCE_IP:0" --paths remote-read --payloads 64 \
    --inflight 1 --duration-ms 2000 --one-sided-poll-mode spin --server-threads 1 --threads 1 \
    >"$OUT/bench_small_t1_$r.txt" 2>"$OUT/bench_small_t1_$r.err" ||
    echo "bench (small, one thread) failed: $OUT/bench_small_t1_$r.err" >&2
  grep -E '^\| 64' "$OUT/bench_small_t1_$r.txt" || true
done
