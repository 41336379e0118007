#!/usr/bin/env python3
"""deploy/chart: the Helm chart deploy/helm/moe-serve, checked with Helm's own
engine (helm-python-sdk: Helm v4's Go library, offline) and the Kubernetes
schemas (kubernetes-validate).

  test_chart.py [--bin DIR]     DIR: build/bin, for the flag check (optional)

For every values file in the chart's ci/ folder (CPU, GPU, disaggregated
pools, external etcd, multi-pod groups, everything on) and the defaults,
each rendered with and without the CRDs (LeaderWorkerSet, ServiceMonitor,
MPIJob) among the API versions:
  - helm lint --strict passes;
  - every object validates against the Kubernetes schemas (strict: unknown
    fields fail) of the newest bundled version and of 1.30; objects of CRD
    kinds get their own field check and their pod templates are validated as
    Pods;
  - the objects fit together: selectors match their pods, every process gets
    the same --etcd URLs, probes name the health services the binaries
    register, ports agree, the CRD kinds appear exactly when their CRD does;
  - every flag given to moe-worker / moe-coordinator exists in the built
    binary's --help, except the PENDING ones, which appear only when their
    value turns them on.
Bad values fail at render with a message naming the value.
Exit 77 (SKIPPED) when the Python packages are missing."""
import argparse
import glob
import json
import os
import re
import subprocess
import sys

SKIP = 77
try:
    import helm_python as helm
    import kubernetes_validate
    import yaml
    from helm_python import _native
except ImportError as e:  # pragma: no cover
    print(f"SKIPPED: {e} (python3 -m pip install helm-python-sdk kubernetes-validate)")
    sys.exit(SKIP)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "deploy", "helm", "moe-serve")
NS = "moe"
RELEASE = "demo"
CRDS = [
    "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "kubeflow.org/v2beta1/MPIJob",
]
# Flags the chart passes that the binaries do not have yet (other issues add
# them); each is gated behind a value that defaults to off.
PENDING = {
    "moe-coordinator": {"--http-listen": "coordinator.http.enabled"},
    "moe-worker": {"--metrics-listen": "worker.metrics.enabled"},
}
# Flags that must be there exactly when a value is on (TLS and tokens).
GATED = {
    "moe-coordinator": {"--api-token-file": "auth.enabled", "--admin-token-file": "auth.enabled",
                        "--tls-dir": "tls.enabled", "--tls-server-name": "tls.enabled"},
    "moe-worker": {"--tls-dir": "tls.enabled", "--tls-server-name": "tls.enabled"},
}
# The health service names the binaries register (coordinator_main.c,
# worker/service.c, common/rpc_health.c: "" is the server as a whole).
HEALTH = {"coordinator": {"", "moe.v1.Inference", "moe.v1.Admin"}, "worker": {"", "moe.v1.Worker"}}

failures = []


def fail(case, msg):
    failures.append(f"[{case}] {msg}")


def render(chart, values, api_versions, kube_version="v1.33.0"):
    opts = {"name": RELEASE, "namespace": NS, "api_versions": api_versions,
            "kube_version": kube_version, "is_install": True}
    out = json.loads(_native.call_string("helm_render", chart._raw(),
                                         json.dumps(values) if values is not None else None,
                                         json.dumps(opts)))
    objs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objs.append((path, doc))
    return objs, out


def pod_specs(obj):
    """(label, pod template) of every pod an object makes."""
    k, s = obj["kind"], obj.get("spec", {})
    if k in ("Deployment", "StatefulSet", "Job"):
        return [(k, s["template"])]
    if k == "LeaderWorkerSet":
        t = s["leaderWorkerTemplate"]
        return [("leader", t["leaderTemplate"]), ("worker", t["workerTemplate"])]
    if k == "MPIJob":
        return [(r, spec["template"]) for r, spec in s["mpiReplicaSpecs"].items()]
    return []


def check_fields(case, where, d, allowed, required=()):
    if not isinstance(d, dict):
        fail(case, f"{where}: not an object")
        return
    for key in d:
        if key not in allowed:
            fail(case, f"{where}: unknown field '{key}'")
    for key in required:
        if key not in d:
            fail(case, f"{where}: missing '{key}'")


