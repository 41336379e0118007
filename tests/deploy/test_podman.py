#!/usr/bin/env python3
"""deploy/podman: the chart's rendered pod specs, run for real in the built
image with `podman kube play`, reach a healthy cluster that answers requests
through the chart's own Service names, and drain on the chart's preStop.

  test_podman.py [--image localhost/moe-serve:dev] [--keep]

What stands in for the parts of Kubernetes that are not here (no API server,
kubelet, kube-proxy or cluster DNS can run on this machine):
  - controllers: every Deployment / StatefulSet is expanded into its pods
    (Deployment pods NAME-HASH-XXXXX, StatefulSet pods NAME-N with the
    hostname and subdomain a StatefulSet gives them), each played as a Pod
    on its own podman network address;
  - cluster DNS and kube-proxy: hostAliases (/etc/hosts) in every pod carry
    each Service's names (NAME, NAME.NS, NAME.NS.svc, NAME.NS.svc.cluster.local)
    pointing at a ready pod it selects, and each headless Service's per-pod
    names of the pods whose subdomain it is;
  - kubelet: the downward API values (metadata.name / namespace,
    status.podIP: podman 4.3 refuses the last) and $(VAR) expansion in
    command and args are filled in here; Secret, ConfigMap and emptyDir
    volumes are
    written to host directories (podman 4.3 crashes on secret volumes) with
    the mode and group (fsGroup) the kubelet gives them; the startup,
    readiness and liveness probes (gRPC health with the probe's service name,
    TCP, HTTP) are run from here against the pod's address, as the kubelet
    would; preStop hooks are run with `podman exec` before the container is
    stopped; restartPolicy is Never so that any crash fails the test.
NetworkPolicy is not enforced by podman (checked statically by test_chart.py)."""
import argparse
import base64
import hashlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "deploy", "helm", "moe-serve")
VALUES = os.path.join(ROOT, "tests", "deploy", "podman-values.yaml")
NS = "moe"
RELEASE = "demo"
SKIP = 77

try:
    import grpc
    import helm_python as helm
    import yaml
    from helm_python import _native
except ImportError as e:
    print(f"SKIPPED: {e} (python3 -m pip install helm-python-sdk grpcio pyyaml)")
    sys.exit(SKIP)

PODMAN = os.environ.get("PODMAN", "podman --runtime /usr/sbin/runc").split()
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def die(msg):
    raise SystemExit(f"deploy/podman: FAILED: {msg}")


def podman(*args, check=True, timeout=300, capture=True):
    r = subprocess.run(PODMAN + list(args), capture_output=capture, text=True, timeout=timeout)
    if check and r.returncode:
        die(f"podman {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r


# ---- the kubelet's probes, from outside the pod ------------------------------

def grpc_health(ip, port, service, timeout=2.0):
    """grpc.health.v1.Health/Check; returns the status number (1 = SERVING)."""
    req = service.encode()
    req = (b"\x0a" + bytes([len(req)]) + req) if req else b""
    with grpc.insecure_channel(f"{ip}:{port}") as ch:
        call = ch.unary_unary("/grpc.health.v1.Health/Check",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
        resp = call(req, timeout=timeout)
    return resp[1] if len(resp) >= 2 and resp[0] == 0x08 else 0


def probe_ok(pod, container, probe):
    def port_of(p):
        if isinstance(p, int):
            return p
        for cp in container.get("ports", []):
            if cp.get("name") == p:
                return cp["containerPort"]
        die(f"{pod['name']}: probe port {p} not among the container's ports")
    try:
        if "grpc" in probe:
            return grpc_health(pod["ip"], probe["grpc"]["port"], probe["grpc"].get("service", "")) == 1
        if "tcpSocket" in probe:
            with socket.create_connection((pod["ip"], port_of(probe["tcpSocket"]["port"])), 2):
                return True
        if "httpGet" in probe:
            h = probe["httpGet"]
            with socket.create_connection((pod["ip"], port_of(h["port"])), 2) as s:
                s.sendall(f"GET {h.get('path', '/')} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
                head = s.recv(4096).decode(errors="replace")
            return bool(re.match(r"HTTP/1\.[01] [23]\d\d", head))
        die(f"{pod['name']}: probe kind {list(probe)} not handled")
    except (grpc.RpcError, OSError):
        return False


# ---- from rendered objects to playable pods ----------------------------------

def render(values_file):
    chart = helm.Chart.load(CHART)
    with open(values_file) as f:
        values = yaml.safe_load(f)
    opts = {"name": RELEASE, "namespace": NS, "is_install": True, "kube_version": "v1.33.0"}
    out = json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values),
                                         json.dumps(opts)))
    objs = [d for p, t in sorted(out.items()) if not p.endswith("NOTES.txt")
            for d in yaml.safe_load_all(t) if d]
    return objs


