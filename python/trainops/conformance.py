"""Run onnx's own backend test cases of the ``ai.onnx.preview.training`` domain through
ONNX Runtime with the trainops library registered.

Cases come from a directory in onnx's backend-test layout (``<name>/model.onnx``,
``<name>/test_data_set_<i>/{input,output}_<k>.pb``): by default the copy inside the
installed package (``trainops/data/onnx-node``), else the source checkout's
``models/onnx-node`` (written by ``scripts/export_conformance.py``); or, with
``from_onnx=True``, straight from the installed onnx's test-case generators.

Each case gets a row ``(name, status, detail)`` with status ``"pass"``, ``"fail"`` or
``"not implemented"`` (the session does not load because the operator is not
registered). ``Gradient`` is listed too: a custom-op library cannot implement it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .onnx_defs import IR_VERSION, TRAINING_DOMAIN

__all__ = [
    "DOMAIN",
    "Case",
    "Row",
    "find_models_dir",
    "load_cases_from_dir",
    "load_cases_from_onnx",
    "run_case",
    "run_conformance",
    "format_table",
    "versions",
]

DOMAIN = TRAINING_DOMAIN
DEFAULT_RTOL = 1e-3  # onnx's node test cases' defaults
DEFAULT_ATOL = 1e-7
MAX_IR_VERSION = IR_VERSION  # newer models are lowered to this (onnxruntime 1.17 loads <= 9)

GRADIENT_DETAIL = "needs the graph's backward pass, which a custom-op library cannot build"

_PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKOUT_ROOT = _PACKAGE_DIR.parent.parent  # python/trainops -> repository root

# How onnxruntime says that it has no kernel/schema for an operator.
_NOT_IMPLEMENTED = re.compile(
    r"is not a registered function/op"
    r"|Could not find an implementation for"
    r"|No Op registered for"
    r"|No opset import for domain"
    r"|Unrecognized attribute: domain",
    re.IGNORECASE,
)


class Row(NamedTuple):
    name: str
    status: str  # "pass" | "fail" | "not implemented"
    detail: str


@dataclass
class Case:
    name: str
    model: Any  # onnx.ModelProto
    data_sets: list[tuple[list[np.ndarray], list[np.ndarray]]] = field(default_factory=list)
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL

    @property
    def op_types(self) -> list[str]:
        return sorted({n.op_type for n in self.model.graph.node if n.domain == DOMAIN})


def find_models_dir() -> Path | None:
    """``trainops/data/onnx-node`` (installed) first, then ``<checkout>/models/onnx-node``."""
    for candidate in (_PACKAGE_DIR / "data" / "onnx-node",
                      _CHECKOUT_ROOT / "models" / "onnx-node"):
        if candidate.is_dir() and any(candidate.glob("*/model.onnx")):
            return candidate
    return None


def _uses_domain(model) -> bool:
    return (any(op.domain == DOMAIN for op in model.opset_import)
            or any(node.domain == DOMAIN for node in model.graph.node))


def _load_tensor(path: Path) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(tensor)


def load_cases_from_dir(models_dir: str | Path) -> list[Case]:
    """Every ``<name>/model.onnx`` case under ``models_dir``, sorted by name."""
    import onnx

    models_dir = Path(models_dir)
    cases = []
    for model_path in sorted(models_dir.glob("*/model.onnx")):
        case_dir = model_path.parent
        model = onnx.load(str(model_path))
        data_sets = []
        for ds in sorted(case_dir.glob("test_data_set_*"),
                         key=lambda p: int(p.name.rsplit("_", 1)[1])):
            def read(prefix, ds=ds):
                files = sorted(ds.glob(f"{prefix}_*.pb"),
                               key=lambda p: int(p.stem.rsplit("_", 1)[1]))
                return [_load_tensor(f) for f in files]
            data_sets.append((read("input"), read("output")))
        cases.append(Case(case_dir.name, model, data_sets))
    return cases


def load_cases_from_onnx(nodes: bool = True, models: bool = True) -> list[Case]:
    """The installed onnx's node test cases (and model test cases, where its ``Gradient``
    cases live) whose model uses the training domain."""
    from onnx.backend.test.case import model as model_cases
    from onnx.backend.test.case import node as node_cases

    found = []
    collected = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some unrelated exporters warn about casts
        if nodes:
            collected += list(node_cases.collect_testcases(None))
        if models:
            collected += list(model_cases.collect_testcases())
    for c in collected:
        if c.model is None or not c.data_sets or not _uses_domain(c.model):
            continue
        data_sets = [([np.asarray(a) for a in ins], [np.asarray(a) for a in outs])
                     for ins, outs in c.data_sets]
        found.append(Case(c.name, c.model, data_sets, c.rtol, c.atol))
    return sorted(found, key=lambda c: c.name)


def _gradient_cases_from_onnx() -> list[Case]:
    try:
        return [c for c in load_cases_from_onnx(nodes=False) if "Gradient" in c.op_types]
    except Exception:  # noqa: BLE001 - onnx's generators are optional here
        return []


def _first_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _session(model, library: str):
    import onnxruntime as ort

    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    model = copy
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _compare(name: str, actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float):
    """np.testing-style check; raises AssertionError."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {actual.shape}, expected {expected.shape}")
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)


