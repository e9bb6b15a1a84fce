#!/bin/bash
# Before/after bench in ONE VM boot (docs/benchmarks.md, "Before/after this
# session's call-path changes"). Before binary: BEFORE_BENCH (default the
# baseline build at /work/bench-baseline); after: this checkout's release bench.
# Run: ../shared/softroce/run-in-softroce-vm.sh scripts/bench-before-after.sh
# One VM boot: perftest, then before/after bench interleaved.
O=target/bench-ba; mkdir -p $O; D=$SOFTROCE_DEV; X=${SOFTROCE_GID_INDEX:-1}
uptime > $O/uptime0.txt
timeout 60 ib_send_lat -d $D -x $X -s 64 -n 2000 > $O/pt.server.txt 2>&1 & sleep 2
timeout 60 ib_send_lat -d $D -x $X -s 64 -n 2000 127.0.0.1 > $O/perftest.txt 2>&1; wait
for r in 1 2; do
  for v in before after; do
    if [ $v = before ]; then B=${BEFORE_BENCH:-/work/bench-baseline/target/release/bench}; else B=target/release/bench; fi
    timeout 240 $B --addr $SOFTROCE_IP:0 --paths rdma,tonic-tcp --payloads 64,1m --inflight 1,8,64 --duration-ms 1000 --max-cell-mib 16 --json $O/$v-$r.json > $O/$v-$r.txt 2>&1 || echo "$v $r failed"
    timeout 120 $B --addr $SOFTROCE_IP:0 --paths rdma,tonic-tcp --payloads 64 --inflight 1 --duration-ms 1000 --current-thread --json $O/$v-ct-$r.json > $O/$v-ct-$r.txt 2>&1 || echo "$v ct $r failed"
  done
done
uptime > $O/uptime1.txt
