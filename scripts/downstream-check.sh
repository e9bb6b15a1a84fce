#!/usr/bin/env bash
# Builds and runs a project OUTSIDE this workspace that uses rdma-grpc the way the
# README's "Use it in an existing tonic project" says: a tonic helloworld whose
# Cargo.toml has `rpc-core = { path = ".../rpc-core" }` and the build-dependency
# `rpc-codegen = { path = ".../codegen" }`, whose build.rs calls
# `rpc_codegen::compile_protos`, and whose main.rs uses `rpc_core::Server` and
# `rpc_core::Channel`. It makes one SayHello call and prints the reply and the
# transport (tcp with a fallback reason on a host without RDMA).
#
# What it guards: a user's project gets the vendored rdma-sys (package
# rdma-grpc-sys, bindgen 0.72) through plain path dependencies, with no [patch]
# of its own, never crates.io's rdma-sys 0.3.0 (bindgen 0.59, which panics with
# libclang >= 16); and it builds with the newest libclang installed
# (LIBCLANG_PATH is unset, so clang-sys picks the newest).
#
# Speed: it builds in the workspace's target directory, from a copy of the
# workspace's Cargo.lock, so the same versions and already compiled
# dependencies are reused. DOWNSTREAM_FRESH=1 builds in an empty target
# directory instead (everything from scratch, rdma-grpc-sys' bindgen included).
# DOWNSTREAM_TIMEOUT (seconds, default 1800) bounds the build, 60 s the run;
# DOWNSTREAM_KEEP=1 keeps the temporary project.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
t0=$SECONDS

fail() { echo "downstream-check: FAILED: $*"; exit 1; }

# The workspace's target directory, found as scripts/test.sh finds it.
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])') ||
  fail "cargo metadata failed"

PROJ=$(mktemp -d "${TMPDIR:-/tmp}/rdma-grpc-downstream.XXXXXX")
if [ "${DOWNSTREAM_KEEP:-0}" = 1 ]; then
  echo "downstream-check: keeping $PROJ"
else
  trap 'rm -rf "$PROJ"' EXIT
fi
if [ "${DOWNSTREAM_FRESH:-0}" = 1 ]; then
  TARGET_DIR=$PROJ/target
fi