def rand5():
    return "".join(random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))


def expand_pods(objs):
    pods = []
    for o in objs:
        k, s, name = o["kind"], o.get("spec", {}), o["metadata"]["name"]
        if k == "Deployment":
            h = hashlib.sha256(json.dumps(s["template"], sort_keys=True).encode()).hexdigest()[:10]
            for _ in range(s.get("replicas", 1)):
                pn = f"{name}-{h}-{rand5()}"
                pods.append({"name": pn, "hostname": pn, "subdomain": None,
                             "template": s["template"], "owner": f"Deployment/{name}"})
        elif k == "StatefulSet":
            for i in range(s.get("replicas", 1)):
                pn = f"{name}-{i}"
                pods.append({"name": pn, "hostname": pn, "subdomain": s["serviceName"],
                             "template": s["template"], "owner": f"StatefulSet/{name}"})
        elif k in ("LeaderWorkerSet", "MPIJob", "Job"):
            die(f"{k} in the podman values: not playable here")
    return pods


def selects(sel, pod):
    labels = pod["template"]["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in sel.items())


def dns_records(objs, pods):
    recs = {}
    for svc in (o for o in objs if o["kind"] == "Service"):
        name, spec = svc["metadata"]["name"], svc["spec"]
        matched = [p for p in pods if selects(spec.get("selector", {}), p)]
        if not matched:
            die(f"Service {name} selects no pod")
        if spec.get("clusterIP") == "None":
            for p in matched:
                if p["subdomain"] == name:
                    for n in (f"{p['hostname']}.{name}", f"{p['hostname']}.{name}.{NS}",
                              f"{p['hostname']}.{name}.{NS}.svc",
                              f"{p['hostname']}.{name}.{NS}.svc.cluster.local"):
                        recs[n] = p["ip"]
        else:
            # kube-proxy stand-in: the Service name goes to its first pod
            for n in (name, f"{name}.{NS}", f"{name}.{NS}.svc", f"{name}.{NS}.svc.cluster.local"):
                recs[n] = matched[0]["ip"]
    by_ip = {}
    for n, ip in sorted(recs.items()):
        by_ip.setdefault(ip, []).append(n)
    return [{"ip": ip, "hostnames": names} for ip, names in sorted(by_ip.items())], recs


def materialize_volumes(pod, objs, voldir, fs_group):
    """Secret / ConfigMap volumes -> host directories (the kubelet's job)."""
    out = []
    for v in pod["template"]["spec"].get("volumes", []):
        if "secret" in v or "configMap" in v:
            src = v.get("secret") or v.get("configMap")
            kind, key = ("Secret", "secretName") if "secret" in v else ("ConfigMap", "name")
            obj = next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == src[key]),
                       None)
            if obj is None:
                die(f"{pod['name']}: volume {v['name']}: {kind} {src[key]} is not in the chart")
            d = os.path.join(voldir, pod["name"], v["name"])
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o755)
            data = obj.get("data", {})
            for fname, val in data.items():
                path = os.path.join(d, fname)
                with open(path, "wb") as f:
                    f.write(base64.b64decode(val) if kind == "Secret" else val.encode())
                os.chown(path, 0, fs_group)
                os.chmod(path, src.get("defaultMode", 0o644))
            out.append({"name": v["name"], "hostPath": {"path": d, "type": "Directory"}})
        elif "emptyDir" in v:
            # podman 4.3 turns an emptyDir into a named volume shared by
            # every pod that uses the name: give each pod its own directory
            d = os.path.join(voldir, pod["name"], v["name"])
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o777)
            out.append({"name": v["name"], "hostPath": {"path": d, "type": "Directory"}})
        elif "persistentVolumeClaim" in v:
            die(f"{pod['name']}: PVC volumes are not played here (etcd.persistence.enabled: false)")
        else:
            out.append(v)
    return out


