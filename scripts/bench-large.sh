#!/usr/bin/env bash
# Large calls against perftest in ONE Soft-RoCE VM boot (docs/benchmarks.md,
# "Large calls"):
#
#   scripts/bench-large.sh                         # builds the release bench, boots the VM
#   python3 scripts/bench-large-summary.py target/bench-large   # ratios, medians, spreads
#
# Inside the VM, ROUNDS (default 3) interleaved rounds of: perftest
# ib_write_bw and ib_read_bw at 1 MiB and ib_write_bw at 16 MiB; then the
# bench over the rdma path (tonic's stub) and the direct path at 1 MiB and
# 16 MiB with 1 and 8 in flight, each of the three ways a large message
# moves, in an order that rotates from round to round: written into a
# destination the receiver grants (the default where windows exist),
# read by the receiver (--no-write-destination), WRITTEN in chunks into
# the rendezvous region and copied out (--no-read-rendezvous); then the
# perftest runs again. A round's reference is the mean of its two perftest
# runs. Raw outputs go to BENCH_OUT (default target/bench-large). No
# figure is checked: the script only measures.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${BENCH_OUT:-target/bench-large}
ROUNDS=${ROUNDS:-3}
if [ "${1:-}" != "--in-vm" ]; then
  SOFTROCE=${SOFTROCE_SCRIPT:-../shared/softroce/run-in-softroce-vm.sh}
  cargo build --release -p rpc-examples --bin bench
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
  mkdir -p "$OUT"
  BENCH_BIN=$TARGET_DIR/release/bench BENCH_OUT=$OUT ROUNDS=$ROUNDS \
    timeout 3600 "$SOFTROCE" bash scripts/bench-large.sh --in-vm
  exit
fi
B=${BENCH_BIN:?}
D=${SOFTROCE_DEV:?not in the Soft-RoCE VM}
X=${SOFTROCE_GID_INDEX:-1}
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/perftest.txt
echo "guest $(uname -r), $(nproc) vCPU, device $D, IP $SOFTROCE_IP" >"$OUT/machine.txt"
perf() { # tag tool size iterations: server in the background, client over the TCP side channel
  local tag=$1 tool=$2 size=$3 n=$4
  timeout 120 "$tool" -d "$D" -x "$X" -s "$size" -n "$n" -F >/dev/null 2>&1 &
  local spid=$!
  sleep 2
  timeout 120 "$tool" -d "$D" -x "$X" -s "$size" -n "$n" -F 127.0.0.1 2>&1 |
    grep -E '^ *[0-9]+ +[0-9]+ ' | sed "s/^/$tool $tag: /" | tee -a "$OUT/perftest.txt" ||
    echo "$tool failed" >&2
  wait "$spid" || true
}
ways=(written read chunked)
for r in $(seq "$ROUNDS"); do
  echo "=== round $r $(date +%T)"
  perf "1m r$r a" ib_write_bw 1048576 150
  perf "1m r$r a" ib_read_bw 1048576 150
  perf "16m r$r a" ib_write_bw 16777216 20
  for k in 0 1 2; do
    way=${ways[$(((k + r - 1) % 3))]}
    case $way in
    written) extra=() ;;
    read) extra=(--no-write-destination) ;;
    chunked) extra=(--no-read-rendezvous) ;;
    esac
    for path in rdma direct; do
      echo "--- $path $way round $r $(date +%T)"
      timeout 600 "$B" --addr "$SOFTROCE_IP:0" --paths "$path" --payloads 1m,16m --inflight 1,8 \
        --duration-ms 4000 --max-cell-mib 320 ${extra[@]+"${extra[@]}"} \
        --json "$OUT/$path-$way-r$r.json" >"$OUT/$path-$way-r$r.txt" 2>&1 ||
        echo "bench $path $way failed: $OUT/$path-$way-r$r.txt" >&2
    done
  done
  perf "1m r$r b" ib_write_bw 1048576 150
  perf "1m r$r b" ib_read_bw 1048576 150
  perf "16m r$r b" ib_write_bw 16777216 20
done
echo "raw outputs in $OUT; summary: python3 scripts/bench-large-summary.py $OUT"