def validate_crd_object(case, obj):
    """The fields of the CRD kinds, as their Go API types define them
    (leaderworkerset.x-k8s.io/v1, kubeflow.org/v2beta1, monitoring.coreos.com/v1)."""
    k, s, name = obj["kind"], obj.get("spec", {}), obj["metadata"]["name"]
    w = f"{k} {name}"
    if k == "LeaderWorkerSet":
        check_fields(case, w + " spec", s, {"replicas", "leaderWorkerTemplate", "rolloutStrategy",
                                            "startupPolicy", "networkConfig"},
                     ["leaderWorkerTemplate"])
        t = s["leaderWorkerTemplate"]
        check_fields(case, w + " leaderWorkerTemplate", t,
                     {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                      "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"},
                     ["workerTemplate"])
        if t.get("restartPolicy") not in (None, "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                          "None", "Default"):
            fail(case, f"{w}: restartPolicy {t.get('restartPolicy')}")
        if s.get("startupPolicy") not in (None, "LeaderCreated", "LeaderReady"):
            fail(case, f"{w}: startupPolicy {s.get('startupPolicy')}")
        ro = s.get("rolloutStrategy", {})
        check_fields(case, w + " rolloutStrategy", ro, {"type", "rollingUpdateConfiguration"})
        check_fields(case, w + " rollingUpdateConfiguration", ro.get("rollingUpdateConfiguration", {}),
                     {"partition", "maxUnavailable", "maxSurge"})
        check_fields(case, w + " networkConfig", s.get("networkConfig", {}), {"subdomainPolicy"})
        if not isinstance(t.get("size"), int) or t["size"] < 1:
            fail(case, f"{w}: size {t.get('size')}")
    elif k == "MPIJob":
        check_fields(case, w + " spec", s, {"slotsPerWorker", "runPolicy", "mpiReplicaSpecs",
                                            "sshAuthMountPath", "waitForWorkers", "mpiImplementation",
                                            "runLauncherAsWorker", "launcherCreationPolicy"},
                     ["mpiReplicaSpecs"])
        check_fields(case, w + " runPolicy", s.get("runPolicy", {}),
                     {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                      "backoffLimit", "schedulingPolicy", "suspend", "managedBy"})
        if s.get("mpiImplementation") not in (None, "OpenMPI", "Intel", "MPICH"):
            fail(case, f"{w}: mpiImplementation {s.get('mpiImplementation')}")
        for r, spec in s["mpiReplicaSpecs"].items():
            if r not in ("Launcher", "Worker"):
                fail(case, f"{w}: replica type {r}")
            check_fields(case, f"{w} {r}", spec, {"replicas", "template", "restartPolicy"}, ["template"])
            if spec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never", "ExitCode"):
                fail(case, f"{w} {r}: restartPolicy {spec.get('restartPolicy')}")
        if s["mpiReplicaSpecs"].get("Launcher", {}).get("replicas") != 1:
            fail(case, f"{w}: the Launcher needs replicas 1")
    elif k == "ServiceMonitor":
        check_fields(case, w + " spec", s, {"selector", "namespaceSelector", "endpoints", "jobLabel",
                                            "targetLabels", "podTargetLabels", "sampleLimit"},
                     ["selector", "endpoints"])
        for ep in s["endpoints"]:
            check_fields(case, w + " endpoint", ep, {"port", "path", "interval", "scheme",
                                                      "scrapeTimeout", "relabelings",
                                                      "metricRelabelings", "honorLabels"})
    else:
        fail(case, f"{w}: no check for kind {k}")
    for label, tmpl in pod_specs(obj):
        validate_pod_template(case, f"{w} {label}", tmpl)


KV = kubernetes_validate.latest_version()
VERSIONS = [KV, "1.30.0"]


def validate_pod_template(case, where, tmpl):
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": dict(tmpl.get("metadata", {}), name="x"), "spec": tmpl["spec"]}
    for v in VERSIONS:
        try:
            kubernetes_validate.validate(pod, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(case, f"{where} (as a Pod, Kubernetes {v}): {e.message} at {list(e.path)}")


def validate_object(case, obj):
    if obj["apiVersion"] in ("leaderworkerset.x-k8s.io/v1", "kubeflow.org/v2beta1",
                             "monitoring.coreos.com/v1"):
        validate_crd_object(case, obj)
        return
    for v in VERSIONS:
        try:
            kubernetes_validate.validate(obj, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(case, f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {v}): {e.message} "
                       f"at {'/'.join(map(str, e.path))}")
        except kubernetes_validate.SchemaNotFoundError as e:
            fail(case, f"{obj['kind']}: no schema ({e})")


def help_flags(bindir, binary):
    out = subprocess.run([os.path.join(bindir, binary), "--help"], capture_output=True, text=True,
                         timeout=30).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


def get(values, dotted):
    for part in dotted.split("."):
        values = values.get(part, {}) if isinstance(values, dict) else {}
    return values is True


def process_args(container):
    """(binary, [flags]) of a container that runs moe-coordinator or moe-worker."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    for binary in ("moe-coordinator", "moe-worker"):
        if binary in argv:
            rest = argv[argv.index(binary) + 1:]
            return binary, rest
    return None, []


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def check_semantics(case, objs, values, with_crds, flags):
    by_kind = {}
    for _, o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    merged = values
    pools = merged["pools"]
    multi = [p for p in pools if p.get("podsPerGroup", 1) > 1]
    # CRD kinds exactly when the CRD is there (and the values ask for them)
    lws = by_kind.get("LeaderWorkerSet", [])
    if with_crds and len(lws) != len(multi):
        fail(case, f"{len(multi)} multi-pod pools but {len(lws)} LeaderWorkerSets")
    if not with_crds and lws:
        fail(case, "a LeaderWorkerSet without its CRD")
    sts_names = {o["metadata"]["name"] for o in by_kind.get("StatefulSet", [])}
    for p in multi:
        fb = f"{RELEASE}-moe-serve-{p['name']}"
        if not with_crds and not {fb, fb + "-follower"} <= sts_names:
            fail(case, f"pool {p['name']}: no leader/follower StatefulSets without the LWS CRD")
    sm = by_kind.get("ServiceMonitor", [])
    if not with_crds and sm:
        fail(case, "a ServiceMonitor without its CRD")
    has_target = merged["coordinator"]["http"]["enabled"] or merged["worker"]["metrics"]["enabled"] \
        or not merged["etcd"]["external"]["endpoints"]
    if with_crds and merged["metrics"]["serviceMonitor"]["enabled"] and has_target and not sm:
        fail(case, "no ServiceMonitor although the CRD exists")
    bench = merged["benchmark"]
    if bench["enabled"]:
        want = "MPIJob" if (bench["kind"] == "mpijob" or (bench["kind"] == "auto" and with_crds)) else "Job"
        if not by_kind.get(want):
            fail(case, f"benchmark: no {want}")
    # Services select pods that exist, on ports the pods have
    pods = []  # (owner, template)
    for _, o in objs:
        for label, t in pod_specs(o):
            pods.append((f"{o['kind']} {o['metadata']['name']} {label}", t))
    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector", {})
        matched = [t for _, t in pods
                   if all(t["metadata"]["labels"].get(k) == v for k, v in sel.items())]
        if not matched:
            fail(case, f"Service {svc['metadata']['name']} selects no pod")
        for port in svc["spec"]["ports"]:
            tp = port.get("targetPort", port["port"])
            for t in matched:
                names = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
                nums = {p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
                if tp not in names and tp not in nums and t["metadata"]["labels"].get(
                        "moe-serve.io/group-role") != "follower":
                    fail(case, f"Service {svc['metadata']['name']}: port {tp} not on its pods")
    for kind in ("Deployment", "StatefulSet"):
        for o in by_kind.get(kind, []):
            sel = o["spec"]["selector"]["matchLabels"]
            labels = o["spec"]["template"]["metadata"]["labels"]
            if any(labels.get(k) != v for k, v in sel.items()):
                fail(case, f"{kind} {o['metadata']['name']}: selector does not match its template")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"]["matchLabels"]
        if not any(all(t["metadata"]["labels"].get(k) == v for k, v in sel.items()) for _, t in pods):
            fail(case, f"PodDisruptionBudget {pdb['metadata']['name']} selects no pod")
    # every process: same etcd URLs, known flags, probes on registered services
    etcd_urls = set()
    ext = merged["etcd"]["external"]["endpoints"]
    if ext:
        expect_etcd = ",".join(ext)
    else:
        n = merged["etcd"]["replicas"]
        expect_etcd = ",".join(
            f"http://{RELEASE}-moe-serve-etcd-{i}.{RELEASE}-moe-serve-etcd-headless.{NS}.svc."
            f"cluster.local:{merged['etcd']['clientPort']}" for i in range(n))
        if len(by_kind.get("StatefulSet", [])) < 1 or not any(
                o["metadata"]["name"].endswith("-etcd") for o in by_kind["StatefulSet"]):
            fail(case, "no etcd StatefulSet")
    n_servers = {"moe-coordinator": 0, "moe-worker": 0}
    for owner, t in pods:
        for c in t["spec"]["containers"]:
            binary, argv = process_args(c)
            if not binary:
                continue
            n_servers[binary] += 1
            etcd_urls.add(flag_value(argv, "--etcd"))
            used = {a for a in argv if a.startswith("--")}
            if flags:
                for f in sorted(used - flags[binary]):
                    gate = PENDING[binary].get(f)
                    if not gate:
                        fail(case, f"{owner}: {binary} has no flag {f}")
                    elif not get(merged, gate):
                        fail(case, f"{owner}: pending flag {f} passed although {gate} is off")
            for f, gate in PENDING[binary].items():
                if f in used and not get(merged, gate):
                    fail(case, f"{owner}: pending flag {f} without {gate}")
            for f, gate in GATED[binary].items():
                if (f in used) != bool(get(merged, gate)):
                    fail(case, f"{owner}: flag {f} {'passed' if f in used else 'missing'} "
                               f"with {gate} = {get(merged, gate)}")
            comp = "coordinator" if binary == "moe-coordinator" else "worker"
            port = int(flag_value(argv, "--listen").rsplit(":", 1)[1])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                pr = c.get(probe)
                if pr and "exec" in pr and get(merged, "tls.enabled"):
                    # TLS: `moectl --addr 127.0.0.1:PORT --tls-dir D ... health SERVICE`
                    cmd = pr["exec"]["command"]
                    if cmd[0] != "moectl" or "health" not in cmd or "--tls-dir" not in cmd:
                        fail(case, f"{owner}: {probe} is not a moectl health probe: {cmd}")
                        continue
                    pr = {"grpc": {"port": int(flag_value(cmd, "--addr").rsplit(":", 1)[1]),
                                   "service": cmd[cmd.index("health") + 1]}}
                if not pr or "grpc" not in pr:
                    fail(case, f"{owner}: {probe} is neither a gRPC probe nor (TLS) moectl health")
                    continue
                if pr["grpc"]["port"] != port:
                    fail(case, f"{owner}: {probe} on port {pr['grpc']['port']}, listens on {port}")
                if pr["grpc"].get("service", "") not in HEALTH[comp]:
                    fail(case, f"{owner}: {probe} asks for health service "
                               f"'{pr['grpc'].get('service')}' that {binary} does not register")
            if comp == "worker":
                if c["lifecycle"]["preStop"]["exec"]["command"][:2] != ["moe-prestop", "worker"]:
                    fail(case, f"{owner}: no draining preStop")
                grace = t["spec"]["terminationGracePeriodSeconds"]
                if grace <= int(flag_value(argv, "--drain-timeout")):
                    fail(case, f"{owner}: terminationGracePeriodSeconds {grace} <= drain timeout")
                env = {e["name"] for e in c.get("env", [])}
                for ref in re.findall(r"\$\((\w+)\)", " ".join(argv)):
                    if ref not in env:
                        fail(case, f"{owner}: $({ref}) used but not in the container's env")
    if etcd_urls != {expect_etcd}:
        fail(case, f"--etcd differs between processes or from the etcd members: {etcd_urls}")
    want_workers = len(pools)
    if n_servers["moe-worker"] != want_workers or n_servers["moe-coordinator"] != 1:
        fail(case, f"server containers: {n_servers}, expected {want_workers} worker templates")
    # GPU pools ask for their GPUs; NetworkPolicy covers workers (and etcd)
    for o in by_kind.get("Deployment", []) + by_kind.get("StatefulSet", []) + lws:
        for label, t in pod_specs(o):
            for c in t["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                g = int(env.get("MOE_GPUS_PER_RANK", "0") or 0)
                lim = c.get("resources", {}).get("limits", {})
                if g and "nvidia.com/gpu" not in lim:
                    fail(case, f"{o['metadata']['name']}: GPU pool without nvidia.com/gpu")
                if not g and "nvidia.com/gpu" in lim:
                    fail(case, f"{o['metadata']['name']}: CPU pool asks for GPUs")
    if merged["networkPolicy"]["enabled"]:
        comps = {np_["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                 for np_ in by_kind.get("NetworkPolicy", [])}
        if "worker" not in comps or (not ext and "etcd" not in comps):
            fail(case, f"NetworkPolicy covers {comps}")
        for np_ in by_kind.get("NetworkPolicy", []):
            peer = np_["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
            if peer.get("app.kubernetes.io/instance") != RELEASE or "ports" in np_["spec"]["ingress"][0]:
                fail(case, f"NetworkPolicy {np_['metadata']['name']}: first rule is not 'any port "
                           "from this release'")
    # Secrets from values never carry a token or a TLS key: the chart makes
    # the group ssh key, and the TLS / token Secrets only when no secretName
    # is given (generated once, kept)
    generated = {f"{RELEASE}-moe-serve-tls": ("kubernetes.io/tls", "tls"),
                 f"{RELEASE}-moe-serve-auth": ("Opaque", "auth")}
    for s in by_kind.get("Secret", []):
        name = s["metadata"]["name"]
        if s.get("type") == "kubernetes.io/ssh-auth":
            continue
        kind, key = generated.get(name, (None, None))
        if s.get("type") != kind or not get(merged, key + ".enabled") or \
                get(merged, key + ".secretName"):
            fail(case, f"Secret {name}: the chart makes only the ssh key and, without a "
                       f"secretName, the TLS and token Secrets")
        elif s["metadata"].get("annotations", {}).get("helm.sh/resource-policy") != "keep":
            fail(case, f"Secret {name}: generated but not kept across upgrades")
        elif kind == "Opaque" and set(s.get("data", {})) != {"token", "admin-token"}:
            fail(case, f"Secret {name}: keys {sorted(s.get('data', {}))}")
    # placement ConfigMap: valid JSON with the pool's rank count
    for cm in by_kind.get("ConfigMap", []):
        if cm["metadata"]["name"].endswith("-placement"):
            for key, text in cm["data"].items():
                pl = json.loads(text)
                pool = next(p for p in pools if f"{p['name']}.json" == key)
                if pl.get("n_rank") != pool.get("ranksPerGroup", 1):
                    fail(case, f"placement {key}: n_rank {pl.get('n_rank')}")


BAD = [
    ({"pools": [{"name": "a", "role": "both"}]}, "/pools/0/role"),
    ({"pools": [{"name": "Bad_Name"}]}, "/pools/0/name"),
    ({"pools": [{"name": "a", "ranksPerGroup": 0}]}, "/pools/0/ranksPerGroup"),
    ({"pools": [{"name": "a", "gpusPerRank": -1}]}, "/pools/0/gpusPerRank"),
    ({"pools": [{"name": "a", "replicas": "two"}]}, "/pools/0/replicas"),
    ({"pools": [{"name": "a", "ranksPerGroup": 6, "podsPerGroup": 4}]}, "pools[0].ranksPerGroup (6)"),
    ({"pools": [{"name": "a", "ranksPerGroup": 4, "tp": 3}]}, "pools[0].tp (3)"),
    ({"pools": [{"name": "a", "ranksPerGroup": 2, "tp": 2, "dpAttention": True}]},
     "pools[0].dpAttention needs ranksPerGroup (2) > tp (2)"),
    ({"pools": [{"name": "a", "dpAttention": True}]}, "ranksPerGroup (1) > tp (1)"),
    ({"pools": [{"name": "a", "ranksPerGroup": 2, "dpAttention": "yes"}]}, "/pools/0/dpAttention"),
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "pools[1].name"),
    ({"pools": [{"name": "p", "role": "prefill"}]}, "role prefill needs a pool with role decode"),
    ({"pools": [{"name": "a", "ranksPerGroup": 2, "placement": {"n_rank": 4, "experts": [[0]]}}]},
     "pools[0].placement.n_rank (4)"),
    ({"pools": [{"name": "a", "placement": {"experts": [[0]]}}]}, "/pools/0/placement"),
    ({"pools": [{"name": "a", "resources": {"limits": {"memory": "lots"}}}]},
     "/pools/0/resources/limits/memory"),
    ({"pools": []}, "/pools"),
    ({"etcd": {"replicas": 2}}, "/etcd/replicas"),
    ({"etcd": {"external": {"endpoints": ["etcd:2379"]}}}, "/etcd/external/endpoints/0"),
    ({"etcd": {"image": {"repository": "quay.io/coreos/etcd"}}}, "etcd.image.tag"),
    ({"coordinator": {"replcas": 3}}, "'replcas'"),
    ({"coordinator": {"grpcPort": 70000}}, "/coordinator/grpcPort"),
    ({"worker": {"dtype": "fp8"}}, "/worker/dtype"),
    ({"worker": {"drainTimeoutSeconds": 120}}, "worker.terminationGracePeriodSeconds (90)"),
    ({"model": {"path": "models/x"}}, "/model/path"),
    ({"model": {"path": "/opt/m", "volume": {"emptyDir": {}}}}, "model.path (/opt/m)"),
    ({"benchmark": {"enabled": True, "backend": "openai"}, "coordinator": {"http": {"enabled": False}}},
     "benchmark.backend"),
    ({"benchmark": {"enabled": True, "kind": "mpijob"}}, "benchmark.kind"),
    ({"benchmark": {"kind": "slurm"}}, "/benchmark/kind"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
]


def readme_lists_every_value(defaults):
    with open(os.path.join(CHART, "README.md")) as f:
        text = f.read()
    keys = []

    def walk(prefix, d):
        for k, v in d.items():
            path = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and v and path not in ("coordinator.resources", "etcd.resources",
                                                          "benchmark.resources", "podSecurityContext",
                                                          "containerSecurityContext",
                                                          "metrics.dashboard.labels"):
                walk(path, v)
            else:
                keys.append(path)
    walk("", defaults)
    for p in defaults["pools"][0]:
        keys.append(f"pools[].{p}")
    for k in ("pools[].podsPerGroup", "pools[].device", "pools[].dtype", "pools[].threads",
              "pools[].kvMemoryMiB", "pools[].extraArgs", "pools[].env", "pools[].podAnnotations"):
        keys.append(k)
    for k in sorted(set(keys)):
        if f"`{k}`" not in text:
            fail("README", f"deploy/helm/moe-serve/README.md does not list `{k}`")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", help="build/bin with moe-worker and moe-coordinator (flag check)")
    a = ap.parse_args()
    flags = None
    if a.bin:
        flags = {b: help_flags(a.bin, b) | {"--help"} for b in ("moe-coordinator", "moe-worker")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "deploy", "gen_schema.py"),
                        "--check"], capture_output=True, text=True)
    if r.returncode:
        fail("schema", r.stderr.strip() or r.stdout.strip())

    chart = helm.Chart.load(CHART)
    defaults = chart.values
    readme_lists_every_value(defaults)
    cases = [("defaults", {})]
    for f in sorted(glob.glob(os.path.join(CHART, "ci", "*.yaml"))):
        with open(f) as fh:
            cases.append((os.path.basename(f), yaml.safe_load(fh) or {}))
    n_objs = 0
    kinds = set()
    for name, values in cases:
        lint = helm.lint(CHART, values, strict=True, kube_version="v1.33.0")
        for m in lint["messages"]:
            if m["severity"] >= 2:
                fail(name, f"helm lint: {m['path']}: {m['error']}")
        for e in lint["errors"]:
            fail(name, f"helm lint: {e}")
        merged = chart.merge_values(values)
        for with_crds in (False, True):
            case = f"{name}{' +CRDs' if with_crds else ''}"
            try:
                objs, _ = render(chart, values, CRDS if with_crds else [])
            except helm.HelmError as e:
                fail(case, f"render: {e}")
                continue
            for _, o in objs:
                validate_object(case, o)
                kinds.add(o["kind"])
            n_objs += len(objs)
            check_semantics(case, objs, merged, with_crds, flags)
    for values, needle in BAD:
        try:
            render(chart, values, [])
            fail("bad values", f"{json.dumps(values)} rendered; expected an error naming {needle}")
        except helm.HelmError as e:
            if needle not in str(e):
                fail("bad values", f"{json.dumps(values)}: error does not name {needle}: {e}")
    print(f"deploy/chart: {len(cases)} values cases x 2 API sets, {n_objs} objects of "
          f"{len(kinds)} kinds ({', '.join(sorted(kinds))}) validated against Kubernetes "
          f"{' and '.join(VERSIONS)}; {len(BAD)} bad values rejected"
          f"{'; flags checked against ' + a.bin if a.bin else ''}")
    if failures:
        print(f"{len(failures)} FAILURES:")
        for f in failures:
            print("  " + f)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
