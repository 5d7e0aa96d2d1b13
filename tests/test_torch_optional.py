"""torch is optional (the extra ``torch``): ``import trainops``, the Trainer and the metadata
reader of :mod:`trainops.train.torch_meta` never import it; only :mod:`trainops.torch` (the
bridge) does at module level. Runs with or without torch installed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import trainops
from trainops.train import torch_meta

ROOT = Path(trainops.__file__).parent


def test_no_module_outside_the_bridge_imports_torch_at_load():
    """Every ``import torch`` outside python/trainops/torch/ is inside a function."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "torch":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:  # module level (also under if/try at module level)
            for n in ast.walk(node) if not isinstance(node, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef,
                                                             ast.ClassDef)) else ():
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [n.module or ""] if isinstance(n, ast.ImportFrom) and n.level == 0 else []
                if any(m == "torch" or m.startswith("torch.") for m in names):
                    found.append(f"{rel}:{n.lineno}")
    assert not found, f"torch imported at module level outside trainops.torch: {found}"


def test_import_trainops_and_the_trainer_do_not_import_torch():
    code = ("import sys, trainops, trainops.train, trainops.train.torch_meta\n"
            "from trainops import Trainer, losses, optim\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    path = os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=dict(os.environ, PYTHONPATH=path))


def test_metadata_reader_refuses_a_malformed_record():
    m = onnx.ModelProto()
    m.graph.initializer.add(name="w")
    assert torch_meta.read(m) is None and torch_meta.trainable_params(m) is None
    torch_meta.write(m, {"params": {"a.w": {"initializer": "w", "transposed": False},
                                    "b.w": {"initializer": "w", "transposed": False}},
                         "buffers": {}})
    assert torch_meta.trainable_params(m) == ["w"]  # tied: one initializer
    for bad, why in (("{", "not JSON"), ('{"params": {}}', "keys 'params' and 'buffers'"),
                     ('{"params": {"x": {"initializer": "v", "transposed": false}}, '
                      '"buffers": {}}', "'v' is not an initializer")):
        m.metadata_props[0].value = bad
        with pytest.raises(ValueError, match=why):
            torch_meta.read(m)
    with pytest.raises(ValueError, match="not exported by trainops.torch.export"):
        torch_meta.state_dict(onnx.ModelProto(), {})
