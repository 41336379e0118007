#!/usr/bin/env python3
"""TLS and bearer tokens on real processes (issue 14, part 2).

    test_security.py --bin-dir DIR --source-dir DIR PART

PART (one ctest each, a few seconds apiece):
  tls     every gRPC and HTTP port of a coordinator and a worker speaks TLS: a
          plaintext client is refused, a client trusting another CA fails, the
          worker's port (mutual TLS) refuses a client without a certificate; a
          completion goes through coordinator -> worker over mutual TLS; moectl
          health and moe-client over TLS; bad TLS flags fail at start naming
          the file
  tokens  every method of every service in proto/moe/v1 (from the generated
          descriptors) and every HTTP route the coordinator registers (read
          from its source): no token, a wrong token, the other API's token are
          UNAUTHENTICATED / 401 (OpenAI's error shape), the right one passes;
          health probes and /health, /version, /metrics are open; moectl and
          moe-client --token-file; bad token files
  reload  SIGHUP: replaced certificate files are served to new connections on
          the coordinator's gRPC and HTTP ports and the worker's gRPC, metrics
          and KV data plane ports (serials compared); a broken file keeps the
          old certificate; a rotated token file takes effect
  etcd    a real etcd with --client-cert-auth: workers register and the
          coordinator routes through it over TLS with client certificates; no
          client certificate, or an http:// endpoint with TLS flags, fails
  kv      a disaggregated handoff (prefill -> decode) over the KV data plane
          with mutual TLS gives the same greedy tokens as a mixed worker; the
          KV port refuses plaintext and certificate-less clients

Exit 77 (SKIP) without the grpc / grpc_tools modules or openssl (etcd for
PART etcd).
"""
import argparse
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_testlib as tl  # noqa: E402
from moe_testlib import expect, log  # noqa: E402

try:
    import grpc
    import grpc_tools  # noqa: F401
except ImportError as e:
    print("SKIPPED: Python module missing (%s); tests/run.sh installs grpcio, grpcio-tools" % e)
    sys.exit(tl.SKIP)
if not shutil.which("openssl"):
    print("SKIPPED: no openssl binary (apt-get install openssl)")
    sys.exit(tl.SKIP)

ap = argparse.ArgumentParser()
ap.add_argument("--bin-dir", required=True)
ap.add_argument("--source-dir", required=True)
ap.add_argument("part", choices=["tls", "tokens", "reload", "etcd", "kv"])
args = ap.parse_args()
BIN = args.bin_dir
SRC = args.source_dir
MODEL = os.path.join(SRC, "tests/golden/fixtures/qwen3_moe")
TMP = tempfile.mkdtemp(prefix="moe-sec-")
tl.install_guards(120, TMP)
R = tl.Results()
sys.path.insert(0, os.path.join(TMP, "stubs"))
inference_pb2, _ = tl.make_stubs(SRC, TMP)
from moe.v1 import admin_pb2, health_pb2, worker_pb2  # noqa: E402


# ---- certificates ------------------------------------------------------------------

def make_certs(out, *extra):
    r = subprocess.run([os.path.join(SRC, "deploy/make-test-certs.sh"), out] + list(extra),
                       capture_output=True, text=True, timeout=30)
    expect(r.returncode == 0, "make-test-certs.sh failed: %s%s", r.stdout, r.stderr)


CERTS = os.path.join(TMP, "certs")      # CA A: every process
OTHER = os.path.join(TMP, "other-ca")   # CA B: a client that trusts the wrong CA
make_certs(CERTS)
make_certs(OTHER)


def cert_file(d, name):
    return os.path.join(d, name)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def serial_of_der(der):
    r = subprocess.run(["openssl", "x509", "-inform", "DER", "-noout", "-serial"], input=der,
                       capture_output=True, timeout=10)
    expect(r.returncode == 0, "openssl x509: %s", r.stderr)
    return r.stdout.decode().strip().split("=", 1)[1].upper()


def serial_of_pem(path):
    r = subprocess.run(["openssl", "x509", "-in", path, "-noout", "-serial"],
                       capture_output=True, text=True, timeout=10)
    return r.stdout.strip().split("=", 1)[1].upper()


