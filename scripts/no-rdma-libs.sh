#!/usr/bin/env bash
# Run anywhere: our binaries do not link the RDMA libraries; on a host
# without them they start, use TCP and say why.
#   1. readelf: no executable of the workspace (bins, examples, test binaries of
#      the debug build, and the release binaries of rpc-examples) has libibverbs or
#      librdmacm among its NEEDED entries;
#   2. in a mount namespace where the library directory is replaced by a view
#      without libibverbs.so* and librdmacm.so* (as on a host without rdma-core):
#      demo, helloworld-server and -client start, work over TCP and print the reason
#      `RDMA libraries not installed (libibverbs.so.1: ...)`; a stock grpcio client
#      still reaches the server.
# Usage: scripts/no-rdma-libs.sh   (root, or unprivileged user namespaces for `unshare -rm`)
# Env: NO_RDMA_LIBS_SKIP_RELEASE=1 skips the release build (and its check).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# ------------------------------------------------- 2. inside the namespace
if [ "${1:-}" = "--in-namespace" ]; then
  BIN=$2 LOG=$3 T=$4
  set -e
  mount --make-rprivate / 2>/dev/null || true
  # Every directory the loader finds either library in (ldconfig's cache).
  dirs=$(ldconfig -p | awk '/(libibverbs|librdmacm)\.so/ {print $NF}' | xargs -r -n1 dirname |
    xargs -r -n1 realpath | sort -u)
  [ -n "$dirs" ] || { echo "no libibverbs/librdmacm known to ldconfig: nothing to hide"; exit 1; }
  i=0
  for d in $dirs; do
    # The real directory stays reachable at $T/orig$i; the loader's path gets a
    # tmpfs with a symlink to every entry except the two libraries.
    mkdir "$T/orig$i" "$T/view$i"
    mount --bind "$d" "$T/orig$i"
    mount -t tmpfs tmpfs "$T/view$i"
    for f in "$T/orig$i"/* "$T/orig$i"/.[!.]*; do
      [ -e "$f" ] || [ -L "$f" ] || continue
      case ${f##*/} in libibverbs.so* | librdmacm.so*) continue ;; esac
      ln -s "$f" "$T/view$i/${f##*/}"
    done
    mount --bind "$T/view$i" "$d"
    echo "hidden: $d/libibverbs.so* $d/librdmacm.so*"
    i=$((i + 1))
  done
  set +e
  fail=0
  ok() { echo "no-rdma-libs: ok     $*"; }
  bad() { echo "no-rdma-libs: FAILED $*"; fail=1; }
  # Control: the libraries are really gone for the dynamic loader.
  if python3 -c 'import ctypes; ctypes.CDLL("libibverbs.so.1")' 2>"$LOG/control.txt"; then
    bad "control: libibverbs.so.1 still loads in the namespace"
  elif python3 -c 'import ctypes; ctypes.CDLL("librdmacm.so.1")' 2>>"$LOG/control.txt"; then
    bad "control: librdmacm.so.1 still loads in the namespace"
  else
    ok "control: dlopen(libibverbs.so.1) and dlopen(librdmacm.so.1) fail: $(tail -1 "$LOG/control.txt")"
  fi
  REASON='RDMA libraries not installed \(libibverbs\.so\.1: cannot open shared object file'

  timeout 120 "$BIN/demo" --addr 127.0.0.1:0 --calls 20 >"$LOG/demo.txt" 2>&1
  rc=$?
  grep -E '^(server|client):' "$LOG/demo.txt"
  if [ $rc -eq 0 ] && grep -qE "^client: transport: tcp \(fallback: $REASON" "$LOG/demo.txt" &&
    grep -q '^server: .*no RDMA listener' "$LOG/demo.txt"; then
    ok "demo: runs every call kind over TCP and prints the fallback reason"
  else
    bad "demo (exit $rc, output in $LOG/demo.txt)"; tail -20 "$LOG/demo.txt"
  fi

  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  A=127.0.0.1:$port
  timeout 120 "$BIN/helloworld-server" --addr "$A" >"$LOG/server.txt" 2>&1 &
  srv=$!
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.2
  done
  timeout 60 "$BIN/helloworld-client" --addr "$A" >"$LOG/client.txt" 2>&1
  rc=$?
  cat "$LOG/client.txt"
  if [ $rc -eq 0 ] && grep -q '^RESPONSE=HelloReply { message: "Hello Tonic!" }' "$LOG/client.txt" &&
    grep -qE "^transport: tcp \(fallback: $REASON" "$LOG/client.txt"; then
    ok "helloworld-client: answered over TCP, prints the fallback reason"
  else
    bad "helloworld-client (exit $rc)"
  fi
  timeout 60 "$BIN/helloworld-client" --addr "$A" --transport rdma >"$LOG/client-rdma.txt" 2>&1
  rc=$?
  cat "$LOG/client-rdma.txt"
  if [ $rc -ne 0 ] && grep -qE "$REASON" "$LOG/client-rdma.txt"; then
    ok "helloworld-client --transport rdma: fails with the reason"
  else
    bad "helloworld-client --transport rdma (exit $rc)"
  fi
  if timeout 90 python3 tests/stock_client/grpcio_hello.py --no-spawn --addr "$A" --calls 20; then
    ok "stock grpcio client -> helloworld-server"
  else
    bad "stock grpcio client -> helloworld-server"
  fi
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
  grep -E 'RDMA|serving' "$LOG/server.txt"
  n=$(grep -cE "$REASON.*: serving gRPC over TCP only" "$LOG/server.txt")
  if grep -q 'GreeterServer listening' "$LOG/server.txt" && [ "$n" -eq 1 ]; then
    ok "helloworld-server: served TCP only, logged the reason once"
  else
    bad "helloworld-server (reason logged $n times, output in $LOG/server.txt)"
  fi
  exit $fail
