"""The source tree's layout rules, checked on every CI run (no library needed).

- Rust: no file of ``crates/*/src`` depends on a file that depends back on it, directly or
  through others. Files are nodes of a graph; ``A -> B`` when ``A`` names an
  item that lives in ``B`` through a ``use`` declaration or a path in code that starts with
  ``crate::``, ``super::``, ``self::`` or the name of a child module ``A`` declares
  (``mod x86;`` ... ``x86::kernel(..)``), resolved through the module tree (``foo.rs`` and
  ``foo/mod.rs``, inline ``mod name { .. }`` blocks) and through ``use`` re-exports: a
  ``use super::Api`` that ``ffi/mod.rs`` satisfies with ``pub use api::Api`` is an edge to
  ``api.rs``, not to ``mod.rs``. Declaring ``mod child;`` is not an edge by itself.
  Comments (doc links included) and string literals are not code. Other crates and
  ``std`` are outside the graph (Cargo already forbids cycles between crates).
- Python: every module of ``python/trainops`` is at most 400 lines, except the gradient
  rule table (``autodiff/rules.py`` and the family modules that register into its one
  ``RULES`` table, ``autodiff/rules_*.py``: one rule per op).
- Python: no import cycle between modules of ``trainops`` through MODULE-LEVEL imports
  (those run when the module is imported, including under ``if``/``try`` at top level).
  Imports inside functions are left out: they run late, after every module is loaded, and
  are the package's way of breaking a load-time dependency on purpose (``__init__``'s lazy
  attributes, the CLI). ``if TYPE_CHECKING:`` blocks are left out too (never run).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CRATES = ROOT / "crates"
PACKAGE = ROOT / "python" / "trainops"
MAX_LINES = 400
SIZE_EXEMPT = {"autodiff/rules.py"}
SIZE_EXEMPT_GLOB = "autodiff/rules_*.py"  # families of the same table

# ---------------------------------------------------------------------------------------------
# Rust: module tree, use declarations, path references
# ---------------------------------------------------------------------------------------------

_CHAR = re.compile(r"b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^'\\\n])'")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MOD_DECL = re.compile(rf"\bmod\s+(?:r#)?({_IDENT})\s*([;{{])")
_USE = re.compile(r"\buse\s+([^;]*);")
_PATH = re.compile(rf"(?<![\w:$])(\$?crate|super|self|{_IDENT})((?:\s*::\s*{_IDENT})+)")


def strip_rust(text: str) -> str:
    """``text`` with comments, string and char literals blanked (same length, same lines)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and (i == 0 or not text[i - 1].isalnum()):
            end = text.find('"' + m.group(1), m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i : j + 1]))
            i = j + 1
        elif c == "'" and (m := _CHAR.match(text, i)):
            out.append(" " * (m.end() - i))
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_use_tree(tree: str, prefix: tuple[str, ...] = ()):
    """Yield ``(name_bound_or_'*', path)`` for a use tree such as ``a::{b, c::{self, d as e}}``."""
    tree = re.sub(r"\s*(::|[{},])\s*", r"\1", tree.strip())
    tree = re.sub(r"^(pub(\([^)]*\))?\s+)", "", tree).lstrip(":")
    brace = tree.find("{")
    if brace >= 0:
        base = prefix + tuple(s for s in tree[:brace].split("::") if s)
        body = tree[brace + 1 : tree.rfind("}")]
        depth, start = 0, 0
        for k, ch in enumerate(body + ","):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                part, start = body[start:k], k + 1
                if part:
                    yield from parse_use_tree(part, base)
        return
    m = re.fullmatch(r"(.*?)\s+as\s+(\w+)", tree)
    path, alias = (m.group(1), m.group(2)) if m else (tree, None)
    segs = prefix + tuple(s.strip() for s in path.split("::") if s.strip())
    if segs and segs[-1] == "self":
        segs = segs[:-1]
    if segs and segs[-1] == "*":
        yield "*", segs[:-1]
    elif segs and alias != "_":
        yield (alias or segs[-1]), segs


