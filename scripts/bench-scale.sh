#!/usr/bin/env bash
# Many connections (docs/benchmarks.md, "Many connections"): one echo server, N RDMA connections from one
# client process, in ONE Soft-RoCE VM boot: `scale client` (examples/src/bin/scale.rs)
# starts `scale server` on the guest's rxe address and steps up to each count
# in STEPS, printing setup rate, registered bytes and RSS of both processes,
# background calls ok/failed, 64 B latency and 1 MiB bandwidth on one
# connection with ratios to 1 connection. No figure is checked; the exit
# status is non-zero when a connection could not be opened or a call failed.
#
# Builds nothing: first, on the host,
#   cargo build --release -p rpc-examples --bin scale
# then
#   scripts/bench-scale.sh                       # STEPS=10,100,1000,2000
#   STEPS=10,50 scripts/bench-scale.sh           # a quick one
#
# Env: STEPS (default 10,100,1000,2000), SCALE_CONCURRENCY (handshakes at once,
#      default 8 here: under TCG 32 at once outlast the transport's 5 s handshake
#      timeout), SCALE_ARGS (more `scale client` flags, e.g. "--idle-secs 6
#      --lat-iters 500 --call-interval-ms 2000"), SCALE_OUT (output
#      dir, default target/bench-scale), SCALE_BIN (default <target dir>/release/scale),
#      SOFTROCE_VM_MEM (default 6G here), SOFTROCE_VM_TIMEOUT (seconds, default 1800),
#      SOFTROCE_SCRIPT (default ../shared/softroce/run-in-softroce-vm.sh).
# Output: $SCALE_OUT/scale-<time>.{md,json,stderr} (and scale.{md,json} = the last run);
# the table also goes to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---------------------------------------------------------------- inside the VM
if [ "${1:-}" = "--in-vm" ]; then
  BIN=$2 OUT=$3 STAMP=$4 LIMIT=$5
  : "${SOFTROCE_IP:?not in the Soft-RoCE VM}"
  # Thousands of connections need thousands of fds (a few per connection on
  # each side): as many as the kernel allows.
  ulimit -n 1048576 2>/dev/null || ulimit -n "$(ulimit -Hn)"
  {
    echo "guest: $(uname -srm), $(nproc) vCPU, $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo) RAM,"\
      "device ${SOFTROCE_DEV:-?} ($SOFTROCE_IP), ulimit -n $(ulimit -n)"
    echo "binary: $BIN ($(stat -c %y "$BIN" | cut -d. -f1))"
    echo "command: scale client --addr $SOFTROCE_IP:0 --steps $STEPS --concurrency $SCALE_CONCURRENCY ${SCALE_ARGS:-}"
  } | tee "$OUT/scale-$STAMP.env" >&2
  set +e
  # shellcheck disable=SC2086
  timeout -k 10 "$LIMIT" "$BIN" client --addr "$SOFTROCE_IP:0" --steps "$STEPS" --concurrency "$SCALE_CONCURRENCY" \
    --json "$OUT/scale-$STAMP.json" --markdown "$OUT/scale-$STAMP.md" ${SCALE_ARGS:-} \
    2> >(tee "$OUT/scale-$STAMP.stderr" >&2)
  rc=$?
  set -e
  [ "$rc" = 124 ] && echo "bench-scale: scale client timed out after ${LIMIT}s" >&2
  if [ "$rc" != 0 ]; then
    echo "bench-scale: scale client exited $rc; kernel messages (OOM?):" >&2
    dmesg | grep -iE 'out of memory|oom|killed process' | tail -5 >&2 || true
  fi
  exit "$rc"
fi

# ---------------------------------------------------------------- on the host
SOFTROCE_SCRIPT=${SOFTROCE_SCRIPT:-../shared/softroce/run-in-softroce-vm.sh}
TARGET_DIR=${CARGO_TARGET_DIR:-target}
BIN=$(readlink -f "${SCALE_BIN:-$TARGET_DIR/release/scale}")
OUT=${SCALE_OUT:-target/bench-scale}
export STEPS=${STEPS:-10,100,1000,2000}
export SCALE_CONCURRENCY=${SCALE_CONCURRENCY:-8}
export SOFTROCE_VM_MEM=${SOFTROCE_VM_MEM:-6G}
export SOFTROCE_VM_TIMEOUT=${SOFTROCE_VM_TIMEOUT:-1800}
if [ ! -x "$BIN" ]; then
  echo "bench-scale: $BIN not found; build it first: cargo build --release -p rpc-examples --bin scale" >&2
  exit 2
fi
[ -x "$SOFTROCE_SCRIPT" ] || { echo "bench-scale: $SOFTROCE_SCRIPT not found (see ../shared/softroce/README.md)" >&2; exit 2; }
mkdir -p "$OUT"
STAMP=$(date +%Y%m%d-%H%M%S)
# The client's own bound: the VM's, minus boot (~15 s) and shutdown.
LIMIT=$((SOFTROCE_VM_TIMEOUT > 120 ? SOFTROCE_VM_TIMEOUT - 60 : SOFTROCE_VM_TIMEOUT))
echo "bench-scale: STEPS=$STEPS, $SCALE_CONCURRENCY handshakes at a time, VM memory $SOFTROCE_VM_MEM, timeout ${SOFTROCE_VM_TIMEOUT}s; output $OUT/scale-$STAMP.*" >&2
set +e
"$SOFTROCE_SCRIPT" "$0" --in-vm "$BIN" "$OUT" "$STAMP" "$LIMIT"
rc=$?
set -e
for ext in md json; do
  [ -f "$OUT/scale-$STAMP.$ext" ] && cp "$OUT/scale-$STAMP.$ext" "$OUT/scale.$ext"
done
echo "bench-scale: exit $rc; table $OUT/scale-$STAMP.md, figures $OUT/scale-$STAMP.json, log $OUT/scale-$STAMP.stderr" >&2
exit "$rc"
