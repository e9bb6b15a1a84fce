#!/bin/bash
# Several bench binaries in ONE Soft-RoCE VM boot, interleaved over ROUNDS
# rounds (docs/benchmarks.md): perftest first (ib_send_lat 64 B, ib_write_bw
# 1 MiB), then per round and binary: 64 B unary at 1, 8 and 64 in flight and
# 1 MiB at 1 and 8 (rdma and tonic-tcp; two bench runs), and 64 B at 1 in flight on a
# current_thread runtime. BENCHES="name=path name=path ..." (default: this
# checkout's release bench as "after"). Table: scripts/bench-compare-table.py.
# Run: ../shared/softroce/run-in-softroce-vm.sh scripts/bench-compare.sh
O=${COMPARE_OUT:-target/bench-compare}; mkdir -p "$O"; D=$SOFTROCE_DEV; X=${SOFTROCE_GID_INDEX:-1}
BENCHES=${BENCHES:-after=target/release/bench}
ROUNDS=${ROUNDS:-2}
uptime > "$O/uptime0.txt"
timeout 60 ib_send_lat -d "$D" -x "$X" -s 64 -n 2000 > "$O/lat.server.txt" 2>&1 & sleep 2
timeout 60 ib_send_lat -d "$D" -x "$X" -s 64 -n 2000 127.0.0.1 > "$O/perftest.txt" 2>&1; wait
timeout 120 ib_write_bw -d "$D" -x "$X" -s 1048576 -n 50 > "$O/bw.server.txt" 2>&1 & sleep 2
timeout 120 ib_write_bw -d "$D" -x "$X" -s 1048576 -n 50 127.0.0.1 > "$O/bw-1048576.txt" 2>&1; wait
for r in $(seq 1 "$ROUNDS"); do
  for nb in $BENCHES; do
    n=${nb%%=*}; b=${nb#*=}
    echo "--- $n round $r" >&2
    timeout 300 "$b" --addr "$SOFTROCE_IP:0" --paths rdma,tonic-tcp --payloads 64 --inflight 1,8,64 \
      --duration-ms 1000 --json "$O/$n-$r.json" > "$O/$n-$r.txt" 2>&1 || echo "$n $r failed" >&2
    timeout 300 "$b" --addr "$SOFTROCE_IP:0" --paths rdma,tonic-tcp --payloads 1m --inflight 1,8 \
      --duration-ms 1000 --max-cell-mib 16 --json "$O/$n-1m-$r.json" > "$O/$n-1m-$r.txt" 2>&1 || echo "$n 1m $r failed" >&2
    timeout 120 "$b" --addr "$SOFTROCE_IP:0" --paths rdma,tonic-tcp --payloads 64 --inflight 1 \
      --duration-ms 1000 --current-thread --json "$O/$n-ct-$r.json" > "$O/$n-ct-$r.txt" 2>&1 || echo "$n ct $r failed" >&2
  done
done
uptime > "$O/uptime1.txt"
