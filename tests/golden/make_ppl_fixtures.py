#!/usr/bin/env python3
"""Writes the reference numbers of the quality meter (moe-generate --perplexity,
worker/engine/perplexity.h) as Hugging Face transformers computes them, for each
golden fixture model, into <fixture>/ppl.json:

    python3 tests/golden/make_ppl_fixtures.py [FIXTURE ...]   # default: mixtral qwen3_moe tiny_en

The text is tests/golden/fixtures/ppl_text.txt, or for the trained model
tiny_en its held-out split (tiny_en/heldout.txt: the bodies of every 20th
fortune, as deploy/model/train_tiny_moe.py holds them out), tokenized with the fixture's
tokenizer.json (tokenizers library, no special tokens). Definitions, the same
as the C code's: windows of N tokens x[wN .. wN+N) (a trailing partial window
dropped), each run alone; in each window the logits at positions N/2 .. N-2 are
scored against the next token. PPL = exp(mean NLL). The "bf16" run is the model
with every weight rounded to bf16, computed in f32 (what --dtype bf16 --exact
does); against the f32 run as the base: KL(P_f32 || P_bf16) per scored position
(mean, median, p99 = the value at rank ceil(0.99 S) ascending, max) and the
top-1 agreement (argmax, ties to the lower id). All sums in float64.

Pruning (moe-prune): the tokens routed to each expert over all windows are
counted from the routers' top-k choices; in every MoE layer the KEEP experts
with the most tokens (ties to the lower id) are kept, renumbered in id order,
with their router rows; the pruned checkpoint is written and loaded back
through transformers, and its PPL and KL against the f32 base recorded, with
the kept ids, under "pruned".

Needs torch, transformers (5.x), tokenizers. CI does not run this: the files it
writes are committed; tests/golden/test_perplexity.py holds the C engine to them.
"""
import copy
import json
import math
import os
import sys

import re
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
TEXT = os.path.join(FIX, "ppl_text.txt")
CTX = {"mixtral": 32, "qwen3_moe": 32}
KEEP = {"mixtral": 3, "qwen3_moe": 4, "tiny_en": 6}
TEXTS = {"tiny_en": "tiny_en/heldout.txt"}  # relative to fixtures/; default ppl_text.txt
DEFAULT_CTX = 128


def load(dir_):
    m = AutoModelForCausalLM.from_pretrained(dir_, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager")
    m.eval()
    with torch.no_grad():  # fresh, aligned memory (see make_fixtures.py)
        for p in m.parameters():
            p.data = p.data.clone()
    return m


def bf16_copy(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return m


@torch.no_grad()
def scored_logprobs(model, ids, ctx):
    """float64 log-softmax rows of every scored position, and their targets."""
    rows, targets = [], []
    for w in range(len(ids) // ctx):
        win = ids[w * ctx:(w + 1) * ctx]
        logits = model(torch.tensor([win], dtype=torch.long)).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        for j in range(ctx // 2, ctx - 1):
            rows.append(lp[j])
            targets.append(win[j + 1])
    return rows, targets


@torch.no_grad()
def expert_counts(model, ids, ctx):
    """Tokens routed to each expert of each layer over the windows:
    {layer: [count per expert]} (MoE layers only)."""
    counts, handles = {}, []
    for name, mod in model.named_modules():
        m = re.match(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.gate$", name)
        if not m or not hasattr(mod, "top_k"):
            continue
        layer = int(m.group(1))
        counts[layer] = [0] * mod.weight.shape[0]

        def hook(_mod, _inp, out, layer=layer):
            for e in out[2].reshape(-1).tolist():
                counts[layer][e] += 1
        handles.append(mod.register_forward_hook(hook))
    for w in range(len(ids) // ctx):
        model(torch.tensor([ids[w * ctx:(w + 1) * ctx]], dtype=torch.long))
    for h in handles:
        h.remove()
    return counts


def prune_checkpoint(src, dst, counts, keep):
    """The pruned checkpoint moe-prune writes, built independently here."""
    kept = {}
    for layer, c in counts.items():
        order = sorted(range(len(c)), key=lambda e: (-c[e], e))[:keep]
        kept[layer] = sorted(order)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    out = {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(.*)$", name)
        if m:
            layer, e = int(m.group(1)), int(m.group(3))
            if e in kept[layer]:
                out["model.layers.%d.%s.experts.%d.%s" % (layer, m.group(2), kept[layer].index(e),
                                                         m.group(4))] = t
            continue
        m = re.match(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.gate\.weight$", name)
        out[name] = t[kept[int(m.group(1))]].contiguous() if m else t
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    for k in ("num_local_experts", "num_experts"):
        if k in cfg:
            cfg[k] = keep
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
    return [kept[l] for l in sorted(kept)]


def kl_stats(base, other):
    kl = sorted(float(torch.sum(torch.exp(b) * (b - q))) for b, q in zip(base, other))
    top1 = sum(first_argmax(b) == first_argmax(q) for b, q in zip(base, other)) / len(base)
    k99 = max(0, math.ceil(0.99 * len(kl)) - 1)
    return {"kl_mean": sum(kl) / len(kl), "kl_median": kl[len(kl) // 2], "kl_p99": kl[k99],
            "kl_max": kl[-1], "top1": top1}


def ppl_of(rows, targets):
    nll = -sum(float(r[t]) for r, t in zip(rows, targets)) / len(rows)
    return nll, math.exp(nll)


def first_argmax(row):
    mx = torch.max(row)
    return int(torch.nonzero(row == mx)[0])


def main(argv):
    names = argv or ["mixtral", "qwen3_moe", "tiny_en"]
    torch.set_num_threads(1)
    for name in names:
        text_rel = TEXTS.get(name, "ppl_text.txt")
        text = open(os.path.join(FIX, text_rel), encoding="utf-8").read()
        d = os.path.join(FIX, name)
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        ids = tok.encode(text, add_special_tokens=False).ids
        ctx = CTX.get(name, DEFAULT_CTX)
        model = load(d)
        base, targets = scored_logprobs(model, ids, ctx)
        other, _ = scored_logprobs(bf16_copy(model), ids, ctx)
        nll, ppl = ppl_of(base, targets)
        nll16, ppl16 = ppl_of(other, targets)
        out = {
            "text": text_rel, "n_tokens": len(ids), "ctx": ctx, "n_scored": len(base),
            "f32": {"ppl": ppl, "nll_mean": nll},
            "bf16": dict({"ppl": ppl16, "nll_mean": nll16}, **kl_stats(base, other)),
        }
        keep = KEEP.get(name)
        if keep:
            tmp = tempfile.mkdtemp(prefix="moe-prune-ref-")
            kept = prune_checkpoint(d, tmp, expert_counts(model, ids, ctx), keep)
            pruned, _ = scored_logprobs(load(tmp), ids, ctx)
            nllp, pplp = ppl_of(pruned, targets)
            out["pruned"] = dict({"keep": keep, "kept": kept, "ppl": pplp, "nll_mean": nllp},
                                 **kl_stats(base, pruned))
            shutil.rmtree(tmp)
        with open(os.path.join(d, "ppl.json"), "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(name, json.dumps(out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
