#!/usr/bin/env python3
"""Integration test of the serving cluster from a stock Python gRPC client.

    test_client.py --bin-dir BUILD/bin --source-dir SRC

Generates Python stubs from proto/moe/v1/*.proto (grpcio-tools) into a
temporary directory, starts a private etcd, two moe-workers registered in it
(--lease-ttl 2, --dtype f32) and a moe-coordinator with --etcd, then checks
through grpcio what a real client sees: greedy tokens equal moe-generate's,
32 concurrent streams, cancel frees the KV, bad requests are refused with the
right status naming the field, a SIGKILLed worker is dropped, a SIGTERMed
worker finishes its request, refuses new work and exits 0.

Without an etcd binary the workers are given to the coordinator as a static
--workers list instead (said loudly; etcd membership is then not tested).

Prints one "ok"/"FAIL" line per check, then "N passed, M failed"; exits 1 on
any failure, 77 (skipped) only when the grpc module cannot be imported. Every
child runs in its own process group with PR_SET_PDEATHSIG and is killed on
exit, on SIGTERM/SIGINT and by a watchdog bounding the whole run.
"""
import argparse
import atexit
import concurrent.futures
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request

SKIP = 77
TIME_LIMIT_S = 570  # bounds a hang; the CTest timeout is 600 s
LONG_CONTEXT = 16384  # context of the model copy served by the workers
LONG_TOKENS = 12000  # a request that runs for seconds on the tiny model
LEASE_TTL_S = 2

try:
    import grpc
except ImportError as e:  # the only reason to skip
    print("#" * 72)
    print("# SKIPPED: the Python 'grpc' module (grpcio) cannot be imported: %s" % e)
    print("# Install it: python3 -m pip install grpcio grpcio-tools protobuf")
    print("#" * 72)
    sys.exit(SKIP)

T0 = time.monotonic()


def log(msg):
    print("[%6.2f s] %s" % (time.monotonic() - T0, msg), flush=True)


# ---- child processes ---------------------------------------------------------------------

_children = []  # subprocess.Popen, each the leader of its own process group
_tmpdir = []  # the run's temporary directory, removed on any exit but SIGKILL
_children_lock = threading.RLock()  # re-entered by the signal handler
_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _child_setup():
    # Runs in the child between fork and exec: die with this process.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(argv, log_path):
    """Starts argv in a new session with stdout+stderr into log_path."""
    out = open(log_path, "wb")
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=_child_setup)
    finally:
        out.close()
    p.log_path = log_path
    with _children_lock:
        _children.append(p)
    return p


def kill_group(p, sig=signal.SIGKILL):
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all_children():
    with _children_lock:
        procs = list(_children)
        _children.clear()
    for p in procs:
        if p.poll() is None:
            kill_group(p)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _remove_tmp():
    for d in _tmpdir:
        shutil.rmtree(d, ignore_errors=True)


def _on_signal(sig, _frame):
    kill_all_children()
    _remove_tmp()
    os._exit(128 + sig)


def _watchdog():
    print("test_client: time limit of %d s reached, killing everything" % TIME_LIMIT_S,
          flush=True)
    kill_all_children()
    _remove_tmp()
    os._exit(1)


