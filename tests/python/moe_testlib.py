"""Helpers for the Python integration tests: child processes that die with
the test (own process group, PR_SET_PDEATHSIG, killed on exit, on
SIGTERM/SIGINT and by a watchdog), free ports, a pass/fail tally, gRPC stubs
generated from proto/moe/v1 and a copy of the bundled model with a longer
context (so that long requests are still running when a test cancels them).
"""
import atexit
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

T0 = time.monotonic()
SKIP = 77


def log(msg):
    print("[%6.2f s] %s" % (time.monotonic() - T0, msg), flush=True)


_children = []
_tmpdirs = []
_lock = threading.RLock()
_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _child_setup():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(argv, log_path, env=None):
    """Starts argv in a new session with stdout+stderr into log_path."""
    out = open(log_path, "wb")
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=_child_setup, env=env)
    finally:
        out.close()
    p.log_path = log_path
    with _lock:
        _children.append(p)
    return p


def kill_group(p, sig=signal.SIGKILL):
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all_children():
    with _lock:
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


def remove_tmpdirs():
    for d in _tmpdirs:
        shutil.rmtree(d, ignore_errors=True)


def install_guards(time_limit_s, tmp=None):
    """atexit + signal cleanup and a watchdog that ends the run."""
    if tmp:
        _tmpdirs.append(tmp)
    atexit.register(kill_all_children)

    def on_signal(sig, _frame):
        kill_all_children()
        remove_tmpdirs()
        os._exit(128 + sig)

    def watchdog():
        print("time limit of %d s reached, killing everything" % time_limit_s, flush=True)
        kill_all_children()
        remove_tmpdirs()
        os._exit(1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t = threading.Timer(time_limit_s, watchdog)
    t.daemon = True
    t.start()
    return t


def read_log(p):
    try:
        with open(p.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def wait_line(p, pattern, what, timeout=20.0):
    """Waits until the child's output matches `pattern` (a regex with one
    group); returns the group."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        m = re.search(pattern, read_log(p))
        if m:
            return m.group(1)
        if p.poll() is not None:
            break
        time.sleep(0.02)
    raise RuntimeError("%s: no line matching %r (exit %s); its output:\n%s" %
                       (what, pattern, p.poll(), read_log(p)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Loopback only: never through an http_proxy from the environment.
no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Results:
    def __init__(self):
        self.passed = self.failed = self.skipped = 0

    def run(self, name, fn, *args):
        t = time.monotonic()
        try:
            fn(*args)
        except Skipped as e:
            self.skipped += 1
            log("SKIPPED %s: %s" % (name, e))
            return True
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

    def summary(self):
        print("%d passed, %d failed, %d skipped" % (self.passed, self.failed, self.skipped),
              flush=True)


class Skipped(Exception):
    """A check that cannot run here (said loudly, counted apart)."""


def expect(cond, fmt, *args):
    if not cond:
        raise AssertionError(fmt % args if args else fmt)


def make_stubs(src, tmp):
    """Python modules from proto/moe/v1 (grpc_tools.protoc); returns the
    inference_pb2 and inference_pb2_grpc modules."""
    out = os.path.join(tmp, "stubs")
    os.makedirs(out, exist_ok=True)
    protos = ["moe/v1/inference.proto", "moe/v1/admin.proto", "moe/v1/worker.proto",
              "moe/v1/health.proto"]
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", os.path.join(src, "proto"),
           "--python_out=" + out, "--grpc_python_out=" + out] + protos
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    expect(r.returncode == 0, "grpc_tools.protoc failed (exit %d): %s%s", r.returncode,
           r.stdout, r.stderr)
    sys.path.insert(0, out)
    from moe.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
    return inference_pb2, inference_pb2_grpc


def make_model_copy(fixture, tmp, context):
    """The bundled model (symlinked weights) with max_position_embeddings =
    context; returns its directory."""
    model = os.path.join(tmp, os.path.basename(fixture))
    os.makedirs(model)
    for f in os.listdir(fixture):
        if f != "config.json" and not f.startswith(("logits", "golden")):
            os.symlink(os.path.join(fixture, f), os.path.join(model, f))
    with open(os.path.join(fixture, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = context
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return model
