#!/usr/bin/env python3
"""The compression trade-off table and chart: quantization level and expert
pruning versus size, speed and quality, measured with this repository's tools.

    python3 bench/tradeoff.py --build build --model DIR --text HELDOUT.txt [--ctx N]
        [--calib CALIB.txt] [--keep N] [--out bench/results/tradeoff]

For the model DIR (quality) and the benchmark-shape model (speed: vocab 32000,
hidden 1024, 8 layers, 8 experts top-2, made by moe-mkmodel), every variant:
f32, bf16, int8, int4 with group size 32 / 64 / 128, and each of those after
pruning to --keep experts per layer (moe-prune on the routing counts of a
calibration run over --calib; default --text). Columns:

  weights MiB     what the worker holds in memory (moe-generate's count)
  B/token         weight bytes a decoded token reads at batch 1 (attention,
                  top-k experts, router, lm_head), from the config
  PPL             perplexity over --text in windows of --ctx (moe-generate
                  --perplexity, the binaries' default arithmetic)
  KL mean / p99   KL(P_f32 || P_variant) per scored position, the f32 --exact
                  run as the base; top-1 = argmax agreement with it
  decode / prefill tok/s  the benchmark-shape model, 2 threads, batch 1 (decode
                  of 64 tokens after an 8-token prompt; prefill of 512 tokens),
                  best of --rounds alternated rounds

Writes OUT.md (the table, with the machine and the commands) and OUT.png
(size vs perplexity, marker area = decode tok/s; needs matplotlib).
"""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile


def run(argv):
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode:
        sys.exit("failed (%d): %s\n%s" % (p.returncode, " ".join(argv), p.stderr[-2000:]))
    return p.stdout


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = re.search(r"Model name:\s*(.+)", out).group(1).strip()
        flags = re.search(r"Flags:\s*(.+)", out).group(1).split()
        ext = [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags]
        return "%s, %d CPUs (%s)" % (name, os.cpu_count(), ", ".join(ext) or "no AVX-512 dot")
    except (OSError, AttributeError):
        return platform.processor()


def bytes_per_token(cfg, dtype, group):
    d, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dh = cfg.get("head_dim") or d // H
    E = cfg.get("num_local_experts", cfg.get("num_experts"))
    k = cfg["num_experts_per_tok"]
    ff = cfg.get("moe_intermediate_size", cfg["intermediate_size"])

    def lin(rows, cols):
        if dtype == "f32":
            return rows * cols * 4
        if dtype == "bf16":
            return rows * cols * 2
        if dtype == "int8":
            return rows * cols + rows * 4
        return rows * cols // 2 + rows * (cols // group) * 4

    attn = lin(H * dh + 2 * KV * dh, d) + lin(d, H * dh)
    expert = lin(2 * ff, d) + lin(d, ff)
    router = E * d * (4 if dtype == "f32" else 2)
    return L * (attn + k * expert + router) + lin(V, d)