fi

# ------------------------------------------------- 1. NEEDED entries
# Where cargo puts binaries (honours CARGO_TARGET_DIR and build.target-dir).
TARGET=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])') || {
  echo "cargo metadata failed"; exit 1; }
LOG=$TARGET/no-rdma-libs; mkdir -p "$LOG"
fail=0

# Control: the check sees a NEEDED libibverbs where there is one.
ctl=$(ldconfig -p | awk '/librdmacm\.so\.1 / {print $NF; exit}')
if [ -n "$ctl" ] && readelf -d "$ctl" | grep -q 'NEEDED.*\[libibverbs\.so'; then
  echo "no-rdma-libs: ok     control: readelf sees libibverbs among the NEEDED of $ctl"
else
  echo "no-rdma-libs: FAILED control: no NEEDED libibverbs found in librdmacm ($ctl)"; fail=1
fi

needed_check() { # what, then executables
  local what=$1; shift
  local bad=0 n=0 b
  for b in "$@"; do
    n=$((n + 1))
    if readelf -d "$b" | grep -E 'NEEDED.*\[(libibverbs|librdmacm)' >/dev/null; then
      echo "  $b: $(readelf -d "$b" | grep -oE '\[(libibverbs|librdmacm)[^]]*\]' | tr '\n' ' ')"
      bad=$((bad + 1))
    fi
  done
  if [ "$n" -eq 0 ]; then
    echo "no-rdma-libs: FAILED $what: no executables found"; fail=1
  elif [ "$bad" -eq 0 ]; then
    echo "no-rdma-libs: ok     $what: $n executables, none has libibverbs/librdmacm as NEEDED"
  else
    echo "no-rdma-libs: FAILED $what: $bad of $n executables need an RDMA library"; fail=1
  fi
}

# The executables cargo produces for the workspace (a no-op build after test.sh's first step).
mapfile -t debug_bins < <(cargo build --workspace --all-targets --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])')
needed_check "debug build (bins, examples, tests)" "${debug_bins[@]}"

if [ "${NO_RDMA_LIBS_SKIP_RELEASE:-0}" != 1 ]; then
  mapfile -t release_bins < <(cargo build --release -p rpc-examples --bins --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])')
  needed_check "release build of rpc-examples (demo, helloworld, routeguide, bench)" "${release_bins[@]}"
fi

# ------------------------------------------------- 2. run with the libraries hidden
BIN=$TARGET/debug
for b in demo helloworld-server helloworld-client; do
  [ -x "$BIN/$b" ] || { echo "no-rdma-libs: FAILED missing $BIN/$b (cargo build first)"; exit 1; }
done
if [ "$(id -u)" -eq 0 ]; then ns=(unshare -m); else ns=(unshare -rm); fi
# Mount points for the namespace (its mounts vanish with it; the empty
# directories are removed afterwards).
T=$(mktemp -d)
"${ns[@]}" "$0" --in-namespace "$BIN" "$LOG" "$T" || fail=1
rm -rf "$T"
[ "$fail" -eq 0 ] && echo "no-rdma-libs: all checks passed" || echo "no-rdma-libs: some checks FAILED"
exit $fail
