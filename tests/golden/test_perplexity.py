#!/usr/bin/env python3
"""The quality meter (moe-generate --perplexity) against transformers: for each
fixture with a ppl.json (written by make_ppl_fixtures.py), the f32 run's
perplexity equals transformers' to 1e-4 relative (4 digits and more), and the
bf16 run against the saved f32 base gives transformers' KL divergence (mean,
median, p99, max to 1e-2 relative) and top-1 agreement (to one position).
Bad inputs end with a message naming the file and field.

    test_perplexity.py MOE_GENERATE FIXTURES_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += not ok


def run(gen, *args):
    p = subprocess.run([gen, *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def number(pattern, text):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else float("nan")


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def main():
    gen, fix = sys.argv[1], sys.argv[2]
    text = os.path.join(fix, "ppl_text.txt")
    tmp = tempfile.mkdtemp(prefix="moe-ppl-")
    names = sorted(n for n in os.listdir(fix) if os.path.isfile(os.path.join(fix, n, "ppl.json")))
    check(len(names) >= 2, f"fixtures with ppl.json: {names}")
    for name in names:
        model = os.path.join(fix, name)
        ref = json.load(open(os.path.join(model, "ppl.json")))
        ctx = str(ref["ctx"])
        base = os.path.join(tmp, name + ".kl")
        common = ["--model", model, "--perplexity", text, "--ctx", ctx, "--exact"]
        rc, out, err = run(gen, *common, "--dtype", "f32", "--kl-save", base)
        check(rc == 0, f"{name} f32 run: exit {rc} {err.strip()[-200:] if rc else ''}")
        n_scored = int(number(r"(\d+) scored", out))
        check(n_scored == ref["n_scored"], f"{name}: {n_scored} scored positions, "
              f"transformers {ref['n_scored']}")
        ppl = number(r"ppl: ([0-9.e+-]+) \(mean", out)
        want = ref["f32"]["ppl"]
        check(rel(ppl, want) < 1e-4, f"{name} f32: ppl {ppl:.6f}, transformers {want:.6f} "
              f"(rel {rel(ppl, want):.2g})")
        rc, out, err = run(gen, *common, "--dtype", "bf16", "--kl-base", base)
        check(rc == 0, f"{name} bf16 run: exit {rc} {err.strip()[-200:] if rc else ''}")
        b = ref["bf16"]
        ppl16 = number(r"ppl: ([0-9.e+-]+) \(mean", out)
        check(rel(ppl16, b["ppl"]) < 1e-4, f"{name} bf16: ppl {ppl16:.6f}, transformers "
              f"{b['ppl']:.6f}")
        for key, pat in (("kl_mean", r"mean ([0-9.e+-]+),"), ("kl_median", r"median ([0-9.e+-]+),"),
                         ("kl_p99", r"p99 ([0-9.e+-]+),"), ("kl_max", r"max ([0-9.e+-]+);")):
            got = number(r"kl: .*?" + pat, out)
            check(rel(got, b[key]) < 1e-2, f"{name} {key}: {got:.6g}, transformers {b[key]:.6g}")
        top1 = number(r"top-1 agreement ([0-9.]+)%", out) / 100
        check(abs(top1 - b["top1"]) <= 1.0 / ref["n_scored"] + 1e-9,
              f"{name} top-1 agreement: {top1:.4f}, transformers {b['top1']:.4f}")

    # bad inputs: a clear message naming the file and field, non-zero exit
    model = os.path.join(fix, names[0]) if names else fix
    base = os.path.join(tmp, names[0] + ".kl") if names else "none"
    empty = os.path.join(tmp, "empty.txt")
    open(empty, "w").close()
    short = os.path.join(tmp, "short.txt")
    open(short, "w").write("A short text.")
    twice = os.path.join(tmp, "twice.txt")
    open(twice, "w").write(open(text).read() * 2)
    junk = os.path.join(tmp, "junk.kl")
    open(junk, "wb").write(b"not a base file at all, only some bytes" * 4)
    cases = [
        (["--perplexity", empty], "the file is empty"),
        (["--perplexity", short, "--ctx", "64"], "not one window of --ctx 64"),
        (["--perplexity", os.path.join(tmp, "missing.txt")], "missing.txt: No such file"),
        (["--perplexity", text, "--ctx", "16", "--kl-base", base], "ctx 32, this run uses 16"),
        (["--perplexity", twice, "--ctx", "32", "--kl-base", base], "tokens of another text"),
        (["--perplexity", text, "--ctx", "32", "--kl-base", junk], "not a file written by --kl-save"),
        (["--perplexity", text, "--ctx", "100000"], "--ctx 100000"),
        (["--prompt", "hi", "--kl-base", base], "go with --perplexity"),
    ]
    for args, want in cases:
        rc, out, err = run(gen, "--model", model, *args)
        check(rc != 0 and want in err, f"refused ({want}): exit {rc}, {err.strip().splitlines()[-1:]}")
    shutil.rmtree(tmp)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
