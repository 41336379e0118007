#!/usr/bin/env python3
"""Writes the golden-test fixtures: two tiny random-weight MoE checkpoints in
Hugging Face layout (Mixtral, Qwen3-MoE) and the reference logits and greedy
continuations that Hugging Face transformers computes for them; and the same
references for the trained demo model deploy/model/moe-tiny-en (tiny_en: its
checkpoint files are relative symlinks to the deploy copy).

    python3 tests/golden/make_fixtures.py            # writes tests/golden/fixtures/{mixtral,qwen3_moe,tiny_en}
    python3 tests/golden/make_fixtures.py --only tiny_en   # after retraining the demo model

Needs torch, transformers (5.x), tokenizers, safetensors, numpy. CI does not
run this: the fixtures it writes are committed. Deterministic: fixed seeds,
one torch thread; re-running on the same versions rewrites identical files.

Per model directory:
  config.json, generation_config.json, tokenizer.json
  model.safetensors                      (qwen3_moe)  or
  model-0000{1,2}-of-00002.safetensors + model.safetensors.index.json (mixtral)
  golden.json        prompts, ids, 32-token greedy continuations, min margins
  logits_f32.bin     logits at every prompt position, f32 weights
  logits_bf16.bin    same with every weight rounded to bf16 (compute in f32)

logits_*.bin layout (little-endian): 8-byte magic "MOELOGIT", u32 version = 1,
u32 n_prompts, then per prompt: u32 n_pos, u32 vocab, n_pos * vocab f32
(row = prompt position, in order).
"""

import argparse
import copy
import json
import os
import shutil
import struct
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig,
                          MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
N_NEW = 32                # greedy tokens per prompt
MIN_MARGIN = 2e-3         # smallest allowed top1 - top2 logit gap on a greedy path
MIN_DISTINCT = 8          # a greedy path must hold this many distinct tokens (no 1-token loops)
MIN_ROUTER_MARGIN = 1e-4  # smallest allowed gap between the k-th and (k+1)-th router logit
MAX_SEED_TRIES = 50
LOGITS_MAGIC = b"MOELOGIT"
LOGITS_VERSION = 1

PROMPT_SHORT = "The quick brown fox jumps over the lazy dog."
PROMPT_MULTI = "Grüße aus Zürich! 你好，世界 🦊"
PROMPT_LONG_SOURCE = (
    "Mixture-of-experts language models route every token to a few expert networks chosen by a "
    "small router, so each token touches only a fraction of the weights. Serving them well means "
    "batching tokens that go to the same expert, keeping the key and value cache in fixed-size "
    "blocks, and moving experts between devices while requests keep arriving. The quick brown fox "
    "jumps over the lazy dog while the engine streams tokens back to every client."
)
PROMPT_LONG_TOKENS = 60
ONE_TOKEN_CANDIDATES = ["", "Hello", "The", "a", "the", "A", " "]


def mixtral_config(vocab, bos, eos):
    return MixtralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, sliding_window=None,
        hidden_act="silu", initializer_range=0.1)


def qwen3_moe_config(vocab, bos, eos):
    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, intermediate_size=96, mlp_only_layers=[1], decoder_sparse_step=1,
        norm_topk_prob=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rms_norm_eps=1e-6,
        max_position_embeddings=256, use_sliding_window=False, sliding_window=None,
        attention_bias=False, bos_token_id=bos, eos_token_id=eos, hidden_act="silu",
        initializer_range=0.1)


def qwen2_moe_config(vocab, bos, eos):
    # q/k/v biases and a gated shared expert; widths multiples of 32 (int4)
    return Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, intermediate_size=96, mlp_only_layers=[1],
        decoder_sparse_step=1, norm_topk_prob=False, qkv_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rms_norm_eps=1e-6,
        max_position_embeddings=256, use_sliding_window=False, sliding_window=None,
        bos_token_id=bos, eos_token_id=eos, hidden_act="silu", initializer_range=0.1)


