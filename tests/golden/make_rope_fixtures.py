#!/usr/bin/env python3
"""Writes golden fixtures for RoPE scaling: the Mixtral fixture's weights with
config.json's rope_parameters set to linear, llama3 and yarn scaling, and the
logits and greedy continuations transformers computes for the fixture's
prompts, into tests/golden/fixtures/mixtral_rope_<type>/ (weights, tokenizer
and templates are relative symlinks to ../mixtral, so only the config and the
references are new). test_golden runs on them as on any fixture.

    python3 tests/golden/make_rope_fixtures.py

The original context is set below the fixtures' longest path (62 prompt + 32
greedy tokens) so the scaled and interpolated frequencies all take part.
Needs what make_fixtures.py needs; CI does not run it.
"""
import json
import os
import shutil
import sys
import tempfile

import torch
from transformers import MixtralForCausalLM

import make_fixtures as mf

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "fixtures", "mixtral")
VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
}
LINKED = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja", "generation_config.json"]


@torch.no_grad()
def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    golden = json.load(open(os.path.join(SRC, "golden.json")))
    base_cfg = json.load(open(os.path.join(SRC, "config.json")))
    for name, rope in VARIANTS.items():
        out = os.path.join(HERE, "fixtures", "mixtral_rope_" + name)
        cfg = dict(base_cfg)
        cfg["rope_parameters"] = dict(rope, rope_theta=base_cfg["rope_theta"])
        with tempfile.TemporaryDirectory() as tmp:
            for f in LINKED:
                if os.path.exists(os.path.join(SRC, f)):
                    os.symlink(os.path.join(SRC, f), os.path.join(tmp, f))
            json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"), indent=2)
            model = MixtralForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                       attn_implementation="eager",
                                                       experts_implementation="eager")
            model.eval()
            for p in model.parameters():
                p.data = p.data.clone()
            model_bf = mf.bf16_copy(model)
            rows32, rows16, prompts = [], [], []
            for p in golden["prompts"]:
                l32, g32, m32 = mf.run_reference(model, p["ids"])
                l16, g16, m16 = mf.run_reference(model_bf, p["ids"])
                rows32.append(l32)
                rows16.append(l16)
                prompts.append({"text": p["text"], "ids": p["ids"], "greedy_f32": g32,
                                "greedy_bf16": g16, "min_margin_f32": m32,
                                "min_margin_bf16": m16})
        margin = min(min(p["min_margin_f32"], p["min_margin_bf16"]) for p in prompts)
        if margin < 1e-4:
            sys.exit("%s: a greedy margin of %.3g is too small to test" % (name, margin))
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        for f in LINKED:
            if os.path.exists(os.path.join(SRC, f)):
                os.symlink(os.path.join("..", "mixtral", f), os.path.join(out, f))
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        mf.write_logits(os.path.join(out, "logits_f32.bin"), rows32)
        mf.write_logits(os.path.join(out, "logits_bf16.bin"), rows16)
        g = dict(golden, model="mixtral_rope_" + name, prompts=prompts, rope_parameters=rope)
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump(g, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print("%s: min greedy margin %.4g, wrote %s" % (name, margin, out))


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
