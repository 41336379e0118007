#!/usr/bin/env python3
"""Makes the chat-template fixtures under tests/golden/fixtures/chat_templates/:

  expected.json   every corpus template (fixtures/chat_templates/*.jinja and
                  the two bundled models' own templates) x every conversation
                  below, rendered by jinja2 as transformers renders chat
                  templates (chat_oracle.py); needs only jinja2.
  fuzz.json       a slice of chat_fuzz.py's random templates with jinja2's
                  results, so CI holds the C interpreter to them even
                  without jinja2.
  token_ids.json  the token ids of transformers' apply_chat_template for the
                  bundled models (tests/golden/fixtures/{qwen3_moe,mixtral});
                  needs transformers (no torch). Kept as it is when
                  transformers is missing.

Deterministic: a re-run with the same jinja2/transformers versions rewrites
identical files. CI never runs this; test_chat_live.py re-derives
expected.json live where jinja2 is installed.

  python3 tests/golden/make_chat_fixtures.py
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
OUT = os.path.join(FIX, "chat_templates")
sys.path.insert(0, HERE)

import chat_oracle  # noqa: E402
import chat_fuzz  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city, in <units> & more",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. 'Paris'"},
            "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]
FLAT_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
               "parameters": {"city": {"type": "string"}, "days": {"type": "integer", "max": 7}}},
              {"name": "calc", "parameters": {"expr": {"type": "string"}}}]

CALL = {"type": "function", "function": {"name": "get_weather",
                                        "arguments": {"city": "Paris", "units": "celsius"}}}
CALL_STR = {"type": "function", "function": {"name": "search",
                                            "arguments": "{\"query\": \"moe serving\"}"}}

# name -> (messages, extra variables)
CONVERSATIONS = {
    "basic": ([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is a mixture of experts?"},
        {"role": "assistant", "content": "A model that routes each token to a few expert networks."},
        {"role": "user", "content": "How many experts does Mixtral use per token?"},
    ], {}),
    "no_system": ([
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ], {}),
    "single_user": ([{"role": "user", "content": "One question only."}], {}),
    "system_only": ([{"role": "system", "content": "Only a system prompt."}], {}),
    "unicode": ([
        {"role": "system", "content": "Réponds en français. 日本語もOK 🙂"},
        {"role": "user", "content": "Grüße! Ελληνικά, עברית, 中文, emoji 👩‍🔬 and e\u0301 combining"},
        {"role": "assistant", "content": "Ｆｕｌｌ－ｗｉｄｔｈ ｔｅｘｔ and ß → SS?"},
        {"role": "user", "content": "\u2028line sep\u00a0nbsp\u3000ideographic space"},
    ], {}),
    "empty_content": ([
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": " "},
    ], {}),
    "content_parts": ([
        {"role": "system", "content": [{"type": "text", "text": "System as parts."}]},
        {"role": "user", "content": [{"type": "text", "text": "First part."},
                                     {"type": "image", "image": "<image data>"},
                                     {"type": "text", "text": "Second part."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Parts back."}]},
        {"role": "user", "content": [{"type": "text", "text": "Last."}]},
    ], {}),
    "whitespace": ([
        {"role": "system", "content": "  padded system  \n"},
        {"role": "user", "content": "\n\tindented question\n\n"},
        {"role": "assistant", "content": "   answer with spaces   "},
        {"role": "user", "content": "trailing newline\n"},
    ], {}),
    "special_chars": ([
        {"role": "user", "content": "Quotes ' \" backslash \\ {{ not a tag }} {% raw %} <b>&amp;</b>"},
        {"role": "assistant", "content": "JSON: {\"a\": [1, 2]} and a tab\there"},
        {"role": "user", "content": "<|im_start|> and [INST] typed by a user"},
    ], {}),
    "think": ([
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "<think>\nAgain simple.\n</think>\n\n6"},
    ], {}),
    "reasoning_field": ([
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Recall optics."},
        {"role": "user", "content": "Shorter?"},
    ], {"enable_thinking": True}),
    "no_thinking": ([
        {"role": "system", "content": "Think less."},
        {"role": "user", "content": "Quick answer please."},
    ], {"enable_thinking": False}),
    "tools": ([
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
        {"role": "tool", "content": "second result"},
        {"role": "assistant", "content": "It is 21 °C and clear."},
        {"role": "user", "content": "Thanks"},
    ], {"tools": TOOLS}),
    "tool_call_string_args": ([
        {"role": "user", "content": "Search for moe serving."},
        {"role": "assistant", "content": "Searching.", "tool_calls": [CALL_STR]},
        {"role": "tool", "content": "results..."},
    ], {"tools": TOOLS}),
    "flat_tools": ([
        {"role": "user", "content": "Use the tools listing."},
    ], {"tools": FLAT_TOOLS}),
    "llama_options": ([
        {"role": "system", "content": "System."},
        {"role": "user", "content": "Weather?"},
    ], {"tools": TOOLS, "tools_in_user_message": False, "date_string": "01 Jan 2025",
        "builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"]}),
    "alternation_error": ([
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ], {}),
    "bad_role": ([
        {"role": "user", "content": "hi"},
        {"role": "narrator", "content": "meanwhile"},
    ], {}),
    "long": ([{"role": ("user" if i % 2 == 0 else "assistant"), "content": f"turn {i}: " + "word " * i}
              for i in range(20)], {}),
    "numbers": ([
        {"role": "user", "content": "Numbers in extra variables."},
    ], {"tools": [{"name": "f", "parameters": {"a": 1, "b": 2.5, "c": -0.125, "d": 1e-07,
                                               "e": 12345678901, "f": True, "g": None}}]}),
}

TOKENS = {  # bos/eos handed to the corpus templates
    "qwen3_style.jinja": (None, "<|im_end|>"),
    "mistral_style.jinja": ("<s>", "</s>"),
    "llama3_style.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "deepseek_v3_style.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "macros_style.jinja": ("<bos>", "<eos>"),
}
MODELS = ["qwen3_moe", "mixtral"]


def model_template(model):
    """The template and bos/eos as chat_template_load reads them."""
    d = os.path.join(FIX, model)
    cfg = {}
    if os.path.exists(os.path.join(d, "tokenizer_config.json")):
        with open(os.path.join(d, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    p = os.path.join(d, "chat_template.jinja")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            src = f.read()
    else:
        src = cfg["chat_template"]

    def tok(v):
        return v.get("content") if isinstance(v, dict) else v
    return src, tok(cfg.get("bos_token")), tok(cfg.get("eos_token"))


def corpus_cases():
    """Every (template, conversation, add_generation_prompt) with jinja2's result."""
    cases = []
    sources = []
    for name in sorted(TOKENS):
        with open(os.path.join(OUT, name), encoding="utf-8") as f:
            sources.append((name, f.read(), TOKENS[name][0], TOKENS[name][1], False))
    for m in MODELS:
        src, bos, eos = model_template(m)
        sources.append(("model:" + m, src, bos, eos, True))
    for tname, src, bos, eos, own in sources:
        for cname, (messages, extra) in CONVERSATIONS.items():
            for agp in (False, True):
                case = {"template": tname, "conversation": cname, "messages": messages,
                        "add_generation_prompt": agp, "extra": extra}
                # a model's own bos/eos come from its tokenizer_config (null here)
                case["bos_token"] = None if own else bos
                case["eos_token"] = None if own else eos
                r = dict(case, bos_token=bos, eos_token=eos)
                out, err = chat_oracle.render(src, r)
                if out is not None:
                    case["out"] = out
                else:
                    case["error"] = err
                cases.append(case)
    return cases