# Which libclang bindgen can load: clang-sys takes the newest when LIBCLANG_PATH
# is not set, and this script does not set it.
unset LIBCLANG_PATH
versions=$( (ls /usr/lib/llvm-*/lib/libclang*.so* /usr/lib/*/libclang-*.so* /usr/lib64/libclang*.so* 2>/dev/null || true) |
  sed -nE 's#.*/llvm-([0-9]+)/lib/.*#\1#p; s#.*/libclang-([0-9]+)(\.[0-9]+)*\.so.*#\1#p' | sort -un | tr '\n' ' ')
[ -n "$versions" ] || fail "no libclang found (apt-get install libclang-dev)"
echo "downstream-check: libclang installed: ${versions% } (LIBCLANG_PATH unset: bindgen loads the newest, $(echo $versions | awk '{print $NF}'))"
echo "downstream-check: project $PROJ, target dir $TARGET_DIR"

# --- the project, as the README's "Use it in an existing tonic project" says ---
mkdir -p "$PROJ/proto" "$PROJ/src"
cp "$ROOT/proto/helloworld.proto" "$PROJ/proto/"
# Same versions as the workspace (cargo drops the entries this project does not use).
cp "$ROOT/Cargo.lock" "$PROJ/Cargo.lock"

cat >"$PROJ/Cargo.toml" <<EOF
[package]
name = "downstream-helloworld"
version = "0.1.0"
edition = "2021"
publish = false

[dependencies]
rpc-core = { path = "$ROOT/rpc-core" }
tonic = "0.14"
tonic-prost = "0.14"
prost = "0.14"
tokio = { version = "1.0", features = ["macros", "rt-multi-thread"] }

[build-dependencies]
rpc-codegen = { path = "$ROOT/codegen" }   # optional: no protoc needed

# The workspace's dev profile, only so that the dependencies it already compiled
# in the shared target directory are reused.
[profile.dev]
debug = 1

[profile.dev.package."*"]
opt-level = 1
debug = 0

# A project of its own, not part of any enclosing workspace.
[workspace]
EOF

cat >"$PROJ/build.rs" <<'EOF'
fn main() {
    rpc_codegen::compile_protos(&["proto/helloworld.proto"], &["proto"]).unwrap();
}
EOF

cat >"$PROJ/src/main.rs" <<'EOF'
//! tonic's helloworld server and client in one process, with the two lines
//! the README changes: `rpc_core::Server` and `rpc_core::Channel`.
use std::time::Duration;

// use tonic::transport::Server;
use rpc_core::Server;
// use tonic::transport::Channel;
use rpc_core::Channel;
use tonic::{Request, Response, Status};

pub mod hello_world {
    tonic::include_proto!("helloworld");
}
use hello_world::greeter_client::GreeterClient;
use hello_world::greeter_server::{Greeter, GreeterServer};
use hello_world::{HelloReply, HelloRequest};

#[derive(Debug, Default)]
pub struct MyGreeter {}

#[tonic::async_trait]
impl Greeter for MyGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let reply = HelloReply {
            message: format!("Hello {}!", request.into_inner().name),
        };
        Ok(Response::new(reply))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let greeter = MyGreeter::default();
    // Port 0: any free port; `start` serves in the background and tells it.
    let server = Server::builder()
        .add_service(GreeterServer::new(greeter))
        .start("127.0.0.1:0".parse()?) // RDMA + HTTP/2 on TCP, same port
        .await?;
    let addr = server.local_addr();
    println!("server: {addr}");

    let channel = Channel::from_shared(format!("http://{addr}"))?
        .timeout(Duration::from_secs(5))
        .connect()
        .await?;
    println!("transport: {}", channel.transport()); // rdma, or tcp (fallback: <reason>)
    let mut client = GreeterClient::new(channel);

    let request = Request::new(HelloRequest {
        name: "Tonic".into(),
    });
    let response = client.say_hello(request).await?;
    println!("RESPONSE={:?}", response.into_inner());

    server.shutdown().await?;
    Ok(())
}
EOF

# --- build ---
echo "downstream-check: cargo build (timeout ${DOWNSTREAM_TIMEOUT:-1800} s)"
log=$PROJ/build.log
set +e
(cd "$PROJ" && CARGO_TARGET_DIR=$TARGET_DIR timeout "${DOWNSTREAM_TIMEOUT:-1800}" cargo build 2>&1) | tee "$log" |
  grep -E '^ *(Compiling (rdma-grpc-sys|rdma-sys|rdma-transport|rpc-core|rpc-codegen|downstream-helloworld)|Finished)|^(error|warning: unused)' 
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  echo "--- build log (tail)"; tail -n 60 "$log"
  [ "$rc" -eq 124 ] && fail "cargo build timed out after ${DOWNSTREAM_TIMEOUT:-1800} s"
  fail "cargo build of the downstream project failed (exit $rc)"
fi
if grep -q 'Compiling rdma-grpc-sys' "$log"; then
  echo "downstream-check: rdma-grpc-sys (bindgen) built in this run"
else
  echo "downstream-check: rdma-grpc-sys up to date in $TARGET_DIR (DOWNSTREAM_FRESH=1 rebuilds it)"
fi

# --- the dependency graph: the vendored crate, never crates.io's rdma-sys ---
grep -q '^name = "rdma-grpc-sys"$' "$PROJ/Cargo.lock" || fail "rdma-grpc-sys is not in the project's Cargo.lock"
if grep -q '^name = "rdma-sys"$' "$PROJ/Cargo.lock"; then
  grep -n -A3 '^name = "rdma-sys"$' "$PROJ/Cargo.lock"
  fail "crates.io rdma-sys is in the project's Cargo.lock"
fi
echo "downstream-check: dependency graph:"
(cd "$PROJ" && CARGO_TARGET_DIR=$TARGET_DIR cargo tree --offline -e normal -i rdma-grpc-sys) | sed 's/^/  /'

# --- run ---
echo "downstream-check: run (timeout 60 s)"
set +e
out=$(RUST_LOG=${RUST_LOG:-warn} timeout 60 "$TARGET_DIR/debug/downstream-helloworld" 2>&1)
rc=$?
set -e
echo "$out" | sed 's/^/  /'
[ "$rc" -eq 124 ] && fail "the program timed out after 60 s"
[ "$rc" -eq 0 ] || fail "the program exited with $rc"
echo "$out" | grep -q '^RESPONSE=HelloReply { message: "Hello Tonic!" }$' || fail "no SayHello reply"
echo "$out" | grep -q '^transport: ' || fail "no transport line"
echo "downstream-check: ok ($((SECONDS - t0)) s)"