def kubelet_env(c, pod):
    env = {}
    new = []
    for e in c.get("env", []):
        if "valueFrom" in e:
            fp = e["valueFrom"].get("fieldRef", {}).get("fieldPath")
            val = {"metadata.name": pod["name"], "metadata.namespace": NS,
                   "status.podIP": pod["ip"]}.get(fp)
            if val is None:
                die(f"{pod['name']}: env {e['name']}: valueFrom {e['valueFrom']} not handled")
            e = {"name": e["name"], "value": val}
        env[e["name"]] = e.get("value", "")
        new.append(e)

    def expand(s):
        return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), s)
    c = dict(c, env=new)
    for k in ("command", "args"):
        if k in c:
            c[k] = [expand(a) for a in c[k]]
    return c


def playable(pod, objs, aliases, voldir):
    t = pod["template"]
    spec = dict(t["spec"])
    fs_group = spec.get("securityContext", {}).get("fsGroup", 0)
    containers = []
    for c in spec["containers"]:
        c = kubelet_env(c, pod)
        # probes and hooks are run from here; ports are information in a pod
        # spec, but `podman kube play` 4.3 would publish them on the host
        for k in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "ports"):
            c.pop(k, None)
        containers.append(c)
    inits = [kubelet_env(c, pod) for c in spec.get("initContainers", [])]
    for c in inits:
        c.pop("ports", None)
    spec = {k: v for k, v in spec.items()
            if k not in ("serviceAccountName", "affinity", "imagePullSecrets", "initContainers")}
    spec.update(containers=containers, hostname=pod["hostname"], hostAliases=aliases,
                restartPolicy="Never",
                volumes=materialize_volumes(pod, objs, voldir, fs_group))
    if inits:
        spec["initContainers"] = inits
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod["name"], "labels": t["metadata"].get("labels", {})},
            "spec": spec}


# ---- the cluster ------------------------------------------------------------