def read_log(p):
    try:
        with open(p.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def wait_address(p, what, timeout=60.0):
    """Waits for the ' on HOST:PORT' line a server prints once it listens."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        m = re.search(r" on (\S+:\d+)", read_log(p))
        if m:
            return m.group(1)
        if p.poll() is not None:
            break
        time.sleep(0.02)
    raise RuntimeError("%s did not start (exit %s); its output:\n%s" % (what, p.poll(), read_log(p)))


# Loopback only: never through an http_proxy from the environment.
_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- checks --------------------------------------------------------------------------------

class Results:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def run(self, name, fn, *args):
        t = time.monotonic()
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then we go on
            self.failed += 1
            detail = str(e) if isinstance(e, AssertionError) else traceback.format_exc()
            log("FAIL %s (%.2f s): %s" % (name, time.monotonic() - t, detail.strip()))
            return False
        self.passed += 1
        log("ok   %s (%.2f s)" % (name, time.monotonic() - t))
        return True

    def fail(self, name, why):
        self.failed += 1
        log("FAIL %s: %s" % (name, why))


def expect(cond, fmt, *args):
    if not cond:
        raise AssertionError(fmt % args if args else fmt)


class Cluster:
    """Stubs, processes and channels of one test run."""

    def __init__(self, args, tmp):
        self.bin = os.path.abspath(args.bin_dir)
        self.src = os.path.abspath(args.source_dir)
        self.tmp = tmp
        self.fixture = os.path.join(self.src, "tests/golden/fixtures/qwen3_moe")
        self.model = None
        self.etcd = None
        self.etcd_url = None
        self.workers = {}  # id -> Popen
        self.worker_addr = {}
        self.coord = None
        self.channel = None

    # -- set-up --

    def make_stubs(self):
        out = os.path.join(self.tmp, "stubs")
        os.makedirs(out)
        protos = ["moe/v1/inference.proto", "moe/v1/admin.proto", "moe/v1/worker.proto",
                  "moe/v1/health.proto"]
        cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", os.path.join(self.src, "proto"),
               "--python_out=" + out, "--grpc_python_out=" + out] + protos
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        expect(r.returncode == 0, "grpc_tools.protoc failed (exit %d): %s%s", r.returncode,
               r.stdout, r.stderr)
        sys.path.insert(0, out)
        global pb, pb_grpc, admin_pb, admin_grpc, health_pb, health_grpc
        from moe.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc  # noqa: E402
        from moe.v1 import admin_pb2 as admin_pb, admin_pb2_grpc as admin_grpc  # noqa: E402
        from moe.v1 import health_pb2 as health_pb, health_pb2_grpc as health_grpc  # noqa: E402

    def make_model_copy(self):
        # Same weights (greedy tokens match moe-generate on the fixture), a
        # longer context so that long requests are still running when the
        # test cancels or signals them.
        self.model = os.path.join(self.tmp, "qwen3_moe")
        os.makedirs(self.model)
        for f in ("model.safetensors", "tokenizer.json", "generation_config.json"):
            os.symlink(os.path.join(self.fixture, f), os.path.join(self.model, f))
        with open(os.path.join(self.fixture, "config.json")) as f:
            cfg = json.load(f)
        cfg["max_position_embeddings"] = LONG_CONTEXT
        with open(os.path.join(self.model, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)

    def start_etcd(self):
        etcd = shutil.which("etcd")
        if not etcd:
            log("NOTE: no etcd binary on PATH: the workers are given to the coordinator with "
                "--workers; etcd membership (lease expiry) is NOT tested")
            return
        cport, pport = free_port(), free_port()
        client, peer = "http://127.0.0.1:%d" % cport, "http://127.0.0.1:%d" % pport
        self.etcd = spawn([etcd, "--name", "n", "--data-dir", os.path.join(self.tmp, "etcd-data"),
                           "--listen-client-urls", client, "--advertise-client-urls", client,
                           "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                           "--initial-cluster", "n=" + peer, "--heartbeat-interval", "10",
                           "--election-timeout", "100", "--log-level", "error"],
                          os.path.join(self.tmp, "etcd.log"))
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end:
            try:
                with _no_proxy.open(client + "/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        self.etcd_url = client
                        log("etcd healthy on %s" % client)
                        return
            except OSError:
                pass
            if self.etcd.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("etcd did not become healthy:\n" + read_log(self.etcd))

    def start_worker(self, wid):
        argv = [os.path.join(self.bin, "moe-worker"), "--model", self.model, "--listen",
                "127.0.0.1:0", "--dtype", "f32", "--threads", "1", "--kv-memory", "64",
                "--worker-id", wid]
        if self.etcd_url:
            argv += ["--etcd", self.etcd_url, "--lease-ttl", str(LEASE_TTL_S)]
        p = spawn(argv, os.path.join(self.tmp, wid + ".log"))
        self.workers[wid] = p
        self.worker_addr[wid] = wait_address(p, "moe-worker " + wid)
        log("worker %s on %s (pid %d)" % (wid, self.worker_addr[wid], p.pid))

    def start_coordinator(self):
        argv = [os.path.join(self.bin, "moe-coordinator"), "--model", self.model, "--listen",
                "127.0.0.1:0", "--poll-ms", "100", "--grace-ms", "1000"]
        if self.etcd_url:
            argv += ["--etcd", self.etcd_url]
        else:
            argv += ["--workers", ",".join(self.worker_addr.values())]
        self.coord = spawn(argv, os.path.join(self.tmp, "coordinator.log"))
        addr = wait_address(self.coord, "moe-coordinator")
        log("coordinator on %s (pid %d)" % (addr, self.coord.pid))
        self.channel = grpc.insecure_channel(addr, options=[("grpc.enable_http_proxy", 0)])
        self.inference = pb_grpc.InferenceStub(self.channel)
        self.admin = admin_grpc.AdminStub(self.channel)
        self.health = health_grpc.HealthStub(self.channel)

    def status(self):
        return self.admin.ClusterStatus(admin_pb.ClusterStatusRequest(), timeout=5)

    def serving_ids(self):
        return sorted(w.id for w in self.status().workers
                      if w.state == admin_pb.WORKER_STATE_SERVING)

    def cluster_id(self, wid):
        """The id the coordinator lists a worker under: its --worker-id when
        it registered in etcd, its address in a static --workers list."""
        return wid if self.etcd_url else self.worker_addr[wid]

    def wait_serving(self, wids, timeout):
        ids = [self.cluster_id(w) for w in wids]
        t_end = time.monotonic() + timeout
        got = None
        while time.monotonic() < t_end:
            try:
                got = self.serving_ids()
                if got == sorted(ids):
                    return
            except grpc.RpcError as e:
                got = "%s %s" % (e.code(), e.details())
            time.sleep(0.05)
        raise AssertionError("ClusterStatus: SERVING workers %s, want %s" % (got, sorted(ids)))

    def kv_used(self):
        return sum(w.kv_blocks_used for w in self.status().workers)

    def fresh_status(self, timeout=60.0):
        """ClusterStatus once the coordinator has polled every worker after
        this call began, so it describes everything that happened before."""
        t0 = time.monotonic()
        t_end = t0 + timeout
        while time.monotonic() < t_end:
            before = time.monotonic()
            st = self.status()
            # polled at (answer time - ago) >= (before - ago)
            if st.workers and all(before - w.last_seen_ms_ago / 1e3 > t0 for w in st.workers):
                return st
            time.sleep(0.02)
        raise AssertionError("the coordinator did not poll every worker within %.0f s" % timeout)

    def kv_idle(self, timeout=60.0):
        """kv_blocks_used summed over the workers once nothing runs, read from
        a view polled after nothing ran any more."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            st = self.fresh_status()
            if st.requests_running == 0 and all(w.running == 0 and w.waiting == 0
                                                for w in st.workers):
                return sum(w.kv_blocks_used for w in st.workers)
            time.sleep(0.02)
        raise AssertionError("the cluster did not become idle within %.0f s" % timeout)

    # -- requests --

    @staticmethod
    def greedy(n, **kw):
        return pb.SamplingParams(max_tokens=n, ignore_eos=True, **kw)

    def generate(self, req, timeout=30):
        """Runs one Generate; returns (ids, text, last message, n messages)."""
        ids, text, last, n = [], [], None, 0
        for m in self.inference.Generate(req, timeout=timeout):
            n += 1
            ids.extend(m.token_ids)
            text.append(m.text)
            last = m
        return ids, "".join(text), last, n

    def short_ok(self, prompt, n=4):
        ids, _, last, _ = self.generate(pb.GenerateRequest(text=prompt,
                                                           sampling=self.greedy(n)))
        expect(len(ids) == n and last.finish_reason == pb.FINISH_REASON_LENGTH,
               "'%s': %d tokens, finish %s", prompt, len(ids), last and last.finish_reason)

    def stop(self):
        if self.channel:
            self.channel.close()
        for p in list(self.workers.values()) + [self.coord]:
            if p and p.poll() is None:
                kill_group(p, signal.SIGTERM)
        for p in list(self.workers.values()) + [self.coord]:
            if p:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    kill_group(p)
        if self.etcd:
            kill_group(self.etcd)
        kill_all_children()


# ---- the checks -----------------------------------------------------------------------------

def reference_tokens(c, prompt, n):
    r = subprocess.run([os.path.join(c.bin, "moe-generate"), "--model", c.fixture, "--prompt",
                        prompt, "-n", str(n), "--dtype", "f32", "--ignore-eos", "--threads", "1"],
                       capture_output=True, text=True, timeout=30)
    expect(r.returncode == 0, "moe-generate exit %d: %s", r.returncode, r.stderr.strip())
    for line in r.stdout.splitlines():
        if line.startswith("tokens:"):
            return [int(t) for t in line[7:].split()]
    raise AssertionError("moe-generate printed no 'tokens:' line:\n" + r.stdout)


def check_greedy(c):
    prompt, n = "The quick brown fox jumps over", 24
    ref = reference_tokens(c, prompt, n)
    expect(len(ref) == n, "moe-generate gave %d tokens, want %d", len(ref), n)
    ids, text, last, msgs = c.generate(pb.GenerateRequest(
        request_id="py-greedy", text=prompt, sampling=c.greedy(n), stream_text=True))
    log("  greedy: %d messages, text %r" % (msgs, text[:60]))
    expect(ids == ref, "token ids %s != moe-generate %s", ids, ref)
    expect(last.finish_reason == pb.FINISH_REASON_LENGTH, "finish_reason %d", last.finish_reason)
    expect(last.usage.completion_tokens == n, "usage.completion_tokens %d",
           last.usage.completion_tokens)
    expect(last.request_id == "py-greedy", "request_id echoed as %r", last.request_id)
    expect(len(text) > 0, "the text deltas join to an empty string")


def check_concurrent(c):
    n_streams, n = 32, 16

    def one(i):
        ids, _, last, _ = c.generate(pb.GenerateRequest(
            text="concurrent request number %d says hello" % i, sampling=c.greedy(n)))
        return len(ids), last.finish_reason

    with concurrent.futures.ThreadPoolExecutor(n_streams) as ex:
        futs = [ex.submit(one, i) for i in range(n_streams)]
        res, errs = [], []
        for f in futs:
            try:
                res.append(f.result(timeout=30))
            except grpc.RpcError as e:
                errs.append("%s %s" % (e.code(), e.details()))
    expect(not errs, "%d of %d streams failed: %s", len(errs), n_streams, errs[:3])
    bad = [r for r in res if r != (n, pb.FINISH_REASON_LENGTH)]
    expect(not bad, "%d streams ended wrong (tokens, finish): %s", len(bad), bad[:3])


def check_cancel(c):
    idle = c.kv_idle()
    it = c.inference.Generate(pb.GenerateRequest(text="a long story about cancellation",
                                                 sampling=c.greedy(LONG_TOKENS)), timeout=30)
    got = 0
    for m in it:
        got += len(m.token_ids)
        expect(not m.finish_reason, "finished (%d) before the cancel", m.finish_reason)
        if got >= 5:
            break
    # still running (it has thousands of tokens to go): a view polled now shows its blocks
    busy = sum(w.kv_blocks_used for w in c.fresh_status().workers)
    it.cancel()
    t_cancel = time.monotonic()
    expect(it.code() == grpc.StatusCode.CANCELLED, "stream status %s after cancel", it.code())
    now = busy
    while time.monotonic() - t_cancel < 30:  # only bounds a hang; the time is printed
        now = c.kv_used()
        if now == idle:
            break
        time.sleep(0.02)
    log("  cancel after %d tokens: kv_blocks_used %d -> %d -> %d in %.0f ms" %
        (got, idle, busy, now, (time.monotonic() - t_cancel) * 1000))
    expect(busy > idle, "kv_blocks_used never rose above its idle value %d while running", idle)
    expect(now == idle, "kv_blocks_used %d, not back to idle %d within 30 s of the cancel", now,
           idle)


def bad_requests():
    """(name, request, status, text the details must contain)."""
    INV, NF = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND

    def req(prompt="hello", sp=None, **kw):
        s = pb.SamplingParams(max_tokens=4, ignore_eos=True)
        for k, v in (sp or {}).items():
            if isinstance(v, list):
                getattr(s, k).extend(v)
            else:
                setattr(s, k, v)
        if isinstance(prompt, list):
            return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=s, **kw)
        return pb.GenerateRequest(text=prompt, sampling=s, **kw)

    return [
        ("temperature -1", req(sp={"temperature": -1}), INV, "sampling.temperature"),
        ("top_p 2", req(sp={"top_p": 2}), INV, "sampling.top_p"),
        ("top_k 2^30", req(sp={"top_k": 1 << 30}), INV, "sampling.top_k"),
        ("min_p 2", req(sp={"min_p": 2}), INV, "sampling.min_p"),
        ("repetition_penalty 20", req(sp={"repetition_penalty": 20}), INV,
         "sampling.repetition_penalty"),
        ("presence_penalty 5", req(sp={"presence_penalty": 5}), INV, "sampling.presence_penalty"),
        ("frequency_penalty -3", req(sp={"frequency_penalty": -3}), INV,
         "sampling.frequency_penalty"),
        ("9 stop strings", req(sp={"stop": list("abcdefghi")}), INV, "sampling.stop"),
        ("200-byte stop string", req(sp={"stop": ["x" * 200]}), INV, "sampling.stop[0]"),
        ("17 stop token ids", req(sp={"stop_token_ids": [1] * 17}), INV,
         "sampling.stop_token_ids"),
        ("logprobs 50", req(sp={"logprobs": 50}), INV, "sampling.logprobs"),
        ("empty prompt text", req(prompt=""), INV, "prompt"),
        ("no prompt", pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)), INV,
         "prompt"),
        ("prompt id out of vocabulary", req(prompt=[5, 17, 99, 1 << 20]), INV,
         "prompt.token_ids[3]"),
        ("max_tokens beyond the context", req(sp={"max_tokens": LONG_CONTEXT}), INV,
         "sampling.max_tokens"),
        ("unknown model", req(model="llama-70b"), NF, "model"),
        ("request_id of 1000 bytes", req(request_id="r" * 1000), INV, "request_id"),
    ]


