#!/usr/bin/env python3
"""The OpenAI-compatible HTTP API and /metrics, seen from real clients.

    test_http.py --bin-dir BUILD/bin --source-dir SRC

Starts two moe-workers (--metrics-listen) serving a copy of the bundled
Qwen3-MoE model (with its chat template) with a long context, and a
moe-coordinator with --http-listen, then checks with the official `openai`
package, raw HTTP and `curl -N`: completions and chat, streamed and not,
n = 2, logprobs, stop strings, seed reproducibility, include_usage; greedy
text equal to the gRPC path's; usage counts; SSE chunks arriving one by one;
a table of bad requests (status and OpenAI-shaped error body naming the
field, the server still serving); 429 at --max-queue; 503 with no worker;
--chat-template overriding the checkpoint's; a client that goes away
mid-stream (and one waiting for a whole answer)
frees the workers' KV blocks; /metrics of the coordinator and the workers
parsed by prometheus_client; a real Prometheus server scraping them answers
a query with the request count the test sent.

Exits 77 (skipped) only when the openai, prometheus_client or grpc module is
missing; a missing `prometheus` or `curl` binary skips those checks loudly.
"""
import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_testlib import (SKIP, Results, Skipped, expect, free_port, install_guards,  # noqa: E402
                         kill_all_children, kill_group, log, make_model_copy, make_stubs,
                         no_proxy, read_log, spawn, wait_line)

try:
    import grpc
    import openai
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as e:
    print("#" * 72)
    print("# SKIPPED: a Python module is missing: %s" % e)
    print("# Install: python3 -m pip install openai prometheus_client grpcio grpcio-tools")
    print("#" * 72)
    sys.exit(SKIP)

TIME_LIMIT_S = 150  # the CTest timeout is 180 s
LONG_CONTEXT = 16384
MAX_QUEUE = 8
GREEDY_PROMPT = "The quick brown fox jumps over"


# ---- plain HTTP -----------------------------------------------------------------------------

def http_req(addr, method, path, body=None, timeout=30, headers=None):
    """(status, headers dict, body bytes); body: bytes, str or a JSON object."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    h = {"Content-Type": "application/json"} if body is not None else {}
    h.update(headers or {})
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def http_json(addr, method, path, body=None, timeout=30):
    st, _, data = http_req(addr, method, path, body, timeout)
    try:
        return st, json.loads(data) if data else None
    except ValueError:
        raise AssertionError("%s %s: %d with a body that is not JSON: %r" %
                             (method, path, st, data[:200]))


def sse_events(raw):
    """The JSON objects (or the string '[DONE]') of an SSE body."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        expect(block.startswith("data: "), "SSE event without 'data: ': %r", block[:100])
        payload = block[6:]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metrics_of(addr):
    st, _, data = http_req(addr, "GET", "/metrics")
    expect(st == 200, "GET /metrics on %s: %d", addr, st)
    fams = {}
    for fam in text_string_to_metric_families(data.decode()):
        fams[fam.name] = fam
    return fams


def sample_sum(fams, family, sample_name=None, **labels):
    fam = fams.get(family)
    if fam is None:
        return None
    total = 0.0
    for s in fam.samples:
        if sample_name and s.name != sample_name:
            continue
        if all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


# ---- the cluster ------------------------------------------------------------------------------

class Cluster:
    def __init__(self, args, tmp):
        self.bin = os.path.abspath(args.bin_dir)
        self.src = os.path.abspath(args.source_dir)
        self.tmp = tmp
        self.fixture = os.path.join(self.src, "tests/golden/fixtures/qwen3_moe")
        self.workers = []  # (Popen, grpc address, metrics address)
        self.coord = None

    def start(self):
        self.pb, self.pb_grpc = make_stubs(self.src, self.tmp)
        self.model = make_model_copy(self.fixture, self.tmp, LONG_CONTEXT)
        for i in range(2):
            p = spawn([os.path.join(self.bin, "moe-worker"), "--model", self.model, "--listen",
                       "127.0.0.1:0", "--dtype", "f32", "--threads", "1", "--kv-memory", "64",
                       "--metrics-listen", "127.0.0.1:0"],
                      os.path.join(self.tmp, "worker%d.log" % i))
            g = wait_line(p, r"serving \S+ on (\S+:\d+)", "moe-worker")
            m = wait_line(p, r"/metrics on (\S+:\d+)", "moe-worker")
            self.workers.append((p, g, m))
            log("worker %d: gRPC %s, metrics %s" % (i, g, m))
        argv = [os.path.join(self.bin, "moe-coordinator"), "--model", self.model, "--listen",
                "127.0.0.1:0", "--workers", ",".join(w[1] for w in self.workers),
                "--http-listen", "127.0.0.1:0", "--poll-ms", "100", "--grace-ms", "1000",
                "--max-queue", str(MAX_QUEUE)]
        self.coord = spawn(argv, os.path.join(self.tmp, "coordinator.log"))
        self.http = wait_line(self.coord, r"/metrics on (\S+:\d+)", "moe-coordinator")
        self.grpc = wait_line(self.coord, r"serving on (\S+:\d+)", "moe-coordinator")
        log("coordinator: gRPC %s, HTTP %s" % (self.grpc, self.http))
        self.client = openai.OpenAI(base_url="http://%s/v1" % self.http, api_key="unused",
                                    max_retries=0, timeout=60,
                                    http_client=openai.DefaultHttpxClient(trust_env=False))
        self.channel = grpc.insecure_channel(self.grpc, options=[("grpc.enable_http_proxy", 0)])
        self.inference = self.pb_grpc.InferenceStub(self.channel)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end:
            if http_req(self.http, "GET", "/health")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("/health never answered 200")

    def model_name(self):
        return os.path.basename(self.model)

    def worker_load(self):
        """(KV blocks used, running) summed over the workers' /metrics."""
        used = running = 0
        for _, _, m in self.workers:
            f = metrics_of(m)
            used += sample_sum(f, "moe_kv_blocks", state="used")
            running += sample_sum(f, "vllm:num_requests_running")
        return used, running

    def wait_idle(self, timeout, what, coordinator=True):
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout:
            last = self.worker_load()
            coord = sample_sum(metrics_of(self.http), "moe_coordinator_requests_running") \
                if coordinator else 0
            if last == (0, 0) and coord == 0:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError("%s: workers still hold KV blocks / running sequences %s after "
                             "%.0f s" % (what, last, timeout))

    def stop(self):
        for p in [self.coord] + [w[0] for w in self.workers]:
            if p and p.poll() is None:
                kill_group(p, 15)
        for p in [self.coord] + [w[0] for w in self.workers]:
            if p:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    kill_group(p)
        kill_all_children()


