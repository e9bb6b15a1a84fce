#!/usr/bin/env bash
# Runs every test of the project (the README's test command; .ci/run calls it):
#   1. host: unit tests, engine/property tests, codegen, the behaviour suite over the
#      in-memory and TCP paths (the RDMA tests are #[ignore]d: listed as ignored);
#      a tonic project outside the workspace built and run (scripts/downstream-check.sh);
#   2. a stock gRPC client (Python grpcio) against helloworld-server over TCP; the
#      binaries without the RDMA libraries (scripts/no-rdma-libs.sh);
#   3. the device suite in ONE Soft-RoCE VM boot (scripts/vm-suite.sh): rdma-transport
#      on real verbs, the behaviour suite over RDMA, transport selection and fallback,
#      the examples (the ignored device tests run there with --include-ignored).
#      Inside the VM, a missing device fails the tests loudly.
# Needs: the apt packages .ci/run installs, and ../shared/softroce/ (or SOFTROCE_SCRIPT).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SOFTROCE=${SOFTROCE_SCRIPT:-$ROOT/../shared/softroce/run-in-softroce-vm.sh}
# Where cargo puts binaries: honours CARGO_TARGET_DIR and .cargo/config.toml's build.target-dir.
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])') || {
  echo "cargo metadata failed"; exit 1; }
BIN=$TARGET_DIR/debug
export RPC_BIN_DIR=$BIN
passed=0; failed=0; failures=()
step() {
  local name=$1; shift
  echo; echo "=== $name"
  local t0=$SECONDS
  if "$@"; then passed=$((passed+1)); echo "=== $name: ok ($((SECONDS-t0)) s)"
  else failed=$((failed+1)); failures+=("$name"); echo "=== $name: FAILED ($((SECONDS-t0)) s)"; fi
}

step "build (workspace, all targets)" cargo build --workspace --all-targets --quiet
step "a project outside the workspace, as the README's tonic recipe says (newest libclang)" \
  ./scripts/downstream-check.sh
step "host tests (cargo test --workspace)" cargo test --workspace --quiet --no-fail-fast
step "stock gRPC client (grpcio) -> helloworld-server over TCP" \
  python3 tests/stock_client/grpcio_hello.py --server "$BIN/helloworld-server"

step "stock gRPC tooling (grpcio reflection + health) -> helloworld-server over TCP" \
  python3 tests/stock_client/grpcio_reflection.py --server "$BIN/helloworld-server"
step "run anywhere: no NEEDED RDMA library; demo, helloworld and grpcio with the RDMA libraries hidden" \
  ./scripts/no-rdma-libs.sh

step "benchmark smoke (no timings asserted)" \
  "$BIN/bench" --quick --paths memory,direct-memory,tcp-fallback,tonic-tcp
step "fuzz smoke (every target, 10 s each)" ./scripts/fuzz.sh 10

# Test binaries that need a device, built above; found by target name.
bins=$(cargo test --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
want = {"verbs": "VERBS_TEST", "hostile": "HOSTILE_TEST", "behaviour": "BEHAVIOUR_TEST", "reliability": "RELIABILITY_TEST"}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        print(want[m["target"]["name"]] + "=" + m["executable"])
')
[ -n "$bins" ] && export $bins
if [ -z "${VERBS_TEST:-}" ] || [ -z "${HOSTILE_TEST:-}" ] || [ -z "${BEHAVIOUR_TEST:-}" ] || [ -z "${RELIABILITY_TEST:-}" ]; then
  failed=$((failed+1)); failures+=("locating device test binaries"); echo "could not find test binaries: $bins"
elif [ ! -x "$SOFTROCE" ]; then
  failed=$((failed+1)); failures+=("Soft-RoCE VM"); echo "missing $SOFTROCE (set SOFTROCE_SCRIPT)"
else
  # SoftiWARP too (iWARP: no WRITE_WITH_IMM, rdma_cm over real TCP ports), in the same boot.
  step "Soft-RoCE VM suite (one boot)" env VERBS_TEST="$VERBS_TEST" BEHAVIOUR_TEST="$BEHAVIOUR_TEST" \
    RELIABILITY_TEST="$RELIABILITY_TEST" HOSTILE_TEST="$HOSTILE_TEST" \
    SOFTROCE_VM_SIW=${SOFTROCE_VM_SIW:-1} \
    SOFTROCE_VM_TIMEOUT=${SOFTROCE_VM_TIMEOUT:-3000} "$SOFTROCE" "$ROOT/scripts/vm-suite.sh"
fi

echo
for f in "${failures[@]}"; do echo "failed step: $f"; done
echo "test steps: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