def check_bad_requests(c):
    wrong = []
    for name, rq, code, field in bad_requests():
        msgs = 0
        try:
            for _ in c.inference.Generate(rq, timeout=10):
                msgs += 1
            wrong.append("%s: accepted (%d messages)" % (name, msgs))
        except grpc.RpcError as e:
            if e.code() != code or field not in (e.details() or "") or msgs:
                wrong.append("%s: got %s '%s' after %d messages, want %s naming '%s'" %
                             (name, e.code().name, e.details(), msgs, code.name, field))
    expect(not wrong, "%d of %d bad requests answered wrong:\n  %s", len(wrong),
           len(bad_requests()), "\n  ".join(wrong))
    h = c.health.Check(health_pb.HealthCheckRequest(service=""), timeout=5)
    expect(h.status == health_pb.HealthCheckResponse.SERVING, "health %s after the bad requests",
           health_pb.HealthCheckResponse.ServingStatus.Name(h.status))
    c.short_ok("a normal request after the bad ones", 8)


def check_sigkill(c):
    victim_wid, other_wid = sorted(c.workers)
    victim, other = c.cluster_id(victim_wid), c.cluster_id(other_wid)
    p = c.workers.pop(victim_wid)
    kill_group(p, signal.SIGKILL)
    p.wait(timeout=60)
    t_kill = time.monotonic()
    limit = LEASE_TTL_S + 30  # only bounds a hang
    state = None
    while time.monotonic() - t_kill < limit:
        st = {w.id: w.state for w in c.status().workers}
        state = st.get(victim)
        if state is None or state == admin_pb.WORKER_STATE_DOWN:
            break
        time.sleep(0.05)
    dt = time.monotonic() - t_kill
    log("  %s %s after %.2f s" % (victim, "gone" if state is None else
                                  admin_pb.WorkerState.Name(state), dt))
    expect(state is None or state == admin_pb.WORKER_STATE_DOWN,
           "%s still listed as %s %.1f s after SIGKILL", victim,
           admin_pb.WorkerState.Name(state), limit)
    for i in range(5):
        c.short_ok("after the crash, request %d" % i, 4)
    expect(other in c.serving_ids(), "%s is not SERVING any more", other)


