#!/usr/bin/env python3
"""A minimal OTLP/HTTP sink for benchmarks: accepts POST /v1/traces, counts
requests and bytes (printed on SIGTERM), answers 200 with an empty
ExportTraceServiceResponse. Usage: otlp_sink.py PORT"""
import http.server
import signal
import sys

posts = 0
nbytes = 0


class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        global posts, nbytes
        n = int(self.headers.get("content-length", 0))
        self.rfile.read(n)
        posts += 1
        nbytes += n
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def bye(*_):
    print(f"otlp sink: {posts} exports, {nbytes} bytes", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, bye)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
