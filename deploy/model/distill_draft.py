#!/usr/bin/env python3
"""Trains the draft models for speculative decoding with moe-tiny-en: two
small dense students with the teacher's tokenizer, on the teacher's training
text (the same fortunes, the same held-out split), the same seed, shape and
steps; one distilled from the teacher, one on the text alone (the control):

    python3 deploy/model/distill_draft.py                 # both, into deploy/model/
    python3 deploy/model/distill_draft.py --only kd       # the distilled one

  draft-tiny-en-kd    loss = alpha * KL(teacher || student) at temperature T
                      (times T^2) + (1 - alpha) * next-token cross-entropy
  draft-tiny-en-text  loss = next-token cross-entropy

The student is a Qwen3MoeForCausalLM whose every layer is dense
(mlp_only_layers = all), so the engine loads it as it loads any checkpoint;
by default 2 layers of hidden 128, about a tenth of the teacher's compute per
token. Distilling at T = 1 matches what speculative decoding needs: a draft
token is kept with probability min(1, p/q), so the closer q is to the
teacher's p, the more drafts are kept.

Needs torch, transformers (5.x), tokenizers, safetensors and the Debian
`fortunes` / `fortunes-min` packages (as train_tiny_moe.py). Seeded; writes
each model's train_log.json with held-out cross-entropy, KL to the teacher
and top-1 agreement with the teacher (the acceptance a greedy draft gets).
"""

import argparse
import json
import math
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_tiny_moe as T  # noqa: E402  (the teacher's data pipeline)


def student_config(args, teacher_cfg):
    layers = list(range(args.n_layer))
    return Qwen3MoeConfig(
        vocab_size=teacher_cfg.vocab_size, hidden_size=args.d_model, num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head, num_key_value_heads=args.n_kv_head, head_dim=args.d_head,
        num_experts=1, num_experts_per_tok=1, moe_intermediate_size=args.d_ff,
        intermediate_size=args.d_ff, mlp_only_layers=layers, decoder_sparse_step=1,
        norm_topk_prob=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rms_norm_eps=1e-6,
        max_position_embeddings=teacher_cfg.max_position_embeddings, use_sliding_window=False,
        sliding_window=None, attention_bias=False, bos_token_id=teacher_cfg.bos_token_id,
        eos_token_id=teacher_cfg.eos_token_id, pad_token_id=teacher_cfg.pad_token_id,
        hidden_act="silu", initializer_range=0.02, output_router_logits=False)


@torch.no_grad()
def evaluate(student, teacher, stream, seq_len, max_windows, batch=16):
    """Held-out cross-entropy of the student, its KL(teacher || student) and
    its top-1 agreement with the teacher, over non-overlapping windows."""
    student.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    ce = kl = agree = count = 0.0
    for b0 in range(0, n, batch):
        x = torch.stack([stream[i * seq_len:(i + 1) * seq_len + 1]
                         for i in range(b0, min(n, b0 + batch))])
        s = student(x[:, :-1]).logits.float().flatten(0, 1)
        t = teacher(x[:, :-1]).logits.float().flatten(0, 1)
        ce += F.cross_entropy(s, x[:, 1:].flatten(), reduction="sum").item()
        kl += F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True,
                       reduction="sum").item()
        agree += (s.argmax(-1) == t.argmax(-1)).sum().item()
        count += s.shape[0]
    student.train()
    return ce / count, kl / count, agree / count