# ---- checks ----------------------------------------------------------------------------------

def greedy_completion(c, n=24, extra_body=None, **kw):
    extra = {"ignore_eos": True}
    extra.update(extra_body or {})
    return c.client.completions.create(model=c.model_name(), prompt=GREEDY_PROMPT, max_tokens=n,
                                       temperature=0, extra_body=extra, **kw)


def check_greedy_vs_grpc(c):
    r = greedy_completion(c)
    ch = r.choices[0]
    expect(r.object == "text_completion" and r.model == c.model_name(), "object %s model %s",
           r.object, r.model)
    expect(ch.finish_reason == "length", "finish_reason %s", ch.finish_reason)
    req = c.pb.GenerateRequest(text=GREEDY_PROMPT, stream_text=True, sampling=c.pb.SamplingParams(
        max_tokens=24, ignore_eos=True, skip_special_tokens=True))
    text, last = [], None
    for m in c.inference.Generate(req, timeout=30):
        text.append(m.text)
        last = m
    grpc_text = "".join(text)
    log("  greedy text %r" % ch.text[:50])
    expect(ch.text == grpc_text, "HTTP text %r != gRPC text %r", ch.text, grpc_text)
    st, tok = http_json(c.http, "POST", "/tokenize", {"prompt": GREEDY_PROMPT})
    expect(st == 200 and tok["count"] == len(tok["tokens"]), "/tokenize: %d %s", st, tok)
    u = r.usage
    expect(u.prompt_tokens == tok["count"] == last.usage.prompt_tokens,
           "usage.prompt_tokens %d, /tokenize %d, gRPC %d", u.prompt_tokens, tok["count"],
           last.usage.prompt_tokens)
    expect(u.completion_tokens == 24 and u.total_tokens == u.prompt_tokens + 24,
           "usage %s", u)
    st, de = http_json(c.http, "POST", "/detokenize", {"tokens": tok["tokens"]})
    expect(st == 200 and de["prompt"] == GREEDY_PROMPT, "/detokenize: %d %s", st, de)
    c.greedy_text = ch.text


def check_stream_usage(c):
    chunks = list(greedy_completion(c, stream=True, stream_options={"include_usage": True}))
    expect(len(chunks) >= 3, "%d chunks", len(chunks))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    expect(text == c.greedy_text, "streamed text %r != %r", text, c.greedy_text)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    expect(finishes[-1] == "length" and all(f is None for f in finishes[:-1]),
           "finish reasons %s", finishes)
    last = chunks[-1]
    expect(not last.choices and last.usage and last.usage.completion_tokens == 24,
           "the last chunk is not the usage chunk: %s", last)
    expect(all(ch.usage is None for ch in chunks[:-1]), "usage on a non-final chunk")


def check_n_seed(c):
    def run(seed):
        r = c.client.completions.create(model=c.model_name(), prompt=["Once upon", "a time"],
                                        max_tokens=12, temperature=1.0, top_p=0.95, n=2,
                                        seed=seed, extra_body={"ignore_eos": True, "top_k": 50})
        return r
    a, b, other = run(42), run(42), run(43)
    expect(len(a.choices) == 4 and sorted(ch.index for ch in a.choices) == [0, 1, 2, 3],
           "choices %s", [ch.index for ch in a.choices])
    ta = [ch.text for ch in sorted(a.choices, key=lambda x: x.index)]
    tb = [ch.text for ch in sorted(b.choices, key=lambda x: x.index)]
    to = [ch.text for ch in sorted(other.choices, key=lambda x: x.index)]
    expect(ta == tb, "same seed, different texts: %s vs %s", ta, tb)
    expect(ta != to, "seeds 42 and 43 gave the same four texts")
    expect(ta[0] != ta[1] or ta[2] != ta[3], "the n = 2 samples of a prompt are identical")
    expect(a.usage.completion_tokens == 48, "completion_tokens %d, want 4 x 12",
           a.usage.completion_tokens)
    n1 = http_json(c.http, "POST", "/tokenize", {"prompt": "Once upon"})[1]["count"]
    n2 = http_json(c.http, "POST", "/tokenize", {"prompt": "a time"})[1]["count"]
    expect(a.usage.prompt_tokens == n1 + n2, "prompt_tokens %d, want %d + %d (once per prompt)",
           a.usage.prompt_tokens, n1, n2)


def check_logprobs(c):
    r = greedy_completion(c, n=8, logprobs=3)
    lp = r.choices[0].logprobs
    expect(lp and len(lp.tokens) == 8 and len(lp.token_logprobs) == 8 and
           len(lp.top_logprobs) == 8 and len(lp.text_offset) == 8, "logprobs %s", lp)
    for i in range(8):
        top = lp.top_logprobs[i]
        expect(1 <= len(top) <= 3, "top_logprobs[%d] has %d entries", i, len(top))
        expect(lp.token_logprobs[i] <= 0 and lp.token_logprobs[i] >= max(top.values()) - 1e-4,
               "greedy token %d: logprob %g, best alternative %g", i, lp.token_logprobs[i],
               max(top.values()))
    expect("".join(lp.tokens) == r.choices[0].text or "\ufffd" in r.choices[0].text,
           "logprob tokens %s do not spell the text %r", lp.tokens, r.choices[0].text)