def fuzz_cases(seed=7, n=200):
    out = []
    for i in range(n):
        c = chat_fuzz.make_case(seed, i)
        text, err = chat_oracle.render(c["template"], c)
        if text is not None and " object at 0x" in text.lower():
            continue
        if text is not None:
            c["out"] = text
        else:
            c["error"] = err
        out.append(c)
    return out


TOKEN_CONVERSATIONS = ["basic", "no_system", "single_user", "unicode", "whitespace", "special_chars",
                       "think", "long", "empty_content"]
QWEN_ONLY = ["tools", "no_thinking", "reasoning_field", "system_only"]


def token_cases():
    import transformers
    from transformers import AutoTokenizer
    out = []
    for m in MODELS:
        tok = AutoTokenizer.from_pretrained(os.path.join(FIX, m))
        names = TOKEN_CONVERSATIONS + (QWEN_ONLY if m == "qwen3_moe" else [])
        for cname in names:
            messages, extra = CONVERSATIONS[cname]
            for agp in (False, True):
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp,
                                               **extra)
                ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=agp,
                                              **extra)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                out.append({"model": m, "conversation": cname, "messages": messages,
                            "add_generation_prompt": agp, "extra": extra, "text": text,
                            "ids": list(ids)})
    return out, transformers.__version__


def write(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main():
    import jinja2
    write(os.path.join(OUT, "expected.json"),
          {"format": "moe-chat-templates", "version": 1, "jinja2_version": jinja2.__version__,
           "cases": corpus_cases()})
    write(os.path.join(OUT, "fuzz.json"),
          {"format": "moe-chat-fuzz", "version": 1, "jinja2_version": jinja2.__version__,
           "seed": 7, "cases": fuzz_cases()})
    try:
        cases, tv = token_cases()
    except ImportError as e:
        print(f"token_ids.json kept as it is ({e})")
        return
    write(os.path.join(OUT, "token_ids.json"),
          {"format": "moe-chat-token-ids", "version": 1, "transformers_version": tv,
           "cases": cases})


if __name__ == "__main__":
    main()