def train_one(kind, args, teacher, train_ids, held_ids, tok, out_dir):
    torch.manual_seed(args.seed)
    cfg = student_config(args, teacher.config)
    cfg._attn_implementation = "sdpa"
    student = Qwen3MoeForCausalLM(cfg)
    student.train()
    n_param = sum(p.numel() for p in student.parameters())
    print(f"{kind}: student {n_param / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in student.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in student.named_parameters()
                if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    targs = argparse.Namespace(lr=args.lr, warmup=args.warmup, steps=args.steps,
                               min_lr_frac=args.min_lr_frac)
    g = torch.Generator().manual_seed(args.seed)
    max_start = len(train_ids) - args.seq_len - 1
    t0 = time.time()
    recent, history = [], []
    for step in range(args.steps):
        for grp in opt.param_groups:
            grp["lr"] = T.lr_at(step, targs)
        starts = torch.randint(0, max_start, (args.batch,), generator=g)
        x = torch.stack([train_ids[s:s + args.seq_len + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.autocast)):
            s_logits = student(x[:, :-1]).logits.float().flatten(0, 1)
            if kind == "kd":
                with torch.no_grad():
                    t_logits = teacher(x[:, :-1]).logits.float().flatten(0, 1)
        ce = F.cross_entropy(s_logits, x[:, 1:].flatten())
        loss = ce
        if kind == "kd":
            tt = args.temperature
            kd = F.kl_div(F.log_softmax(s_logits / tt, -1), F.log_softmax(t_logits / tt, -1),
                          log_target=True, reduction="batchmean") * tt * tt
            loss = args.alpha * kd + (1 - args.alpha) * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        recent.append(ce.item())
        if (step + 1) % args.log_every == 0 or step == 0:
            mean = sum(recent[-args.log_every:]) / len(recent[-args.log_every:])
            el = time.time() - t0
            history.append({"step": step + 1, "train_ce": round(mean, 4),
                            "loss": round(loss.item(), 4), "elapsed_s": round(el, 1)})
            print(f"{kind} step {step + 1}/{args.steps} train ce {mean:.4f} loss "
                  f"{loss.item():.4f} {el:.0f}s", flush=True)
    train_s = time.time() - t0
    student.float()
    with torch.no_grad():  # what is shipped: bf16 weights
        for p in student.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ce, kl, agree = evaluate(student, teacher, held_ids, args.seq_len, args.eval_windows)
    log = {
        "command": "python3 deploy/model/distill_draft.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k not in ("out_root", "only")),
        "kind": kind, "teacher": os.path.relpath(args.teacher, HERE), "seed": args.seed,
        "threads": args.threads, "cpu": T.cpu_name(), "torch": torch.__version__,
        "transformers": transformers.__version__, "parameters": n_param,
        "loss": ("alpha * T^2 * KL(teacher || student at T) + (1 - alpha) * CE"
                 if kind == "kd" else "CE"),
        "alpha": args.alpha if kind == "kd" else 0.0,
        "temperature": args.temperature if kind == "kd" else None,
        "tokens_seen": args.steps * args.batch * args.seq_len, "train_seconds": round(train_s, 1),
        "held_out_ce_bf16": round(ce, 4), "held_out_ppl_bf16": round(math.exp(ce), 2),
        "held_out_kl_to_teacher": round(kl, 4), "held_out_top1_agreement": round(agree, 4),
        "history": history,
    }
    targs_save = argparse.Namespace(n_expert=1, max_pos=teacher.config.max_position_embeddings)
    T.save(student, tok, targs_save, out_dir, log)
    print(f"{kind}: {train_s / 60:.1f} min; held-out ce {ce:.4f}, KL to teacher {kl:.4f}, "
          f"top-1 agreement {agree:.3f} -> {out_dir}", flush=True)
    return log


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default=os.path.join(HERE, "moe-tiny-en"))
    ap.add_argument("--out-root", default=HERE)
    ap.add_argument("--only", choices=["kd", "text"])
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=2)
    ap.add_argument("--n-kv-head", type=int, default=1)
    ap.add_argument("--d-head", type=int, default=64)
    ap.add_argument("--d-ff", type=int, default=384)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--alpha", type=float, default=0.9, help="weight of the KL term (kd)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--autocast", type=int, default=1)
    ap.add_argument("--eval-windows", type=int, default=160)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    teacher = Qwen3MoeForCausalLM.from_pretrained(args.teacher, dtype=torch.float32,
                                                  attn_implementation="sdpa")
    teacher.eval()
    tok = Tokenizer.from_file(os.path.join(args.teacher, "tokenizer.json"))
    # the teacher's split and documents (train_tiny_moe.py, its seed)
    tlog = json.load(open(os.path.join(args.teacher, "train_log.json")))
    rng = random.Random(tlog["seed"])
    fortunes = T.read_fortunes(T.EXCLUDE)
    if not fortunes:
        raise SystemExit(f"no fortunes under {T.FORTUNE_DIR}: "
                         "apt-get install -y fortunes fortunes-min")
    every = T.HELD_OUT_EVERY
    train_f = [f for i, f in enumerate(fortunes) if i % every != every - 1]
    held_f = [f for i, f in enumerate(fortunes) if i % every == every - 1]
    train_docs = T.documents(train_f, rng)
    held_docs = T.documents(held_f, random.Random(tlog["seed"] + 1))
    train_ids = T.token_stream(tok, train_docs)
    held_ids = T.token_stream(tok, held_docs)
    print(f"data: {len(train_ids)} train / {len(held_ids)} held-out tokens", flush=True)
    for kind in ("kd", "text"):
        if args.only and kind != args.only:
            continue
        train_one(kind, args, teacher, train_ids, held_ids, tok,
                  os.path.join(args.out_root, f"draft-tiny-en-{kind}"))


if __name__ == "__main__":
    main()