def tls_context(ca=None, cert=None, key=None, alpn=None):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca:
        ctx.load_verify_locations(ca)
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(cert, key)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def peer_serial(port, ca=None, cert=None, key=None, alpn=None, name="127.0.0.1"):
    """The serial of the certificate the server on `port` shows a new
    connection (after a full handshake)."""
    ctx = tls_context(ca, cert, key, alpn)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=name) as s:
            der = s.getpeercert(binary_form=True)
            if cert is None:  # TLS 1.3: a refused client hears it on the first read
                s.settimeout(0.3)
                try:
                    s.recv(1)
                except (socket.timeout, TimeoutError):
                    pass
    return serial_of_der(der)


def handshake_fails(port, **kw):
    """True when a TLS client configured by kw cannot talk to the port: the
    handshake fails, or (TLS 1.3, a missing client certificate) the server
    closes the connection at once."""
    ctx = tls_context(kw.get("ca"), kw.get("cert"), kw.get("key"), kw.get("alpn"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.settimeout(2)
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if kw.get("alpn") else
                          b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = s.recv(1)
                return data == b""
    except (ssl.SSLError, ConnectionError, OSError):
        return True


def plaintext_refused_http(port):
    try:
        with tl.no_proxy.open("http://127.0.0.1:%d/health" % port, timeout=5) as r:
            r.read()
        return False
    except (urllib.error.URLError, ConnectionError, OSError, ValueError) as e:
        return not isinstance(e, urllib.error.HTTPError)


# ---- processes ---------------------------------------------------------------------

def start_worker(name, *extra, tls=True):
    argv = [os.path.join(BIN, "moe-worker"), "--model", MODEL, "--listen", "127.0.0.1:0",
            "--threads", "1", "--kv-memory", "16", "--dtype", "f32"]
    if tls:
        argv += ["--tls-dir", CERTS]
    p = tl.spawn(argv + list(extra), os.path.join(TMP, name + ".log"))
    addr = tl.wait_line(p, r"serving \S+ on (127\.0\.0\.1:\d+)", name)
    p.addr = addr
    p.port = int(addr.rsplit(":", 1)[1])
    return p


def start_coordinator(name, workers, *extra, tls=True, etcd=None):
    argv = [os.path.join(BIN, "moe-coordinator"), "--model", MODEL, "--listen", "127.0.0.1:0",
            "--http-listen", "127.0.0.1:0", "--poll-ms", "50"]
    argv += ["--etcd", etcd] if etcd else ["--workers", workers]
    if tls:
        argv += ["--tls-dir", CERTS]
    p = tl.spawn(argv + list(extra), os.path.join(TMP, name + ".log"))
    p.port = int(tl.wait_line(p, r"serving on 127\.0\.0\.1:(\d+)", name))
    p.http = int(tl.wait_line(p, r"/metrics on 127\.0\.0\.1:(\d+)", name))
    return p


def channel(port, tls=True, cert=False, ca=None):
    target = "127.0.0.1:%d" % port
    if not tls:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=read(ca or cert_file(CERTS, "ca.crt")),
        private_key=read(cert_file(CERTS, "client.key")) if cert else None,
        certificate_chain=read(cert_file(CERTS, "client.crt")) if cert else None)
    return grpc.secure_channel(target, creds)


def health(ch, service="", timeout=5):
    m = ch.unary_unary("/grpc.health.v1.Health/Check",
                       request_serializer=lambda x: x.SerializeToString(),
                       response_deserializer=health_pb2.HealthCheckResponse.FromString)
    return m(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def health_code(ch, service=""):
    try:
        health(ch, service, timeout=3)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def wait_routable(port, tls=True, token=None, timeout=20):
    """Until a Generate through the coordinator succeeds (its worker polled)."""
    t_end = time.monotonic() + timeout
    last = None
    while time.monotonic() < t_end:
        try:
            return generate(port, [1, 2, 3], 2, tls=tls, token=token)
        except grpc.RpcError as e:
            last = e
            time.sleep(0.05)
    raise AssertionError("the coordinator on %d never routed: %s" % (port, last))


def generate(port, ids, n, tls=True, token=None, ch=None):
    own = ch is None
    ch = ch or channel(port, tls)
    try:
        m = ch.unary_stream("/moe.v1.Inference/Generate",
                            request_serializer=lambda x: x.SerializeToString(),
                            response_deserializer=inference_pb2.GenerateResponse.FromString)
        rq = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=ids),
            sampling=inference_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        md = [("authorization", "Bearer " + token)] if token else None
        out = []
        for r in m(rq, timeout=20, metadata=md):
            out.extend(r.token_ids)
        return out
    finally:
        if own:
            ch.close()


def https_get(port, path, ca=None, token=None):
    """(status, body) of GET path over HTTPS, trusting `ca` (default CA A)."""
    ctx = tls_context(ca or cert_file(CERTS, "ca.crt"))
    rq = urllib.request.Request("https://127.0.0.1:%d%s" % (port, path))
    if token:
        rq.add_header("Authorization", "Bearer " + token)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(rq, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def run_cli(*argv, timeout=30):
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


# ---- parts ---------------------------------------------------------------------------

def part_tls():
    w = start_worker("worker", "--metrics-listen", "127.0.0.1:0")
    w.metrics = int(tl.wait_line(w, r"/metrics on 127\.0\.0\.1:(\d+)", "worker metrics"))
    c = start_coordinator("coord", w.addr)
    ca_a, ca_b = cert_file(CERTS, "ca.crt"), cert_file(OTHER, "ca.crt")

    def coordinator_grpc():
        with channel(c.port) as ch:
            expect(health(ch) == health_pb2.HealthCheckResponse.SERVING, "health over TLS")
        with channel(c.port, tls=False) as ch:
            code = health_code(ch)
            expect(code == grpc.StatusCode.UNAVAILABLE, "plaintext client: %s", code)
        with channel(c.port, ca=ca_b) as ch:
            code = health_code(ch)
            expect(code == grpc.StatusCode.UNAVAILABLE, "client trusting CA B: %s", code)
        expect(peer_serial(c.port, ca_a, alpn=["h2"]) == serial_of_pem(cert_file(CERTS, "tls.crt")),
               "the coordinator shows its certificate")

    def coordinator_http():
        st, body, _ = https_get(c.http, "/health")
        expect(st == 200, "HTTPS /health: %s %s", st, body)
        expect(plaintext_refused_http(c.http), "plain HTTP answered on the HTTPS port")
        expect(handshake_fails(c.http, ca=ca_b), "HTTPS client trusting CA B got through")

    def worker_grpc_mutual():
        with channel(w.port, cert=True) as ch:
            expect(health(ch) == health_pb2.HealthCheckResponse.SERVING, "worker health, mTLS")
        with channel(w.port) as ch:  # trusts the CA, shows no certificate
            code = health_code(ch)
            expect(code == grpc.StatusCode.UNAVAILABLE, "client without a certificate: %s", code)
        with channel(w.port, tls=False) as ch:
            code = health_code(ch)
            expect(code == grpc.StatusCode.UNAVAILABLE, "plaintext client: %s", code)
        with channel(w.port, cert=True, ca=ca_b) as ch:
            code = health_code(ch)
            expect(code == grpc.StatusCode.UNAVAILABLE, "client trusting CA B: %s", code)
        expect(handshake_fails(w.port, ca=ca_a, alpn=["h2"]),
               "the worker's port let a client without a certificate talk")

    def worker_metrics():
        st, body, _ = https_get(w.metrics, "/metrics")
        expect(st == 200 and b"vllm:num_requests_running" in body, "HTTPS /metrics: %s", st)
        expect(plaintext_refused_http(w.metrics), "plain HTTP answered on the metrics port")

    def end_to_end():
        toks = wait_routable(c.port)
        expect(len(toks) == 2, "Generate over TLS -> mutual TLS: %s", toks)
        rc, out, err = run_cli(os.path.join(BIN, "moe-client"), "--addr", "127.0.0.1:%d" % c.port,
                               "--tls-ca", ca_a, "--tokens", "1,2,3", "-n", "4", "--quiet")
        expect(rc == 0 and "4 tokens" in out, "moe-client over TLS: rc %d %s %s", rc, out, err)
        rc, out, err = run_cli(os.path.join(BIN, "moe-client"), "--addr", "127.0.0.1:%d" % c.port,
                               "--tls-ca", ca_b, "--tokens", "1,2,3", "-n", "4", "--quiet",
                               "--timeout-ms", "3000")
        expect(rc != 0 and "UNAVAILABLE" in err, "moe-client trusting CA B: rc %d %s", rc, err)
        rc, out, err = run_cli(os.path.join(BIN, "moectl"), "--addr", "127.0.0.1:%d" % w.port,
                               "--tls-dir", CERTS, "health", "moe.v1.Worker")
        expect(rc == 0 and out.strip() == "SERVING", "moectl health (mTLS): %d %s %s", rc, out, err)
        rc, out, err = run_cli(os.path.join(BIN, "moectl"), "--addr", "127.0.0.1:%d" % w.port,
                               "--tls-ca", ca_a, "--timeout-ms", "3000", "health")
        expect(rc == 1, "moectl health without a client certificate: %d %s", rc, out)

    def bad_flags():
        cases = [
            (["--tls-cert", cert_file(CERTS, "server.crt")], "--tls-cert needs --tls-key"),
            (["--tls-cert", cert_file(CERTS, "server.crt"), "--tls-key",
              cert_file(CERTS, "client.key")], "does not belong to the certificate"),
            (["--tls-cert", cert_file(CERTS, "server.crt"), "--tls-key",
              cert_file(CERTS, "server.key"), "--tls-ca", ca_b], "does not chain to a CA"),
            (["--tls-ca", os.path.join(TMP, "missing.pem")], "missing.pem"),
            (["--tls-ca", cert_file(CERTS, "server.key")], "no PEM certificate"),
        ]
        for flags, want in cases:
            rc, out, err = run_cli(os.path.join(BIN, "moe-coordinator"), "--model", MODEL,
                                   "--listen", "127.0.0.1:0", "--workers", "127.0.0.1:1", *flags)
            expect(rc == 2 and want in err, "%s: rc %d, %r (wanted %r)", flags, rc, err, want)
        rc, out, err = run_cli(os.path.join(BIN, "moe-worker"), "--model", MODEL, "--tls-ca", ca_a)
        expect(rc != 0 and "needs a certificate and key" in err, "worker with a CA only: %s", err)

    R.run("tls: coordinator gRPC port", coordinator_grpc)
    R.run("tls: coordinator HTTP port", coordinator_http)
    R.run("tls: worker gRPC port (mutual TLS)", worker_grpc_mutual)
    R.run("tls: worker metrics port", worker_metrics)
    R.run("tls: coordinator -> worker, moe-client, moectl health", end_to_end)
    R.run("tls: bad TLS flags", bad_flags)


def write_token(path, token):
    with open(path, "w") as f:
        f.write("# test token\n%s\n" % token)


def part_tokens():
    api, admin, wrong = "api-" + os.urandom(16).hex(), "admin-" + os.urandom(16).hex(), \
        "wrong-" + os.urandom(16).hex()
    api_f, admin_f, wrong_f = (os.path.join(TMP, n) for n in ("api.tok", "admin.tok", "wrong.tok"))
    write_token(api_f, api)
    write_token(admin_f, admin)
    write_token(wrong_f, wrong)
    w = start_worker("worker", tls=False)
    c = start_coordinator("coord", w.addr, "--api-token-file", api_f, "--admin-token-file",
                          admin_f, tls=False)

    def grpc_walk():
        wait_routable(c.port, tls=False, token=api)
        services = {}
        for mod in (inference_pb2, admin_pb2, health_pb2, worker_pb2):
            for s in mod.DESCRIPTOR.services_by_name.values():
                services[s.full_name] = s
        need = {"moe.v1.Inference": api, "moe.v1.Admin": admin, "grpc.health.v1.Health": None}
        expect(set(need) <= set(services), "services in the protos: %s", sorted(services))
        n = 0
        with channel(c.port, tls=False) as ch:
            for sname, right in need.items():
                for m in services[sname].methods:
                    path = "/%s/%s" % (sname, m.name)
                    call = (ch.unary_stream if m.server_streaming else ch.unary_unary)(path)
                    other = admin if right == api else api
                    for what, tok in (("no token", None), ("wrong token", wrong),
                                      ("other API's token", other), ("right token", right)):
                        md = [("authorization", "Bearer " + tok)] if tok else None
                        code = grpc.StatusCode.OK
                        try:
                            r = call(b"", timeout=5, metadata=md)
                            if m.server_streaming:  # the first message or the status
                                try:
                                    next(r)
                                except StopIteration:
                                    pass
                                r.cancel()
                        except grpc.RpcError as e:
                            code = e.code()
                        if right is None or what == "right token":
                            expect(code not in (grpc.StatusCode.UNAUTHENTICATED,
                                                grpc.StatusCode.UNIMPLEMENTED),
                                   "%s with %s: %s", path, what, code)
                        else:
                            expect(code == grpc.StatusCode.UNAUTHENTICATED,
                                   "%s with %s: %s (wanted UNAUTHENTICATED)", path, what, code)
                        n += 1
            # an unregistered method under a guarded service: no answer without the token
            try:
                ch.unary_unary("/moe.v1.Admin/NoSuchMethod")(b"", timeout=5)
            except grpc.RpcError as e:
                expect(e.code() == grpc.StatusCode.UNAUTHENTICATED, "unknown Admin method: %s",
                       e.code())
        log("  %d calls checked" % n)

    def http_walk():
        routes = []
        for f in os.listdir(os.path.join(SRC, "coordinator")):
            if f.endswith(".c"):
                text = open(os.path.join(SRC, "coordinator", f)).read()
                for m in re.finditer(r'http_server_route(_open)?\([^,]+,\s*"(\w+)",\s*"([^"]+)"',
                                     text):
                    routes.append((m.group(2), m.group(3), bool(m.group(1))))
        expect(len(routes) >= 8 and ("POST", "/v1/completions", False) in routes,
               "routes found in coordinator/*.c: %s", routes)
        n = 0
        for method, path, open_ in routes:
            for what, tok in (("no token", None), ("wrong token", wrong), ("admin token", admin),
                              ("right token", api)):
                rq = urllib.request.Request("http://127.0.0.1:%d%s" % (c.http, path),
                                            method=method,
                                            data=b"{}" if method == "POST" else None)
                rq.add_header("Content-Type", "application/json")
                if tok:
                    rq.add_header("Authorization", "Bearer " + tok)
                try:
                    with tl.no_proxy.open(rq, timeout=10) as r:
                        st, body, hdr = r.status, r.read(), r.headers
                except urllib.error.HTTPError as e:
                    st, body, hdr = e.code, e.read(), e.headers
                if open_ or what == "right token":
                    expect(st != 401, "%s %s with %s: 401", method, path, what)
                else:
                    expect(st == 401, "%s %s with %s: %s (wanted 401)", method, path, what, st)
                    j = __import__("json").loads(body)
                    expect(j["error"]["code"] == 401 and j["error"]["type"] and
                           "token" in j["error"]["message"] and
                           hdr.get("WWW-Authenticate") == "Bearer",
                           "401 body/headers: %s %s", body, dict(hdr))
                n += 1
        log("  %d HTTP requests checked (%d routes, %d open)" %
            (n, len(routes), sum(1 for r in routes if r[2])))

    def clis():
        addr = "127.0.0.1:%d" % c.port
        rc, out, err = run_cli(os.path.join(BIN, "moectl"), "--addr", addr, "--token-file",
                               admin_f, "status")
        expect(rc == 0 and "workers:" in out, "moectl with the admin token: %d %s", rc, err)
        rc, out, err = run_cli(os.path.join(BIN, "moectl"), "--addr", addr, "--token-file",
                               api_f, "status")
        expect(rc == 1 and "UNAUTHENTICATED" in err, "moectl with the API token: %d %s", rc, err)
        rc, out, err = run_cli(os.path.join(BIN, "moectl"), "--addr", addr, "health")
        expect(rc == 0, "moectl health without a token: %d %s", rc, err)
        rc, out, err = run_cli(os.path.join(BIN, "moe-client"), "--addr", addr, "--token-file",
                               api_f, "--tokens", "1,2", "-n", "3", "--quiet")
        expect(rc == 0 and "3 tokens" in out, "moe-client with the API token: %d %s", rc, err)
        rc, out, err = run_cli(os.path.join(BIN, "moe-client"), "--addr", addr, "--token-file",
                               admin_f, "--tokens", "1,2", "-n", "3", "--quiet")
        expect(rc == 1 and "UNAUTHENTICATED" in err, "moe-client, admin token: %d %s", rc, err)
        rc, out, err = run_cli(os.path.join(BIN, "moe-bench"), "--base-url", addr, "--token-file",
                               api_f, "--num-prompts", "2", "--random-input-len", "4",
                               "--random-output-len", "2", "--vocab-size", "100", "--quiet")
        expect(rc == 0 and "Successful requests" in out, "moe-bench --token-file: %d %s %s",
               rc, out[-300:], err[-300:])
        rc, out, err = run_cli(os.path.join(BIN, "moe-bench"), "--backend", "openai",
                               "--base-url", "http://127.0.0.1:%d" % c.http, "--api-key", api,
                               "--num-prompts", "2", "--random-input-len", "4",
                               "--random-output-len", "2", "--vocab-size", "100",
                               "--prompt-format", "tokens", "--quiet")
        expect(rc == 0 and "Successful requests" in out, "moe-bench openai --api-key: %d %s %s",
               rc, out[-300:], err[-300:])

    def bad_files():
        short = os.path.join(TMP, "short.tok")
        empty = os.path.join(TMP, "empty.tok")
        write_token(short, "abc")
        with open(empty, "w") as f:
            f.write("# nothing\n\n")
        for f, want in ((short, "line 2: a token of 3 characters"), (empty, "no token"),
                        (os.path.join(TMP, "nope.tok"), "nope.tok")):
            rc, out, err = run_cli(os.path.join(BIN, "moe-coordinator"), "--model", MODEL,
                                   "--workers", "127.0.0.1:1", "--api-token-file", f)
            expect(rc == 2 and "--api-token-file" in err and want in err, "%s: %d %s", f, rc, err)

    R.run("tokens: every gRPC method x 4 credentials", grpc_walk)
    R.run("tokens: every HTTP route x 4 credentials", http_walk)
    R.run("tokens: moectl, moe-client, moe-bench", clis)
    R.run("tokens: bad token files", bad_files)


def part_reload():
    # the live certificate folder, replaced file by file below
    live = os.path.join(TMP, "live")
    os.makedirs(live)
    for f in ("ca.crt", "tls.crt", "tls.key"):
        shutil.copy(cert_file(CERTS, f), live)
    make_certs(os.path.join(TMP, "next"), "--ca-from", CERTS)
    api_f = os.path.join(TMP, "api.tok")
    old_tok, new_tok = "old-" + os.urandom(16).hex(), "new-" + os.urandom(16).hex()
    write_token(api_f, old_tok)
    kv_port = tl.free_port()
    w = tl.spawn([os.path.join(BIN, "moe-worker"), "--model", MODEL, "--listen", "127.0.0.1:0",
                  "--threads", "1", "--kv-memory", "16", "--tls-dir", live, "--role", "decode",
                  "--kv-listen", "127.0.0.1:%d" % kv_port, "--metrics-listen", "127.0.0.1:0"],
                 os.path.join(TMP, "worker.log"))
    w.port = int(tl.wait_line(w, r"serving \S+ on 127\.0\.0\.1:(\d+)", "worker"))
    w.metrics = int(tl.wait_line(w, r"/metrics on 127\.0\.0\.1:(\d+)", "worker metrics"))
    c = tl.spawn([os.path.join(BIN, "moe-coordinator"), "--model", MODEL, "--listen",
                  "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--workers",
                  "127.0.0.1:%d" % w.port, "--tls-dir", live, "--api-token-file", api_f],
                 os.path.join(TMP, "coord.log"))
    c.port = int(tl.wait_line(c, r"serving on 127\.0\.0\.1:(\d+)", "coordinator"))
    c.http = int(tl.wait_line(c, r"/metrics on 127\.0\.0\.1:(\d+)", "coordinator http"))
    ca = cert_file(live, "ca.crt")
    client = dict(cert=cert_file(CERTS, "client.crt"), key=cert_file(CERTS, "client.key"))
    ports = [("coordinator gRPC", c.port, dict(alpn=["h2"])),
             ("coordinator HTTP", c.http, {}),
             ("worker gRPC", w.port, dict(alpn=["h2"], **client)),
             ("worker metrics", w.metrics, {}),
             ("worker KV data plane", kv_port, client)]

    def serials():
        return {name: peer_serial(port, ca, **kw) for name, port, kw in ports}

    old = serial_of_pem(cert_file(live, "tls.crt"))
    new = serial_of_pem(os.path.join(TMP, "next", "tls.crt"))
    n_reloads = [0]

    def sighup_and_wait(what):
        n_reloads[0] += 1
        for p in (c, w):
            p.send_signal(signal.SIGHUP)
        for p in (c, w):
            t_end = time.monotonic() + 30
            while time.monotonic() < t_end and \
                    len(re.findall(r"SIGHUP: (TLS|TLS reload)", tl.read_log(p))) < n_reloads[0]:
                time.sleep(0.02)
            expect(len(re.findall(r"SIGHUP: (TLS|TLS reload)", tl.read_log(p))) >= n_reloads[0],
                   "%s: no reload line after SIGHUP (%s):\n%s", p.args[0], what, tl.read_log(p))

    def before():
        got = serials()
        expect(all(s == old for s in got.values()), "before: %s (wanted %s)", got, old)

    def replaced():
        for f in ("tls.crt", "tls.key"):  # rename: never half a file
            shutil.copy(os.path.join(TMP, "next", f), os.path.join(live, f + ".tmp"))
            os.rename(os.path.join(live, f + ".tmp"), os.path.join(live, f))
        sighup_and_wait("new certificate")
        got = serials()
        expect(all(s == new for s in got.values()), "after SIGHUP: %s (wanted %s)", got, new)
        expect("serial " + new in tl.read_log(c), "the log names the new serial")

    def broken():
        with open(os.path.join(live, "tls.key"), "w") as f:
            f.write("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
        sighup_and_wait("broken key")
        expect("previous certificate stays in use" in tl.read_log(c), "the log says why")
        got = serials()
        expect(all(s == new for s in got.values()), "after a broken reload: %s", got)
        expect(c.poll() is None and w.poll() is None, "a broken reload stopped a process")

    def token_rotation():
        wait_routable(c.port, token=old_tok)
        write_token(api_f, new_tok)
        sighup_and_wait("token")
        try:
            generate(c.port, [1, 2], 1, token=old_tok)
            raise AssertionError("the old token still works after the reload")
        except grpc.RpcError as e:
            expect(e.code() == grpc.StatusCode.UNAUTHENTICATED, "old token: %s", e.code())
        expect(len(generate(c.port, [1, 2], 1, token=new_tok)) == 1, "new token refused")
        st, _, _ = https_get(c.http, "/v1/models", ca=ca, token=new_tok)
        expect(st == 200, "HTTP with the new token: %s", st)

    R.run("reload: every port shows the first certificate", before)
    R.run("reload: SIGHUP -> new connections see the new serial on every port", replaced)
    R.run("reload: a broken key keeps the previous certificate", broken)
    R.run("reload: a rotated token file", token_rotation)


def part_etcd():
    etcd = shutil.which("etcd")
    if not etcd:
        print("SKIPPED: no etcd binary (apt-get install etcd-server)")
        sys.exit(tl.SKIP)
    cport, pport = tl.free_port(), tl.free_port()
    client, peer = "https://127.0.0.1:%d" % cport, "http://127.0.0.1:%d" % pport
    e = tl.spawn([etcd, "--name", "n", "--data-dir", os.path.join(TMP, "etcd-data"),
                  "--listen-client-urls", client, "--advertise-client-urls", client,
                  "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                  "--initial-cluster", "n=" + peer, "--heartbeat-interval", "10",
                  "--election-timeout", "100", "--log-level", "error",
                  "--cert-file", cert_file(CERTS, "server.crt"),
                  "--key-file", cert_file(CERTS, "server.key"),
                  "--trusted-ca-file", cert_file(CERTS, "ca.crt"), "--client-cert-auth"],
                 os.path.join(TMP, "etcd.log"))
    ctx = tls_context(cert_file(CERTS, "ca.crt"), cert_file(CERTS, "client.crt"),
                      cert_file(CERTS, "client.key"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=ctx))
    t_end = time.monotonic() + 20
    while True:
        try:
            with opener.open(client + "/health", timeout=1) as r:
                if b'"health":"true"' in r.read():
                    break
        except OSError:
            pass
        expect(time.monotonic() < t_end and e.poll() is None, "etcd did not start:\n%s",
               tl.read_log(e))
        time.sleep(0.05)

    def routed():
        w = start_worker("worker", "--etcd", client, "--etcd-tls-dir", CERTS, tls=False)
        c = start_coordinator("coord", None, "--etcd-cacert", cert_file(CERTS, "ca.crt"),
                              "--etcd-cert", cert_file(CERTS, "client.crt"), "--etcd-key",
                              cert_file(CERTS, "client.key"), tls=False, etcd=client)
        expect("registered in etcd" in tl.read_log(w), "worker: %s", tl.read_log(w))
        toks = wait_routable(c.port, tls=False)
        expect(len(toks) == 2, "routed through the etcd membership: %s", toks)

    def refused():
        cases = [(["--etcd-cacert", cert_file(CERTS, "ca.crt")], "etcd"),  # no client cert
                 (["--etcd-tls-dir", OTHER], "etcd"),                      # another CA
                 (["--etcd-cert", cert_file(CERTS, "client.crt")], "--etcd-cert needs --etcd-key")]
        for flags, want in cases:
            rc, out, err = run_cli(os.path.join(BIN, "moe-coordinator"), "--model", MODEL,
                                   "--listen", "127.0.0.1:0", "--etcd", client, *flags,
                                   timeout=30)
            expect(rc != 0 and want in err, "%s: rc %d %s", flags, rc, err[-400:])
        rc, out, err = run_cli(os.path.join(BIN, "moe-coordinator"), "--model", MODEL,
                               "--listen", "127.0.0.1:0", "--etcd", "http://127.0.0.1:%d" % cport,
                               "--etcd-tls-dir", CERTS)
        expect(rc != 0 and "use https://" in err, "http:// with TLS flags: %d %s", rc, err)

    R.run("etcd: registration and routing over TLS with client certificates", routed)
    R.run("etcd: no client certificate, the wrong CA, http:// are refused", refused)


def part_kv():
    kv_p = tl.free_port()
    p = start_worker("prefill", "--role", "prefill", "--kv-listen", "127.0.0.1:0")
    d = start_worker("decode", "--role", "decode", "--kv-listen", "127.0.0.1:%d" % kv_p)
    m = start_worker("mixed")
    c1 = start_coordinator("coord-disagg", "%s,%s" % (p.addr, d.addr))
    c2 = start_coordinator("coord-mixed", m.addr)
    prompt = list(range(5, 45))

    def same_tokens():
        wait_routable(c1.port)
        wait_routable(c2.port)
        a = generate(c1.port, prompt, 12)
        b = generate(c2.port, prompt, 12)
        expect(a == b and len(a) == 12, "disaggregated over TLS %s != mixed %s", a, b)
        st, body, _ = https_get(c1.http, "/metrics")
        m_ = re.search(rb"^moe_kv_handoff_total(?:\{[^}]*\})? (\d+)", body, re.M)
        expect(m_ and int(m_.group(1)) >= 1, "no KV handoff counted: %s",
               m_.group(0) if m_ else body[:200])
        bad = re.findall(rb"^moe_kv_handoff_failures_total(?:\{[^}]*\})? (\d+)", body, re.M)
        expect(all(int(v) == 0 for v in bad), "failed handoffs (recomputed): %s", bad)
        expect("KV link: a connection refused" not in tl.read_log(d), "decode refused a peer")

    def kv_port_refuses():
        # plaintext: a KV request head gets no STATUS back
        with socket.create_connection(("127.0.0.1", kv_p), timeout=5) as s:
            s.settimeout(5)
            s.sendall(b"MOEK" + b"\x02\x00\x00\x00" + b"\x00\x00\x00\x00")
            try:
                data = s.recv(64)
            except OSError:
                data = b""
            expect(not data.startswith(b"MOEK"), "a plaintext request was answered: %r", data)
        expect(handshake_fails(kv_p, ca=cert_file(CERTS, "ca.crt")),
               "a TLS client without a certificate talked to the KV port")
        expect(handshake_fails(kv_p, ca=cert_file(OTHER, "ca.crt"),
                               cert=cert_file(OTHER, "client.crt"),
                               key=cert_file(OTHER, "client.key")),
               "a client with another CA's certificate talked to the KV port")

    R.run("kv: a handoff over mutual TLS gives the mixed worker's tokens", same_tokens)
    R.run("kv: the KV port refuses plaintext and uncertified clients", kv_port_refuses)


def clean_exits():
    """SIGTERM every server this part started: each exits 0 with no sanitizer
    report (TLS material, token sets and the SIGHUP thread freed)."""
    procs = [p for p in tl._children if os.path.basename(p.args[0]).startswith("moe-")]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = "hung"
        text = tl.read_log(p)
        expect(rc == 0 and not re.search(r"Sanitizer|runtime error", text),
               "%s: exit %s%s", os.path.basename(p.args[0]), rc,
               "\n" + text[-3000:] if rc != 0 or "Sanitizer" in text else "")


t0 = time.monotonic()
{"tls": part_tls, "tokens": part_tokens, "reload": part_reload, "etcd": part_etcd,
 "kv": part_kv}[args.part]()
R.run("%s: every server exits cleanly on SIGTERM" % args.part, clean_exits)
tl.kill_all_children()
log("%s: %.1f s" % (args.part, time.monotonic() - t0))
R.summary()
shutil.rmtree(TMP, ignore_errors=True)
sys.exit(1 if R.failed else 0)
