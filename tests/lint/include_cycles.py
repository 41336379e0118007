#!/usr/bin/env python3
"""Fails if the project's files include each other in a circle.

A module is a .c/.h pair with the same path stem (worker/engine/engine.{c,h});
module A depends on module B when A's .c or .h includes B's header. Every
strongly connected set of more than one module is a circle and is printed.
A private header (NAME_internal.h) belongs to the code that includes it: it
may include its library's public header without that counting as a circle.
Includes are resolved the way the build resolves them: relative to the
including file, then to each folder the project puts on the include path.

  tests/lint/include_cycles.py [ROOT]
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCES = ("common", "kernels", "worker", "coordinator", "bench")
INCLUDE_DIRS = ["common", "kernels", "worker", "coordinator", "bench/moe_bench"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def files():
    for top in SOURCES:
        for d, _, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                if n.endswith((".c", ".h", ".cu", ".cuh")):
                    yield os.path.join(d, n)


def resolve(inc, src):
    for base in [os.path.dirname(src)] + [os.path.join(ROOT, d) for d in INCLUDE_DIRS]:
        p = os.path.normpath(os.path.join(base, inc))
        if os.path.isfile(p):
            return p
    return None  # generated (protobuf) or a system header


def module(path):
    return os.path.relpath(os.path.splitext(path)[0], ROOT)


def main():
    deps = {}
    for f in files():
        m = module(f)
        deps.setdefault(m, set())
        with open(f, encoding="utf-8", errors="replace") as fh:
            for inc in INCLUDE.findall(fh.read()):
                p = resolve(inc, f)
                if p and module(p) != m and not m.endswith("_internal"):
                    deps[m].add(module(p))
    # Tarjan's strongly connected components
    index, low, stack, on, sccs, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in deps.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(deps):
        if v not in index:
            visit(v)
    for c in sccs:
        print("include circle: " + " <-> ".join(c))
    print("%d modules, %d include circles" % (len(deps), len(sccs)))
    return 1 if sccs else 0


if __name__ == "__main__":
    sys.exit(main())
