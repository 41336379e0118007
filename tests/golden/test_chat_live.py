#!/usr/bin/env python3
"""The chat-template corpus checked live against jinja2 on this machine:
every template x conversation of make_chat_fixtures.py is rendered by jinja2
(configured as transformers does) and by the C interpreter (chat_render),
and must agree byte for byte (or both fail). Also checks that the committed
expected.json still is what this jinja2 renders (a jinja2 upgrade that
changes a render shows here).

  test_chat_live.py --render build/tests/chat_render

Exit 77 (skipped) without jinja2.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import jinja2  # noqa: F401
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)
import make_chat_fixtures as mk  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", required=True)
    args = ap.parse_args()
    live = mk.corpus_cases()
    sources = {}
    for name in mk.TOKENS:
        with open(os.path.join(mk.OUT, name), encoding="utf-8") as f:
            sources[name] = (f.read(), *mk.TOKENS[name])
    for m in mk.MODELS:
        sources["model:" + m] = mk.model_template(m)
    batch = []
    for c in live:
        src, bos, eos = sources[c["template"]]
        batch.append({"template": src, "messages": c["messages"],
                      "add_generation_prompt": c["add_generation_prompt"],
                      "bos_token": bos, "eos_token": eos, "extra": c["extra"]})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(batch, f)
        path = f.name
    try:
        r = subprocess.run([args.render, path], capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(path)
    if r.returncode:
        print(f"chat_render failed: {r.stderr}")
        return 1
    got = json.loads(r.stdout)
    bad = 0
    for c, g in zip(live, got):
        ok = ("out" in c and g.get("out") == c["out"]) or ("error" in c and "error" in g)
        if not ok:
            bad += 1
            print(f"MISMATCH {c['template']} x {c['conversation']} "
                  f"add_generation_prompt={c['add_generation_prompt']}")
            print(f"  jinja2: {c.get('out', 'ERROR ' + c.get('error', ''))!r}")
            print(f"  C:      {g.get('out', 'ERROR ' + g.get('error', ''))!r}")
    with open(os.path.join(mk.OUT, "expected.json"), encoding="utf-8") as f:
        committed = json.load(f)["cases"]
    stale = sum(1 for a, b in zip(committed, live) if a != b) + abs(len(committed) - len(live))
    if stale:
        print(f"expected.json differs from this jinja2 ({jinja2.__version__}) in {stale} cases: "
              "rerun tests/golden/make_chat_fixtures.py")
    print(f"test_chat_live: {len(live)} cases, {bad} mismatches, {stale} stale")
    return 1 if bad or stale else 0


if __name__ == "__main__":
    sys.exit(main())
