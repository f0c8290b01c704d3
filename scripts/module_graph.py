#!/usr/bin/env python3
"""List the import edges between the source files of a crate and print the cycles.

Usage: scripts/module_graph.py [SRC_DIR] [--edges] [--no-tests]

An edge A -> B means that file A names an item defined in file B through a
`crate::`, `super::` or `self::` path (in a `use` or inline). A re-export is
followed to the file that defines the item, so `use crate::Message` counts as
an edge to `message.rs`, not to `lib.rs`. Code inside an inline `mod tests`
counts unless --no-tests is given. Cycles are the strongly connected groups
of two or more files; the exit status is 1 when there is one.
"""

import os
import re
import sys


def module_files(src):
    """Map module path (tuple) -> file path relative to src."""
    files = {}
    for root, _dirs, names in os.walk(src):
        for name in names:
            if not name.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, name), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            files[tuple(parts)] = rel
    return files


def strip_comments_and_strings(text):
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and not re.match(r"\w", text[i - 1:i] or " "):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            out.append('""')
            i = n if end < 0 else end + 1 + len(m.group(1))
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or text.startswith("'\\u{", i):
            j = text.find("'", i + 1)
            out.append("' '")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use(tree):
    """Expand a use tree ("a::{b, c::d as e}") into (path list, alias)."""
    tree = re.sub(r"\s*(::|[{},])\s*", r"\1", re.sub(r"\s+", " ", tree.strip()))
    results = []

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        return parts

    def walk(prefix, s):
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            head = s[:brace].rstrip(":")
            head_parts = [p for p in head.split("::") if p]
            for part in split_top(s[brace + 1:-1]):
                walk(prefix + head_parts, part)
            return
        alias = None
        m = re.match(r"(.*?)\s+as\s+(\w+)$", s.strip())
        if m:
            s, alias = m.group(1), m.group(2)
        segs = [p.strip() for p in s.split("::") if p.strip()]
        if segs == ["self"]:
            segs = []
        results.append((prefix + segs, alias))

    walk([], tree)
    return results


def absolute(segs, module, files):
    """Make a path absolute from module (tuple); None for external crates."""
    if not segs:
        return None
    if tuple(module) + (segs[0],) in files:
        return list(module) + list(segs)
    if segs[0] == "crate":
        return list(segs[1:])
    if segs[0] in ("super", "self"):
        base = list(module)
        i = 0
        while i < len(segs) and segs[i] in ("super", "self"):
            if segs[i] == "super":
                base = base[:-1]
            i += 1
        return base + list(segs[i:])
    return None


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = module_files(src)
        self.texts = {}
        self.aliases = {}  # module -> {name: absolute path}
        self.uses = {}  # file module -> [(absolute path, in_tests)]
        for module, rel in self.files.items():
            with open(os.path.join(src, rel), encoding="utf-8") as f:
                self.texts[module] = strip_comments_and_strings(f.read())
        for module in self.files:
            self.scan(module)

    def scan(self, module):
        text = self.texts[module]
        aliases = self.aliases.setdefault(module, {})
        found = []
        # Inline modules: track `mod NAME {` ... matching `}`.
        stack, depth = [], 0
        use_re = re.compile(r"\buse\s+([^;]+);")
        path_re = re.compile(r"\b(?:crate|super|self)(?:::\w+)+")
        mod_re = re.compile(r"\bmod\s+(\w+)\s*\{")
        i, n = 0, len(text)
        events = []
        for m in mod_re.finditer(text):
            events.append((m.end() - 1, "mod", m.group(1)))
        use_spans = []
        for m in use_re.finditer(text):
            events.append((m.start(), "use", m.group(1)))
            use_spans.append((m.start(), m.end()))
        for m in path_re.finditer(text):
            if any(a <= m.start() < b for a, b in use_spans):
                continue
            events.append((m.start(), "path", m.group(0)))
        events.sort()
        ev = 0
        pending_mod = {}
        for pos, kind, val in events:
            if kind == "mod":
                pending_mod[pos] = val
        for i, ch in enumerate(text):
            while ev < len(events) and events[ev][0] == i:
                _, kind, val = events[ev]
                ev += 1
                inner = tuple(module) + tuple(name for name, _ in stack)
                in_tests = any(name == "tests" for name, _ in stack)
                if kind == "use":
                    for segs, alias in expand_use(val):
                        target = absolute(segs, inner, self.files)
                        if target is None:
                            continue
                        found.append((target, in_tests))
                        if not stack and target:
                            name = alias or target[-1]
                            if name != "*":
                                aliases[name] = target
                elif kind == "path":
                    target = absolute(val.split("::"), inner, self.files)
                    if target is not None:
                        found.append((target, in_tests))
            if ch == "{":
                depth += 1
                if i in pending_mod:
                    stack.append((pending_mod[i], depth))
            elif ch == "}":
                if stack and stack[-1][1] == depth:
                    stack.pop()
                depth -= 1
        self.uses[module] = found

    def resolve(self, path, seen=0):
        """The file module that defines the item named by an absolute path."""
        path = [p for p in path if p != "*"]
        k = len(path)
        while k > 0 and tuple(path[:k]) not in self.files:
            k -= 1
        module = tuple(path[:k])
        rest = path[k:]
        if not rest or seen > 10:
            return module
        alias = self.aliases.get(module, {}).get(rest[0])
        if alias is not None and alias != path:
            return self.resolve(alias + rest[1:], seen + 1)
        return module

    def edges(self, with_tests=True):
        out = {}
        for module, found in self.uses.items():
            for target, in_tests in found:
                if in_tests and not with_tests:
                    continue
                dest = self.resolve(target)
                if dest != module and dest in self.files:
                    out.setdefault(module, set()).add(dest)
        return out


def cycles(edges):
    """Strongly connected components with two or more members (Tarjan)."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
                comps.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return comps


def is_within(a, b):
    """Whether module a is b or inside b."""
    return a[:len(b)] == b


def file_edges(edges):
    """Edges between files, leaving out a folder's mod.rs and its own parts."""
    return {
        a: {b for b in bs if not is_within(a, b) and not is_within(b, a)}
        for a, bs in edges.items()
    }


def module_edges(edges):
    """Edges lifted to sibling modules under their deepest common parent."""
    out = {}
    for a, bs in edges.items():
        for b in bs:
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            if k == len(a) or k == len(b):
                continue
            out.setdefault(a[:k + 1], set()).add(b[:k + 1])
    return out


def show(title, edges, name):
    comps = cycles(edges)
    total = sum(len(v) for v in edges.values())
    print(f"{title}: {total} edges, {len(comps)} cycle(s)")
    for comp in comps:
        members = set(comp)
        print("  cycle: " + ", ".join(name(m) for m in comp))
        for a in comp:
            for b in sorted(edges.get(a, ()) & members, key=name):
                print(f"    {name(a)} -> {name(b)}")
    return len(comps)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "src")
    crate = Crate(src)
    edges = crate.edges(with_tests="--no-tests" not in sys.argv)
    name = lambda m: crate.files[m]
    if "--edges" in sys.argv:
        for a in sorted(edges, key=name):
            for b in sorted(edges[a], key=name):
                print(f"{name(a)} -> {name(b)}")
    print(f"{len(crate.files)} files")
    found = show("files (a folder's mod.rs and its parts are one)", file_edges(edges), name)
    modname = lambda m: "crate::" + "::".join(m)
    found += show("modules (siblings under a common parent)", module_edges(edges), modname)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
