#!/bin/bash
# Two builds of the bench in ONE Soft-RoCE VM boot, interleaved, with
# instructions per call (docs/benchmarks.md, "Reproduce"): perftest
# (ib_send_lat 64 B), then 2 rounds of bench (rdma + tonic-tcp, 64 B, 1/8/64
# in flight) alternating between the binaries, then callgrind of the 64 B
# RDMA call (200 and 400 calls) for each. BEFORE_BENCH / AFTER_BENCH: the two
# bench binaries, paths relative to the repository root (default after: this
# checkout's target/release/bench). Output: target/ba; table of the medians:
# python3 scripts/bench-ba-callgrind-table.py target/ba.
# Usage, from the repository root:
#   cp target/release/bench target/bench-before   # then rebuild with the change
#   BEFORE_BENCH=target/bench-before ../shared/softroce/run-in-softroce-vm.sh scripts/bench-ba-callgrind.sh
cd "$(dirname "$0")/.." || exit 1
O=target/ba; mkdir -p $O; D=$SOFTROCE_DEV; X=${SOFTROCE_GID_INDEX:-1}
B_before=${BEFORE_BENCH:?set BEFORE_BENCH}; B_after=${AFTER_BENCH:-target/release/bench}
timeout 60 ib_send_lat -d "$D" -x "$X" -s 64 -n 2000 > $O/pt.server.txt 2>&1 & sleep 2
timeout 60 ib_send_lat -d "$D" -x "$X" -s 64 -n 2000 127.0.0.1 > $O/perftest.txt 2>&1; wait
for r in 1 2; do for v in before after; do
  b=B_$v
  timeout 200 "${!b}" --addr "$SOFTROCE_IP:0" --paths rdma,tonic-tcp --payloads 64 --inflight 1,8,64 \
    --duration-ms 1000 --json $O/$v-$r.json > $O/$v-$r.txt 2>&1 || echo "$v $r failed"
done; done
for v in before after; do for n in 200 400; do
  b=B_$v
  timeout 400 valgrind --tool=callgrind --callgrind-out-file=$O/cg.$v.$n.out "${!b}" --addr "$SOFTROCE_IP:0" \
    --paths rdma --payloads 64 --inflight 1 --iters $n --warmup 50 --threads 2 > /dev/null 2>&1 || echo "cg $v $n failed"
done; done