def olmoe_config(vocab, bos, eos):
    # q_norm / k_norm over all heads at once; experts of intermediate_size
    return OlmoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, tie_word_embeddings=False, clip_qkv=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rms_norm_eps=1e-5,
        max_position_embeddings=256, attention_bias=False, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=None, hidden_act="silu", initializer_range=0.1)


def deepseek_v3_config(vocab, bos, eos):
    # q through q_lora_rank, 4 groups of 2 experts (the best 2 groups kept), a
    # dense first layer, 2 shared experts, YaRN with mscale != mscale_all_dim
    # (both the cos/sin factor and the softmax scale), interleaved rope rows;
    # widths multiples of 32 (int4)
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=128, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 0.8,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=None, hidden_act="silu", initializer_range=0.1, attention_bias=False)


def deepseek_v3_lite_config(vocab, bos, eos):
    # the other branches: q_proj (no q_lora_rank), one group, every layer MoE,
    # one shared expert, plain rope in rotate-half layout, no renormalisation
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=1.5, kv_lora_rank=64, q_lora_rank=None,
        qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=1, topk_group=1,
        num_experts_per_tok=3, first_k_dense_replace=0, norm_topk_prob=False,
        max_position_embeddings=256, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=None, hidden_act="silu", initializer_range=0.1, attention_bias=False)


MODELS = {
    "mixtral": {"cls": MixtralForCausalLM, "config": mixtral_config, "tokenizer": "llama",
                "shards": 2, "seed": 1000,
                "init": {"embed_std": 1.0, "gain": 1.2, "router_gain": 1.5, "lm_gain": 3.0,
                         "final_norm": 1.0}},
    "qwen3_moe": {"cls": Qwen3MoeForCausalLM, "config": qwen3_moe_config, "tokenizer": "qwen",
                  "shards": 1, "seed": 2000,
                "init": {"embed_std": 0.1, "gain": 1.6, "router_gain": 1.5, "lm_gain": 0.0,
                         "final_norm": 5.0}},
    "olmoe": {"cls": OlmoeForCausalLM, "config": olmoe_config, "tokenizer": "llama",
              "shards": 1, "seed": 4000,
              "init": {"embed_std": 1.0, "gain": 1.4, "router_gain": 1.5, "lm_gain": 3.0,
                       "final_norm": 1.0}},
    "qwen2_moe": {"cls": Qwen2MoeForCausalLM, "config": qwen2_moe_config, "tokenizer": "qwen",
                  "shards": 1, "seed": 3000,
                  "init": {"embed_std": 1.0, "gain": 1.4, "router_gain": 1.5, "lm_gain": 3.0,
                           "final_norm": 1.0}},
    "deepseek_v3": {"cls": DeepseekV3ForCausalLM, "config": deepseek_v3_config,
                    "tokenizer": "llama", "shards": 1, "seed": 5000,
                    "init": {"embed_std": 1.0, "gain": 1.4, "router_gain": 3.0, "lm_gain": 3.0,
                             "final_norm": 1.0, "score_bias": 0.2}},
    "deepseek_v3_lite": {"cls": DeepseekV3ForCausalLM, "config": deepseek_v3_lite_config,
                         "tokenizer": "llama", "shards": 1, "seed": 6000,
                         "init": {"embed_std": 1.0, "gain": 1.4, "router_gain": 3.0,
                                  "lm_gain": 3.0, "final_norm": 1.0, "score_bias": 0.2}},
}


def special_id(tok, names):
    for n in names:
        i = tok.token_to_id(n)
        if i is not None:
            return i
    return None


