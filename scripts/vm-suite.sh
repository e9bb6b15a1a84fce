#!/usr/bin/env bash
# Runs inside the Soft-RoCE VM (scripts/test.sh starts it): every test that needs
# verbs, each bounded by a timeout. SOFTROCE_IN_VM=1 makes a missing device fail.
# The device tests are #[ignore]d (a host's `cargo test` lists them as ignored):
# every test binary here runs with --include-ignored, which also applies to a
# filtered set; without it, SOFTROCE_IN_VM=1 fails the binary's
# device_tests_run_where_a_device_is_expected.
set -uo pipefail
cd "$(dirname "$0")/.."
# Binaries: RPC_BIN_DIR (scripts/test.sh sets it), else cargo's target directory
# (honours CARGO_TARGET_DIR).
BIN=${RPC_BIN_DIR:-$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/debug}
: "${SOFTROCE_IP:?not inside the Soft-RoCE VM}" "${VERBS_TEST:?}" "${BEHAVIOUR_TEST:?}" "${RELIABILITY_TEST:?}" "${HOSTILE_TEST:?}"
export RUST_LOG=${RUST_LOG:-warn} RUST_BACKTRACE=1
# The emulated VM can be slow to set up a connection when the host is busy:
# give rdma_cm time rather than let a client fall back to TCP.
export RPC_RDMA_CONNECT_TIMEOUT_MS=${RPC_RDMA_CONNECT_TIMEOUT_MS:-15000}
# The long runs (10^5-call load, 10^3-cycle churn) run once for the docs
# (docs/reliability.md); CI runs the same tests at a smaller count.
export RELIABILITY_LOAD_CALLS=${RELIABILITY_LOAD_CALLS:-20000} RELIABILITY_CHURN_CYCLES=${RELIABILITY_CHURN_CYCLES:-300}
# Balanced channel over 3 RDMA servers, one killed and one added (behaviour
# balance::rdma_server_killed_and_added): 10^4 calls once for the docs, fewer in CI.
export BALANCE_CALLS=${BALANCE_CALLS:-2000}
LOG=target/vm-suite-logs; mkdir -p "$LOG"
passed=0; failed=0
check() { # name, then command; its whole output is kept in $out and in $LOG
  local name=$1; shift
  local t0=$SECONDS f="$LOG/check-$((passed+failed)).log"
  "$@" >"$f" 2>&1; local rc=$?
  out=$(cat "$f")
  if [ $rc -eq 0 ]; then passed=$((passed+1)); echo "vm: ok     $name ($((SECONDS-t0)) s)"
  else failed=$((failed+1)); echo "vm: FAILED $name ($((SECONDS-t0)) s, exit $rc, output in $f):"; tail -40 "$f"; fi
}
run() { # name, then command; output streamed
  local name=$1; shift
  local t0=$SECONDS
  echo "vm: --- $name"
  if "$@"; then passed=$((passed+1)); echo "vm: ok     $name ($((SECONDS-t0)) s)"
  else failed=$((failed+1)); echo "vm: FAILED $name ($((SECONDS-t0)) s)"; fi
}
# Runs a command with the example services' per-request println lines filtered out.
quiet() { "$@" 2>&1 | grep -vE '^(Got a request|GetFeature|ListFeatures =|  =>| ///|RecordRoute$|  ==>|RouteChat$)'; return "${PIPESTATUS[0]}"; }
T0=$SECONDS
echo "vm: device ${SOFTROCE_DEV:-?} ip $SOFTROCE_IP"

run "rdma-transport on verbs (message sizes, 100k messages, both ways, many conns, peer killed, no listener)" \
  timeout 600 "$VERBS_TEST" --include-ignored --test-threads=1
if [ -n "${SOFTROCE_SIW_IP:-}" ]; then
  run "rdma-transport on verbs over iWARP (SoftiWARP siw0)" \
    env SOFTROCE_IP="$SOFTROCE_SIW_IP" timeout 600 "$VERBS_TEST" --include-ignored --test-threads=1
fi
run "hostile RDMA peer on a real QP (no credit, forged notifications, WRITEs outside the region, foreign and dead rkeys)" \
  timeout 300 "$HOSTILE_TEST" --include-ignored --test-threads=1 --nocapture
if [ -n "${SOFTROCE_SIW_IP:-}" ]; then
  run "hostile RDMA peer over iWARP (SoftiWARP siw0)" \
    env SOFTROCE_IP="$SOFTROCE_SIW_IP" timeout 300 "$HOSTILE_TEST" --include-ignored --test-threads=1 --nocapture
fi
check "rdma_pingpong example (rdma-transport API, both ends in one process)" \
  timeout 120 "$BIN/examples/rdma_pingpong" --loopback "$SOFTROCE_IP"
echo "$out" | tail -3
check "rdma_pingpong, both ends answering from the inline handler, polling mode (every pong checked)" \
  timeout 120 "$BIN/examples/rdma_pingpong" --loopback "$SOFTROCE_IP" --deliver inline --poll-mode spin --iters 500
echo "$out" | grep PINGPONG
run "behaviour suite over RDMA, on the direct path and through tonic's client and server (all call kinds, 64 MiB, 1000 calls, deadlines, cancel, builder options, balance: $BALANCE_CALLS calls, re-probe, same-port RDMA)" \
  quiet timeout 900 "$BEHAVIOUR_TEST" rdma --skip transports --include-ignored --test-threads=1
