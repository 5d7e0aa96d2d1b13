#!/usr/bin/env python3
"""Export onnx's own node test cases for the ``ai.onnx.preview.training`` domain.

Writes, for every case of ``onnx.backend.test.case.node.collect_testcases`` whose model
uses that domain (by opset import or node domain; no hard-coded list)::

    models/onnx-node/<name>/model.onnx
    models/onnx-node/<name>/test_data_set_<i>/input_<k>.pb
    models/onnx-node/<name>/test_data_set_<i>/output_<k>.pb
    models/onnx-node/VERSION

in the layout of onnx's ``backend/test/data/node`` (the same serialisation as
``python -m onnx.backend.test.cmd_tools generate-data``: ``numpy_helper.from_array`` named
after the graph's inputs and outputs). The models are written exactly as onnx builds them
(IR version 7, which every supported onnxruntime loads).

Idempotent: a file is rewritten only when its bytes change, and case directories of this
domain that onnx no longer has are removed.

Usage: python scripts/export_conformance.py [--output DIR] [--check]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper

DOMAIN = "ai.onnx.preview.training"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "models" / "onnx-node"
COMMAND = "python scripts/export_conformance.py"


def uses_domain(model: onnx.ModelProto, domain: str = DOMAIN) -> bool:
    if any(op.domain == domain for op in model.opset_import):
        return True
    return any(node.domain == domain for node in model.graph.node)


def training_cases(domain: str = DOMAIN) -> list:
    """onnx's node test cases whose model uses ``domain``, sorted by name."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        # Collecting every node case evaluates all of onnx's exporters, some of which warn
        # about overflow in casts; none of that concerns us.
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    found = [c for c in cases if c.model is not None and uses_domain(c.model, domain)]
    return sorted(found, key=lambda c: c.name)


def _tensor_bytes(value, name: str) -> bytes:
    if isinstance(value, TensorProto):
        return value.SerializeToString()
    return numpy_helper.from_array(value, name).SerializeToString()


def case_files(case) -> dict[str, bytes]:
    """Relative path -> bytes for one case, as onnx's generate-data writes it."""
    files = {"model.onnx": case.model.SerializeToString()}
    graph = case.model.graph
    for i, (inputs, outputs) in enumerate(case.data_sets):
        ds = f"test_data_set_{i}"
        for k, value in enumerate(inputs):
            vi = graph.input[k]
            if not vi.type.HasField("tensor_type"):
                raise NotImplementedError(f"{case.name}: input {k} is not a tensor")
            files[f"{ds}/input_{k}.pb"] = _tensor_bytes(value, vi.name)
        for k, value in enumerate(outputs):
            vi = graph.output[k]
            if not vi.type.HasField("tensor_type"):
                raise NotImplementedError(f"{case.name}: output {k} is not a tensor")
            files[f"{ds}/output_{k}.pb"] = _tensor_bytes(value, vi.name)
    return files


def _write_if_changed(path: Path, data: bytes) -> bool:
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return True


def version_text(names: list[str]) -> str:
    lines = [
        f"onnx {onnx.__version__}",
        f"domain {DOMAIN}",
        f"command {COMMAND}",
        "cases " + " ".join(names),
    ]
    return "\n".join(lines) + "\n"


def export(output: Path = DEFAULT_OUTPUT, check: bool = False) -> list[str]:
    """Write (or with ``check``, compare) the cases; returns the paths that differ."""
    cases = training_cases()
    if not cases:
        raise SystemExit(f"onnx {onnx.__version__} has no node test cases in {DOMAIN}")
    wanted: dict[Path, bytes] = {}
    for case in cases:
        for rel, data in case_files(case).items():
            wanted[output / case.name / rel] = data
    wanted[output / "VERSION"] = version_text([c.name for c in cases]).encode()

    changed: list[str] = []
    names = {c.name for c in cases}
    # Stale case directories (a case onnx dropped) and stale files inside kept ones.
    if output.is_dir():
        for sub in sorted(output.iterdir()):
            if sub.is_dir() and (sub / "model.onnx").is_file() and sub.name not in names:
                changed.append(str(sub))
                if not check:
                    shutil.rmtree(sub)
        for name in sorted(names):
            case_dir = output / name
            if not case_dir.is_dir():
                continue
            for f in sorted(case_dir.rglob("*")):
                if f.is_file() and f not in wanted:
                    changed.append(str(f))
                    if not check:
                        f.unlink()
            for d in sorted((p for p in case_dir.rglob("*") if p.is_dir()), reverse=True):
                if not any(d.iterdir()):
                    d.rmdir()

    for path, data in wanted.items():
        if check:
            if not (path.is_file() and path.read_bytes() == data):
                changed.append(str(path))
        elif _write_if_changed(path, data):
            changed.append(str(path))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="target directory (default: models/onnx-node of this checkout)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the files on disk differ")
    args = parser.parse_args(argv)
    changed = export(args.output, check=args.check)
    verb = "differ" if args.check else "written"
    for path in changed:
        print(f"{verb}: {path}")
    print(f"{len(changed)} file(s) {verb}; onnx {onnx.__version__} -> {args.output}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
