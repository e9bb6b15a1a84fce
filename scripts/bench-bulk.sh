#!/bin/bash
# Issue 12 (bulk path) figures in ONE Soft-RoCE VM boot (docs/benchmarks.md,
# "Bulk path"): ib_write_bw at 1 MiB and 16 MiB, then the before binary
# (BEFORE_BENCH, e.g. a release build of the previous main) and this
# checkout's bench interleaved over 2 rounds (1 MiB and 16 MiB unary, 1 and 8
# in flight, rdma and tonic-tcp), then, with this checkout only: SEND vs
# WRITE-with-immediate notification, the rendezvous sweep (buffer size x
# count, 1 MiB x 1 and x 8), echo both ways and client/server streaming.
# BULK_MAIN_ONLY=1 stops after the main rounds (for the further boots of a
# median over boots).
# Run: ../shared/softroce/run-in-softroce-vm.sh scripts/bench-bulk.sh
# Output: $BULK_OUT (default target/bench-bulk), one file per run; the table
# generator is scripts/bench-bulk-table.py.
O=${BULK_OUT:-target/bench-bulk}; mkdir -p "$O"; D=$SOFTROCE_DEV; X=${SOFTROCE_GID_INDEX:-1}
AFTER=${AFTER_BENCH:-target/release/bench}
BEFORE=${BEFORE_BENCH:-}
uptime > "$O/uptime0.txt"
bw() { # size iters [suffix]
  timeout 120 ib_write_bw -d "$D" -x "$X" -s "$1" -n "$2" > "$O/bw-$1$3.server.txt" 2>&1 & sleep 2
  timeout 120 ib_write_bw -d "$D" -x "$X" -s "$1" -n "$2" 127.0.0.1 > "$O/bw-$1$3.txt" 2>&1; wait
  grep -E '^ *[0-9]+ +[0-9]+ ' "$O/bw-$1$3.txt" >&2
}
run() { # name binary args...
  local name=$1 bin=$2; shift 2
  echo "--- $name" >&2
  timeout 300 "$bin" --addr "$SOFTROCE_IP:0" --json "$O/$name.json" "$@" > "$O/$name.txt" 2>&1 ||
    echo "$name failed: see $O/$name.txt" >&2
}
bw 1048576 50
bw 16777216 8
MAIN=(--paths rdma,tonic-tcp --payloads 1m,16m --inflight 1,8 --duration-ms 1500 --max-cell-mib 48)
for r in 1 2; do
  [ -n "$BEFORE" ] && run "before-$r" "$BEFORE" "${MAIN[@]}"
  run "after-$r" "$AFTER" "${MAIN[@]}"
done
if [ -n "${BULK_MAIN_ONLY:-}" ]; then uptime > "$O/uptime1.txt"; exit 0; fi
bw 1048576 50 -b
SW=(--paths rdma --payloads 1m --inflight 1,8 --duration-ms 1500)
run "notify-send" "$AFTER" "${SW[@]}" --no-write-imm
run "notify-imm" "$AFTER" "${SW[@]}" --rdv-buffers 8
for b in 64k 256k 1m; do
  for n in 4 8 16; do
    run "sweep-$b-$n" "$AFTER" "${SW[@]}" --rdv-bytes "$b" --rdv-buffers "$n"
  done
done
run "echo-both-ways" "$AFTER" --paths rdma,tonic-tcp --payloads 1m --inflight 1,8 --duration-ms 1500 --echo-both-ways
run "client-stream" "$AFTER" --paths rdma,tonic-tcp --payloads 1m --inflight 1 --duration-ms 1500 --stream client --stream-msgs 8
run "server-stream" "$AFTER" --paths rdma,tonic-tcp --payloads 1m --inflight 1 --duration-ms 1500 --stream server --stream-msgs 8
uptime > "$O/uptime1.txt"
