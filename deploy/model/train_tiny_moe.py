#!/usr/bin/env python3
"""Trains moe-tiny-en, the bundled demo model: a small Qwen3-MoE (8 experts,
top-2, every layer MoE) on the English text of Debian's `fortunes` and
`fortunes-min` packages, on the CPU, in minutes.

    apt-get install -y fortunes fortunes-min
    python3 deploy/model/train_tiny_moe.py            # writes deploy/model/moe-tiny-en/

Needs torch, transformers (5.x), tokenizers, safetensors. Seeded: the data
split, the tokenizer, the initial weights, the batches and the dropout-free
training loop are fixed by --seed (bit-for-bit identical reruns need the
same torch build and thread count; --threads 2 is the default).

What it does:
  1. reads the fortune files (UTF-8 versions, *.u8) under /usr/share/games/
     fortunes, minus the ones in EXCLUDE; every 20th fortune (in file order)
     is held out;
  2. formats each fortune as a document: plain text, or, for Q:/A: riddles
     and every 4th other fortune, a ChatML conversation (the user asks for
     something on the file's topic, the assistant answers with the fortune),
     so that a chat prompt gets an English answer;
  3. trains a byte-level BPE (Qwen-style pre-tokenizer, vocab --vocab) on
     the training text;
  4. trains Qwen3MoeForCausalLM (AdamW, warm-up then cosine decay, random
     windows of --seq-len + 1 tokens from the packed token stream, Switch
     load-balancing loss on the routers);
  5. writes the Hugging Face layout in bf16 (config.json, model.safetensors,
     tokenizer.json, tokenizer_config.json with a ChatML template,
     generation_config.json) and train_log.json (losses, time, machine).
"""

import argparse
import glob
import json
import math
import os
import platform
import random
import re
import subprocess
import tempfile
import time

# Set before torch starts OpenMP: on a busy machine, threads that spin at
# barriers while their partner is descheduled made each step 5-10x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers,  # noqa: E402
                        pre_tokenizers, processors, trainers)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FORTUNE_DIR = "/usr/share/games/fortunes"
# Not English prose (pictures, other languages) or jokes built on stereotypes
# (not for a demo). The offensive set (fortunes-off, the off/ directory) is
# never read.
EXCLUDE = {"art", "ascii-art", "translate-me", "ethnic", "men-women"}
HELD_OUT_EVERY = 20

BOS = "<|endoftext|>"   # document separator, also pad
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"    # end of a turn: the chat EOS
SPECIALS = [BOS, IM_START, IM_END]
# Qwen2/3's pre-tokenizer regex (words, single digits, punctuation runs, spaces).
PRETOK_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# What the user asks for, per fortune file, when a fortune becomes a chat.
TOPICS = {
    "computers": "computers", "cookie": "life", "debian": "Debian", "definitions": "words",
    "disclaimer": "disclaimers", "drugs": "drugs", "education": "school", "food": "food",
    "fortunes": "life", "goedel": "logic", "humorists": "humor", "kids": "kids",
    "knghtbrd": "life", "law": "the law", "linux": "Linux", "linuxcookie": "Linux",
    "literature": "books", "love": "love", "magic": "magic", "medicine": "medicine",
    "miscellaneous": "anything", "news": "the news", "paradoxum": "paradoxes",
    "people": "people", "perl": "Perl", "pets": "pets", "platitudes": "life",
    "politics": "politics", "pratchett": "books", "riddles": "riddles", "science": "science",
    "songs-poems": "poetry", "sports": "sports", "startrek": "Star Trek", "tao": "the Tao",
    "wisdom": "wisdom", "work": "work", "zippy": "anything",
}
ASKS = ["Tell me something about {t}.", "What do you know about {t}?",
        "Say something about {t}.", "Give me a quote about {t}.", "Tell me a fortune."]


def read_fortunes(exclude):
    """(file name, fortune text) in sorted-file, in-file order."""
    out = []
    for path in sorted(glob.glob(os.path.join(FORTUNE_DIR, "*.u8"))):
        name = os.path.basename(path)[:-3]
        if name in exclude:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for chunk in re.split(r"\n%\n", "\n" + text + "\n"):
            body = unwrap([re.sub(r"[ \t]+", " ", ln).strip() for ln in chunk.split("\n")])
            body = re.sub(r"\n{3,}", "\n\n", body.strip("\n"))
            if len(body) >= 8:
                out.append((name, body))
    return out


