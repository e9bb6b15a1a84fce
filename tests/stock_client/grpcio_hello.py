#!/usr/bin/env python3
"""A stock gRPC client (Python grpcio, not written by this project) calls
helloworld-server over TCP (HTTP/2).

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
                      f"{root}/proto/helloworld.proto"])
    if rc != 0:
        print("FAIL: grpc_tools.protoc failed", file=sys.stderr); return 1
    sys.path.insert(0, out)
    import helloworld_pb2, helloworld_pb2_grpc

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
    finally:
        if proc:
            proc.terminate(); proc.wait(timeout=10)
    return 0

if __name__ == "__main__":
    sys.exit(main())
