#!/usr/bin/env python3
"""A scripted inference server for the moe-bench tests: answers with known
delays so the measured TTFT / ITL / TPOT / E2EL can be checked.

  fake_server.py grpc --stubs DIR [options]   moe.v1.Inference (grpcio)
  fake_server.py http [options]               OpenAI /v1/completions, /v1/chat/completions (SSE)

Prints "listening on 127.0.0.1:PORT" once ready. Per request, with N the
number after the last '-' of its request id (x-request-id on HTTP):

  first token at  (--ttft-ms if N is even, else --slow-ttft-ms) after receipt
  token k at      first + k * --itl-ms (absolute times: sleep errors do not add up)
  tokens          max_tokens of the request, one per message / SSE chunk
  --fail-every K  requests with N % K == K - 1 fail after their first token
                  (gRPC: status UNAVAILABLE; HTTP: the connection is cut)
  --http-503-every K   HTTP only: N % K == K - 1 answers 503 at once

The chat stream starts with a role-only chunk at once (not a token). The last
gRPC message carries usage and Timings with ttft_ms = the scripted TTFT; the
HTTP stream ends with a usage chunk (prompt_tokens = the number of ids of a
token-id prompt, else the number of words) and [DONE].
"""
import argparse
import json
import socket
import sys
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def req_number(rid):
    try:
        return int(rid.rsplit("-", 1)[-1])
    except (ValueError, AttributeError):
        return 0


def plan(args, rid):
    n = req_number(rid)
    ttft = (args.ttft_ms if n % 2 == 0 else args.slow_ttft_ms) / 1e3
    fail = args.fail_every > 0 and n % args.fail_every == args.fail_every - 1
    return n, ttft, fail


def sleep_until(t):
    while True:
        d = t - time.monotonic()
        if d <= 0:
            return
        time.sleep(d)


def run_grpc(args):
    sys.path.insert(0, args.stubs)
    import grpc
    from moe.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

    class Inference(pb_grpc.InferenceServicer):
        def GetModelInfo(self, request, context):
            return pb.ModelInfo(name="fake-grpc", vocab_size=1000, max_context=4096)

        def Generate(self, request, context):
            t0 = time.monotonic()
            _, ttft, fail = plan(args, request.request_id)
            n_out = request.sampling.max_tokens or 4
            n_in = len(request.token_ids.ids) if request.HasField("token_ids") else \
                len(request.text.split())
            for k in range(n_out):
                sleep_until(t0 + ttft + k * args.itl_ms / 1e3)
                if fail and k == 1:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[10 + k])
            yield pb.GenerateResponse(
                request_id=request.request_id,
                finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(prompt_tokens=n_in, completion_tokens=n_out),
                timings=pb.Timings(queue_ms=1.0, prefill_ms=ttft * 1e3 - 1.0, ttft_ms=ttft * 1e3,
                                   decode_ms=(n_out - 1) * args.itl_ms,
                                   e2e_ms=ttft * 1e3 + (n_out - 1) * args.itl_ms))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_InferenceServicer_to_server(Inference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def run_http(args):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send_json(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def chunk(self, data):
            b = data.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
            self.wfile.flush()

        def event(self, obj):
            self.chunk("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n")

        def do_GET(self):
            if self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": "fake-http"}]})
            else:
                self.send_json(404, {"error": {"message": "no such path"}})

        def do_POST(self):
            t0 = time.monotonic()
            n = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(n) or b"{}")
            rid = self.headers.get("X-Request-Id", "")
            num, ttft, fail = plan(args, rid)
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self.send_json(404, {"error": {"message": "no such path"}})
                return
            if args.http_503_every > 0 and num % args.http_503_every == args.http_503_every - 1:
                self.send_json(503, {"error": {"message": "scripted overload"}})
                return
            if chat:
                prompt = body["messages"][0]["content"]
            else:
                prompt = body["prompt"]
            n_in = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            n_out = body.get("max_tokens") or 4
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            base = {"id": "cmpl-" + rid, "model": body.get("model", "")}
            if chat:
                self.event({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                         "content": ""}}]})
            for k in range(n_out):
                sleep_until(t0 + ttft + k * args.itl_ms / 1e3)
                if fail and k == 1:
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                text = "tok%d " % k
                choice = {"index": 0, "delta": {"content": text}} if chat else \
                    {"index": 0, "text": text}
                if k == n_out - 1:
                    choice["finish_reason"] = "length"
                self.event({**base, "choices": [choice]})
            self.event({**base, "choices": [], "usage": {
                "prompt_tokens": n_in, "completion_tokens": n_out,
                "total_tokens": n_in + n_out}})
            self.event("[DONE]")
            self.chunk("")  # terminating chunk

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # the default 5 drops concurrent connects: a 1 s SYN retry

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"listening on 127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["grpc", "http"])
    p.add_argument("--stubs")
    p.add_argument("--ttft-ms", type=float, default=150)
    p.add_argument("--slow-ttft-ms", type=float, default=450)
    p.add_argument("--itl-ms", type=float, default=60)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--http-503-every", type=int, default=0)
    args = p.parse_args()
    if args.mode == "grpc":
        run_grpc(args)
    else:
        run_http(args)


if __name__ == "__main__":
    main()
