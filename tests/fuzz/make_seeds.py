#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (<target>/corpus/*) from the golden
fixtures and hand-written cases. The output is committed; run this again
(from anywhere) after changing it. Needs only the standard library and
protoc (Debian protobuf-compiler) for the protobuf seeds.

Seeds are small real inputs: the fixtures' own headers, configs,
tokenizers, templates and conversations, the placement records the
coordinator writes, answers as etcd 3.4 sends them, KV link frames as
worker/kv_link.c writes them. Each file is one input of its target in the
format that target's header comment describes."""
import base64
import json
import os
import shutil
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIX = os.path.join(ROOT, "tests", "golden", "fixtures")


def out_dir(target):
    d = os.path.join(HERE, target, "corpus")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    return d


def write(d, name, data):
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def read(rel, mode="r"):
    with open(os.path.join(FIX, rel), mode) as f:
        return f.read()


# ---- safetensors ------------------------------------------------------------------------

DSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def st_file(tensors, metadata=None, pad=0):
    """tensors: [(name, dtype, shape)]; data laid out contiguously (bytes i % 251)."""
    header, off = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = DSIZE[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * pad
    return struct.pack("<Q", len(h)) + h + bytes(i % 251 for i in range(off))


def shrink_header(path, limit):
    """The fixture's real header (names, dtypes, ranks), shapes cut to <= 3."""
    b = read(path, "rb")
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    ts = [(k, v["dtype"], [min(s, 3) for s in v["shape"]]) for k, v in h.items()
          if k != "__metadata__"][:limit]
    return st_file(ts, h.get("__metadata__"))


def seeds_safetensors():
    d = out_dir("safetensors")
    write(d, "qwen3_moe_header.safetensors", shrink_header("qwen3_moe/model.safetensors", 80))
    write(d, "mixtral_shard1_header.safetensors",
          shrink_header("mixtral/model-00001-of-00002.safetensors", 20))
    write(d, "empty_header.safetensors", struct.pack("<Q", 2) + b"{}")
    write(d, "metadata_only.safetensors", st_file([], {"format": "pt"}))
    write(d, "every_dtype.safetensors",
          st_file([("a", "F32", [2, 3]), ("b", "F16", [4]), ("c", "BF16", [1, 1]),
                   ("scalar", "F32", []), ("empty", "F16", [0, 5])], pad=6))
    write(d, "eight_dims.safetensors", st_file([("t", "BF16", [1, 2, 1, 2, 1, 1, 2, 1])]))
    write(d, "unsupported_dtype.safetensors",
          struct.pack("<Q", 58) + b'{"x":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}   '
          + bytes(8))
    write(d, "overlap.safetensors",
          struct.pack("<Q", 103) +
          b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
          b'"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' + bytes(12))


def seeds_safetensors_index():
    d = out_dir("safetensors_index")
    wm = {"a.x": "a.safetensors", "a.y": "a.safetensors", "b.z": "b.safetensors"}
    write(d, "valid.json", json.dumps({"metadata": {"total_size": 24}, "weight_map": wm}))
    write(d, "one_shard.json", json.dumps({"weight_map": {"b.z": "b.safetensors"}}))
    write(d, "wrong_shard.json", json.dumps({"weight_map": {"a.x": "b.safetensors"}}))
    write(d, "outside.json", json.dumps({"weight_map": {"a.x": "../a.safetensors"}}))
    write(d, "mixtral_index.json", read("mixtral/model.safetensors.index.json"))


# ---- config.json ------------------------------------------------------------------------

def seeds_model_config():
    d = out_dir("model_config")
    q = read("qwen3_moe/config.json")
    m = read("mixtral/config.json")
    write(d, "qwen3_moe.json", q)
    write(d, "mixtral.json", m)
    qj = json.loads(q)
    v = dict(qj, eos_token_id=[800, 799], bos_token_id=None, head_dim=None, num_experts=None,
             decoder_sparse_step=2, mlp_only_layers=[])
    write(d, "qwen3_variant.json", json.dumps(v))
    mj = json.loads(m)
    write(d, "mixtral_rope_scaling.json", json.dumps(dict(mj, rope_scaling={"type": "linear"})))
    write(d, "deepseek_v3.json", read("deepseek_v3/config.json"))
    write(d, "deepseek_v3_lite.json", read("deepseek_v3_lite/config.json"))
    write(d, "mixtral_minimal.json", json.dumps({k: mj[k] for k in (
        "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "vocab_size", "num_local_experts", "num_experts_per_tok", "intermediate_size")}))


# ---- tokenizers ---------------------------------------------------------------------------

TOKENIZERS = ["gpt2", "qwen", "llama", "llama_metaspace"]  # the order of fuzz_tokenizer_encode.c


def seeds_tokenizer_json():
    d = out_dir("tokenizer_json")
    for name in TOKENIZERS:
        write(d, name + ".json", read("tokenizers/%s/tokenizer.json" % name))
    tiny = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3},
                      "merges": ["a b"], "byte_fallback": False},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            "decoder": {"type": "ByteLevel"},
            "added_tokens": [{"id": 4, "content": "<s>", "special": True, "lstrip": False,
                              "rstrip": False, "normalized": False, "single_word": False}]}
    write(d, "tiny_bytelevel.json", json.dumps(tiny))


def seeds_tokenizer_encode():
    d = out_dir("tokenizer_encode")
    cases = json.loads(read("tokenizers/cases.json"))
    for t, name in enumerate(TOKENIZERS):
        enc = cases[name]["encode"]
        for i, c in enumerate(enc[::3]):  # a third of the texts, each tokenizer
            flags = t | (4 if i & 1 else 0) | (8 if i & 2 else 0)
            write(d, "%s_text_%02d" % (name, i), bytes([flags]) + c["text"].encode())
        for i, c in enumerate(cases[name].get("decode", [])[:4]):
            ids = b"".join(struct.pack("<H", x) for x in c["ids"])
            write(d, "%s_ids_%02d" % (name, i), bytes([t | 16 | (8 if i & 1 else 0)]) + ids)
    write(d, "invalid_utf8", bytes([0]) + b"ok \xc3\x28 \xed\xa0\x80 \xf4\x90\x80\x80")


# ---- chat templates ------------------------------------------------------------------------

def seeds_chat_template():
    d = out_dir("chat_template")
    expected = json.loads(read("chat_templates/expected.json"))["cases"]
    seen = set()
    for c in expected:  # each template with each conversation shape once
        key = (c["template"], c["conversation"])
        if key in seen or len(seen) >= 40:
            continue
        seen.add(key)
        src = read("chat_templates/" + c["template"])
        var = {k: c[k] for k in ("messages", "add_generation_prompt", "bos_token", "eos_token",
                                 "extra") if k in c}
        name = "%s_%s" % (c["template"].split(".")[0], c["conversation"])
        write(d, name, src.encode() + b"\0" + json.dumps(var, ensure_ascii=False).encode())
    write(d, "mixtral_template", read("mixtral/chat_template.jinja"))
    qcfg = json.loads(read("qwen3_moe/tokenizer_config.json"))
    if isinstance(qcfg.get("chat_template"), str):
        write(d, "qwen3_tokenizer_config_template", qcfg["chat_template"])
    fuzz = json.loads(read("chat_templates/fuzz.json"))["cases"]
    for i, c in enumerate(fuzz[:60]):
        var = {k: c[k] for k in ("messages", "add_generation_prompt", "bos_token", "eos_token",
                                 "extra") if k in c}
        write(d, "fuzz_%03d" % i,
              c["template"].encode() + b"\0" + json.dumps(var, ensure_ascii=False).encode())
    # raw message bytes after the NUL: role/flag byte, content, 0x01 separators
    write(d, "raw_messages",
          b"{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}"
          b"{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}"
          b"{% if add_generation_prompt %}assistant:{% endif %}\0"
          b"\x80system text\x01\x01user \xff\xfe bytes\x01\x0eassistant calls\x01\x03tool out")
    write(d, "limits", "{% for i in range(100000) %}{% for j in range(20) %}{{ j }}"
          "{% endfor %}{% endfor %}")


# ---- placement JSON -----------------------------------------------------------------------

def shape_byte(n_rank, n_layer, n_expert_log2, apply=False):
    return bytes([(n_rank - 1) | ((n_layer - 1) << 3) | (n_expert_log2 << 5) | (0x80 if apply else 0)])


def placement_map(n_rank, n_layer, n_expert, layers=True):
    base = [[e * n_rank // n_expert] for e in range(n_expert)]
    m = {"n_rank": n_rank, "experts": base}
    if layers:
        lay = {}
        for l in range(n_layer):
            lst = [list(r) for r in base]
            if n_rank > 1:
                lst[l % n_expert] = sorted({lst[l % n_expert][0], (lst[l % n_expert][0] + 1) % n_rank})
            lay[str(l)] = lst
        m["layers"] = lay
    return m


def seeds_placement():
    d = out_dir("placement")
    for n_rank, n_layer, lg in ((2, 3, 3), (1, 1, 0), (4, 2, 2), (8, 4, 3)):
        m = placement_map(n_rank, n_layer, 1 << lg)
        write(d, "r%d_l%d_e%d" % (n_rank, n_layer, 1 << lg),
              shape_byte(n_rank, n_layer, lg) + json.dumps(m).encode())
    write(d, "experts_only", shape_byte(2, 1, 3) +
          json.dumps({"n_rank": 2, "experts": [[0], [0], [0], [0], [0], [1], [1], [1]]}).encode())
    write(d, "replicated", shape_byte(2, 1, 2) +
          json.dumps({"n_rank": 2, "experts": [[0, 1], [0], [1], [1, 0]]}).encode())


def seeds_coord_placement():
    d = out_dir("coord_placement")
    m0 = placement_map(2, 3, 8)
    m1 = placement_map(2, 3, 8, layers=True)
    m1["layers"]["1"][3] = [0, 1]
    rec = {"epoch": 4, "slots_per_rank": 8, "placement": m1,
           "previous": {"epoch": 3, "placement": m0}}
    write(d, "record_r2_l3_e8", shape_byte(2, 3, 3) + json.dumps(rec).encode())
    write(d, "record_first", shape_byte(4, 2, 2) +
          json.dumps({"epoch": 1, "slots_per_rank": 2, "placement": placement_map(4, 2, 4)}).encode())
    write(d, "record_absent", shape_byte(1, 1, 0))
    write(d, "apply_r2_l3_e8", shape_byte(2, 3, 3, True) + json.dumps(m1).encode())
    write(d, "apply_wrapped", shape_byte(4, 1, 2, True) +
          json.dumps({"epoch": 2, "placement": placement_map(4, 1, 4)}).encode())
    write(d, "apply_experts_only", shape_byte(8, 4, 3, True) +
          json.dumps({"n_rank": 8, "experts": [[e] for e in range(8)]}).encode())


# ---- KV link frames ------------------------------------------------------------------------

KV_LINK_MAGIC = 0x4B454F4D
EXPECT, FORGET, ORDER, SLICE, STATUS = 1, 2, 3, 4, 5


def i32(v):
    return struct.pack("<i", v)


def u64(v):
    return struct.pack("<Q", v)


def kstr(s):
    s = s.encode()
    return i32(len(s)) + s


def ints(v):
    return i32(len(v)) + b"".join(i32(x) for x in v)


def frame(t, body):
    return struct.pack("<III", KV_LINK_MAGIC, t, len(body)) + body


def seeds_kv_link():
    d = out_dir("kv_link")
    write(d, "expect", frame(EXPECT, kstr("h1") + i32(23) + i32(3000) + ints([4, 9, 2, 7, 11, 30])))
    write(d, "forget", frame(FORGET, kstr("h1")))
    targets = kstr("127.0.0.1:40001") + i32(0) + i32(2) + kstr("127.0.0.1:40002") + i32(2) + i32(4)
    write(d, "order", frame(ORDER, kstr("h1") + i32(23) + i32(5000) + ints([0, 1, 2]) + i32(4) +
                            ints([4, 9, 2, 7, 11, 30]) + i32(2) + targets))
    # n_layer, d_head, kv_dtype (0 F32, 2 BF16), head_begin, head_end, n_tokens, dst_block_size
    write(d, "slice", frame(SLICE, kstr("h1") + i32(3) + i32(8) + i32(0) + i32(0) + i32(2) + i32(23) +
                            i32(4) + ints([4, 9, 2, 7, 11, 30]) + i32(0) + i32(0) + bytes(128) +
                            kstr("127.0.0.1:40003")))
    write(d, "slice_nccl", frame(SLICE, kstr("h2") + i32(3) + i32(8) + i32(2) + i32(2) + i32(4) + i32(5) +
                                 i32(16) + ints([1]) + i32(1) + i32(1) + bytes(range(128)) +
                                 kstr("10.0.0.2:40003")))
    write(d, "status_ok", frame(STATUS, i32(0) + u64(4416) + i32(1) + kstr("")))
    write(d, "status_refused", frame(STATUS, i32(3) + u64(0) + i32(0) +
                                     kstr("handoff h1 is not expected here (released or expired)")))
    write(d, "bad_magic", struct.pack("<III", 0x12345678, EXPECT, 4) + kstr(""))


def seeds_kv_link_server():
    """Inputs of fuzz_kv_link_server.c: byte 0 the type (0 EXPECT, 1 FORGET, 2 ORDER,
    3 SLICE, 6 STATUS, 7 unknown), a 16-bit body length, the body, then the payload; its
    endpoint expects handoff "h" in blocks 1, 3, 5 (10 tokens of a 2-layer cache with 2 KV
    heads of 4, blocks of 4)."""
    d = out_dir("kv_link_server")

    def msg(t, body, payload=b""):
        return bytes([t]) + struct.pack("<H", len(body)) + body + payload

    blocks = [1, 3, 5]
    per = 10 * 2 * 4 * 4  # tokens x heads x d_head x sizeof(float), per layer and kind
    payload = bytes(range(256)) * (per * 4 // 256 + 1)

    def slice_hdr(hid, hb, he, dtype=0):
        return kstr(hid) + i32(2) + i32(4) + i32(dtype) + i32(hb) + i32(he) + i32(10) + i32(4) + \
            ints(blocks) + i32(0) + i32(0) + bytes(128) + kstr("127.0.0.1:1")

    write(d, "slice_h", msg(3, slice_hdr("h", 0, 2), payload[:per * 4]))
    write(d, "slice_h_short_payload", msg(3, slice_hdr("h", 0, 2), payload[:per + 7]))
    write(d, "slice_h_one_head", msg(3, slice_hdr("h", 1, 2), payload[:per * 2]))
    write(d, "slice_unknown", msg(3, slice_hdr("x", 0, 2), payload[:per * 4]))
    write(d, "slice_h_bf16", msg(3, slice_hdr("h", 0, 2, 2), payload[:per * 2]))
    write(d, "slice_h_bad_dtype", msg(3, slice_hdr("h", 0, 2, 77), payload[:per * 4]))
    write(d, "expect_other", msg(0, kstr("g") + i32(7) + i32(1000) + ints([0, 2])))
    write(d, "expect_out_of_cache", msg(0, kstr("g") + i32(7) + i32(1000) + ints([0, 8])))
    write(d, "forget_h", msg(1, kstr("h")))
    write(d, "order_h", msg(2, kstr("h") + i32(10) + i32(500) + ints([6, 7, 0]) + i32(4) +
                            ints(blocks) + i32(1) + kstr("self") + i32(0) + i32(2)))
    write(d, "status", msg(6, i32(0) + u64(1) + i32(0) + kstr("")))
    write(d, "unknown_type", msg(7, kstr("h")))


# ---- protobuf requests -------------------------------------------------------------------

REQUESTS = [  # (selector byte, message type, text format)
    (0, "moe.v1.GenerateRequest",
     'request_id: "r1" text: "Hello, world" sampling { temperature: 0.7 top_p: 0.9 top_k: 40 '
     'max_tokens: 16 stop: "\\n\\n" stop_token_ids: 2 seed: 3 logprobs: 2 }'),
    (0, "moe.v1.GenerateRequest",
     'model: "qwen3_moe" token_ids { ids: [1, 2, 3, 800] } sampling { repetition_penalty: 1.1 '
     'presence_penalty: -0.5 frequency_penalty: 0.5 min_p: 0.05 ignore_eos: true } '
     'deadline_ms: 2000 stream_text: true'),
    (0, "moe.v1.GenerateRequest", 'text: "x" sampling { temperature: 101 }'),
    (1, "moe.v1.WorkerGenerateRequest",
     'request_id: "coord-1" prompt_token_ids: [5, 6, 7] sampling { max_tokens: 8 '
     'stop: "a" stop: "bc" } deadline_ms: 100'),
    (1, "moe.v1.WorkerGenerateRequest",
     'request_id: "coord-2" prompt_token_ids: [5] prefill_only: true handoff_id: "h-1"'),
    (0, "moe.v1.GenerateRequest",
     'text: "Once" sampling { max_tokens: 8 min_tokens: 3 stop_token_ids: 2 '
     'logit_bias { key: 5 value: 2.5 } logit_bias { key: 9 value: -100 } prompt_logprobs: 2 }'),
]


def seeds_request():
    d = out_dir("request")
    for i, (sel, msg, text) in enumerate(REQUESTS):
        enc = subprocess.run(["protoc", "--encode=" + msg, "--proto_path=" + os.path.join(ROOT, "proto"),
                              "moe/v1/worker.proto"], input=text.encode(), capture_output=True,
                             check=True).stdout
        write(d, "%s_%d" % (msg.split(".")[-1], i), bytes([sel]) + enc)
    write(d, "empty_generate", bytes([0]))
    # invalid UTF-8 (a lead byte without its continuation) in request_id (field 2);
    # protoc refuses to encode it, so the bytes are written out
    write(d, "GenerateRequest_bad_utf8", bytes([0]) + b"\x12\x04ab\xc3(" + b"\x1a\x02hi")


# ---- etcd answers ------------------------------------------------------------------------

def b64(s):
    return base64.b64encode(s.encode()).decode()


HDR = {"cluster_id": "14841639068965178418", "member_id": "10276657743932975437",
       "revision": "12", "raft_term": "2"}


def kv(key, value, mod, lease=None):
    k = {"key": b64(key), "create_revision": "5", "mod_revision": str(mod), "version": "2",
         "value": b64(value)}
    if lease:
        k["lease"] = lease
    return k


def etcd_seed(d, name, op, http_idx, body, flag=0):
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    write(d, name, bytes([op | (flag << 4), http_idx]) + body.encode())


def seeds_etcd():
    d = out_dir("etcd")
    etcd_seed(d, "put", 0, 0, {"header": HDR})
    etcd_seed(d, "get", 1, 0, {"header": HDR, "kvs": [kv("/moe/k", "v", 12)], "count": "1"})
    etcd_seed(d, "get_missing", 1, 0, {"header": HDR})
    etcd_seed(d, "get_prefix", 2, 0, {"header": HDR, "count": "2", "kvs": [
        kv("/moe/workers/w1", '{"address": "127.0.0.1:50061", "role": "mixed"}', 7,
           "7587869584612532490"),
        kv("/moe/workers/w2", '{"address": "127.0.0.1:50062"}', 9, "7587869584612532491")]})
    etcd_seed(d, "delete", 3, 0, {"header": HDR, "deleted": "1"})
    etcd_seed(d, "lease_grant", 4, 0, {"header": HDR, "ID": "7587869584612532490", "TTL": "5"})
    etcd_seed(d, "keepalive", 5, 0, {"result": {"header": HDR, "ID": "7587869584612532490",
                                                "TTL": "5"}})
    etcd_seed(d, "keepalive_lost", 5, 0, {"result": {"header": HDR, "ID": "7587869584612532490"}})
    etcd_seed(d, "revoke", 6, 0, {"header": HDR})
    etcd_seed(d, "txn_ok", 7, 0, {"header": HDR, "succeeded": True,
                                  "responses": [{"response_put": {"header": {"revision": "12"}}}]})
    etcd_seed(d, "txn_failed", 7, 0, {"header": HDR, "responses": [{"response_range": {
        "header": {"revision": "12"}, "kvs": [kv("/moe/placement/m", "{}", 11)], "count": "1"}}]},
        flag=11)
    etcd_seed(d, "error_unary", 4, 4, {"error": "etcdserver: requested lease not found",
                                        "code": 5, "message": "etcdserver: requested lease not found"})
    etcd_seed(d, "error_unavailable", 0, 7, "upstream connect error")
    etcd_seed(d, "not_json", 1, 0, "not json!")
    watch = [
        {"result": {"header": HDR, "created": True}},
        {"result": {"header": HDR, "events": [
            {"kv": kv("/moe/workers/w1", '{"address": "127.0.0.1:50061"}', 13, "1")},
            {"type": "DELETE", "kv": {"key": b64("/moe/workers/w2"), "mod_revision": "14"}}]}},
        {"result": {"header": HDR, "compact_revision": "20"}},
        {"result": {"header": HDR, "events": [{"kv": kv("/moe/placement/m", "{}", 21)}]}},
        {"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}},
    ]
    stream = "\n".join(json.dumps(w) for w in watch) + "\n"
    for chunk in (0, 5, 96):
        write(d, "watch_chunk%d" % chunk, bytes([8 | (1 << 4), chunk]) + stream.encode())
    etcd_seed(d, "watch_canceled", 9, 3, {"result": {"header": HDR, "canceled": True}})


def main():
    for f in (seeds_safetensors, seeds_safetensors_index, seeds_model_config,
              seeds_tokenizer_json, seeds_tokenizer_encode, seeds_chat_template, seeds_placement,
              seeds_coord_placement, seeds_kv_link, seeds_kv_link_server, seeds_request, seeds_etcd):
        f()
    for t in sorted(os.listdir(HERE)):
        c = os.path.join(HERE, t, "corpus")
        if os.path.isdir(c):
            n = os.listdir(c)
            print("%-18s %3d seeds, %7d bytes" % (t, len(n), sum(os.path.getsize(os.path.join(c, x))
                                                                 for x in n)))


if __name__ == "__main__":
    sys.exit(main())
