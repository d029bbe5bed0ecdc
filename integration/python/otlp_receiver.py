"""A real OTLP/gRPC trace receiver for the tracing test, on the official
definitions: opentelemetry-proto's generated TraceService servicer, served
by grpcio. It listens on 127.0.0.1 (a free port), prints `listening PORT`,
then one JSON line per span it receives, flushed at once:

  {"service": ..., "instance": ..., "trace_id": hex, "span_id": hex,
   "parent_span_id": hex or "", "name": ..., "kind": int,
   "status": int, "attributes": {key: value as text}}

It stops when its standard input closes (the test ends) or on SIGTERM.
"""

import json
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

LOCK = threading.Lock()


def value(v):
    """An AnyValue as text (the test reads every attribute as text)."""
    kind = v.WhichOneof("value")
    if kind is None:
        return ""
    if kind in ("array_value", "kvlist_value"):
        return str(getattr(v, kind))
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return str(getattr(v, kind))


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        lines = []
        for rs in request.resource_spans:
            res = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    lines.append(
                        json.dumps(
                            {
                                "service": res.get("service.name", ""),
                                "instance": res.get("service.instance.id", ""),
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent_span_id": s.parent_span_id.hex(),
                                "name": s.name,
                                "kind": s.kind,
                                "status": s.status.code,
                                "attributes": {
                                    a.key: value(a.value) for a in s.attributes
                                },
                            }
                        )
                    )
        with LOCK:
            for line in lines:
                sys.stdout.write(line + "\n")
            sys.stdout.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with LOCK:
        sys.stdout.write(f"listening {port}\n")
        sys.stdout.flush()
    # The test holds our standard input open while it needs us.
    sys.stdin.read()
    server.stop(grace=1).wait()


if __name__ == "__main__":
    main()