def init_weights(model, seed, init):
    """Fan-in scaled normal weights, larger than the usual 0.02 so logits are
    peaked (clear greedy margins) and every layer moves the residual stream.
    Norm weights are 1 + N(0, 0.1) so a C engine that mixes up norms fails;
    the final norm is scaled by init["final_norm"] (with tied embeddings the
    embedding must stay small against the layers' output, or the model only
    repeats its input token, so the logit scale comes from the final norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
                if name == "model.norm.weight":
                    val *= init["final_norm"]
            elif name.endswith("embed_tokens.weight"):
                val = torch.randn(p.shape, generator=g) * init["embed_std"]
            else:
                if name.startswith("lm_head"):
                    gain = init["lm_gain"]
                elif name.endswith("mlp.gate.weight"):      # router
                    gain = init["router_gain"]
                else:
                    gain = init["gain"]
                val = torch.randn(p.shape, generator=g) * (gain / p.shape[-1] ** 0.5)
            p.copy_(val.to(p.dtype))
        # DeepSeek-V3's e_score_correction_bias is a buffer (zero at init):
        # non-zero, so choosing by score + bias differs from choosing by score
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * init["score_bias"])


def long_prompt(enc, source):
    """The shortest run of source's first words that is PROMPT_LONG_TOKENS long."""
    words = source.split(" ")
    for n in range(1, len(words) + 1):
        t = " ".join(words[:n])
        if len(enc(t)) >= PROMPT_LONG_TOKENS:
            return t
    return source


def make_prompts(tok, model_name):
    def enc(text):
        return tok.encode(text, add_special_tokens=True).ids

    prompts = [PROMPT_SHORT, PROMPT_MULTI, long_prompt(enc, PROMPT_LONG_SOURCE)]
    one = next((t for t in ONE_TOKEN_CANDIDATES if len(enc(t)) == 1), None)
    if one is None:
        sys.exit(f"{model_name}: no one-token prompt among {ONE_TOKEN_CANDIDATES}")
    prompts.append(one)
    out = []
    for t in prompts:
        ids = enc(t)
        if not ids:
            sys.exit(f"{model_name}: prompt {t!r} encodes to no tokens")
        out.append((t, ids))
    return out


