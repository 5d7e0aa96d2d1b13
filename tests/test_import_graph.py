"""The modules of python/trainops import each other without circles: every import statement
of every module, those inside functions included (a function-level import hides a circle
from Python's start-up but not from the design: each module should only look down), read
from the source with ``ast``, and the graph of "module imports module" checked for cycles.

Dynamic imports (``importlib.import_module`` of a computed name) are not seen."""

from __future__ import annotations

import ast
from pathlib import Path

import trainops
from test_layout import find_cycles, python_edges

# Circles known and owned elsewhere, each with why it is left: the bench package's facade
# (bench/__init__.py) imports harness and yardsticks, and harness imports TARGETS,
# load_target and targets back from the facade inside its functions (yardsticks reaches
# the facade through harness). Moving the target table out of __init__.py breaks it; when
# that happens, remove the entry here (the test then asks for it).
KNOWN = {
    frozenset({"trainops.bench", "trainops.bench.harness", "trainops.bench.yardsticks"}),
}


def every_import(tree: ast.Module):
    """Every import statement of a module, those inside functions included."""
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def import_edges(root: Path) -> dict[str, set[str]]:
    """Module -> the modules under ``root`` it imports, anywhere in its body: test_layout's
    python_edges, given every import statement instead of the module-level ones."""
    return python_edges(root, every_import)


def cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components with more than one module (test_layout's
    Tarjan)."""
    return {frozenset(c) for c in find_cycles(edges)}


def test_trainops_has_no_import_circles():
    root = Path(trainops.__file__).parent
    edges = import_edges(root)
    # The walk saw the package: the autodiff modules and their function-level imports.
    assert "trainops.autodiff.hygiene" in edges["trainops.autodiff.backward"]
    assert "trainops.autodiff.graph" in edges["trainops.autodiff.control"]
    found = cycles(edges)
    new = sorted(sorted(c) for c in found - KNOWN)
    assert not new, f"import circles in python/trainops (a module imports one that imports it " \
                    f"back, maybe inside a function): {new}"
    gone = sorted(sorted(c) for c in KNOWN - found)
    assert not gone, f"these known circles are gone: remove them from KNOWN: {gone}"


def test_the_detector_sees_function_level_and_package_circles(tmp_path):
    """The checker itself: a circle closed by an import inside a function, one through a
    package's __init__ (``from . import name``), and a clean chain that is none."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .a import x\n",  # a -> b -> a, inside a function
        "c.py": "from .d import y\n",
        "d.py": "import os\n",  # c -> d only
        "sub/__init__.py": "from .e import z\n",
        "sub/e.py": "def g():\n    from . import TABLE\n",  # sub -> sub.e -> sub
        "sub/f.py": "from ..c import y\nfrom .. import a\n",  # only down
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    edges = import_edges(pkg)
    assert edges["p.sub.f"] == {"p.c", "p.a"}
    assert cycles(edges) == {frozenset({"p.a", "p.b"}), frozenset({"p.sub", "p.sub.e"})}