def unwrap(lines, wrapped=45):
    """Joins hard-wrapped prose: a line of `wrapped` or more characters runs
    on into the next one unless that one is empty or an attribution
    ('-- Mark Twain'). Short lines (verse, lists, dialogue) keep their breaks."""
    out = []
    for ln in lines:
        if out and len(out[-1]) >= wrapped and ln and not ln.startswith("--") \
                and not out[-1].startswith("--"):
            out[-1] += " " + ln
        else:
            out.append(ln)
    return "\n".join(out)


def as_qa(body):
    """(question, answer) for a 'Q: ... A: ...' (or 'A: ... Q: ...') fortune."""
    m = re.search(r"(?:^|\n)Q:\s*(.+?)\s*(?:\n)A:\s*(.+)$", body, re.S)
    if m:
        return m.group(1), m.group(2)
    m = re.search(r"(?:^|\n)A:\s*(.+?)\s*\nQ:\s*(.+)$", body, re.S)
    if m:
        return m.group(2), m.group(1)
    return None


def chat(user, assistant):
    return (f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n")


def documents(fortunes, rng):
    """Formats fortunes as training documents (see the module comment)."""
    docs = []
    for i, (name, body) in enumerate(fortunes):
        qa = as_qa(body)
        if qa:
            docs.append(chat(qa[0].replace("\n", " "), qa[1].replace("\n", " ")))
        elif i % 4 == 1:
            ask = rng.choice(ASKS).format(t=TOPICS.get(name, "life"))
            docs.append(chat(ask, body))
        else:
            docs.append(body)
    return docs


def train_tokenizer(texts, vocab):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOK_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_stream(tok, docs):
    bos = tok.token_to_id(BOS)
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(bos)
    return torch.tensor(ids, dtype=torch.long)


def model_config(args, vocab, ids):
    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=args.d_model, num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head, num_key_value_heads=args.n_kv_head, head_dim=args.d_head,
        num_experts=args.n_expert, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.d_ff, intermediate_size=args.d_ff * 2, mlp_only_layers=[],
        decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rms_norm_eps=1e-6,
        max_position_embeddings=args.max_pos, use_sliding_window=False, sliding_window=None,
        attention_bias=False, bos_token_id=ids[BOS], eos_token_id=[ids[IM_END], ids[BOS]],
        pad_token_id=ids[BOS], hidden_act="silu", initializer_range=0.02,
        router_aux_loss_coef=args.aux_coef, output_router_logits=False)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def eval_loss(model, stream, seq_len, max_windows, batch=16):
    """Mean next-token cross-entropy over non-overlapping windows."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    for b0 in range(0, n, batch):
        rows = [stream[i * seq_len:(i + 1) * seq_len + 1] for i in range(b0, min(n, b0 + batch))]
        x = torch.stack(rows)
        logits = model(x[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for ln in out.splitlines():
            if ln.startswith("Model name:"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def save(model, tok, args, out_dir, log):
    """The Hugging Face layout, weights in bf16, plus the fields the C config
    parser reads at top level (rope_theta, num_experts)."""
    if os.path.isdir(out_dir):
        for f in os.listdir(out_dir):
            if f != "README.md":
                os.remove(os.path.join(out_dir, f))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tensors = {}
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(tmp, f), "pt") as s:
                    for k in s.keys():
                        tensors[k] = s.get_tensor(k).contiguous()
        with open(os.path.join(tmp, "config.json")) as f:
            config = json.load(f)
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["num_experts"] = config.get("num_experts", args.n_expert)
    config["output_router_logits"] = False
    config.pop("transformers_version", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(sorted(config.items())), f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": BOS, "eos_token": IM_END,
        "pad_token": BOS, "unk_token": None, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length":
        args.max_pos, "split_special_tokens": False, "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
        f.write("\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": config["pad_token_id"], "do_sample": True, "temperature": 0.8,
           "top_p": 0.95}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "moe-tiny-en"))
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-kv-head", type=int, default=2)
    ap.add_argument("--d-head", type=int, default=64)
    ap.add_argument("--n-expert", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=224, help="moe_intermediate_size")
    ap.add_argument("--max-pos", type=int, default=1024, help="max_position_embeddings")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--experts-impl", default="grouped_mm",
                    help="transformers experts implementation used for training")
    ap.add_argument("--autocast", type=int, default=1,
                    help="1: matmuls in bf16 (torch.autocast; weights and optimizer in f32)")
    ap.add_argument("--eval-windows", type=int, default=160)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    fortunes = read_fortunes(EXCLUDE)
    if not fortunes:
        raise SystemExit(f"no fortunes under {FORTUNE_DIR}: apt-get install -y fortunes fortunes-min")
    files = sorted({n for n, _ in fortunes})
    train_f = [f for i, f in enumerate(fortunes) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held_f = [f for i, f in enumerate(fortunes) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train_docs = documents(train_f, rng)
    held_docs = documents(held_f, random.Random(args.seed + 1))
    rng.shuffle(train_docs)

    tok = train_tokenizer([d for d in train_docs], args.vocab)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    train_ids = token_stream(tok, train_docs)
    held_ids = token_stream(tok, held_docs)
    print(f"data: {len(files)} files, {len(train_f)} train / {len(held_f)} held-out fortunes, "
          f"{len(train_ids)} / {len(held_ids)} tokens, vocab {vocab}", flush=True)

    cfg = model_config(args, vocab, ids)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = args.experts_impl
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(cfg)
    model.train()
    n_param = sum(p.numel() for p in model.parameters())
    print(f"model: {n_param / 1e6:.2f} M parameters ({2 * n_param / 1e6:.1f} MB in bf16)",
          flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(args.seed)
    max_start = len(train_ids) - args.seq_len - 1
    t_train = time.time()
    recent = []
    history = []
    for step in range(args.steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, args)
        starts = torch.randint(0, max_start, (args.batch,), generator=g)
        x = torch.stack([train_ids[s:s + args.seq_len + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.autocast)):
            out = model(x[:, :-1], output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss = ce + args.aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent.append(ce.item())
        if (step + 1) % args.log_every == 0 or step == 0:
            mean = sum(recent[-args.log_every:]) / len(recent[-args.log_every:])
            el = time.time() - t_train
            history.append({"step": step + 1, "train_ce": round(mean, 4),
                            "aux": round(out.aux_loss.item(), 4), "elapsed_s": round(el, 1)})
            print(f"step {step + 1}/{args.steps} lr {lr_at(step, args):.2e} train ce {mean:.4f} "
                  f"aux {out.aux_loss.item():.3f} {el:.0f}s "
                  f"({(step + 1) * args.batch * args.seq_len / el:.0f} tok/s)", flush=True)
    train_s = time.time() - t_train

    # Losses of what is shipped: the weights rounded to bf16 (computed in f32).
    model.float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.config._experts_implementation = "eager"
    held = eval_loss(model, held_ids, args.seq_len, args.eval_windows)
    train_eval = eval_loss(model, train_ids, args.seq_len, args.eval_windows)
    last = sum(recent[-100:]) / len(recent[-100:])
    total_s = time.time() - t_start
    log = {
        "command": "python3 deploy/model/train_tiny_moe.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "seed": args.seed, "threads": args.threads, "cpu": cpu_name(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "data": {"files": files, "excluded": sorted(EXCLUDE), "train_fortunes": len(train_f),
                 "held_out_fortunes": len(held_f), "train_tokens": len(train_ids),
                 "held_out_tokens": len(held_ids), "held_out_rule":
                 f"every {HELD_OUT_EVERY}th fortune in file order"},
        "parameters": n_param, "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_seconds": round(train_s, 1), "total_seconds": round(total_s, 1),
        "train_ce_last100_steps": round(last, 4),
        "train_ce_eval_bf16": round(train_eval, 4), "held_out_ce_bf16": round(held, 4),
        "held_out_ppl_bf16": round(math.exp(held), 2), "history": history,
    }
    save(model, tok, args, args.out, log)
    print(f"done in {total_s / 60:.1f} min (training {train_s / 60:.1f} min) on {cpu_name()}: "
          f"train ce {last:.4f} (last 100 steps), {train_eval:.4f} (eval, bf16); "
          f"held-out ce {held:.4f} (ppl {math.exp(held):.1f}, bf16) -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