class RouterProbe:
    """Records the smallest gap between the k-th and (k+1)-th router logit
    (DeepSeek-V3: between the k-th and (k+1)-th choice score, score + bias,
    among the kept groups, and between the last kept group and the next)."""

    def __init__(self, model, top_k):
        self.top_k = top_k
        self.min_gap = float("inf")
        self.handles = []
        for name, mod in model.named_modules():
            if name.endswith("mlp.gate") and hasattr(mod, "weight") and mod.weight.dim() == 2 \
                    and mod.weight.shape[0] > top_k:
                grouped = hasattr(mod, "e_score_correction_bias")
                self.handles.append(mod.register_forward_hook(
                    self.hook_grouped if grouped else self.hook))
        if not self.handles:
            raise RuntimeError("no router modules found")

    def hook_grouped(self, mod, inp, out):
        logits = out[0].float()
        c = logits.sigmoid() + mod.e_score_correction_bias
        n_tok, n_exp = c.shape
        g = c.view(n_tok, mod.num_group, -1)
        gs = torch.sort(g.topk(2, dim=-1)[0].sum(-1), dim=-1, descending=True)[0]
        if mod.topk_group < mod.num_group:
            gap = (gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]).min().item()
            self.min_gap = min(self.min_gap, gap)
        keep = torch.zeros_like(gs)
        keep.scatter_(1, g.topk(2, dim=-1)[0].sum(-1).topk(mod.topk_group, dim=-1)[1], 1)
        mask = keep.unsqueeze(-1).expand_as(g).reshape(n_tok, n_exp).bool()
        s = torch.sort(c.masked_fill(~mask, float("-inf")), dim=-1, descending=True)[0]
        k = self.top_k
        if k < mod.topk_group * (n_exp // mod.num_group):
            self.min_gap = min(self.min_gap, (s[:, k - 1] - s[:, k]).min().item())

    def hook(self, mod, inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        s = torch.sort(logits.float().reshape(-1, logits.shape[-1]), dim=-1, descending=True)[0]
        gap = (s[:, self.top_k - 1] - s[:, self.top_k]).min().item()
        self.min_gap = min(self.min_gap, gap)

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def run_reference(model, ids):
    """Logits at every prompt position, and the greedy continuation computed by
    full recomputation (plain argmax, EOS is an ordinary token)."""
    x = torch.tensor([ids], dtype=torch.long)
    logits = model(x).logits[0].float().clone()
    seq = list(ids)
    greedy, margins = [], []
    for _ in range(N_NEW):
        last = model(torch.tensor([seq], dtype=torch.long)).logits[0, -1].float()
        top = torch.topk(last, 2)
        margins.append((top.values[0] - top.values[1]).item())
        nxt = int(top.indices[0])
        greedy.append(nxt)
        seq.append(nxt)
    return logits, greedy, min(margins)


@torch.no_grad()
def generate_check(model, ids, expected):
    """model.generate (KV cache) must give the same 32 tokens, EOS ignored."""
    gen_cfg = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW, eos_token_id=None,
        pad_token_id=0, bos_token_id=None)
    x = torch.tensor([ids], dtype=torch.long)
    out = model.generate(x, generation_config=gen_cfg, attention_mask=torch.ones_like(x))
    got = out[0, len(ids):].tolist()
    if got != expected:
        raise RuntimeError(f"generate() differs from the argmax loop: {got} vs {expected}")


def bf16_copy(model):
    """Every weight rounded to bf16, computed in f32: what the C engine does
    with --dtype bf16. Only parameters are rounded: buffers such as the
    rotary inv_freq are not weights (a real bf16 checkpoint has none of them),
    and rounding them would move the reference away from any engine."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return m


def evaluate(model, prompts, top_k, eos):
    probe = RouterProbe(model, top_k)
    res = []
    for _, ids in prompts:
        res.append(run_reference(model, ids))
    probe.close()
    eos_set = set(eos if isinstance(eos, list) else [eos]) - {None}
    eos_hit = any(t in eos_set for _, greedy, _ in res for t in greedy)
    return res, probe.min_gap, eos_hit


def hub_tensor_names(cfg, arch):
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{w}_proj.weight" for w in "qkvo"}
        if arch == "mixtral":
            names.add(p + "block_sparse_moe.gate.weight")
            names |= {p + f"block_sparse_moe.experts.{e}.{w}.weight"
                      for e in range(cfg.num_local_experts) for w in ("w1", "w2", "w3")}
        elif arch.startswith("deepseek_v3"):
            a = p + "self_attn."
            names.discard(a + "q_proj.weight")
            names -= {a + "k_proj.weight", a + "v_proj.weight"}
            if cfg.q_lora_rank is None:
                names.add(a + "q_proj.weight")
            else:
                names |= {a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"}
            names |= {a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight",
                      a + "kv_b_proj.weight"}
            if i < cfg.first_k_dense_replace:
                names |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
            else:
                names |= {p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"}
                names |= {p + f"mlp.experts.{e}.{w}_proj.weight"
                          for e in range(cfg.n_routed_experts) for w in ("gate", "up", "down")}
                names |= {p + f"mlp.shared_experts.{w}_proj.weight"
                          for w in ("gate", "up", "down")}
        elif arch == "olmoe":
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight",
                      p + "mlp.gate.weight"}
            names |= {p + f"mlp.experts.{e}.{w}_proj.weight"
                      for e in range(cfg.num_experts) for w in ("gate", "up", "down")}
        else:
            if arch == "qwen3_moe":
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
            else:  # qwen2_moe
                names |= {p + f"self_attn.{w}_proj.bias" for w in "qkv"}
            moe = i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
            if moe:
                names.add(p + "mlp.gate.weight")
                names |= {p + f"mlp.experts.{e}.{w}_proj.weight"
                          for e in range(cfg.num_experts) for w in ("gate", "up", "down")}
                if arch == "qwen2_moe":
                    names.add(p + "mlp.shared_expert_gate.weight")
                    names |= {p + f"mlp.shared_expert.{w}_proj.weight"
                              for w in ("gate", "up", "down")}
            else:
                names |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
    return names


def save_checkpoint(model, out_dir, n_shards, arch):
    """save_pretrained (which writes the Hub tensor layout), then re-split the
    tensors into exactly n_shards files, and add the fields a C config parser
    expects (top-level rope_theta; num_experts for Qwen3-MoE as on the Hub)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size="1GB")
        tensors = {}
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(tmp, f), "pt") as s:
                    for k in s.keys():
                        tensors[k] = s.get_tensor(k).contiguous()
        expected = hub_tensor_names(model.config, arch)
        if set(tensors) != expected:
            raise RuntimeError(f"{arch}: save_pretrained wrote unexpected tensor names: "
                               f"missing {sorted(expected - set(tensors))[:5]}, "
                               f"extra {sorted(set(tensors) - expected)[:5]}")
        with open(os.path.join(tmp, "config.json")) as f:
            config = json.load(f)
        gen_path = os.path.join(tmp, "generation_config.json")
        gen = json.load(open(gen_path)) if os.path.exists(gen_path) else None

    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    if arch in ("qwen3_moe", "qwen2_moe", "olmoe"):
        config["num_experts"] = config.get("num_local_experts", model.config.num_experts)
    config.pop("transformers_version", None)
    config = dict(sorted(config.items()))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if gen is not None:
        gen.pop("transformers_version", None)
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
            f.write("\n")

    names = sorted(tensors)
    written = []
    if n_shards == 1:
        path = os.path.join(out_dir, "model.safetensors")
        save_file(tensors, path, metadata={"format": "pt"})
        written.append(path)
    else:
        # Split by bytes, in name order, into n_shards contiguous groups.
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        groups, acc = [[] for _ in range(n_shards)], 0
        for k in names:
            sz = tensors[k].numel() * tensors[k].element_size()
            idx = min(n_shards - 1, acc * n_shards // total)
            groups[idx].append(k)
            acc += sz
        weight_map = {}
        for i, g in enumerate(groups):
            if not g:
                raise RuntimeError(f"{arch}: shard {i} would be empty")
            fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            save_file({k: tensors[k] for k in g}, os.path.join(out_dir, fname),
                      metadata={"format": "pt"})
            written.append(os.path.join(out_dir, fname))
            for k in g:
                weight_map[k] = fname
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        path = os.path.join(out_dir, "model.safetensors.index.json")
        with open(path, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        written.append(path)
    return written


def write_logits(path, rows):
    with open(path, "wb") as f:
        f.write(LOGITS_MAGIC)
        f.write(struct.pack("<II", LOGITS_VERSION, len(rows)))
        for a in rows:
            a = np.ascontiguousarray(a.numpy(), dtype="<f4")
            f.write(struct.pack("<II", a.shape[0], a.shape[1]))
            f.write(a.tobytes())


def read_logits(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != LOGITS_MAGIC:
        raise RuntimeError(f"{path}: bad magic")
    version, n = struct.unpack_from("<II", data, 8)
    off, rows = 16, []
    for _ in range(n):
        n_pos, vocab = struct.unpack_from("<II", data, off)
        off += 8
        rows.append(np.frombuffer(data, "<f4", n_pos * vocab, off).reshape(n_pos, vocab))
        off += 4 * n_pos * vocab
    if off != len(data) or version != LOGITS_VERSION:
        raise RuntimeError(f"{path}: bad layout")
    return rows


@torch.no_grad()
def verify_on_disk(name, out_dir, cls, prompts):
    """Reloads the written checkpoint and checks it reproduces the references."""
    model, info = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                      experts_implementation="eager", output_loading_info=True)
    model.eval()
    if model.config._experts_implementation != "eager":
        raise RuntimeError(f"{name}: experts implementation {model.config._experts_implementation}")
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} or info.get("error_msgs")
    if bad:
        raise RuntimeError(f"{name}: from_pretrained loading info not clean: {info}")
    # The loaded weights may sit at unaligned mmap offsets, and CPU kernels take
    # alignment-dependent paths (1e-6 differences): copy them to fresh memory.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    golden = json.load(open(os.path.join(out_dir, "golden.json")))
    for variant, m in (("f32", model), ("bf16", bf16_copy(model))):
        rows = read_logits(os.path.join(out_dir, f"logits_{variant}.bin"))
        for p, ref in zip(golden["prompts"], rows):
            got = m(torch.tensor([p["ids"]])).logits[0].float().numpy()
            if not np.array_equal(got, ref):
                diff = float(np.abs(got - ref).max())
                raise RuntimeError(f"{name}/{variant}: reloaded logits differ by {diff}")
            _, greedy, _ = run_reference(m, p["ids"])
            if greedy != p[f"greedy_{variant}"]:
                raise RuntimeError(f"{name}/{variant}: reloaded greedy path differs")
    print(f"{name}: reloaded checkpoint reproduces logits and greedy paths exactly")


def make_model(name, spec, tok_dir, out_root):
    tok_path = os.path.join(tok_dir, spec["tokenizer"], "tokenizer.json")
    if not os.path.exists(tok_path):
        sys.exit(f"missing {tok_path}: run tests/golden/make_tokenizers.py first")
    tok = Tokenizer.from_file(tok_path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if name in ("mixtral", "olmoe") or name.startswith("deepseek_v3"):
        bos, eos = 1, 2
    else:
        bos = special_id(tok, ["<|endoftext|>"])
        eos = special_id(tok, ["<|im_end|>", "<|endoftext|>"])
    prompts = make_prompts(tok, name)
    cfg = spec["config"](vocab, bos, eos)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"

    for attempt in range(MAX_SEED_TRIES):
        seed = spec["seed"] + attempt
        torch.manual_seed(seed)
        model = spec["cls"](cfg)
        init_weights(model, seed, spec["init"])
        model.eval()
        model_bf = bf16_copy(model)
        res32, rgap32, eos32 = evaluate(model, prompts, cfg.num_experts_per_tok, eos)
        res16, rgap16, eos16 = evaluate(model_bf, prompts, cfg.num_experts_per_tok, eos)
        m32 = min(r[2] for r in res32)
        m16 = min(r[2] for r in res16)
        distinct = min(len(set(r[1])) for r in res32 + res16)
        ok = (m32 > MIN_MARGIN and m16 > MIN_MARGIN and min(rgap32, rgap16) > MIN_ROUTER_MARGIN
              and not eos32 and not eos16 and distinct >= MIN_DISTINCT)
        print(f"{name}: seed {seed}: min margin f32 {m32:.4g} bf16 {m16:.4g}, "
              f"router {min(rgap32, rgap16):.3g}, eos on path {eos32 or eos16}, "
              f"min distinct tokens {distinct}"
              f"{'' if ok else ' -> next seed'}")
        if ok:
            break
    else:
        sys.exit(f"{name}: no seed in {MAX_SEED_TRIES} tries gave clear margins")

    for (_, ids), r in zip(prompts, res32):
        generate_check(model, ids, r[1])
    for (_, ids), r in zip(prompts, res16):
        generate_check(model_bf, ids, r[1])

    out_dir = os.path.join(out_root, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    written = save_checkpoint(model, out_dir, spec["shards"], name)
    shutil.copyfile(tok_path, os.path.join(out_dir, "tokenizer.json"))
    write_logits(os.path.join(out_dir, "logits_f32.bin"), [r[0] for r in res32])
    write_logits(os.path.join(out_dir, "logits_bf16.bin"), [r[0] for r in res16])
    golden = {
        "format": "moe-golden", "version": 1, "model": name, "seed": seed,
        "n_new": N_NEW,
        "eos_note": "greedy_* are plain argmax paths of exactly n_new tokens; no EOS occurs on them",
        "min_router_margin_f32": rgap32, "min_router_margin_bf16": rgap16,
        "prompts": [
            {"text": t, "ids": ids, "greedy_f32": r32[1], "greedy_bf16": r16[1],
             "min_margin_f32": r32[2], "min_margin_bf16": r16[2]}
            for (t, ids), r32, r16 in zip(prompts, res32, res16)
        ],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")
    verify_on_disk(name, out_dir, spec["cls"], prompts)
    total = 0
    for f in sorted(os.listdir(out_dir)):
        sz = os.path.getsize(os.path.join(out_dir, f))
        total += sz
        print(f"  wrote {os.path.join(out_dir, f)} ({sz} bytes)")
    print(f"  {name}: vocab {vocab}, prompts {[len(ids) for _, ids in prompts]} tokens, "
          f"{total / 1e6:.2f} MB")
    return total


PROMPT_LONG_EN = (
    "A wise old owl lived in an oak. The more he saw, the less he spoke; the less he spoke, the "
    "more he heard. Why can't we all be like that wise old bird? Because, my friend, the rest of "
    "us have meetings to attend, mail to answer and a cat that wants its dinner right now.")

# Trained checkpoints: the weights are given, so instead of trying seeds the
# fixture tries prompts: each slot takes the first candidate whose paths meet
# the same margins as the random models' (EOS may occur: a trained model ends
# its answers, and the greedy paths run on through it, as with ignore_eos).
TRAINED = {
    "tiny_en": {"dir": os.path.join(HERE, "..", "..", "deploy", "model", "moe-tiny-en"),
                "slots": [
                    [PROMPT_SHORT],
                    [PROMPT_MULTI],
                    [None, PROMPT_LONG_EN],   # None: the random models' long prompt
                    ONE_TOKEN_CANDIDATES,
                    ["Once upon a time", "A man walks into a bar.", "The only way to",
                     "It is a truth universally acknowledged", "Computers are"],
                    ["<|im_start|>user\nTell me something about computers.<|im_end|>\n"
                     "<|im_start|>assistant\n",
                     "<|im_start|>user\nTell me a fortune.<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_start|>user\nWhat do you know about love?<|im_end|>\n"
                     "<|im_start|>assistant\n"],
                ]},
}


def make_trained(name, spec, out_root):
    """golden.json and logits for a trained checkpoint (see TRAINED)."""
    ckpt = os.path.normpath(spec["dir"])
    cls = Qwen3MoeForCausalLM
    model = cls.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                experts_implementation="eager")
    model.eval()
    # generate_check must be greedy: the checkpoint's sampling defaults
    # (do_sample in generation_config.json) would fill in for the fields
    # it leaves at their defaults
    model.generation_config = transformers.GenerationConfig()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    model_bf = bf16_copy(model)
    cfg = model.config
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    eos = cfg.eos_token_id
    def enc(text):
        return tok.encode(text, add_special_tokens=True).ids

    chosen, res32, res16 = [], [], []
    gaps32, gaps16 = [], []
    for slot in spec["slots"]:
        for text in slot:
            if text in (None, PROMPT_LONG_EN):
                text = long_prompt(enc, PROMPT_LONG_SOURCE if text is None else text)
            ids = enc(text)
            if not ids or (slot is ONE_TOKEN_CANDIDATES and len(ids) != 1):
                continue
            (r32,), g32, _ = evaluate(model, [(text, ids)], cfg.num_experts_per_tok, eos)
            (r16,), g16, _ = evaluate(model_bf, [(text, ids)], cfg.num_experts_per_tok, eos)
            distinct = min(len(set(r32[1])), len(set(r16[1])))
            ok = (r32[2] > MIN_MARGIN and r16[2] > MIN_MARGIN and min(g32, g16) > MIN_ROUTER_MARGIN
                  and distinct >= MIN_DISTINCT)
            print(f"{name}: prompt {text[:40]!r}: {len(ids)} tokens, min margin f32 {r32[2]:.4g} "
                  f"bf16 {r16[2]:.4g}, router {min(g32, g16):.3g}, distinct {distinct}"
                  f"{'' if ok else ' -> next candidate'}")
            if ok:
                chosen.append((text, ids))
                res32.append(r32)
                res16.append(r16)
                gaps32.append(g32)
                gaps16.append(g16)
                break
        else:
            sys.exit(f"{name}: no candidate in {slot} gave clear margins")
    for (_, ids), r in zip(chosen, res32):
        generate_check(model, ids, r[1])
    for (_, ids), r in zip(chosen, res16):
        generate_check(model_bf, ids, r[1])

    out_dir = os.path.join(out_root, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    rel = os.path.relpath(ckpt, out_dir)
    for f in sorted(os.listdir(ckpt)):
        if f.endswith((".json", ".safetensors")) and f != "train_log.json":
            os.symlink(os.path.join(rel, f), os.path.join(out_dir, f))
    write_logits(os.path.join(out_dir, "logits_f32.bin"), [r[0] for r in res32])
    write_logits(os.path.join(out_dir, "logits_bf16.bin"), [r[0] for r in res16])
    same = open(os.path.join(out_dir, "logits_f32.bin"), "rb").read() == \
        open(os.path.join(out_dir, "logits_bf16.bin"), "rb").read()
    if same:   # bf16 weights on disk: rounding them again changes nothing
        os.remove(os.path.join(out_dir, "logits_bf16.bin"))
        os.symlink("logits_f32.bin", os.path.join(out_dir, "logits_bf16.bin"))
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    golden = {
        "format": "moe-golden", "version": 1, "model": name,
        "seed": json.load(open(os.path.join(ckpt, "train_log.json")))["seed"],
        "n_new": N_NEW,
        "eos_note": "greedy_* are plain argmax paths of exactly n_new tokens; an EOS on them is "
                    "an ordinary token (the test runs with ignore_eos)",
        "eos_on_paths": any(t in eos_ids for r in res32 + res16 for t in r[1]),
        "min_router_margin_f32": min(gaps32), "min_router_margin_bf16": min(gaps16),
        "prompts": [
            {"text": t, "ids": ids, "greedy_f32": r32[1], "greedy_bf16": r16[1],
             "min_margin_f32": r32[2], "min_margin_bf16": r16[2],
             "greedy_text_f32": tok.decode(r32[1], skip_special_tokens=False)}
            for (t, ids), r32, r16 in zip(chosen, res32, res16)
        ],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")
    verify_on_disk(name, out_dir, cls, chosen)
    total = 0
    for f in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, f)
        if not os.path.islink(path):
            total += os.path.getsize(path)
        print(f"  wrote {path}" + (f" -> {os.readlink(path)}" if os.path.islink(path)
                                   else f" ({os.path.getsize(path)} bytes)"))
    print(f"  {name}: prompts {[len(ids) for _, ids in chosen]} tokens, "
          f"{total / 1e6:.2f} MB besides the checkpoint")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizers", default=os.path.join(HERE, "fixtures", "tokenizers"),
                    help="directory holding llama/tokenizer.json and qwen/tokenizer.json")
    ap.add_argument("--out", default=os.path.join(HERE, "fixtures"), help="output root")
    ap.add_argument("--only", choices=sorted(MODELS) + sorted(TRAINED), help="make one model only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    total = 0
    for name, spec in MODELS.items():
        if args.only and name != args.only:
            continue
        total += make_model(name, spec, args.tokenizers, args.out)
    for name, spec in TRAINED.items():
        if args.only and name != args.only:
            continue
        total += make_trained(name, spec, args.out)
    print(f"total {total / 1e6:.2f} MB (transformers {transformers.__version__}, "
          f"torch {torch.__version__})")


if __name__ == "__main__":
    main()