def pick_stop(text):
    """A 2-character stop string from the middle of the greedy text."""
    for k in range(len(text) // 3, len(text) - 3):
        s = text[k:k + 2]
        if "\ufffd" not in s and s.strip() and text.find(s) >= 2:
            return s, text.find(s)
    raise AssertionError("no usable stop string in %r" % text)


def check_stop(c):
    s, at = pick_stop(c.greedy_text)
    r = greedy_completion(c, stop=[s, "never-there"])
    ch = r.choices[0]
    expect(ch.text == c.greedy_text[:at], "stop %r: text %r, want %r", s, ch.text,
           c.greedy_text[:at])
    expect(ch.finish_reason == "stop", "finish_reason %s", ch.finish_reason)
    expect(getattr(ch, "stop_reason", None) == s, "stop_reason %r",
           getattr(ch, "stop_reason", None))
    streamed = "".join(x.choices[0].text for x in greedy_completion(c, stop=s, stream=True)
                       if x.choices)
    expect(streamed == c.greedy_text[:at], "streamed with stop %r: %r, want %r", s, streamed,
           c.greedy_text[:at])
    r = greedy_completion(c, stop=[s], extra_body={"include_stop_str_in_output": True})
    expect(r.choices[0].text == c.greedy_text[:at + len(s)], "include_stop_str_in_output: %r",
           r.choices[0].text)
    log("  stop %r at %d of %d characters" % (s, at, len(c.greedy_text)))


def check_min_tokens(c):
    """A one-character stop string that occurs more than once in the greedy
    text: alone it cuts the text at its first occurrence; raising min_tokens
    one at a time, the first value that changes the answer holds off that
    occurrence (the token completing it is within min_tokens), and then the
    worker stops at a later one and the text is cut there, before a later
    occurrence (the coordinator looks for the cut where the worker looked,
    not from the start), with finish_reason stop."""
    text = c.greedy_text
    counts = {ch: text.count(ch) for ch in set(text) if "!" <= ch <= "~"}
    cands = sorted((ch for ch in counts if counts[ch] >= 2), key=lambda ch: -counts[ch])
    expect(cands, "no ASCII character occurs twice in %r", text)
    ch = cands[0]
    a = text.find(ch)
    r = greedy_completion(c, stop=[ch])
    expect(r.choices[0].text == text[:a] and r.choices[0].finish_reason == "stop",
           "stop %r alone: %r, want %r", ch, r.choices[0].text, text[:a])
    for m in range(1, 25):
        r = greedy_completion(c, stop=[ch], extra_body={"min_tokens": m})
        got = r.choices[0]
        if got.text != text[:a]:
            break
    expect(got.finish_reason == "stop" and len(got.text) > a and
           text.startswith(got.text) and text[len(got.text)] == ch,
           "stop %r, min_tokens %d: %r (%s) is not the greedy text cut before a later %r",
           ch, m, got.text, got.finish_reason, ch)
    streamed = "".join(x.choices[0].text for x in greedy_completion(
        c, stop=[ch], stream=True, extra_body={"min_tokens": m}) if x.choices)
    expect(streamed == got.text, "streamed: %r, want %r", streamed, got.text)
    log("  stop %r at %d; min_tokens %d: cut at %d" % (ch, a, m, len(got.text)))


def check_logit_bias(c):
    """+100 on one token: greedy decoding emits it every step; the logprob
    reported is the raw model's (not ~0); chat takes it too."""
    for tid in range(256, 512):  # a token whose text is a few ASCII letters
        st, de = http_json(c.http, "POST", "/detokenize", {"tokens": [tid]})
        expect(st == 200, "/detokenize: %d %s", st, de)
        if len(de["prompt"]) >= 2 and de["prompt"].isascii() and de["prompt"].isalpha():
            break
    expect(de["prompt"].isalpha(), "no token of ASCII letters among ids 256..511")
    r = greedy_completion(c, n=6, logprobs=0, logit_bias={str(tid): 100})
    ch = r.choices[0]
    expect(ch.text == de["prompt"] * 6, "text %r, want 6 x %r", ch.text, de["prompt"])
    lps = ch.logprobs.token_logprobs
    expect(len(lps) == 6 and max(lps) < -0.7, "forced token's logprobs %s (raw: not ~0)", lps)
    r = greedy_completion(c, n=4, logit_bias={str(tid): -100})
    expect(r.choices[0].text != de["prompt"] * 4, "-100: %r", r.choices[0].text)
    r = c.client.chat.completions.create(model=c.model_name(), max_tokens=3, temperature=0,
                                         messages=[{"role": "user", "content": "hi"}],
                                         logit_bias={str(tid): 100})
    expect(r.choices[0].message.content == de["prompt"] * 3, "chat: %r",
           r.choices[0].message.content)
    log("  token %d (%r) forced: logprobs %s" % (tid, de["prompt"], ["%.2f" % x for x in lps]))


def check_echo_logprobs(c):
    """echo + logprobs (what lm-evaluation-harness sends for log-likelihoods)
    and vLLM's prompt_logprobs field:
    the prompt's tokens come first, the first with null logprob and top, and
    the log-probability given to a prompt token is the one the model gives
    it when it generates that token after the same prefix (gRPC, and its
    sampling.prompt_logprobs agree)."""
    st, tok = http_json(c.http, "POST", "/tokenize", {"prompt": GREEDY_PROMPT})
    expect(st == 200, "/tokenize: %d %s", st, tok)
    ids = tok["tokens"]
    req = c.pb.GenerateRequest(token_ids=c.pb.TokenIds(ids=ids), sampling=c.pb.SamplingParams(
        max_tokens=1, ignore_eos=True, logprobs=0))
    msgs = list(c.inference.Generate(req, timeout=30))
    g, g_lp = msgs[0].token_ids[0], msgs[0].logprobs[0].logprob
    body = {"prompt": ids + [g], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "ignore_eos": True}
    st, r = http_json(c.http, "POST", "/v1/completions", body)
    expect(st == 200, "echo + logprobs: %d %s", st, r)
    lp = r["choices"][0]["logprobs"]
    n = len(ids) + 1
    expect(len(lp["tokens"]) == n + 1 and len(lp["token_logprobs"]) == n + 1,
           "%d tokens, want %d prompt + 1", len(lp["tokens"]), n)
    expect(lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None,
           "first prompt token: %s %s", lp["token_logprobs"][0], lp["top_logprobs"][0])
    expect(all(x <= 0 for x in lp["token_logprobs"][1:]), "logprobs %s", lp["token_logprobs"])
    expect(lp["text_offset"] == sorted(lp["text_offset"]), "text_offset %s", lp["text_offset"])
    got = lp["token_logprobs"][n - 1]
    expect(abs(got - g_lp) <= 1e-4, "prompt token %d's logprob %g, generated it had %g", g, got,
           g_lp)
    req = c.pb.GenerateRequest(token_ids=c.pb.TokenIds(ids=ids + [g]),
                               sampling=c.pb.SamplingParams(max_tokens=1, ignore_eos=True,
                                                            prompt_logprobs=2))
    first = next(iter(c.inference.Generate(req, timeout=30)))
    expect(list(first.prompt_token_ids) == ids + [g] and len(first.prompt_logprobs) == n - 1 and
           abs(first.prompt_logprobs[-1].logprob - g_lp) <= 1e-4 and
           len(first.prompt_logprobs[-1].top) == 2,
           "gRPC prompt_logprobs: %d ids, %d entries", len(first.prompt_token_ids),
           len(first.prompt_logprobs))
    # vLLM's prompt_logprobs field: per choice on completions, {"<id>": Logprob} entries
    body = {"prompt": ids + [g], "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0,
            "ignore_eos": True}
    st, r = http_json(c.http, "POST", "/v1/completions", body)
    expect(st == 200, "prompt_logprobs: %d %s", st, r)
    plp = r["choices"][0].get("prompt_logprobs")
    expect(plp and len(plp) == n and plp[0] is None, "prompt_logprobs %s", plp)
    for i in range(1, n):
        e = plp[i].get(str((ids + [g])[i]))
        expect(e and e["rank"] >= 1 and abs(e["logprob"] - lp["token_logprobs"][i]) <= 1e-5 and
               1 <= len(plp[i]) <= 3 and e["decoded_token"] == lp["tokens"][i],
               "entry %d: %s (echo: %s)", i, plp[i], lp["token_logprobs"][i])
        best = min(plp[i].values(), key=lambda x: x["rank"])
        expect(best["rank"] == 1, "entry %d has no rank-1 token: %s", i, plp[i])
    st, r = http_json(c.http, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    expect(st == 200 and r.get("prompt_logprobs") and r["prompt_logprobs"][0] is None and
           len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"],
           "chat prompt_logprobs: %d %s", st, str(r)[:300])
    log("  %d prompt tokens; the last's logprob %.4f, generated %.4f" % (n, got, g_lp))


def check_chat(c):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something."}]
    r = c.client.chat.completions.create(model=c.model_name(), messages=msgs, temperature=0,
                                         max_completion_tokens=10, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    ch = r.choices[0]
    expect(r.object == "chat.completion" and ch.message.role == "assistant",
           "object %s role %s", r.object, ch.message.role)
    expect(len(ch.logprobs.content) == 10 and all(len(t.top_logprobs) == 2
                                                   for t in ch.logprobs.content),
           "logprobs %s", ch.logprobs)
    st, tok = http_json(c.http, "POST", "/tokenize", {"messages": msgs})
    expect(st == 200 and r.usage.prompt_tokens == tok["count"] and
           r.usage.completion_tokens == 10, "usage %s, /tokenize %s", r.usage, tok)
    # The same prompt as token ids through /v1/completions gives the same text.
    r2 = c.client.completions.create(model=c.model_name(), prompt=tok["tokens"], max_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
    expect(r2.choices[0].text == ch.message.content, "chat %r != completion of the rendered "
           "prompt %r", ch.message.content, r2.choices[0].text)
    # Text parts join with newlines.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                          {"type": "text", "text": "something."}]}]
    joined = [{"role": "user", "content": "Say\nsomething."}]
    a = http_json(c.http, "POST", "/tokenize", {"messages": parts})[1]["tokens"]
    b = http_json(c.http, "POST", "/tokenize", {"messages": joined})[1]["tokens"]
    expect(a == b, "content parts render differently from the joined string")
    # Streaming: role first, then content, then the finish reason, then usage, then [DONE].
    st, _, raw = http_req(c.http, "POST", "/v1/chat/completions", {
        "messages": msgs, "temperature": 0, "max_tokens": 10, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    ev = sse_events(raw)
    expect(st == 200 and ev[-1] == "[DONE]", "status %d, last event %r", st, ev[-1])
    objs = ev[:-1]
    first = objs[0]["choices"][0]["delta"]
    expect(first.get("role") == "assistant", "first delta %s", first)
    fin = [i for i, o in enumerate(objs) if o["choices"] and o["choices"][0]["finish_reason"]]
    expect(len(fin) == 1 and fin[0] == len(objs) - 2, "finish chunk at %s of %d", fin, len(objs))
    expect(objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 10,
           "usage chunk %s", objs[-1])
    content = "".join(o["choices"][0]["delta"].get("content", "") for o in objs[:-1])
    expect(content == ch.message.content, "streamed content %r != %r", content,
           ch.message.content)


def check_sse_timing(c):
    curl = shutil.which("curl")
    if not curl:
        raise Skipped("no curl binary")
    # under a sanitizer (tests/run.sh's MOE_TEST_SANITIZER) a token costs 10-20x: fewer
    n = 600 if os.environ.get("MOE_TEST_SANITIZER") else 3000
    body = json.dumps({"prompt": "tick tock", "max_tokens": n, "temperature": 0,
                       "ignore_eos": True, "logprobs": 0, "stream": True})
    t0 = time.monotonic()
    p = subprocess.Popen([curl, "-sN", "--noproxy", "*", "-H", "Content-Type: application/json",
                          "-d", body, "http://%s/v1/completions" % c.http],
                         stdout=subprocess.PIPE)
    arrivals = []
    for line in p.stdout:
        if line.startswith(b"data: "):
            arrivals.append(time.monotonic())
    p.wait(timeout=30)
    expect(len(arrivals) >= n, "%d events", len(arrivals))
    first, last = arrivals[0] - t0, arrivals[-1] - t0
    # Buffered to the end, every event would arrive in one burst (a few
    # read() calls, one or two milliseconds); streamed, they arrive as the
    # tokens are made, over the whole generation (600 tokens take well over
    # 10 ms on any CPU). A count, not a speed: a slow first token (a loaded
    # machine) does not matter.
    windows = len({int((a - t0) / 0.001) for a in arrivals})
    log("  curl -N: first event at %.1f ms, last at %.1f ms, %d events in %d different 1 ms "
        "windows" % (first * 1e3, last * 1e3, len(arrivals), windows))
    expect(windows >= 10, "events arrived in only %d different 1 ms windows: buffered",
           windows)


BIG = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'


def bad_requests(c):
    """(name, path, body, status, param the error must name or None)."""
    P = "/v1/completions"
    C = "/v1/chat/completions"
    ok = {"prompt": "hi", "max_tokens": 2}

    def w(**kw):
        d = dict(ok)
        d.update(kw)
        return d

    rows = [
        ("malformed JSON", P, b'{"prompt": "hi"', 400, None),
        ("empty body", P, b"", 400, None),
        ("body is an array", P, b"[1, 2]", 400, None),
        ("no prompt", P, {"max_tokens": 2}, 400, "prompt"),
        ("prompt is a number", P, {"prompt": 5}, 400, "prompt"),
        ("prompt mixes strings and ids", P, {"prompt": ["a", [1, 2]]}, 400, "prompt"),
        ("prompt id out of vocabulary", P, {"prompt": [1, 2, 1 << 20]}, 400, "prompt"),
        ("empty prompt", P, {"prompt": ""}, 400, "prompt"),
        ("temperature is a string", P, w(temperature="hot"), 400, "temperature"),
        ("temperature 5", P, w(temperature=5), 400, "temperature"),
        ("top_p 0", P, w(top_p=0), 400, "top_p"),
        ("top_p 1.5", P, w(top_p=1.5), 400, "top_p"),
        ("top_k 2.5", P, w(top_k=2.5), 400, "top_k"),
        ("min_p -1", P, w(min_p=-1), 400, "min_p"),
        ("presence_penalty 3", P, w(presence_penalty=3), 400, "presence_penalty"),
        ("frequency_penalty true", P, w(frequency_penalty=True), 400, "frequency_penalty"),
        ("repetition_penalty 0", P, w(repetition_penalty=0), 400, "repetition_penalty"),
        ("max_tokens -1", P, w(max_tokens=-1), 400, "max_tokens"),
        ("max_tokens 1.5", P, w(max_tokens=1.5), 400, "max_tokens"),
        ("prompt + max_tokens beyond the context", P, w(max_tokens=LONG_CONTEXT), 400,
         "max_tokens"),
        ("n 100", P, w(n=100), 400, "n"),
        ("logprobs 50", P, w(logprobs=50), 400, "logprobs"),
        ("stop of 9 strings", P, w(stop=list("abcdefghi")), 400, "stop"),
        ("stop [1]", P, w(stop=[1]), 400, "stop"),
        ("stop string of 200 bytes", P, w(stop=["x" * 200]), 400, "stop"),
        ("stop_token_ids out of vocabulary", P, w(stop_token_ids=[1 << 20]), 400,
         "stop_token_ids"),
        ("seed is a string", P, w(seed="7"), 400, "seed"),
        ("stream is a string", P, w(stream="yes"), 400, "stream"),
        ("stream_options without stream", P, w(stream_options={"include_usage": True}), 400,
         "stream_options"),
        ("user is a number", P, w(user=5), 400, "user"),
        ("logit_bias is a list", P, w(logit_bias=[5, 10]), 400, "logit_bias"),
        ("logit_bias key not a token id", P, w(logit_bias={"five": 10}), 400, "logit_bias"),
        ("logit_bias token out of vocabulary", P, w(logit_bias={str(1 << 20): 1}), 400,
         "logit_bias"),
        ("logit_bias 101", P, w(logit_bias={"5": 101}), 400, "logit_bias"),
        ("logit_bias of 301 tokens", P, w(logit_bias={str(i): 1 for i in range(301)}), 400,
         "logit_bias"),
        ("best_of 3 (not supported)", P, w(best_of=3), 400, "best_of"),
        ("suffix (not supported)", P, w(suffix="end"), 400, "suffix"),
        ("min_tokens above max_tokens", P, w(min_tokens=3), 400, "min_tokens"),
        ("min_tokens -1", P, w(min_tokens=-1), 400, "min_tokens"),
        ("prompt_logprobs 21", P, w(prompt_logprobs=21), 400, "prompt_logprobs"),
        ("prompt_logprobs streamed", P, w(prompt_logprobs=1, stream=True), 400,
         "prompt_logprobs"),
        ("chat: prompt + min_tokens beyond the context", C, {"messages": [
            {"role": "user", "content": "x"}], "min_tokens": LONG_CONTEXT}, 400, "min_tokens"),
        ("unknown model", P, w(model="gpt-4o"), 404, "model"),
        ("10 MB body", P, BIG, 413, None),
        ("chat: no messages", C, {"max_tokens": 2}, 400, "messages"),
        ("chat: messages is a string", C, {"messages": "hi"}, 400, "messages"),
        ("chat: unknown role", C, {"messages": [{"role": "robot", "content": "x"}]}, 400,
         "messages"),
        ("chat: image content part", C, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
        ("chat: top_logprobs without logprobs", C, {"messages": [
            {"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
        ("chat: tools (not supported)", C, {"messages": [{"role": "user", "content": "x"}],
                                             "tools": [{"type": "function"}]}, 400, "tools"),
        ("chat: unknown model", C, {"model": "nope", "messages": [
            {"role": "user", "content": "x"}]}, 404, "model"),
        ("tokenize: prompt is a number", "/tokenize", {"prompt": 3}, 400, "prompt"),
        ("detokenize: tokens out of vocabulary", "/detokenize", {"tokens": [1 << 20]}, 400,
         "tokens"),
    ]
    return rows


def check_bad_requests(c):
    wrong = []
    rows = bad_requests(c)
    for name, path, body, status, param in rows:
        try:
            st, hdrs, data = http_req(c.http, "POST", path, body, timeout=20)
        except (OSError, http.client.HTTPException) as e:
            wrong.append("%s: %s" % (name, e))
            continue
        try:
            err = json.loads(data)["error"]
            shape = set(err) >= {"message", "type", "param", "code"} and err["code"] == st
        except (ValueError, KeyError, TypeError):
            err, shape = None, False
        if st != status or not shape or (param and err["param"] != param):
            wrong.append("%s: %d %s, want %d naming %s" % (name, st, data[:160], status, param))
    for name, method, path, status in [("unknown path", "GET", "/v2/anything", 404),
                                       ("GET /v1/completions", "GET", "/v1/completions", 405),
                                       ("DELETE /v1/models", "DELETE", "/v1/models", 405)]:
        st, hdrs, data = http_req(c.http, method, path)
        if st != status or "error" not in json.loads(data):
            wrong.append("%s: %d %s, want %d" % (name, st, data[:100], status))
    st, body = http_json(c.http, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                             "an_unknown_field": [1, 2]})
    if st != 200:
        wrong.append("an unknown field: %d %s, want 200 (ignored)" % (st, body))
    expect(not wrong, "%d of %d bad requests answered wrong:\n  %s", len(wrong), len(rows) + 4,
           "\n  ".join(wrong))
    expect(http_req(c.http, "GET", "/health")[0] == 200, "/health after the bad requests")
    r = greedy_completion(c, n=4)
    expect(r.choices[0].finish_reason == "length", "a normal request after the bad ones")


def open_stream(c, max_tokens=12000, prompt="a long story"):
    """A raw streaming request; returns (socket, file) after the first event."""
    host, port = c.http.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "logprobs": 0, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    f = s.makefile("rb")
    status = f.readline()
    expect(b" 200 " in status, "stream status line %r", status)
    while f.readline().strip():
        pass  # headers
    n = 0
    while n < 3:
        line = f.readline()
        expect(line, "the stream ended early")
        n += line.startswith(b"data: ") or b"data: " in line
    return s, f


def check_disconnect(c):
    c.wait_idle(30, "before the disconnect check")
    s, f = open_stream(c)
    busy = (0, 0)
    t_end = time.monotonic() + 30
    while busy[0] == 0 and time.monotonic() < t_end:
        busy = c.worker_load()
    expect(busy[0] > 0 and busy[1] == 1, "while streaming: workers show %s (KV used, running)",
           busy)
    f.close()
    s.close()
    dt = c.wait_idle(30, "after a streaming client went away")
    log("  stream: KV blocks used %d -> 0 %.0f ms after the client closed" % (busy[0], dt * 1e3))
    # A client waiting for a whole answer goes away too.
    host, port = c.http.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps({"prompt": "patience", "max_tokens": 12000, "temperature": 0,
                       "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    busy = (0, 0)
    t_end = time.monotonic() + 30
    while busy[1] == 0 and time.monotonic() < t_end:
        busy = c.worker_load()
    expect(busy[1] == 1, "the whole-answer request is not running: %s", busy)
    s.close()
    dt = c.wait_idle(30, "after a waiting client went away")
    log("  whole answer: KV blocks used %d -> 0 %.0f ms after the client closed" %
        (busy[0], dt * 1e3))
    expect(greedy_completion(c, n=4).choices[0].finish_reason == "length",
           "a request after the disconnects")


def check_queue_full(c):
    c.wait_idle(30, "before the queue check")
    streams = []
    try:
        for i in range(MAX_QUEUE):
            streams.append(open_stream(c, prompt="queue filler %d" % i))
        st, body = http_json(c.http, "POST", "/v1/completions", {"prompt": "one too many",
                                                                 "max_tokens": 2})
        expect(st == 429 and body["error"]["code"] == 429 and
               "max-queue" in body["error"]["message"], "with %d running: %d %s", MAX_QUEUE,
               st, body)
    finally:
        for s, f in streams:
            f.close()
            s.close()
    c.wait_idle(30, "after closing the queue fillers")
    expect(greedy_completion(c, n=2).choices[0].finish_reason == "length",
           "a request after the queue emptied")


def check_no_worker(c):
    argv = [os.path.join(c.bin, "moe-coordinator"), "--model", c.model, "--listen", "127.0.0.1:0",
            "--workers", "127.0.0.1:%d" % free_port(), "--http-listen", "127.0.0.1:0",
            "--poll-ms", "50", "--chat-template", os.path.join(c.src, "tests/python/chat_override.jinja")]
    p = spawn(argv, os.path.join(c.tmp, "coordinator-alone.log"))
    try:
        addr = wait_line(p, r"/metrics on (\S+:\d+)", "lone moe-coordinator")
        st, _, _ = http_req(addr, "GET", "/health")
        expect(st == 503, "/health with no worker: %d", st)
        st, body = http_json(addr, "POST", "/v1/completions", {"prompt": "anyone?",
                                                               "max_tokens": 2})
        expect(st == 503 and body["error"]["code"] == 503, "completion with no worker: %d %s",
               st, body)
        st, _ = http_json(addr, "GET", "/v1/models")
        expect(st == 200, "/v1/models with no worker: %d", st)
        # --chat-template overrides the checkpoint's template.
        msgs = [{"role": "user", "content": "hi"}]
        want = http_json(addr, "POST", "/tokenize", {
            "prompt": "<|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\nhi"
                      "<|im_end|>\n<|im_start|>assistant\n",
            "add_special_tokens": False})[1]["tokens"]
        got = http_json(addr, "POST", "/tokenize", {"messages": msgs})[1]["tokens"]
        ckpt = http_json(c.http, "POST", "/tokenize", {"messages": msgs})[1]["tokens"]
        expect(got == want and got != ckpt, "--chat-template: messages tokenize to %s, want %s "
               "(the checkpoint's template: %s)", got, want, ckpt)
        log("  --chat-template: %d prompt tokens (the checkpoint's template: %d)" %
            (len(got), len(ckpt)))
    finally:
        kill_group(p, 15)
        p.wait(timeout=10)


REQUIRED_COORD = ["vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens",
                  "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                  "moe_coordinator_requests_running", "moe_worker_up", "moe_placement_epoch",
                  "moe_kv_handoff"]
REQUIRED_WORKER = ["vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                   "vllm:prefix_cache_hits", "vllm:num_preemptions",
                   "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                   "moe_expert_tokens", "moe_step_duration_seconds", "moe_step_phase_seconds",
                   "vllm:iteration_tokens_total", "moe_placement_epoch"]


def success_total(c):
    return sample_sum(metrics_of(c.http), "vllm:request_success",
                      "vllm:request_success_total", model_name=c.model_name())


def check_metrics_parse(c):
    # prometheus_client names counter families without "_total".
    fams = metrics_of(c.http)
    missing = [n for n in REQUIRED_COORD if n not in fams]
    expect(not missing, "coordinator /metrics lacks %s (has %s)", missing, sorted(fams)[:40])
    for _, _, m in c.workers:
        wf = metrics_of(m)
        missing = [n for n in REQUIRED_WORKER if n not in wf]
        expect(not missing, "worker /metrics lacks %s", missing)
        routed = sample_sum(wf, "moe_expert_tokens")
        expect(routed > 0, "no tokens routed to experts on worker %s", m)
    for fam in fams.values():
        for s in fam.samples:
            expect(s.labels.get("model_name") == c.model_name(), "%s without model_name",
                   s.name)
    ttft = fams["vllm:time_to_first_token_seconds"]
    buckets = [s.value for s in ttft.samples if s.name.endswith("_bucket")]
    expect(buckets == sorted(buckets) and buckets[-1] > 0, "TTFT buckets %s", buckets)
    before = success_total(c)
    ok_before = sample_sum(fams, "vllm:request_success", "vllm:request_success_total",
                           finished_reason="length")
    for i in range(5):
        greedy_completion(c, n=3)
    after = success_total(c)
    ok_after = sample_sum(metrics_of(c.http), "vllm:request_success",
                          "vllm:request_success_total", finished_reason="length")
    expect(after - before == 5 and ok_after - ok_before == 5,
           "vllm:request_success_total rose by %g (length: %g), want 5", after - before,
           ok_after - ok_before)


def start_prometheus(c, prom, cfg):
    """Prometheus on a free port, once /-/ready answers. free_port() can
    lose its port to another process before Prometheus binds it (other tests
    run beside this one): a start that exits before it is ready is retried on
    a new port, and after three such exits the test fails with their logs."""
    failures = []
    for attempt in range(3):
        port = free_port()
        log_path = os.path.join(c.tmp, "prometheus-%d.log" % attempt)
        p = spawn([prom, "--config.file", cfg, "--storage.tsdb.path",
                   os.path.join(c.tmp, "tsdb-%d" % attempt),
                   "--web.listen-address", "127.0.0.1:%d" % port, "--log.level", "warn"],
                  log_path)
        base = "http://127.0.0.1:%d" % port
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end and p.poll() is None:
            try:
                with no_proxy.open(base + "/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return p, base
            except OSError:
                pass
            time.sleep(0.1)
        if p.poll() is None:
            raise AssertionError("prometheus on port %d not ready in 60 s:\n%s" %
                                 (port, read_log(p)))
        failures.append("port %d: exit %s: %s" % (port, p.returncode, read_log(p).strip()))
    raise AssertionError("prometheus exited before it was ready, 3 times:\n" + "\n".join(failures))


def check_prometheus(c):
    prom = shutil.which("prometheus")
    if not prom:
        raise Skipped("no prometheus binary (Debian package 'prometheus')")
    cfg = os.path.join(c.tmp, "prometheus.yml")
    with open(cfg, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                "scrape_configs:\n"
                "  - job_name: moe-coordinator\n    static_configs:\n"
                "      - targets: ['%s']\n"
                "  - job_name: moe-worker\n    static_configs:\n"
                "      - targets: [%s]\n" %
                (c.http, ", ".join("'%s'" % w[2] for w in c.workers)))
    p, base = start_prometheus(c, prom, cfg)

    def query(q):
        url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": q})
        with no_proxy.open(url, timeout=5) as r:
            d = json.loads(r.read())
        expect(d["status"] == "success", "query %s: %s", q, d)
        return d["data"]["result"]

    try:
        sent_before = success_total(c)
        for i in range(3):
            greedy_completion(c, n=2)
        sent = success_total(c)
        expect(sent - sent_before == 3, "the coordinator counted %g of 3 requests",
               sent - sent_before)
        q = 'sum(vllm:request_success_total{job="moe-coordinator"})'
        got, t_end = None, time.monotonic() + 30
        while time.monotonic() < t_end:
            try:
                res = query(q)
                got = float(res[0]["value"][1]) if res else None
                if got == sent:
                    break
            except (OSError, ValueError):
                pass
            if p.poll() is not None:
                raise AssertionError("prometheus exited (%s):\n%s" % (p.returncode, read_log(p)))
            time.sleep(0.2)
        expect(got == sent, "Prometheus answers %s = %s, the test sent %d requests in all", q, got,
               sent)
        up, t_end = None, time.monotonic() + 30
        while time.monotonic() < t_end:
            up = query('sum(up{job="moe-worker"})')
            if up and float(up[0]["value"][1]) == 2:
                break
            time.sleep(0.2)
        expect(up and float(up[0]["value"][1]) == 2, "workers up as Prometheus sees them: %s", up)
        kv = query('sum(vllm:kv_cache_usage_perc{job="moe-worker"})')
        expect(kv and float(kv[0]["value"][1]) >= 0, "worker series through Prometheus: %s", kv)
        log("  Prometheus: %s = %d (%d sent); both workers scraped" % (q, got, sent))
        # Every query of the Grafana dashboard runs, on series that exist.
        with open(os.path.join(c.src, "deploy/dashboards/moe-serve.json")) as f:
            dash = json.load(f)
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        text = "".join(http_req(a, "GET", "/metrics")[2].decode()
                       for a in [c.http] + [w[2] for w in c.workers])
        conditional = {"moe_rank_expert_rows_total",  # groups of several ranks only
                       "moe_kv_handoff_failures_total",  # after a failed handoff
                       "moe_kv_transfer_failures_total",  # prefill / decode workers only
                       "moe_kv_transfer_bytes_total"}
        bad = []
        for e in exprs:
            for name in set(re.findall(r"\b((?:vllm:|moe_)[a-z0-9_:]+)", e)):
                fam = re.sub(r"_bucket$", "", name)
                if "# TYPE %s " % fam not in text and fam not in conditional:
                    bad.append("%s: no series %s" % (e, fam))
            qe = (e.replace("$model", ".*").replace("$layer", ".*")
                  .replace("$__rate_interval", "10s"))
            url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": qe})
            try:
                with no_proxy.open(url, timeout=5) as r:
                    st = json.loads(r.read())["status"]
            except OSError as err:
                st = str(err)
            if st != "success":
                bad.append("%s: %s" % (qe, st))
        expect(not bad, "dashboard queries:\n  %s", "\n  ".join(bad))
        log("  the dashboard's %d queries run on Prometheus" % len(exprs))
    finally:
        kill_group(p, 15)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(p)


def check_sigterm(c):
    """Last: SIGTERM with a stream in flight ends it within the grace period
    (--grace-ms 1000) and the coordinator exits 0."""
    s, f = open_stream(c, prompt="interrupted")
    t0 = time.monotonic()
    kill_group(c.coord, 15)
    ended = None
    while time.monotonic() - t0 < 15:
        line = f.readline()
        if not line:
            ended = time.monotonic() - t0
            break
    f.close()
    s.close()
    expect(ended is not None, "the stream did not end within 15 s of SIGTERM")
    rc = c.coord.wait(timeout=15)
    log("  stream ended %.2f s after SIGTERM; coordinator exit %d" % (ended, rc))
    expect(rc == 0, "the coordinator exited with %d, want 0:\n%s", rc, read_log(c.coord)[-2000:])
    c.wait_idle(30, "after the coordinator stopped", coordinator=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="moe-http-")
    watchdog = install_guards(TIME_LIMIT_S, None if args.keep else tmp)
    res = Results()
    c = Cluster(args, tmp)
    try:
        up = res.run("cluster up: 2 workers, coordinator with --http-listen", c.start)
        checks = [
            ("openai completions: greedy text equals the gRPC path's, usage right",
             check_greedy_vs_grpc),
            ("openai completions streamed with include_usage", check_stream_usage),
            ("openai completions: 2 prompts x n = 2, seed reproducible", check_n_seed),
            ("openai completions: logprobs", check_logprobs),
            ("openai completions: stop strings (whole, streamed, included)", check_stop),
            ("openai completions: min_tokens holds off a stop string", check_min_tokens),
            ("openai completions and chat: logit_bias", check_logit_bias),
            ("openai completions: echo + logprobs and prompt_logprobs give the prompt's "
             "(gRPC prompt_logprobs)",
             check_echo_logprobs),
            ("openai chat: text, logprobs, usage, streamed deltas in order", check_chat),
            ("curl -N: SSE events arrive one by one", check_sse_timing),
            ("bad requests: status + OpenAI error naming the field; still serving",
             check_bad_requests),
            ("client disconnect frees the workers' KV blocks", check_disconnect),
            ("429 when --max-queue requests run", check_queue_full),
            ("503 and /health 503 with no worker; --chat-template overrides", check_no_worker),
            ("/metrics of coordinator and workers parsed by prometheus_client",
             check_metrics_parse),
            ("a real Prometheus scrapes them; its query returns the requests sent",
             check_prometheus),
            ("SIGTERM with an HTTP stream in flight: it ends, exit 0", check_sigterm),
        ]
        for name, fn in checks:
            if up:
                res.run(name, fn, c)
            else:
                res.fail(name, "not run: the cluster did not start")
        if res.failed:
            for p in [c.coord] + [w[0] for w in c.workers]:
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
    res.summary()
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