def dtype_args(v):
    if v.startswith("int4"):
        return ["--dtype", "int4", "--group-size", v.split("-g")[1]]
    return ["--dtype", v]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--calib")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--keep", type=int)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/tradeoff")
    ap.add_argument("--no-speed", action="store_true")
    a = ap.parse_args()
    gen = os.path.join(a.build, "bin", "moe-generate")
    prune = os.path.join(a.build, "bin", "moe-prune")
    mk = os.path.join(a.build, "bin", "moe-mkmodel")
    tmp = tempfile.mkdtemp(prefix="moe-tradeoff-")
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    n_expert = cfg.get("num_local_experts", cfg.get("num_experts"))
    keep = a.keep or max(cfg["num_experts_per_tok"], n_expert // 2)
    quants = ["f32", "bf16", "int8", "int4-g32", "int4-g64", "int4-g128"]
    base = os.path.join(tmp, "base.kl")
    stats = os.path.join(tmp, "stats.json")
    common = ["--perplexity", a.text, "--ctx", str(a.ctx), "--threads", str(a.threads)]
    run([gen, "--model", a.model, *common, "--exact", "--dtype", "f32", "--kl-save", base])
    run([gen, "--model", a.model, "--perplexity", a.calib or a.text, "--ctx", str(a.ctx),
         "--exact", "--dtype", "f32", "--expert-stats", stats])
    pruned = os.path.join(tmp, "pruned")
    prune_out = run([prune, "--model", a.model, "--stats", stats, "--keep", str(keep),
                     "--out", pruned])
    kept_share = re.search(r"had ([0-9.]+)% of", prune_out).group(1)

    # the speed model, and its pruned twin (uniform counts: speed does not
    # depend on which experts are kept)
    speed_model = os.path.join(tmp, "speed")
    speed_pruned = os.path.join(tmp, "speed_pruned")
    speed_cfg = None
    if not a.no_speed:
        run([mk, "--arch", "mixtral", "--out", speed_model, "--vocab", "32000", "--hidden", "1024",
             "--layers", "8", "--heads", "16", "--kv-heads", "4", "--experts", "8", "--top-k", "2",
             "--ffn", "2816", "--dtype", "bf16", "--seed", "1"])
        sp_stats = os.path.join(tmp, "speed_stats.json")
        json.dump({"stats_layers": 8, "stats_experts": 8,
                   "expert_tokens": [8 - e for _ in range(8) for e in range(8)]}, open(sp_stats, "w"))
        run([prune, "--model", speed_model, "--stats", sp_stats, "--keep", "4", "--out",
             speed_pruned])
        speed_cfg = json.load(open(os.path.join(speed_model, "config.json")))

    rows = []
    for pr in (False, True):
        for q in quants:
            model = pruned if pr else a.model
            name = q + (" pruned %d/%d" % (keep, n_expert) if pr else "")
            try:
                out = run([gen, "--model", model, *common, *dtype_args(q), "--kl-base", base])
            except SystemExit as e:  # e.g. a width that is not a multiple of the group
                print("skipping %s: %s" % (name, str(e).splitlines()[-1]))
                continue
            ppl = float(re.search(r"ppl: ([0-9.e+-]+)", out).group(1))
            kl = re.search(r"mean ([0-9.e+-]+), median [0-9.e+-]+, p99 ([0-9.e+-]+)", out)
            top1 = float(re.search(r"top-1 agreement ([0-9.]+)%", out).group(1))
            info = run([gen, "--model", model, *dtype_args(q), "--tokens", "1", "-n", "1"])
            mib = float(re.search(r"([0-9.]+) MiB of weights", info).group(1))
            c = json.load(open(os.path.join(model, "config.json")))
            g = int(q.split("-g")[1]) if q.startswith("int4") else 0
            rows.append({"variant": name, "quant": q, "pruned": pr, "mib": mib,
                         "bpt": bytes_per_token(c, q.split("-")[0], g), "ppl": ppl,
                         "kl": float(kl.group(1)), "kl99": float(kl.group(2)), "top1": top1})
    if not a.no_speed:
        for r in rows:
            r["decode"] = r["prefill"] = 0.0
        prompt512 = ",".join(str(1 + (i * 7919) % 31999) for i in range(512))
        for _ in range(a.rounds):  # alternated rounds, best of each
            for r in rows:
                m = speed_pruned if r["pruned"] else speed_model
                out = run([gen, "--model", m, *dtype_args(r["quant"]), "--threads",
                           str(a.threads), "--tokens", "1,2,3,4,5,6,7,8", "-n", "65",
                           "--ignore-eos"])
                r["decode"] = max(r["decode"], float(re.search(r"decode: .* ([0-9.]+) tokens/s",
                                                               out).group(1)))
                out = run([gen, "--model", m, *dtype_args(r["quant"]), "--threads",
                           str(a.threads), "--tokens", prompt512, "-n", "1", "--ignore-eos"])
                r["prefill"] = max(r["prefill"], float(re.search(
                    r"prefill: .* ([0-9.]+) tokens/s", out).group(1)))
            for r in rows:
                r["bpt_speed"] = bytes_per_token(
                    dict(speed_cfg, num_local_experts=4 if r["pruned"] else 8),
                    r["quant"].split("-")[0], int(r["quant"].split("-g")[1]) if "-g" in r["quant"] else 0)

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write("Model `%s` (quality), text `%s` (%s, windows of %d), %d of %d experts kept by "
                "pruning (they had %s%% of the calibration run's routed tokens). Quality runs use "
                "the binaries' default arithmetic (fast matmuls, bf16 KV cache) against the f32 "
                "`--exact` run as the KL base, so the f32 row shows what the bf16 KV cache and "
                "the fast paths cost.\n"
                "Speed: the benchmark-shape model, %d threads, batch 1, best of %d alternated "
                "rounds. Machine: %s.\n\n"
                % (a.model, a.text, "held-out text", a.ctx, keep, n_expert, kept_share,
                   a.threads, a.rounds, cpu_name()))
        f.write("Command: `python3 bench/tradeoff.py %s`\n\n" % " ".join(sys.argv[1:]))
        hdr = "| variant | weights MiB | B/token | PPL | KL mean | KL p99 | top-1 % |"
        sep = "|---|---:|---:|---:|---:|---:|---:|"
        if not a.no_speed:
            hdr += " decode tok/s | prefill tok/s | bench B/token |"
            sep += "---:|---:|---:|"
        f.write(hdr + "\n" + sep + "\n")
        for r in rows:
            line = "| %s | %.2f | %.0f | %.3f | %.4f | %.4f | %.2f |" % (
                r["variant"], r["mib"], r["bpt"], r["ppl"], r["kl"], r["kl99"], r["top1"])
            if not a.no_speed:
                line += " %.1f | %.1f | %.1f MB |" % (r["decode"], r["prefill"], r["bpt_speed"] / 1e6)
            f.write(line + "\n")
    print(open(a.out + ".md").read())
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: %s.png not written (python3 -m pip install matplotlib)" % a.out)
        shutil.rmtree(tmp)
        return 0
    fig, ax = plt.subplots(figsize=(8, 5))
    for pr, marker in ((False, "o"), (True, "s")):
        sel = [r for r in rows if r["pruned"] == pr]
        sizes = [max(20.0, r.get("decode", 50.0) * 3) for r in sel]
        ax.scatter([r["mib"] for r in sel], [r["ppl"] for r in sel], s=sizes, marker=marker,
                   alpha=0.6, label="pruned %d/%d" % (keep, n_expert) if pr else "all experts")
        for r in sel:
            ax.annotate(r["quant"], (r["mib"], r["ppl"]), fontsize=8, xytext=(4, 4),
                        textcoords="offset points")
    ax.set_xlabel("weights in memory (MiB)")
    ax.set_ylabel("perplexity (held-out text)")
    ax.set_title("size vs perplexity (marker area ~ decode tok/s on the benchmark shape)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=110)
    print("wrote %s.md and %s.png" % (a.out, a.out))
    shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
