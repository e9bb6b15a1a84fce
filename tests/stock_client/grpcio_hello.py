#!/usr/bin/env python3
"""A stock gRPC client (Python grpcio, not written by this project) calls
helloworld-server over TCP (HTTP/2): SayHello, then deadlines on the echo
service it also serves (a unary handler that sleeps past the deadline, and a
server stream whose deadline passes after its first messages): both must end
with DEADLINE_EXCEEDED, as gRPC specifies (tonic's server alone answers an
expired grpc-timeout with CANCELLED "Timeout expired").

Usage: grpcio_hello.py --server PATH [--addr HOST:PORT] [--no-spawn]
Stubs are generated at run time with grpcio-tools from proto/helloworld.proto.
"""
import argparse, os, socket, subprocess, sys, tempfile, time

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", help="helloworld-server binary to start")
    ap.add_argument("--addr", help="address of a running server (with --no-spawn)")
    ap.add_argument("--no-spawn", action="store_true")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    try:
        import grpc
        from grpc_tools import protoc
    except ImportError as e:
        print(f"FAIL: grpcio / grpcio-tools not installed ({e}); pip install grpcio grpcio-tools", file=sys.stderr)
        return 1
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tempfile.mkdtemp(prefix="grpcio-stubs-")
    rc = protoc.main(["protoc", f"-I{root}/proto", f"--python_out={out}", f"--grpc_python_out={out}",
                      f"{root}/proto/helloworld.proto", f"{root}/proto/echo.proto"])
    if rc != 0:
        print("FAIL: grpc_tools.protoc failed", file=sys.stderr); return 1
    sys.path.insert(0, out)
    import helloworld_pb2, helloworld_pb2_grpc, echo_pb2, echo_pb2_grpc

    proc = None
    addr = args.addr
    if not args.no_spawn:
        addr = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen([args.server, "--addr", addr], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(addr) as ch:
            grpc.channel_ready_future(ch).result(timeout=15)
            stub = helloworld_pb2_grpc.GreeterStub(ch)
            for i in range(args.calls):
                r = stub.SayHello(helloworld_pb2.HelloRequest(name=f"grpcio-{i}"), timeout=10)
                if r.message != f"Hello grpcio-{i}!":
                    print(f"FAIL: unexpected reply {r.message!r}", file=sys.stderr); return 1
            print(f"grpcio {grpc.__version__}: {args.calls} SayHello calls to {addr} answered correctly "
                  f"(last: {r.message!r})")
            echo = echo_pb2_grpc.EchoStub(ch)
            # The server's own answer to an expired grpc-timeout. With a client
            # deadline, grpcio's timer fires first and reports DEADLINE_EXCEEDED
            # itself whatever the server says; so here the client keeps no timer
            # and sends the grpc-timeout header as metadata (grpcio passes it on
            # when the call has no deadline of its own; the handler sleeps 5 s, so
            # the call is bounded even if the server ignored the header).
            try:
                echo.UnaryEcho(echo_pb2.EchoRequest(delay_ms=5000),
                               metadata=(("grpc-timeout", "200m"),))
                print("FAIL: a unary call past its grpc-timeout succeeded", file=sys.stderr); return 1
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    print(f"FAIL: the server answered an expired grpc-timeout with {e.code()} "
                          f"{e.details()!r} (expected DEADLINE_EXCEEDED)", file=sys.stderr); return 1
                print(f"grpcio: the server answers an expired grpc-timeout with {e.code().name} "
                      f"{e.details()!r}")
            # A handler that sleeps 5 s, a 300 ms deadline.
            t0 = time.monotonic()
            try:
                echo.UnaryEcho(echo_pb2.EchoRequest(delay_ms=5000), timeout=0.3)
                print("FAIL: a unary call past its deadline succeeded", file=sys.stderr); return 1
            except grpc.RpcError as e:
                took = time.monotonic() - t0
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    print(f"FAIL: unary call past its deadline: {e.code()} {e.details()!r} "
                          "(expected DEADLINE_EXCEEDED)", file=sys.stderr); return 1
                print(f"grpcio: unary call past its 300 ms deadline -> {e.code().name} "
                      f"{e.details()!r} after {took*1000:.0f} ms")
            # A server stream (a message every 20 ms) whose 300 ms deadline passes mid-way.
            t0 = time.monotonic(); n = 0
            try:
                for _ in echo.ServerStreamingEcho(echo_pb2.EchoRequest(count=1000000, delay_ms=20),
                                                  timeout=0.3):
                    n += 1
                print("FAIL: a stream past its deadline ended normally", file=sys.stderr); return 1
            except grpc.RpcError as e:
                took = time.monotonic() - t0
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or n == 0:
                    print(f"FAIL: stream past its deadline: {e.code()} {e.details()!r} after {n} "
                          "messages (expected DEADLINE_EXCEEDED after some)", file=sys.stderr); return 1
                print(f"grpcio: server stream past its 300 ms deadline -> {e.code().name} "
                      f"{e.details()!r} after {n} messages, {took*1000:.0f} ms")
    finally:
        if proc:
            proc.terminate(); proc.wait(timeout=10)
    return 0

if __name__ == "__main__":
    sys.exit(main())