class Cluster:
    def __init__(self, image, keep, values):
        self.keep = keep
        self.values = values
        self.image = image
        self.tmp = tempfile.mkdtemp(prefix="moe-podman-")
        self.net = f"moe-deploy-{os.getpid()}"
        self.pods = []
        self.objs = []

    def container(self, pod, name):
        return f"{pod['name']}-{name}"

    def pod(self, prefix, index=0):
        ps = [p for p in self.pods if p["name"].startswith(prefix)]
        if len(ps) <= index:
            die(f"no pod {prefix} #{index}")
        return ps[index]

    def up(self):
        if podman("image", "exists", self.image, check=False).returncode:
            die(f"image {self.image} not found: run deploy/container/build-image.sh first")
        self.objs = render(self.values)
        self.pods = expand_pods(self.objs)
        for _ in range(20):
            octet = random.randint(100, 250)
            # no podman DNS server: names come from /etc/hosts (hostAliases) and
            # anything else (gRPC's c-ares also asks for AAAA records) goes to
            # the host's resolvers, which answer at once, as cluster DNS would
            if not podman("network", "create", "--disable-dns", "--subnet", f"10.89.{octet}.0/24",
                          self.net, check=False).returncode:
                break
        else:
            die("could not create a podman network")
        for i, p in enumerate(self.pods):
            p["ip"] = f"10.89.{octet}.{10 + i}"
        aliases, self.dns = dns_records(self.objs, self.pods)
        kinds = sorted({o["kind"] for o in self.objs})
        log(f"rendered {len(self.objs)} objects ({', '.join(kinds)}) -> {len(self.pods)} pods "
            f"on network {self.net} (10.89.{octet}.0/24)")
        # all at once, as the controllers would: `kube play` returns only
        # after a pod's init containers (wait-etcd) are done
        errors = []

        def play(p, path):
            r = podman("kube", "play", "--replace", "--network", self.net, "--ip", p["ip"], path,
                       check=False)
            if r.returncode:
                errors.append(f"{p['name']}: {r.stderr.strip()[-1500:]}")
            else:
                log(f"  started {p['owner']:40s} pod {p['name']} at {p['ip']}")
        threads = []
        for p in self.pods:
            spec = playable(p, self.objs, aliases, self.tmp)
            path = os.path.join(self.tmp, p["name"] + ".yaml")
            with open(path, "w") as f:
                yaml.safe_dump(spec, f)
            threads.append(threading.Thread(target=play, args=(p, path)))
            threads[-1].start()
        for t in threads:
            t.join()
        if errors:
            die("podman kube play: " + "; ".join(errors))

    def exited(self, pod, cname):
        r = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                   self.container(pod, cname), check=False)
        st = r.stdout.split()
        return (st[0] in ("exited", "stopped"), int(st[1]) if len(st) > 1 else None) if st else (True, None)

    def logs(self, pod, cname, tail=60):
        r = podman("logs", "--tail", str(tail), self.container(pod, cname), check=False)
        return (r.stdout + r.stderr).strip()

    def wait_ready(self, deadline_s=300):
        """Every container passes its startup probe, then readiness and
        liveness (the kubelet's order)."""
        end = time.time() + deadline_s
        pending = [(p, c) for p in self.pods for c in p["template"]["spec"]["containers"]]
        while pending:
            left = []
            for p, c in pending:
                done, code = self.exited(p, c["name"])
                if done:
                    die(f"{p['name']}/{c['name']} exited ({code}) before it was ready:\n"
                        f"{self.logs(p, c['name'])}")
                probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
                if all(probe_ok(p, c, pr) for pr in probes):
                    kinds = ", ".join(f"{k}: " + ("grpc " + repr(c[k]["grpc"].get("service", ""))
                                                  if "grpc" in c[k] else next(iter(c[k])))
                                      for k in ("startupProbe", "readinessProbe", "livenessProbe")
                                      if k in c)
                    log(f"  ready: {p['name']}/{c['name']} ({kinds})")
                else:
                    left.append((p, c))
            pending = left
            if pending and time.time() > end:
                die("not ready in time: " + "".join(
                    f"\n--- {p['name']}/{c['name']}:\n{self.logs(p, c['name'], tail=15)}"
                    for p, c in pending))
            if pending:
                time.sleep(0.5)

    def exec(self, pod, cname, *cmd, check=True, timeout=120):
        r = podman("exec", self.container(pod, cname), *cmd, check=False, timeout=timeout)
        if check and r.returncode:
            die(f"{pod['name']}: {' '.join(cmd)}: exit {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}")
        return r

    def prestop(self, pod, cname):
        """The kubelet: run the preStop hook, then SIGTERM PID 1 (what is
        left after the hook) with the grace period as the deadline."""
        c = next(c for c in pod["template"]["spec"]["containers"] if c["name"] == cname)
        hook = c["lifecycle"]["preStop"]["exec"]["command"]
        grace = pod["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        t = time.time()
        self.exec(pod, cname, *hook, check=False, timeout=grace)
        hook_s = time.time() - t
        podman("stop", "-t", str(max(1, int(grace - hook_s))), self.container(pod, cname),
               check=False, timeout=grace + 30)
        return hook_s

    def down(self):
        if self.keep:
            log(f"--keep: pods left running on {self.net}; files in {self.tmp}")
            return
        for p in self.pods:
            podman("pod", "rm", "-f", "-t", "2", p["name"], check=False)
        podman("network", "rm", "-f", self.net, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def moectl_json(cl, coord, *args):
    r = cl.exec(coord, "coordinator", "moectl", "--addr", "127.0.0.1:50051", "--json", *args)
    return json.loads(r.stdout)


def load(cl, coord, addr, loops, tokens, seconds=90):
    """`loops` clients in the coordinator pod, each sending streaming
    requests back to back until one is refused (the drain left no worker)
    or `seconds` pass; returns every request's output."""
    script = (f"end=$((SECONDS + {seconds})); for j in $(seq {loops}); do ( k=0; "
              f"while [ $SECONDS -lt $end ]; do k=$((k + 1)); f=/tmp/load.$j.$k; "
              f"moe-client --addr {addr} --prompt \"load $j $k\" -n {tokens} --ignore-eos --quiet "
              f">$f 2>&1; grep -q UNAVAILABLE $f && break; done ) & done; wait; "
              f"for f in /tmp/load.*; do echo \"== $f\"; cat $f; done; rm -f /tmp/load.*")
    r = cl.exec(coord, "coordinator", "bash", "-c", script, timeout=seconds + 60)
    return r.stdout.split("== ")[1:]


def drain_check(cl, coord, addr, pod, what):
    """Streaming load on the one worker left routable; the chart's preStop
    drains it: every request it had accepted finishes in full (requests
    sent after the drain began find no worker: the coordinator answers
    UNAVAILABLE; none is cut short), the worker exits 0 and leaves the
    coordinator's list."""
    loops, tokens = 24, 240
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("out", load(cl, coord, addr, loops, tokens)))
    th.start()
    end = time.time() + 120
    seen = 0
    while time.time() < end:
        ws = {w["id"]: w for w in moectl_json(cl, coord, "workers", "list")["workers"]}
        w = ws.get(pod["name"], {})
        seen = max(seen, w.get("running", 0) + w.get("waiting", 0))
        if seen >= 2:
            break
        time.sleep(0.02)
    else:
        th.join(timeout=120)
        die(f"{what}: at most {seen} requests ever seen on {pod['name']}; the load saw:\n"
            + "\n".join(result.get("out", [])[:6]) + f"\nworkers: {json.dumps(ws)}")
    hook_s = cl.prestop(pod, "worker")
    th.join(timeout=300)
    outs = result.get("out", [])
    full = sum(1 for o in outs if f"finish: length, {tokens} tokens" in o)
    # Refused before any token: moe-client names UNAVAILABLE and prints no
    # finish line (it would try a next --addr); a stream cut short after
    # tokens would print "finish: none, N tokens".
    refused = sum(1 for o in outs if "UNAVAILABLE" in o
                  and ("finish:" not in o or "finish: none, 0 tokens" in o))
    if full + refused != len(outs) or refused != loops:
        bad = [o for o in outs if f"finish: length, {tokens} tokens" not in o and "UNAVAILABLE" not in o]
        die(f"{what}: {full} full + {refused} refused of {len(outs)} (want every loop to end on "
            f"a refusal); cut short or failed:\n" + "\n".join(bad[:4]))
    done, code = cl.exited(pod, "worker")
    text = cl.logs(pod, "worker", tail=200)
    m = re.search(r"SIGTERM: draining \((\d+) requests in flight\)", text)
    if not m or int(m.group(1)) < 1:
        die(f"{what}: the worker did not drain with requests in flight:\n{text}\n"
            f"coordinator:\n{cl.logs(coord, 'coordinator', tail=30)}\nload:\n"
            + "\n".join(outs[:6]))
    if not done or code != 0:
        die(f"{what}: worker container {'exit ' + str(code) if done else 'still running'}:\n{text}")
    end = time.time() + 15
    while pod["name"] in {w["id"] for w in moectl_json(cl, coord, "workers", "list")["workers"]}:
        if time.time() > end:
            die(f"{what}: {pod['name']} still listed after its drain")
        time.sleep(0.2)
    ttft = [float(x) for o in outs for x in re.findall(r"client: TTFT ([0-9.]+) ms", o)]
    if ttft and max(ttft) > 10000:
        log(f"{what}: WARNING: a request waited {max(ttft) / 1000:.0f} s for its first token; "
            f"the coordinator's log:\n{cl.logs(coord, 'coordinator', tail=30)}")
    log(f"{what}: preStop ran {hook_s:.1f} s; {m.group(1)} requests in flight at SIGTERM; of "
        f"{len(outs)} requests {full} finished in full and {refused} sent after the drain began "
        f"were refused (UNAVAILABLE: no worker left), none cut short; exit 0; gone from the "
        f"coordinator's list")


def disaggregated(cl):
    """Prefill group over two pods (TP 2) -> decode group: requests through
    the coordinator Service are computed by the prefill group and continued
    by the decode group, the KV moving rank to rank between the pods."""
    svc = f"{RELEASE}-moe-serve-coordinator.{NS}.svc.cluster.local:50051"
    c0 = cl.pod(f"{RELEASE}-moe-serve-coordinator-", 0)
    pre = cl.pod(f"{RELEASE}-moe-serve-prefill-", 0)
    dec = cl.pod(f"{RELEASE}-moe-serve-decode-", 0)
    end = time.time() + 30
    while True:
        ws = {w["id"]: w for w in moectl_json(cl, c0, "workers", "list")["workers"]}
        if {pre["name"], dec["name"]} <= set(ws) and all(w["state"] == "serving" for w in ws.values()):
            break
        if time.time() > end:
            die(f"the coordinator sees {sorted(ws)}")
        time.sleep(0.2)
    if ws[pre["name"]]["role"] != "prefill" or ws[dec["name"]]["role"] != "decode" \
            or ws[pre["name"]]["world_size"] != 2 or ws[pre["name"]]["tp_size"] != 2:
        die(f"workers: {json.dumps(ws)}")
    log(f"prefill group {pre['name']} (2 ranks over 2 pods, TP 2) and decode {dec['name']} "
        "registered")
    outs = []
    for i in range(4):
        r = cl.exec(c0, "coordinator", "moe-client", "--addr", svc, "--prompt",
                    f"a prompt long enough to fill some KV blocks, number {i}", "-n", "24",
                    "--ignore-eos")
        if "finish: length, 24 tokens" not in r.stdout:
            die(f"disaggregated request {i}: {r.stdout}{r.stderr}")
        outs.append(r.stdout)
    # the coordinator's counters come from its load polls: wait for them
    end = time.time() + 15
    while True:
        ws = {w["id"]: w for w in moectl_json(cl, c0, "workers", "list")["workers"]}
        p, d = ws[pre["name"]], ws[dec["name"]]
        if p["kv_transfer_failures"] or d["kv_transfer_failures"]:
            die(f"KV handoff failures: prefill {json.dumps(p)}, decode {json.dumps(d)}")
        if p["kv_transfers_out"] >= 4 and d["kv_transfers_in"] >= 4:
            break
        if time.time() > end:
            die(f"KV handoffs: prefill {json.dumps(p)}, decode {json.dumps(d)}")
        time.sleep(0.2)
    log(f"4/4 requests through {svc}: prefill handed {p['kv_transfers_out']} KV transfers "
        f"({p['kv_transfer_bytes']} bytes) to decode ({d['kv_transfers_in']} in), no failures")
    log(f"deploy/podman (disaggregated): PASSED in {time.time() - T0:.0f} s")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="localhost/moe-serve:dev")
    ap.add_argument("--keep", action="store_true", help="leave the pods running")
    ap.add_argument("--values", default=VALUES,
                    help="chart values (default tests/deploy/podman-values.yaml; a file with "
                         "prefill/decode pools runs the disaggregated checks)")
    a = ap.parse_args()
    if not shutil.which(PODMAN[0]):
        print("SKIPPED: podman not installed")
        return SKIP
    if "CONTAINERS_CONF" not in os.environ:
        conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
        conf.write("[containers]\ndefault_ulimits = []\n")
        conf.close()
        os.environ["CONTAINERS_CONF"] = conf.name
    cl = Cluster(a.image, a.keep, a.values)
    try:
        cl.up()
        cl.wait_ready()
        log("every probe passes: etcd quorum, coordinators, workers, the group's follower")
        with open(a.values) as f:
            roles = {p.get("role", "mixed") for p in yaml.safe_load(f)["pools"]}
        if "prefill" in roles:
            return disaggregated(cl)
        svc = f"{RELEASE}-moe-serve-coordinator.{NS}.svc.cluster.local:50051"
        c0 = cl.pod(f"{RELEASE}-moe-serve-coordinator-", 0)
        c1 = cl.pod(f"{RELEASE}-moe-serve-coordinator-", 1)
        # the workers register in etcd; both coordinators learn them
        want = {p["name"] for p in cl.pods if p["template"]["metadata"]["labels"].get(
            "moe-serve.io/group-role") == "leader"}
        for c in (c0, c1):
            end = time.time() + 30
            while True:
                ws = {w["id"]: w for w in moectl_json(cl, c, "workers", "list")["workers"]}
                if set(ws) == want and all(w["state"] == "serving" for w in ws.values()):
                    break
                if time.time() > end:
                    die(f"{c['name']} sees workers {sorted(ws)}, want {sorted(want)}")
                time.sleep(0.2)
        group = cl.pod(f"{RELEASE}-moe-serve-group-", 0)
        if ws[group["name"]]["world_size"] != 2:
            die(f"the two-pod group has world size {ws[group['name']]['world_size']}")
        log(f"both coordinators list {len(want)} workers from etcd; {group['name']} is one group "
            f"of world size 2 over pods {group['name']} + {RELEASE}-moe-serve-group-follower-0")
        # a request through the chart's Service name, and one to the other coordinator
        r = cl.exec(c0, "coordinator", "moe-client", "--addr", svc, "--prompt", "Hello", "-n", "16",
                    "--ignore-eos")
        if "finish: length, 16 tokens" not in r.stdout:
            die(f"moe-client via {svc}: {r.stdout}")
        log(f"moe-client --addr {svc}: 16 tokens\n    " + r.stdout.strip().replace("\n", "\n    "))
        r = cl.exec(c1, "coordinator", "moe-client", "--addr", "127.0.0.1:50051", "--prompt",
                    "Hello", "-n", "16", "--ignore-eos", "--quiet")
        if "finish: length, 16 tokens" not in r.stdout:
            die(f"moe-client via the second coordinator: {r.stdout}")
        log("the second coordinator answers too")
        # only the multi-pod group left routable: it must serve (two ranks, two containers)
        mixed = [p for p in cl.pods if p["name"].startswith(f"{RELEASE}-moe-serve-mixed-")]
        for p in mixed:
            cl.exec(c0, "coordinator", "moectl", "--addr", "127.0.0.1:50051", "workers", "drain", p["name"])
        for i in range(3):
            r = cl.exec(c0, "coordinator", "moe-client", "--addr", svc, "--prompt", f"group {i}",
                        "-n", "32", "--ignore-eos", "--quiet")
            if "finish: length, 32 tokens" not in r.stdout:
                die(f"request with only the two-pod group routable: {r.stdout}")
        log("with both single-pod workers drained (moectl workers drain), the two-pod group "
            "answers 3/3 requests")
        drain_check(cl, c0, svc, group, "drain of the two-pod group (StatefulSet leader)")
        follower = cl.pod(f"{RELEASE}-moe-serve-group-follower-", 0)
        hook_s = cl.prestop(follower, "follower")
        log(f"follower preStop returned in {hook_s:.1f} s (its ranks had left with the group)")
        cl.exec(c0, "coordinator", "moectl", "--addr", "127.0.0.1:50051", "workers", "undrain",
                mixed[0]["name"])
        drain_check(cl, c0, svc, mixed[0], "drain of a single-pod group (Deployment)")
        for c in (c0, c1):
            hook_s = cl.prestop(c, "coordinator")
            done, code = cl.exited(c, "coordinator")
            if not done or code != 0:
                die(f"{c['name']}: coordinator {'exit ' + str(code) if done else 'still running'}")
        log("coordinators: preStop + SIGTERM, exit 0")
        log(f"deploy/podman: PASSED in {time.time() - T0:.0f} s")
        return 0
    finally:
        cl.down()


if __name__ == "__main__":
    sys.exit(main())