@dataclass
class Module:
    """One module: a file's or an inline ``mod name { .. }`` block's."""

    path: tuple[str, ...]
    file: Path
    parent: "Module | None"
    children: dict[str, "Module"] = field(default_factory=dict)
    bindings: dict[str, tuple[str, ...]] = field(default_factory=dict)  # use-bound names
    globs: list[tuple[str, ...]] = field(default_factory=list)
    refs: list[tuple[str, ...]] = field(default_factory=list)  # paths named in this module


def _inline_spans(code: str):
    """``(name, start, end)`` of every inline ``mod name { .. }`` block in stripped code."""
    spans = []
    for m in _MOD_DECL.finditer(code):
        if m.group(2) != "{":
            continue
        depth, j = 0, m.end() - 1
        while j < len(code):
            if code[j] == "{":
                depth += 1
            elif code[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        spans.append((m.group(1), m.start(), j + 1))
    return spans


def load_crate(src: Path, exclude=lambda p: False) -> Module:
    """The module tree of the crate rooted at ``src/lib.rs`` (or ``main.rs``), parsed."""
    root_file = src / "lib.rs" if (src / "lib.rs").exists() else src / "main.rs"
    root = Module((), root_file, None)
    _load_file(root, root_file, exclude)
    return root


def _load_file(module: Module, file: Path, exclude) -> None:
    code = strip_rust(file.read_text())
    spans = _inline_spans(code)

    def owner(pos: int) -> Module:
        """The innermost (inline) module whose body contains ``pos``."""
        chain = sorted((s for s in spans if s[1] < pos < s[2]), key=lambda s: s[1])
        m = module
        for name, _, _ in chain:
            m = m.children[name]
        return m

    for name, start, _ in sorted(spans, key=lambda s: s[1]):
        parent = owner(start)
        parent.children[name] = Module(parent.path + (name,), file, parent)
    for m in _MOD_DECL.finditer(code):
        if m.group(2) != ";":
            continue
        parent = owner(m.start())
        name = m.group(1)
        here = file.parent if file.name in ("lib.rs", "main.rs", "mod.rs") else file.with_suffix("")
        child_file = here / f"{name}.rs"
        if not child_file.exists():
            child_file = here / name / "mod.rs"
        child = Module(parent.path + (name,), child_file, parent)
        parent.children[name] = child
        if child_file.exists() and not exclude(child_file):
            _load_file(child, child_file, exclude)
    use_spans = []
    for m in _USE.finditer(code):
        use_spans.append((m.start(), m.end()))
        target = owner(m.start())
        for name, segs in parse_use_tree(m.group(1)):
            if name == "*":
                target.globs.append(segs)
            else:
                target.bindings[name] = segs
    for m in _PATH.finditer(code):
        if any(a <= m.start() < b for a, b in use_spans):
            continue
        segs = (m.group(1).lstrip("$"),) + tuple(s for s in re.split(r"\s*::\s*", m.group(2)) if s)
        owner(m.start()).refs.append(segs)


def _resolve(module: Module, segs: tuple[str, ...], root: Module, seen=frozenset()):
    """The module whose file holds the item ``segs`` names from ``module``, or None (extern)."""
    key = (module.path, segs)
    if key in seen or not segs:
        return module if not segs else None
    seen = seen | {key}
    first, rest = segs[0], segs[1:]
    if first == "crate":
        cur = root
    elif first == "super":
        cur = module.parent
    elif first == "self":
        cur = module
    elif first in module.children:
        cur = module.children[first]
    elif first in module.bindings:
        cur = _resolve(module, module.bindings[first], root, seen)
        if cur is None:
            return None
        return _walk(cur, rest, root, seen)
    else:
        return None  # an extern crate, std, a local variable's field: outside the graph
    if cur is None:
        return None
    return _walk(cur, rest, root, seen)


def _walk(cur: Module, rest: tuple[str, ...], root: Module, seen):
    while rest:
        name = rest[0]
        if name == "super":
            cur, rest = cur.parent, rest[1:]
            if cur is None:
                return None
        elif name == "self":
            rest = rest[1:]
        elif name in cur.children:
            cur, rest = cur.children[name], rest[1:]
        elif name in cur.bindings:
            target = _resolve(cur, cur.bindings[name], root, seen)
            # A name re-exported (or imported) by ``cur``: the item lives where it points.
            return cur if target is None else _walk(target, rest[1:], root, seen)
        else:
            return cur  # an item defined in cur (or reached through one of its globs)
    return cur


def _modules(m: Module):
    yield m
    for c in m.children.values():
        yield from _modules(c)


def rust_edges(src: Path, exclude=lambda p: False) -> dict[Path, set[Path]]:
    """File-level dependency graph of one crate: ``{file: {files it names items of}}``."""
    root = load_crate(src, exclude)
    edges: dict[Path, set[Path]] = {}
    for m in _modules(root):
        if not m.file.exists() or exclude(m.file):
            continue
        uses = [m.bindings[k] for k in m.bindings] + m.globs
        for segs in uses + [r for r in m.refs if r[0] in ("crate", "super", "self")]:
            t = _resolve(m, segs, root)
            if t is not None and t.file != m.file and t.file.exists():
                edges.setdefault(m.file, set()).add(t.file)
    return edges


def find_cycles(edges: dict) -> list[list]:
    """Every strongly connected component of more than one node (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    nodes = set(edges) | {t for ts in edges.values() for t in ts}

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def _crate_sources():
    return sorted(p for p in CRATES.glob("*/src") if (p / "lib.rs").exists() or (p / "main.rs").exists())


@pytest.mark.parametrize("src", _crate_sources(), ids=lambda p: p.parent.name)
def test_no_rust_file_imports_a_file_that_imports_it_back(src):
    edges = rust_edges(src)
    if len(list(src.rglob("*.rs"))) > 1:
        assert edges, f"no intra-crate edges found in {src}: the parser is broken"
    cycles = find_cycles(edges)
    shown = [
        "\n  ".join(
            f"{a.relative_to(src)} -> {', '.join(str(b.relative_to(src)) for b in sorted(edges[a]) if b in c)}"
            for a in c
        )
        for c in cycles
    ]
    if cycles:
        pytest.fail(f"import cycles between files of {src.relative_to(ROOT)}:\n  " + "\n\n  ".join(shown), pytrace=False)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _names(src: Path, cycles) -> list[list[str]]:
    return [[str(p.relative_to(src)) for p in c] for c in cycles]


def test_rust_checker_finds_cycles_through_every_kind_of_path(tmp_path):
    """The checker itself: each way a file can name another one closes a cycle it reports."""
    src = _write(
        tmp_path,
        {
            "lib.rs": "mod a;\nmod b;\nmod c;\nmod d;\npub mod e;\n",
            # a -> b through a `use` re-exported by e/mod.rs from e/inner.rs, b -> a in code
            "a.rs": "use crate::e::Inner;\npub fn fa() {}\n",
            "e/mod.rs": "mod inner;\npub use inner::Inner;\n",
            "e/inner.rs": "pub struct Inner;\nfn g() { crate::a::fa(); }\n",
            # c <-> d through `super::x::` in code and a grouped `use super::{..}` with a rename
            "c.rs": "pub fn fc() { super::d::fd() }\n",
            "d.rs": "use super::{c::fc as other};\npub fn fd() {}\n",
            # b: comments, doc links and strings name `super::c` but are not code
            "b.rs": "//! [`super::c::fc`]\n/* crate::d::fd */\nconst S: &str = \"crate::c::fc\";\n",
        },
    )
    cycles = _names(src, find_cycles(rust_edges(src)))
    assert sorted(cycles) == [["a.rs", "e/inner.rs"], ["c.rs", "d.rs"]]


def test_rust_checker_resolves_inline_modules_and_children(tmp_path):
    """`super::` inside an inline `mod tests {}` is the file's own module (no edge); a parent
    calling its child by bare name is not counted, a child's `use super::` is."""
    src = _write(
        tmp_path,
        {
            "lib.rs": "mod fam;\nmod low;\n",
            "fam/mod.rs": "mod x86;\npub struct T;\nfn f() { x86::k() }\n"
            "#[cfg(test)]\nmod tests { use super::*; use super::super::low::L; }\n",
            "fam/x86.rs": "use super::T;\npub fn k() {}\n",
            "low.rs": "pub struct L;\n",
        },
    )
    edges = {str(a.relative_to(src)): sorted(str(b.relative_to(src)) for b in bs) for a, bs in rust_edges(src).items()}
    assert edges == {"fam/mod.rs": ["low.rs"], "fam/x86.rs": ["fam/mod.rs"]}
    assert find_cycles(rust_edges(src)) == []


# ---------------------------------------------------------------------------------------------
# Python: file sizes, module-level import cycles
# ---------------------------------------------------------------------------------------------


def _package_files(package: Path = PACKAGE):
    return sorted(package.rglob("*.py"))


def test_python_modules_are_at_most_400_lines():
    too_long = {}
    for path in _package_files():
        rel = path.relative_to(PACKAGE).as_posix()
        n = len(path.read_text().splitlines())
        exempt = rel in SIZE_EXEMPT or Path(rel).match(SIZE_EXEMPT_GLOB)
        if not exempt and n > MAX_LINES:
            too_long[rel] = n
    assert not too_long, f"modules of python/trainops over {MAX_LINES} lines (split them): {too_long}"


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = (package.name,) + path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module):
    """Import nodes that run when the module is imported: at top level, or under a top-level
    ``if``/``try``/``with`` (not under ``if TYPE_CHECKING:``), never inside a def or class."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                todo.extend(node.body)
            todo.extend(node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody)
            for h in node.handlers:
                todo.extend(h.body)
        elif isinstance(node, ast.With):
            todo.extend(node.body)


def python_edges(package: Path = PACKAGE, imports=_top_level_imports) -> dict[str, set[str]]:
    """``{module: {trainops modules it imports}}``: through the import statements
    ``imports(tree)`` yields, by default those at module level (tests/test_import_graph.py
    passes every one). ``from pkg import name`` is an edge to ``pkg.name`` when that is a
    module, else to ``pkg`` (its ``__init__``); a module naming itself is no edge."""
    files = {_module_name(p, package): p for p in _package_files(package)}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        for node in imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names]
            for t in targets:
                if t in files and t != name:
                    edges.setdefault(name, set()).add(t)
    return edges


def test_python_package_has_no_module_level_import_cycle():
    edges = python_edges()
    assert edges, "no intra-package imports found: the parser is broken"
    cycles = find_cycles(edges)
    shown = ["\n  ".join(f"{a} -> {sorted(set(edges[a]) & set(c))}" for a in c) for c in cycles]
    if cycles:
        pytest.fail("import cycles between modules of trainops:\n  " + "\n\n  ".join(shown), pytrace=False)


def test_python_checker_counts_module_level_imports_only(tmp_path):
    """The checker itself: relative and absolute imports, under a top-level ``try``, close a
    cycle; an import inside a function or under ``if TYPE_CHECKING:`` does not."""
    pkg = _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a.py": "from .b import thing\n",
            "b.py": "try:\n    import pkg.a\nexcept ImportError:\n    pass\nthing = 1\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
            "d.py": "from . import c\ndef f():\n    from .c import x\n",
            "sub/__init__.py": "from .e import y\n",
            "sub/e.py": "from .. import a\ny = 1\n",
        },
    )
    edges = python_edges(pkg)
    assert edges == {
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a"},
        "pkg.d": {"pkg.c"},
        "pkg.sub": {"pkg.sub.e"},
        "pkg.sub.e": {"pkg.a"},
    }
    assert find_cycles(edges) == [["pkg.a", "pkg.b"]]