def run_case(case: Case, library: str) -> Row:
    """Run one case; never raises for a case's own failure."""
    if "Gradient" in case.op_types:
        ops = "Gradient"
    else:
        ops = "/".join(case.op_types) or "?"
    try:
        sess = _session(case.model, library)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        if _NOT_IMPLEMENTED.search(msg):
            detail = f"{ops} not registered"
            if ops == "Gradient":
                detail += f" ({GRADIENT_DETAIL})"
            return Row(case.name, "not implemented", detail)
        return Row(case.name, "fail", "session: " + _first_line(msg))
    if not case.data_sets:
        return Row(case.name, "fail", "case has no test data")
    in_names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    worst = 0.0
    for d, (inputs, expected) in enumerate(case.data_sets):
        if len(inputs) != len(in_names) or len(expected) != len(out_names):
            return Row(case.name, "fail",
                       f"data set {d}: {len(inputs)} inputs/{len(expected)} outputs for a "
                       f"model with {len(in_names)}/{len(out_names)}")
        try:
            actual = sess.run(out_names, dict(zip(in_names, inputs)))
        except Exception as exc:  # noqa: BLE001
            return Row(case.name, "fail", f"data set {d}: run: " + _first_line(str(exc)))
        for name, a, e in zip(out_names, actual, expected):
            try:
                _compare(name, a, e, case.rtol, case.atol)
            except AssertionError as exc:
                lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                return Row(case.name, "fail", f"data set {d}: " + _first_line("; ".join(lines)))
            if a.size:
                worst = max(worst, float(np.max(np.abs(
                    np.asarray(a, np.float64) - np.asarray(e, np.float64)))))
    n = len(case.data_sets)
    return Row(case.name, "pass",
               f"{ops}: {n} data set{'s' * (n != 1)}, {len(out_names)} outputs, "
               f"max |diff| {worst:.3g} (rtol {case.rtol:g}, atol {case.atol:g})")


def run_conformance(models_dir: str | Path | None = None, from_onnx: bool = False,
                    library: str | None = None) -> list[Row]:
    """Rows for every case in ``models_dir`` (default: :func:`find_models_dir`), or from
    the installed onnx with ``from_onnx``, plus ``Gradient``."""
    if library is None:
        from . import get_library_path

        library = get_library_path()
    if from_onnx:
        cases = load_cases_from_onnx()
    else:
        if models_dir is None:
            models_dir = find_models_dir()
        if models_dir is None:
            raise FileNotFoundError(
                "no conformance models: looked at "
                f"{_PACKAGE_DIR / 'data' / 'onnx-node'} and "
                f"{_CHECKOUT_ROOT / 'models' / 'onnx-node'} "
                "(write them with scripts/export_conformance.py, or use --from-onnx)")
        cases = load_cases_from_dir(models_dir)
    rows = [run_case(c, library) for c in cases]
    if not any("Gradient" in c.op_types for c in cases):
        grads = _gradient_cases_from_onnx()
        rows += [run_case(c, library) for c in grads]
        if not grads:
            rows.append(Row("Gradient", "not implemented", GRADIENT_DETAIL))
    return rows


def versions() -> dict[str, str]:
    import onnxruntime

    out = {"onnxruntime": onnxruntime.__version__}
    try:
        import onnx

        out["onnx"] = onnx.__version__
    except ImportError:  # pragma: no cover
        out["onnx"] = "not installed"
    return out


def format_table(rows: list[Row]) -> str:
    w_name = max([len("case")] + [len(r.name) for r in rows])
    w_stat = max([len("status")] + [len(r.status) for r in rows])
    lines = [f"{'case':<{w_name}}  {'status':<{w_stat}}  detail",
             f"{'-' * w_name}  {'-' * w_stat}  {'-' * 6}"]
    lines += [f"{r.name:<{w_name}}  {r.status:<{w_stat}}  {r.detail}" for r in rows]
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "not implemented")}
    lines.append(f"{counts['pass']} pass, {counts['fail']} fail, "
                 f"{counts['not implemented']} not implemented")
    return "\n".join(lines)