def check_sigterm(c):
    (wid, p), = c.workers.items()
    n = 2000  # ~0.6 s of decoding (a few s under ASan)
    it = c.inference.Generate(pb.GenerateRequest(text="drain me gently", sampling=c.greedy(n)),
                              timeout=120)
    first = next(it)
    got = len(first.token_ids)
    kill_group(p, signal.SIGTERM)
    t_term = time.monotonic()
    result = {}

    def drain():
        nonlocal got
        try:
            last = first
            for m in it:
                got += len(m.token_ids)
                last = m
            result["finish"] = last.finish_reason
        except grpc.RpcError as e:
            result["error"] = "%s %s" % (e.code(), e.details())
        result["t"] = time.monotonic()

    th = threading.Thread(target=drain)
    th.start()
    # New work is refused while the request drains (and after).
    refused = None
    while refused is None and time.monotonic() - t_term < 30:
        try:
            c.short_ok("knocking on a draining door", 4)
            time.sleep(0.02)
        except grpc.RpcError as e:
            refused = (e.code(), e.details(), "t" not in result)
    th.join(timeout=120)
    expect(not th.is_alive(), "the in-flight request did not end")
    log("  in flight: %d tokens, done %.2f s after SIGTERM; new request: %s" %
        (got, result["t"] - t_term, refused and "%s '%s'%s" % (
            refused[0].name, refused[1], " (while in flight)" if refused[2] else "")))
    expect("error" not in result, "the in-flight request failed: %s", result.get("error"))
    expect(got == n and result["finish"] == pb.FINISH_REASON_LENGTH,
           "the in-flight request ended with %d of %d tokens, finish %s", got, n,
           result.get("finish"))
    expect(refused is not None, "new requests still accepted 30 s after SIGTERM")
    expect(refused[0] == grpc.StatusCode.UNAVAILABLE, "a new request got %s '%s', want "
           "UNAVAILABLE", refused[0].name, refused[1])
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the worker did not exit within 60 s of its last request")
    del c.workers[wid]
    expect(rc == 0, "the worker exited with %d, want 0", rc)


