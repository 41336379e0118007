#!/usr/bin/env python3
"""Makes the tokenizer fixtures under tests/golden/fixtures/tokenizers/.

Trains, deterministically, two small BPE tokenizers with the Hugging Face
`tokenizers` library on the multilingual text embedded below, and writes:

  qwen/tokenizer.json             byte-level BPE, Qwen2/Qwen3 layout
  llama/tokenizer.json            SentencePiece-style BPE (Prepend/Replace
                                  normalizer, byte fallback), Llama/Mistral layout
  llama_metaspace/tokenizer.json  same model, newer Metaspace pre-tokenizer form
  gpt2/tokenizer.json             GPT-2 layout (ByteLevel regex, NFKC, added
                                  tokens with lstrip/rstrip/single_word/normalized)
  cases.json                      for each tokenizer and each test string: the
                                  ids with and without special tokens and the
                                  decoded text with and without skip_special

The test text holds characters that the training text lacks (some CJK, emoji),
so the byte-level and byte-fallback paths are exercised.

Run: python3 tests/golden/make_tokenizers.py   (pip install tokenizers)
Re-running gives the same files byte for byte.
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import AddedToken, Regex

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "tokenizers")

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.
I don't think we'll go; I'll stay home, we've seen it, they're late, she's here.
Numbers: 12345 and 67890, 3.14159, 2024-06-01, 100% of 42 items cost $19.99.
Der schnelle braune Fuchs springt über den faulen Hund. Schöne Grüße aus Köln, Bär.
Le renard brun rapide saute par-dessus le chien paresseux. Ça coûte très cher, élève à l'école.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела?
我们今天去学校学习中文。你好，世界！天气很好。
今日は良い天気ですね。ありがとうございます。カタカナとひらがな。
안녕하세요. 오늘 날씨가 좋네요. 감사합니다.
مرحبا بالعالم. كيف حالك اليوم؟
Emoji: 😀 🎉 👍 and ❤️ hearts.
def main(args):
\tfor i in range(10):
\t\tprint("hello  world", i)   # two  spaces
    return   0

int add(int a, int b) { return a + b; }
   leading spaces and trailing spaces   
multiple    spaces\t\ttabs\n
"""

# Several strings with characters never seen in training (CJK 猫狗鸟龍, emoji 🦀🚀, Devanagari, Greek).
TEST_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "I don't think I'll go, we've SEEN it, THEY'RE here.",
    "Numbers 12345 67890 and 3.14159!",
    "Schöne Grüße über Bär — Ünïcödé.",
    "Ça coûte très cher à l'élève.",
    "Привет, мир! Быстрая лиса.",
    "我们今天学习中文，猫狗鸟龍。",
    "今日は良い天気です。ラーメン食べたい。",
    "안녕하세요, 세계! 반갑습니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "Emoji: 😀🎉 🦀🚀 ❤️ 👍🏽",
    "def f(x):\n\treturn x  +  1\n\n\n",
    "    indented\n        more\n\ttab\r\nwindows",
    "नमस्ते दुनिया Ελληνικά",
    "mixed: abc123def 你好🙂 Grüße  end   ",
]

EDGE_CASES = [
    "",
    " ",
    "  ",
    "   leading",
    "trailing   ",
    "a  b   c    d",
    "\n\n\t",
    "\n",
    "a<|im_end|>b",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "<s>hi</s>",
    "<s> hi </s>",
    "<unk>",
    "🦀",
    "猫狗鸟龍",
    "12345",
    "e\u0301",
    "\u00e9",
    "A\u030a and \u212b",
    "don't DON'T I'LL",
    "x" * 300,
    "x <mask> y",
    "x<mask>y  <mask>",
    "a [W] b",
    "a[W]b [W]",
    "fish \ufb01sh fishy",
    "<|bos|>hi<|eos|>",
    "\t \u3000 wide\u00a0space",
]


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1, sort_keys=False)
        f.write("\n")


def train_lines():
    return TRAIN_TEXT.split("\n")


def make_qwen():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    # Keep newlines in the training data.
    tok.train_from_iterator([line + "\n" for line in train_lines()], trainer=trainer)
    tok.add_special_tokens([
        AddedToken("<|endoftext|>", special=True, normalized=False),
        AddedToken("<|im_start|>", special=True, normalized=False),
        AddedToken("<|im_end|>", special=True, normalized=False),
    ])
    return tok