if [ -n "${SOFTROCE_SIW_IP:-}" ]; then
  # iWARP: the server's RDMA listener takes another port, announced over TCP
  # (docs/wire-protocol.md §3); cases that cannot run on iWARP print SKIP and why.
  run "behaviour suite over iWARP, both ways of calling (SoftiWARP siw0; RDMA port announced over TCP)" \
    quiet env SOFTROCE_IP="$SOFTROCE_SIW_IP" timeout 900 "$BEHAVIOUR_TEST" rdma --skip transports --include-ignored --test-threads=1 --nocapture
fi
run "transport selection (rendezvous, mixed clients, fallback, reconnect)" \
  timeout 300 "$BEHAVIOUR_TEST" transports --include-ignored --test-threads=1

run "reliability (peer killed, server restart, deadline storm, slow consumer, load: $RELIABILITY_LOAD_CALLS calls, churn: $RELIABILITY_CHURN_CYCLES cycles)" \
  timeout 1800 "$RELIABILITY_TEST" --include-ignored --test-threads=1 --nocapture

# Waits until a server accepts TCP connections on HOST:PORT (up to 60 s).
wait_port() {
  local i
  for i in $(seq 1 120); do
    (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null && return 0
    sleep 0.5
  done
  echo "vm: server on $1 did not come up"; return 1
}

# The examples, as a user runs them.
A="$SOFTROCE_IP:50051"
timeout 300 $BIN/helloworld-server --addr "$A" >"$LOG/hw-server.log" 2>&1 &
srv=$!
wait_port "$A"
check "helloworld-client over RDMA prints 'transport: rdma'" \
  bash -c "timeout 60 $BIN/helloworld-client --addr $A > $LOG/hw.out 2>&1; cat $LOG/hw.out; grep -qx 'transport: rdma' $LOG/hw.out"
check "helloworld-client --transport tcp at the same time as a stock grpcio client" bash -c "
  timeout 60 python3 tests/stock_client/grpcio_hello.py --no-spawn --addr $A --calls 50 & py=\$!
  timeout 60 $BIN/helloworld-client --addr $A --transport tcp | grep -qx 'transport: tcp' || exit 1
  timeout 60 $BIN/helloworld-client --addr $A | grep -qx 'transport: rdma' || exit 1
  wait \$py"
kill $srv 2>/dev/null; wait $srv 2>/dev/null

B="$SOFTROCE_IP:50052"
timeout 120 $BIN/helloworld-server --addr "$B" --tcp-only >/dev/null 2>&1 &
srv=$!
wait_port "$B"
check "helloworld-client against a TCP-only server prints the fallback line" \
  bash -c "timeout 60 $BIN/helloworld-client --addr $B > $LOG/hw-fb.out 2>&1; cat $LOG/hw-fb.out; grep -q '^transport: tcp (fallback: peer .* does not accept RDMA' $LOG/hw-fb.out"
kill $srv 2>/dev/null; wait $srv 2>/dev/null

C="$SOFTROCE_IP:50053"
timeout 300 $BIN/routeguide-server --addr "$C" >/dev/null 2>&1 &
srv=$!
wait_port "$C"
check "routeguide-client (all four call kinds) over RDMA" \
  bash -c "timeout 120 $BIN/routeguide-client --addr $C > $LOG/rg.out 2>&1; tail -5 $LOG/rg.out; grep -qx 'transport: rdma' $LOG/rg.out"
kill $srv 2>/dev/null; wait $srv 2>/dev/null

check "demo over RDMA" bash -c "timeout 300 $BIN/demo --addr $SOFTROCE_IP:0 --calls 50 > $LOG/demo.out 2>&1; grep -E '^(server|client|  [A-Za-z]|summary)|WARN|ERROR|Error' $LOG/demo.out; grep -q '^client: transport: rdma' $LOG/demo.out"

check "benchmark smoke over RDMA (no timings asserted)" \
  timeout 300 $BIN/bench --quick --addr "$SOFTROCE_IP:0" --paths rdma,direct,tcp-fallback,tonic-tcp,remote-read,unary-fetch

# Remote memory end to end with the example: Put (the server reads the
# client's region), Get (the client reads the server's), Fetch (the server
# writes the client's), every byte checked by the example, one-sided.
blobstore() { # name ip
  check "blobstore example: one-sided Put, Get and Fetch of 1 MiB over RDMA ($1)" bash -c "
    timeout 120 $BIN/blobstore --addr $2:0 > $LOG/blobstore-$1.out 2>&1; rc=\$?
    grep -vE ' INFO ' $LOG/blobstore-$1.out | tail -7
    [ \$rc -eq 0 ] && grep -qx 'transport: rdma' $LOG/blobstore-$1.out &&
      grep -qx 'remote memory: one-sided RDMA READ and WRITE' $LOG/blobstore-$1.out &&
      grep -qx ok $LOG/blobstore-$1.out"
}
blobstore rxe "$SOFTROCE_IP"
if [ -n "${SOFTROCE_SIW_IP:-}" ]; then
  blobstore siw "$SOFTROCE_SIW_IP"
fi

# The scale benchmark at a small count (the docs run goes to 2000:
# scripts/bench-scale.sh): connections open, every call succeeds, and it
# prints the registered bytes per connection of the server and the client;
# then back to one connection (the control row).
check "scale smoke: 100 RDMA connections to one server, then back to one (no timings asserted)" \
  bash -c "timeout 300 $BIN/scale client --addr $SOFTROCE_IP:0 --steps 10,100 --concurrency 8 \
    --idle-secs 2 --lat-iters 200 --first-warmup 100 --bw-iters 4 --bw-rounds 2 --return-to-one \
    > $LOG/scale.out 2>&1; rc=\$?; \
    grep -E '^\|' $LOG/scale.out; tail -1 $LOG/scale.out; exit \$rc"

echo "vm: suite wall time $((SECONDS-T0)) s"
echo "vm: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
