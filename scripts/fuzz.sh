#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 10: the CI smoke).
#   scripts/fuzz.sh 600      # a longer run
# Uses cargo-fuzz (libFuzzer) on the stable toolchain (RUSTC_BOOTSTRAP=1, no
# sanitizer: the code under test has no unsafe outside rdma-transport's verbs).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-10}
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz missing: cargo install cargo-fuzz --locked"; exit 1; }
export RUSTC_BOOTSTRAP=1
for t in $(cargo fuzz list); do
  echo "fuzz: $t for ${secs}s"
  mkdir -p "corpus/$t"
  out=$(cargo fuzz run -s none "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -timeout=5 2>&1) || {
    echo "$out" | tail -40; echo "fuzz: $t FAILED"; exit 1; }
  echo "$out" | grep -E '^Done [0-9]+ runs' | sed "s/^/fuzz: $t: /"
done