def make_llama(metaspace_form):
    # Train with a splitting Metaspace pre-tokenizer (as SentencePiece trains
    # on whitespace-separated pieces), then write the serving layout.
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always",
                                                 split=True)
    byte_tokens = ["<0x%02X>" % b for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=1, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens)
    tok.train_from_iterator(train_lines(), trainer=trainer)
    spec = json.loads(tok.to_str())
    # Byte tokens are plain vocabulary entries in Llama files, not added tokens.
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in ("<unk>", "<s>", "</s>")]
    for t in spec["added_tokens"]:
        t["special"] = True
        t["normalized"] = False
    if metaspace_form:
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                                 "prepend_scheme": "first", "split": False}
        spec["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
             "split": False},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]}
    else:
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        ]}
        spec["pre_tokenizer"] = None
        spec["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]}
    bos = tok.token_to_id("<s>")
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def make_gpt2():
    """GPT-2 style byte-level BPE (ByteLevel pre-tokenizer with its own regex
    and add_prefix_space), NFKC, a two-token template and added tokens with
    lstrip/rstrip, single_word and normalized."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator([line + "\n" for line in train_lines()], trainer=trainer)
    tok.add_special_tokens([
        AddedToken("<|bos|>", special=True, normalized=False),
        AddedToken("<|eos|>", special=True, normalized=False),
        AddedToken("<mask>", special=True, normalized=False, lstrip=True, rstrip=True),
    ])
    tok.add_tokens([
        AddedToken("[W]", special=False, normalized=False, single_word=True),
        AddedToken("\ufb01sh", special=False, normalized=True),
    ])
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", pair="<|bos|> $A <|eos|> $B:1 <|eos|>:1",
        special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>")),
                        ("<|eos|>", tok.token_to_id("<|eos|>"))])
    return tok


def cases_for(tok):
    out = []
    for text in TEST_TEXT + EDGE_CASES:
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_sp = tok.encode(text, add_special_tokens=True).ids
        out.append({
            "text": text,
            "ids": ids,
            "ids_special": ids_sp,
            "decode": tok.decode(ids_sp, skip_special_tokens=False),
            "decode_skip": tok.decode(ids_sp, skip_special_tokens=True),
        })
    return out


def decode_cases(tok):
    """Id sequences that are not the encoding of any text: a multi-byte
    character cut in the middle, lone continuation bytes, special tokens."""
    out = []
    n = tok.get_vocab_size(with_added_tokens=True)
    seqs = []
    for text in ["🦀", "猫", "Grüße", "é"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        seqs.append(ids[:-1])
        seqs.append(ids[1:])
        seqs.append(ids[1:] + ids[:1] + ids)
    seqs.append(list(range(0, min(n, 300), 7)))
    # (ids 3.. are <0x00>.. in the llama files: a NUL would not survive C strings)
    seqs.append(list(range(n - 3, n)) + list(range(0, 3)) + [n // 2])
    for ids in seqs:
        out.append({"ids": ids,
                    "decode": tok.decode(ids, skip_special_tokens=False),
                    "decode_skip": tok.decode(ids, skip_special_tokens=True)})
    return out


def main():
    toks = {
        "qwen": make_qwen(),
        "llama": make_llama(False),
        "llama_metaspace": make_llama(True),
        "gpt2": make_gpt2(),
    }
    cases = {}
    for name, tok in toks.items():
        path = os.path.join(OUT, name, "tokenizer.json")
        # Pretty-printed but stable: parse the library's own serialisation.
        write_json(path, json.loads(tok.to_str()))
        reloaded = Tokenizer.from_file(path)
        cases[name] = {"n_vocab": reloaded.get_vocab_size(with_added_tokens=True),
                       "encode": cases_for(reloaded),
                       "decode": decode_cases(reloaded)}
    cases["_comment"] = ("made by tests/golden/make_tokenizers.py with tokenizers " +
                         __import__("tokenizers").__version__)
    write_json(os.path.join(OUT, "cases.json"), cases)
    total = 0
    for root, _, files in os.walk(OUT):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    print("wrote %s (%d bytes)" % (OUT, total), file=sys.stderr)


if __name__ == "__main__":
    main()
