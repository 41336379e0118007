#!/usr/bin/env python3
"""Writes deploy/helm/moe-serve/values.schema.json (run after changing the
values; tests/deploy/test_chart.py checks the committed file is current).

The schema is built here rather than by hand so that every object level gets
additionalProperties: false (a misspelt key fails at `helm install` naming
it) and the shared shapes (images, resources, probes of pools) stay the same
everywhere."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "deploy", "helm", "moe-serve", "values.schema.json")


def obj(props, required=(), **kw):
    d = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        d["required"] = list(required)
    d.update(kw)
    return d


def integer(lo=None, hi=None, **kw):
    d = {"type": "integer"}
    if lo is not None:
        d["minimum"] = lo
    if hi is not None:
        d["maximum"] = hi
    d.update(kw)
    return d


def string(**kw):
    return dict({"type": "string"}, **kw)


BOOL = {"type": "boolean"}
PORT = integer(1, 65535)
ANY_OBJ = {"type": "object"}  # Kubernetes objects: checked by the API server's own schema
LIST_OF_OBJ = {"type": "array", "items": {"type": "object"}}
STR_LIST = {"type": "array", "items": {"type": "string"}}
QUANTITY = {"anyOf": [{"type": "string", "pattern": r"^[0-9.]+([eE][0-9]+|[numkMGTPE]i?)?$"},
                      {"type": "number", "minimum": 0}]}
RESOURCES = obj({
    "requests": {"type": "object", "additionalProperties": QUANTITY},
    "limits": {"type": "object", "additionalProperties": QUANTITY},
    "claims": LIST_OF_OBJ,
})
PULL = string(enum=["Always", "IfNotPresent", "Never"])
IMAGE = obj({"repository": string(minLength=1), "tag": string(), "pullPolicy": PULL},
            required=["repository"])
PDB_MIN = {"anyOf": [integer(0), string(pattern=r"^[0-9]+%$")]}
DEVICE = string(enum=["auto", "cpu", "cuda"])
DTYPE = string(enum=["f32", "bf16", "int8", "int4"])
KV_DTYPE = string(enum=["auto", "bf16", "f32"])
ENV = {"type": "array", "items": {"type": "object", "required": ["name"],
                                  "properties": {"name": string(minLength=1)}}}
DNS_NAME = string(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", maxLength=63)

PLACEMENT = {
    "type": "object",
    "description": "moe-worker --placement JSON (worker/placement.h); {} = even split",
    "additionalProperties": False,
    "properties": {
        "n_rank": integer(1),
        "experts": {"type": "array", "minItems": 1,
                    "items": {"type": "array", "minItems": 1, "items": integer(0)}},
        "layers": {"type": "object",
                   "additionalProperties": {"type": "array", "items": {
                       "type": "array", "minItems": 1, "items": integer(0)}}},
    },
    "dependentRequired": {"experts": ["n_rank"], "layers": ["n_rank"]},
}

POOL = obj({
    "name": string(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", maxLength=15,
                   description="lower-case DNS label, at most 15 characters (object names)"),
    "role": string(enum=["mixed", "prefill", "decode"]),
    "replicas": integer(0),
    "ranksPerGroup": integer(1, 1024),
    "podsPerGroup": integer(1, 1024),
    "tp": integer(1, 1024),
    "dpAttention": BOOL,
    "gpusPerRank": integer(0, 16),
    "device": DEVICE,
    "dtype": DTYPE,
    "kvDtype": KV_DTYPE,
    "specTokens": integer(0, 16),
    "draftModel": string(),
    "threads": integer(0, 1024),
    "kvMemoryMiB": integer(1),
    "resources": RESOURCES,
    "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
    "tolerations": LIST_OF_OBJ,
    "affinity": ANY_OBJ,
    "placement": PLACEMENT,
    "extraArgs": STR_LIST,
    "env": ENV,
    "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
}, required=["name"])

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "moe-serve chart values",
    **obj({
        "image": IMAGE,
        "cudaImage": IMAGE,
        "imagePullSecrets": LIST_OF_OBJ,
        "nameOverride": string(maxLength=24),
        "fullnameOverride": string(maxLength=24),
        "clusterDomain": string(minLength=1),
        "serviceAccount": obj({"create": BOOL, "name": string(), "annotations": ANY_OBJ}),
        "podSecurityContext": ANY_OBJ,
        "containerSecurityContext": ANY_OBJ,
        "model": obj({"path": string(pattern=r"^/"), "volume": ANY_OBJ,
                      "mountPath": string(pattern=r"^/")}, required=["path"]),
        "coordinator": obj({
            "replicas": integer(0),
            "grpcPort": PORT,
            "http": obj({"enabled": BOOL, "port": PORT}),
            "maxQueue": integer(1, 1 << 20),
            "threads": integer(1, 64),
            "pollMs": integer(10, 60000),
            "graceSeconds": integer(0, 3600),
            "expertSlots": integer(0, 32767),
            "preStopSeconds": integer(0, 3600),
            "terminationGracePeriodSeconds": integer(1),
            "extraArgs": STR_LIST,
            "env": ENV,
            "resources": RESOURCES,
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": LIST_OF_OBJ,
            "affinity": ANY_OBJ,
            "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "service": obj({"type": string(enum=["ClusterIP", "NodePort", "LoadBalancer"]),
                            "annotations": ANY_OBJ}),
            "pdb": obj({"enabled": BOOL, "minAvailable": PDB_MIN}),
            "hpa": obj({"enabled": BOOL, "minReplicas": integer(1), "maxReplicas": integer(1),
                        "targetCPUUtilizationPercentage": integer(1, 100)}),
        }),
        "worker": obj({
            "grpcPort": PORT,
            "metrics": obj({"enabled": BOOL, "port": PORT}),
            "device": DEVICE,
            "dtype": DTYPE,
            "kvDtype": KV_DTYPE,
            "specTokens": integer(0, 16),
            "draftModel": string(),
            "threads": integer(0, 1024),
            "kvMemoryMiB": integer(1),
            "leaseTTLSeconds": integer(2, 3600),
            "drainTimeoutSeconds": integer(0, 86400),
            "terminationGracePeriodSeconds": integer(1),
            "mpirunArgs": STR_LIST,
            "shmSizeLimit": QUANTITY,
            "startupTimeoutSeconds": integer(5),
            "groupWaitSeconds": integer(1),
            "extraArgs": STR_LIST,
            "env": ENV,
            "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "updateStrategy": ANY_OBJ,
            "pdb": obj({"enabled": BOOL, "maxUnavailable": PDB_MIN}),
        }),
        "pools": {"type": "array", "minItems": 1, "items": POOL},
        "ssh": obj({"existingSecret": string()}),
        "etcd": obj({
            "external": obj({"endpoints": {"type": "array", "items": string(
                pattern=r"^https?://[^/,\s]+(:[0-9]+)?/?$")}}),
            "replicas": {"type": "integer", "enum": [1, 3, 5, 7],
                         "description": "an odd member count: 1, 3, 5 or 7"},
            "image": obj({"repository": string(), "tag": string(), "pullPolicy": PULL}),
            "clientPort": PORT,
            "peerPort": PORT,
            "metricsPort": PORT,
            "heartbeatIntervalMs": integer(1),
            "electionTimeoutMs": integer(1),
            "quotaBackendBytes": integer(0),
            "extraArgs": STR_LIST,
            "persistence": obj({"enabled": BOOL, "size": QUANTITY, "storageClass": string()}),
            "resources": RESOURCES,
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": LIST_OF_OBJ,
            "affinity": ANY_OBJ,
            "pdb": obj({"enabled": BOOL}),
        }),
        "networkPolicy": obj({"enabled": BOOL, "metricsFrom": LIST_OF_OBJ}),
        "metrics": obj({
            "serviceMonitor": obj({"enabled": BOOL, "interval": string(pattern=r"^[0-9]+(ms|s|m|h)$"),
                                   "labels": ANY_OBJ}),
            "dashboard": obj({"enabled": BOOL, "labels": ANY_OBJ}),
        }),
        "auth": obj({"enabled": BOOL, "secretName": string()}),
        "tls": obj({"enabled": BOOL, "secretName": string(), "serverName": string()}),
        "benchmark": obj({
            "enabled": BOOL,
            "kind": string(enum=["auto", "mpijob", "job"]),
            "workers": integer(1),
            "slotsPerWorker": integer(1),
            "backend": string(enum=["grpc", "openai"]),
            "args": STR_LIST,
            "backoffLimit": integer(0),
            "ttlSecondsAfterFinished": integer(0),
            "resources": RESOURCES,
        }),
        "global": ANY_OBJ,
    }),
}

text = json.dumps(SCHEMA, indent=2) + "\n"
if len(sys.argv) > 1 and sys.argv[1] == "--check":
    with open(OUT) as f:
        if f.read() != text:
            sys.exit("values.schema.json is not current: run tests/deploy/gen_schema.py")
    sys.exit(0)
with open(OUT, "w") as f:
    f.write(text)
print("wrote", os.path.relpath(OUT))
