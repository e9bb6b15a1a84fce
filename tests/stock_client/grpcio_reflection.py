#!/usr/bin/env python3
"""Stock gRPC tooling against helloworld-server over TCP: grpcio's server-reflection
client lists the services and resolves helloworld.Greeter's methods and messages from
the server alone (no .proto on this side), and the standard health service answers.

Usage: grpcio_reflection.py --server PATH
Needs: pip install grpcio grpcio-reflection grpcio-health-checking
"""
import argparse, socket, subprocess, sys

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True, help="helloworld-server binary to start")
    args = ap.parse_args()
    try:
        import grpc
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from google.protobuf.descriptor_pool import DescriptorPool
    except ImportError as e:
        print(f"FAIL: {e}; pip install grpcio grpcio-reflection grpcio-health-checking",
              file=sys.stderr)
        return 1
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([args.server, "--addr", addr, "--tcp-only"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(addr) as ch:
            grpc.channel_ready_future(ch).result(timeout=15)
            db = ProtoReflectionDescriptorDatabase(ch)
            services = sorted(db.get_services())
            want = {"helloworld.Greeter", "grpc.health.v1.Health"}
            if not want.issubset(services):
                print(f"FAIL: reflection lists {services}, missing {want - set(services)}",
                      file=sys.stderr)
                return 1
            pool = DescriptorPool(db)
            greeter = pool.FindServiceByName("helloworld.Greeter")
            say = greeter.FindMethodByName("SayHello")
            fields = [f.name for f in say.input_type.fields]
            if say.input_type.full_name != "helloworld.HelloRequest" or fields != ["name"]:
                print(f"FAIL: SayHello input {say.input_type.full_name} {fields}", file=sys.stderr)
                return 1
            health = health_pb2_grpc.HealthStub(ch)
            st = health.Check(health_pb2.HealthCheckRequest(service="helloworld.Greeter"),
                              timeout=10).status
            if st != health_pb2.HealthCheckResponse.SERVING:
                print(f"FAIL: health status {st} for helloworld.Greeter", file=sys.stderr)
                return 1
            try:
                health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=10)
                print("FAIL: health check of an unknown service succeeded", file=sys.stderr)
                return 1
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    print(f"FAIL: unknown service gave {e.code()}", file=sys.stderr); return 1
            print(f"grpcio {grpc.__version__} reflection: services {services}; "
                  f"helloworld.Greeter/SayHello({say.input_type.full_name}) -> "
                  f"{say.output_type.full_name}; health SERVING")
    finally:
        proc.terminate(); proc.wait(timeout=10)
    return 0

if __name__ == "__main__":
    sys.exit(main())