# ---- main -----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="directory of moe-worker, moe-coordinator, "
                    "moe-generate")
    ap.add_argument("--source-dir", required=True, help="the project's source directory")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()

    atexit.register(kill_all_children)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    watchdog = threading.Timer(TIME_LIMIT_S, _watchdog)
    watchdog.daemon = True
    watchdog.start()

    res = Results()
    tmp = tempfile.mkdtemp(prefix="moe-pyclient-")
    if not args.keep:
        _tmpdir.append(tmp)
    c = Cluster(args, tmp)
    try:
        up = res.run("stubs from proto/moe/v1 (grpc_tools.protoc)", c.make_stubs)

        def start():
            c.make_model_copy()
            c.start_etcd()
            for wid in ("py-a", "py-b"):
                c.start_worker(wid)
            c.start_coordinator()
            c.wait_serving(["py-a", "py-b"], 10)

        up = up and res.run("cluster up: ClusterStatus shows 2 SERVING workers", start)
        checks = [
            ("greedy stream by text equals moe-generate", check_greedy),
            ("32 concurrent streams", check_concurrent),
            ("cancel after 5 tokens frees the KV", check_cancel),
            ("bad requests refused naming the field; still SERVING", check_bad_requests),
            ("SIGKILL a worker: dropped within TTL + 2 s, others serve", check_sigkill),
            ("SIGTERM the last worker: in-flight completes, new refused, exit 0",
             check_sigterm),
        ]
        for name, fn in checks:
            if up:
                res.run(name, fn, c)
            else:
                res.fail(name, "not run: the cluster did not start")
        if res.failed:
            for p in [c.etcd, c.coord] + list(c.workers.values()):
                if p:
                    log("---- %s ----\n%s" % (os.path.basename(p.log_path),
                                               read_log(p)[-3000:]))
    finally:
        c.stop()
        if args.keep:
            log("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    watchdog.cancel()
    print("%d passed, %d failed" % (res.passed, res.failed), flush=True)
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
