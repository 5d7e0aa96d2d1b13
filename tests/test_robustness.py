"""Bad input for every op the library registers, through onnxruntime.

Each case feeds one op something wrong (arity, element types, shapes, element counts,
negative and enormous dimensions, NaN and Inf, missing, unknown and wrong-typed attributes,
IOBinding aliasing, a second registration) and asserts either a clear error (the op's name,
the input or attribute at fault, what was expected) or the documented result. After every
case the process is alive and a correct run gives the bits a fresh session gives: the same
session where the model can run correct input (models declare unknown ranks, so the op's
own checks run, not ONNX Runtime's), else a fresh one.

Documented results for non-finite input: Adam, Adagrad, Momentum and MemoryCeiling
propagate NaN and Inf elementwise (as the reference does; other elements are untouched);
MixedPrecisionAdam skips the step (``finite`` false, every output equals its input) when a
gradient divided by the loss scale is not finite, and otherwise propagates like Adam;
AllFinite answers false; DynamicLossScale is its rule applied to the value (a NaN scale
stays NaN on a finite step and becomes ``min_scale`` on a non-finite one). Unknown
attributes are ignored (ONNX Runtime passes them through; the result equals the node's
without them). PhiloxUniform and PhiloxNormal are their formulas for NaN or infinite
attributes (NaN and Inf come out where the float64 formula has them); PhiloxDropout
propagates non-finite data as IEEE arithmetic does, refuses a ratio outside [0, 1) in
training mode and ignores it otherwise. Their correct runs are checked against the numpy
reference of their contract (helpers.random_reference), not only against a fresh session.

Ops are listed in ``KITS``; an op the loaded library does not register (checked with a
session load) skips its cases with a reason, so ops added later are picked up by adding a
kit. ``python -m pytest tests/test_robustness.py -q -s -k count`` prints the case count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers import random_reference as ref
from trainops.models import TRAINING_DOMAIN, node_model

F16, F32, F64, I32, I64, U32 = np.float16, np.float32, np.float64, np.int32, np.int64, np.uint32
MP_DOMAIN = "com.trainops"
BENCH_DOMAIN = "com.trainops.bench"
SHAPES = [(2, 5), (7,)]  # the tensor groups of every correct optimizer run


# --- the ops -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kit:
    """One registered op: how to build its correct (dynamic) model and feeds."""

    op: str
    domain: str
    groups: str = ""  # optimizers: input groups after the scalars, the gradient second
    rewrites: str = ""  # optimizers: the groups the outputs rewrite, in output order
    scalars: tuple = ("R", "T")
    flags: tuple = ()  # bool outputs before the groups
    attrs: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def optimizer(self) -> bool:
        return bool(self.groups)


KITS = {
    "Adam": Kit("Adam", TRAINING_DOMAIN, "XGVH", "XVH"),
    "Adagrad": Kit("Adagrad", TRAINING_DOMAIN, "XGH", "XH"),
    "Momentum": Kit("Momentum", TRAINING_DOMAIN, "XGV", "XV",
                    attrs={"alpha": 0.9, "beta": 0.1, "mode": "standard", "norm_coefficient": 0.0}),
    "MixedPrecisionAdam": Kit("MixedPrecisionAdam", MP_DOMAIN, "XGVH", "XVH",
                              scalars=("R", "T", "loss_scale"), flags=("finite",)),
    "MemoryCeiling": Kit("MemoryCeiling", BENCH_DOMAIN, "XGVH", "XVH"),
    "Philox": Kit("Philox", MP_DOMAIN),
    "DynamicLossScale": Kit("DynamicLossScale", MP_DOMAIN),
    "AllFinite": Kit("AllFinite", MP_DOMAIN),
    "PhiloxUniform": Kit("PhiloxUniform", MP_DOMAIN, attrs={"low": -2.0, "high": 3.0}),
    "PhiloxNormal": Kit("PhiloxNormal", MP_DOMAIN, attrs={"mean": 1.5, "scale": 2.0}),
    "PhiloxDropout": Kit("PhiloxDropout", MP_DOMAIN),
}
OPTIMIZERS = [k for k, kit in KITS.items() if kit.optimizer]


def opt_model(kit: Kit, n: int = 2, dtype=F32, g_dtype=None, *, copy_dtype=None,
              extra_inputs: int = 0, missing_inputs: int = 0, extra_outputs: int = 0,
              missing_outputs: int = 0,
              types: dict | None = None, attrs: dict | None = None, drop_attrs=()):
    """An optimizer node over ``n`` tensor groups, every shape unknown. ``types`` overrides
    element types by input name; ``extra_*``/``missing_inputs`` break the arity."""
    types = dict(types or {})
    if g_dtype is None:
        g_dtype = F16 if kit.op == "MixedPrecisionAdam" else dtype
    inputs = [(s, F32 if s != "T" else I64, None) for s in kit.scalars]
    for k, p in enumerate(kit.groups):
        inputs += [(f"{p}_{i}", g_dtype if k == 1 else dtype, None) for i in range(1, n + 1)]
    inputs += [(f"Z_{j}", dtype, None) for j in range(extra_inputs)]
    inputs = inputs[:len(inputs) - missing_inputs]
    inputs = [(name, types.get(name, dt), shape) for name, dt, shape in inputs]
    outputs = [(f, np.bool_, None) for f in kit.flags]
    outputs += [(f"{p}_{i}_new", dtype, None) for p in kit.rewrites for i in range(1, n + 1)]
    node_attrs = {k: v for k, v in kit.attrs.items() if k not in drop_attrs}
    if copy_dtype:
        outputs += [(f"X_{i}_copy", copy_dtype, None) for i in range(1, n + 1)]
        node_attrs["copy_dtype"] = int(helper.np_dtype_to_tensor_dtype(np.dtype(copy_dtype)))
    outputs += [(f"Y_{j}", dtype, None) for j in range(extra_outputs)]
    outputs = outputs[:len(outputs) - missing_outputs]
    node_attrs.update(attrs or {})
    return node_model(kit.op, inputs, outputs, domain=kit.domain, **node_attrs)


def opt_feeds(kit: Kit, seed: int = 7, n: int = 2, dtype=F32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"R": np.array(0.05, F32), "T": np.array(3, I64)}
    if "loss_scale" in kit.scalars:
        feeds["loss_scale"] = np.array(1024.0, F32)
    for i, shape in enumerate(SHAPES[:n], 1):
        for k, p in enumerate(kit.groups):
            if k == 1:
                g = rng.standard_normal(shape)
                if kit.op == "MixedPrecisionAdam":
                    feeds[f"G_{i}"] = (g * 1024).astype(F16)
                else:
                    feeds[f"G_{i}"] = g.astype(dtype)
            elif p == "H":
                feeds[f"H_{i}"] = (0.01 * rng.random(shape)).astype(dtype)
            elif p == "V":
                feeds[f"V_{i}"] = (0.1 * rng.standard_normal(shape)).astype(dtype)
            else:
                feeds[f"{p}_{i}"] = rng.standard_normal(shape).astype(dtype)
    return feeds


def philox_model(*, shape_attr=None, shape_input=True, state_dtype=U32, shape_dtype=I64,
                 state_out=True, extra_inputs=0, attrs=None):
    inputs = [("state", state_dtype, None)]
    if shape_input:
        inputs.append(("shape", shape_dtype, None))
    inputs += [(f"Z_{j}", I64, None) for j in range(extra_inputs)]
    outputs = [("output", U32, None)] + ([("state_out", U32, None)] if state_out else [])
    node_attrs = dict(attrs or {})
    if shape_attr is not None:
        node_attrs["shape"] = shape_attr
    return node_model("Philox", inputs, outputs, domain=MP_DOMAIN, **node_attrs)


def philox_feeds() -> dict[str, np.ndarray]:
    return {"state": np.array([1, 2, 3, 4, 5, 6], U32), "shape": np.array([3, 5], I64)}


def loss_scale_model(scale=F32, good=I64, finite=np.bool_, **attrs):
    return node_model("DynamicLossScale", [("scale", scale, None), ("good_steps", good, None),
                                           ("finite", finite, None)],
                      [("new_scale", F32, None), ("new_good_steps", I64, None)],
                      domain=MP_DOMAIN, **attrs)


def loss_scale_feeds(scale=1024.0, good=5, finite=True) -> dict[str, np.ndarray]:
    return {"scale": np.array(scale, F32), "good_steps": np.array(good, I64),
            "finite": np.array(finite)}


def all_finite_model(dtypes=(F32, F64, F16), outputs=1, **attrs):
    return node_model("AllFinite", [(f"X_{i}", d, None) for i, d in enumerate(dtypes, 1)],
                      [(f"finite{'_' * j}", np.bool_, None) for j in range(outputs)],
                      domain=MP_DOMAIN, **attrs)


def all_finite_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"X_1": rng.standard_normal((3, 4)).astype(F32), "X_2": rng.standard_normal(5),
            "X_3": rng.standard_normal((2, 2)).astype(F16)}


def good_model(op: str):
    kit = KITS[op]
    if kit.optimizer:
        return opt_model(kit)
    if op in ("PhiloxUniform", "PhiloxNormal"):
        return dist_model(op)
    return {"Philox": philox_model, "DynamicLossScale": loss_scale_model,
            "AllFinite": all_finite_model, "PhiloxDropout": drop_model}[op]()


def good_feeds(op: str) -> dict[str, np.ndarray]:
    kit = KITS[op]
    if kit.optimizer:
        return opt_feeds(kit)
    return {"Philox": philox_feeds, "DynamicLossScale": loss_scale_feeds,
            "AllFinite": all_finite_feeds, "PhiloxUniform": dist_feeds, "PhiloxNormal": dist_feeds,
            "PhiloxDropout": drop_feeds}[op]()


# --- the harness ---------------------------------------------------------------------------

class Harness:
    """Sessions, the expected bits of each op's correct run, and the checks every case ends
    with."""

    def __init__(self, library: str):
        self.library = library
        self._baseline: dict[str, list[np.ndarray]] = {}
        self._registered: dict[str, str | None] = {}

    def options(self, threads=None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        if threads is not None:
            so.intra_op_num_threads = threads
        so.register_custom_ops_library(self.library)
        return so

    def session(self, model, threads=None, so=None):
        import onnxruntime as ort

        return ort.InferenceSession(model.SerializeToString(), so or self.options(threads),
                                    providers=["CPUExecutionProvider"])

    def missing(self, op: str) -> str | None:
        """None when the library registers ``op``, else why not."""
        if op not in self._registered:
            try:
                self.session(good_model(op))
                self._registered[op] = None
            except Exception as exc:  # noqa: BLE001
                text = str(exc)
                if "registered" in text or "not a registered" in text or "No Op" in text:
                    self._registered[op] = f"{op} is not registered by this library: {text[:200]}"
                else:
                    raise
        return self._registered[op]

    def baseline(self, op: str) -> list[np.ndarray]:
        """The correct run's outputs from a fresh session (for the random distributions also
        checked against the numpy reference of their contract)."""
        if op not in self._baseline:
            outs = self.session(good_model(op)).run(None, good_feeds(op))
            if op in REFERENCE_CHECKS:
                REFERENCE_CHECKS[op](outs, good_feeds(op))
            self._baseline[op] = outs
        return self._baseline[op]

    def assert_usable(self, op: str, sess=None) -> None:
        """``sess`` (or a fresh session) runs the correct input to the expected bits."""
        sess = sess or self.session(good_model(op))
        assert_same(sess.run(None, good_feeds(op)), self.baseline(op), f"{op} after the case")


def assert_same(got, want, what=""):
    assert len(got) == len(want), f"{what}: {len(got)} outputs, expected {len(want)}"
    for k, (a, b) in enumerate(zip(got, want)):
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (
            f"{what}: output {k} differs: {a!r} vs {b!r}")


def flat(message: str) -> str:
    return " ".join(str(message).split())


def assert_clear(message: str, needles) -> None:
    text = flat(message)
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(o in text for o in options), f"error lacks {' or '.join(map(repr, options))}: {text}"


# --- case kinds ----------------------------------------------------------------------------

@dataclass
class Case:
    op: str
    id: str
    run: Callable[[Harness], None]
    xfail: str | None = None  # a known bug, with where it is (the case then runs as xfail)


CASES: list[Case] = []


def load_error(op, id_, model: Callable[[], Any], needles, feeds=None):
    """The node is wrong whatever the input: refused at load (or, failing that, at its first
    run), clearly; a correct session works afterwards."""

    def run(h: Harness):
        try:
            sess = h.session(model())
        except Exception as exc:  # noqa: BLE001
            assert_clear(str(exc), needles)
        else:
            with pytest.raises(Exception) as info:
                sess.run(None, feeds() if feeds else feeds_for(model(), good_feeds(op)))
            assert_clear(str(info.value), needles)
        h.assert_usable(op)

    CASES.append(Case(op, id_, run))


def feeds_for(model, base: dict) -> dict[str, np.ndarray]:
    """Feeds of the types ``model`` declares: ``base``'s arrays converted, zeros for inputs
    ``base`` lacks (so ONNX Runtime's own input checks pass and the op's run)."""
    feeds = {}
    for vi in model.graph.input:
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feeds[vi.name] = base[vi.name].astype(dtype) if vi.name in base else np.zeros(SHAPES[0], dtype)
    return feeds


def run_error(op, id_, feeds: Callable[[dict], dict], needles, model=None):
    """Bad input to a correct model (or to ``model``): a clear error at run time, then the
    same session (when the model is the correct one) runs correct input, twice over."""

    def run(h: Harness):
        sess = h.session(model() if model else good_model(op))
        bad = feeds(good_feeds(op))
        for _ in range(2):
            with pytest.raises(Exception) as info:
                sess.run(None, bad)
            assert_clear(str(info.value), needles)
            h.assert_usable(op, None if model else sess)

    CASES.append(Case(op, id_, run))


def result(op, id_, feeds: Callable[[dict], dict], check: Callable, model=None, xfail=None):
    """Unusual but valid input: the documented result, then the same session works."""

    def run(h: Harness):
        sess = h.session(model() if model else good_model(op))
        fed = feeds(good_feeds(op))
        before = {k: np.array(v, copy=True) for k, v in fed.items()}
        outs = sess.run(None, fed)
        for k, v in fed.items():
            assert_same([v], [before[k]], f"input {k} was written")
        check(h, outs, fed)
        h.assert_usable(op, None if model else sess)

    CASES.append(Case(op, id_, run, xfail))


def replace(**new):
    return lambda feeds: {**feeds, **new}


def poke(name, index, value):
    """The feeds with element ``index`` (flat) of ``name`` set to ``value``."""
    def f(feeds):
        a = np.array(feeds[name], copy=True)
        a.reshape(-1)[index] = value
        return {**feeds, name: a}
    return f


# --- optimizers: arity, types, shapes, counts ---------------------------------------------

for op in OPTIMIZERS:
    kit = KITS[op]
    s, k = len(kit.scalars), len(kit.groups)
    arity = f"expected {s} + {k}n inputs"
    first_v = kit.groups[2]  # the first group after the gradient (V or H)
    gi = s + 2  # node index of G_1 (n = 2)
    vi = s + 4  # node index of the third group's first tensor
    load_error(op, "one-input-too-many", lambda kit=kit: opt_model(kit, extra_inputs=1),
               [op, arity, f"got {s + 2 * k + 1}"])
    load_error(op, "one-input-too-few", lambda kit=kit: opt_model(kit, missing_inputs=1),
               [op, arity, f"got {s + 2 * k - 1}"])
    load_error(op, "one-output-too-many", lambda kit=kit: opt_model(kit, extra_outputs=1),
               [op, "outputs", f"got {len(kit.flags) + 2 * len(kit.rewrites) + 1}"])
    # Fewer outputs than the inputs call for: ONNX Runtime 1.17 aborted the process when shape
    # inference named an output the node lacks (the library now only names required ones).
    load_error(op, "one-output-too-few", lambda kit=kit: opt_model(kit, missing_outputs=1),
               [op, "outputs", f"got {len(kit.flags) + 2 * len(kit.rewrites) - 1}"])
    load_error(op, "only-the-first-output", lambda kit=kit: opt_model(
        kit, missing_outputs=2 * len(kit.rewrites) - 1), [op, "outputs", f"got {len(kit.flags) + 1}"])
    load_error(op, "R-int64", lambda kit=kit: opt_model(kit, types={"R": I64}),
               [op, "input 0 (R)", "tensor(float) or tensor(double)", "int64"])
    load_error(op, "T-float", lambda kit=kit: opt_model(kit, types={"T": F32}),
               [op, ("(T)", "input parameter (T)", "T"), ("int64", "tensor(float)")])
    load_error(op, "X-int32", lambda kit=kit: opt_model(kit, types={"X_1": I32}),
               [op, f"input {s} (X_1)", ("tensor(float), tensor(double)", "expected tensor(float)"),
                "got tensor(int32)"])
    load_error(op, f"{first_v}-double-X-float",
               lambda kit=kit, v=first_v: opt_model(kit, types={f"{v}_2": F64}),
               [op, f"input {vi + 1} ({first_v}_2)", "tensor(float) like X_2", "got tensor(double)"])
    load_error(op, "G-double-X-float", lambda kit=kit: opt_model(kit, g_dtype=F64),
               [op, f"input {gi} (G_1)", "tensor(float) like X_1", "got tensor(double)"])
    load_error(op, "G-int64", lambda kit=kit: opt_model(kit, g_dtype=I64),
               [op, f"input {gi} (G_1)", "like X_1", "got tensor(int64)"])

    run_error(op, f"{first_v}-shape-mismatch", replace(**{f"{first_v}_1": np.zeros((5, 2), F32)}),
              [op, f"input {vi} ({first_v}_1)", "expected shape [2, 5] like X_1", "got shape [5, 2]"])
    run_error(op, f"{first_v}-rank-mismatch", replace(**{f"{first_v}_2": np.zeros((7, 1), F32)}),
              [op, f"input {vi + 1} ({first_v}_2)", "like X_2", "got shape [7, 1]"])
    g_bad = np.zeros((3,), F16 if op == "MixedPrecisionAdam" else F32)
    run_error(op, "G-not-broadcastable", replace(G_1=g_bad),
              [op, f"input {gi} (G_1)", "broadcastable to X_1", "got shape [3]"])
    g_bad = np.zeros((1, 2, 5), F16 if op == "MixedPrecisionAdam" else F32)
    run_error(op, "G-higher-rank", replace(G_1=g_bad),
              [op, f"input {gi} (G_1)", "broadcastable to X_1", "got shape [1, 2, 5]"])
    run_error(op, "R-two-elements", replace(R=np.array([0.1, 0.2], F32)),
              [op, "input 0 (R)", "exactly one element", "shape [2]"])
    run_error(op, "R-no-element", replace(R=np.zeros((0,), F32)),
              [op, "input 0 (R)", "exactly one element", "shape [0]"])
    run_error(op, "T-two-elements", replace(T=np.array([[1], [2]], I64)),
              [op, "input 1 (T)", "exactly one element", "shape [2, 1]"])
    run_error(op, "X-misaligned",
              lambda f: {**f, "X_2": np.frombuffer(np.zeros(29, np.uint8).data, F32, 7, 1)},
              [op, f"input {s + 1} (X_2)", "aligned"])

    # Zero elements are valid, however large the other dimensions (no allocation, no overflow).
    def zero_feeds(feeds, kit=kit):
        shape = (0, 1 << 40)
        out = dict(feeds)
        for p in kit.groups:
            dt = feeds[f"{p}_1"].dtype
            out[f"{p}_1"] = np.zeros((0, 1) if p == "G" else shape, dt)
        return out

    def zero_check(h, outs, fed, kit=kit):
        m = len(kit.flags)
        for j in range(len(kit.rewrites)):
            assert outs[m + 2 * j].shape == (0, 1 << 40)
            # The other group is untouched by the empty one: its outputs are the baseline's.
            assert_same([outs[m + 2 * j + 1]], [h.baseline(kit.op)[m + 2 * j + 1]], "group 2")
    result(op, "zero-elements-enormous-dims", zero_feeds, zero_check)

    # --- attributes.
    if op != "MemoryCeiling":  # no float attribute (its int `streams` is tested in test_bench_adam.py)
        fa = "alpha" if op == "Momentum" else "epsilon"  # a float attribute of the op
        load_error(op, "float-attribute-as-int",
                   lambda kit=kit, fa=fa: opt_model(kit, attrs={fa: 1}),
                   [op, f"attribute '{fa}'", "expected a float attribute", "got an int attribute"])
        load_error(op, "float-attribute-as-floats",
                   lambda kit=kit, fa=fa: opt_model(kit, attrs={fa: [1e-6, 1e-7]}),
                   [op, f"attribute '{fa}'", "expected a float attribute", "got a list of floats"])
        load_error(op, "float-attribute-as-string",
                   lambda kit=kit, fa=fa: opt_model(kit, attrs={fa: "1e-6"}),
                   [op, f"attribute '{fa}'", "expected a float attribute", "got a string attribute"])
        load_error(op, "float-attribute-as-tensor",
                   lambda kit=kit, fa=fa: opt_model(kit, attrs={
                       fa: helper.make_tensor("e", TensorProto.FLOAT, [], [1e-6])}),
                   [op, f"attribute '{fa}'", "expected a float attribute", "got a tensor attribute"])
    result(op, "unknown-attribute-ignored", lambda f: f,
           lambda h, outs, fed, op=op: assert_same(outs, h.baseline(op), "unknown attribute"),
           model=lambda kit=kit: opt_model(kit, attrs={"trainops_no_such_attribute": 1.5,
                                                        "other": "x"}))

# Adam-like ops: every attribute missing means ONNX's defaults.
for op, defaults in [("Adam", dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
                                   norm_coefficient_post=0.0)),
                     ("MixedPrecisionAdam", dict(alpha=0.9, beta=0.999, epsilon=1e-6,
                                                 norm_coefficient=0.0, norm_coefficient_post=0.0,
                                                 copy_dtype=0)),
                     ("Adagrad", dict(decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0))]:
    def same_as_explicit(h, outs, fed, op=op, defaults=defaults):
        explicit = h.session(opt_model(KITS[op], attrs=defaults)).run(None, fed)
        assert_same(outs, explicit, "missing attributes = explicit defaults")
    result(op, "missing-attributes-are-defaults", lambda f: f, same_as_explicit)

for attr in ["alpha", "beta", "mode", "norm_coefficient"]:
    load_error("Momentum", f"missing-required-{attr}",
               lambda attr=attr: opt_model(KITS["Momentum"], drop_attrs=(attr,)),
               ["Momentum", f"attribute '{attr}'", "required"])
load_error("Momentum", "mode-unknown", lambda: opt_model(KITS["Momentum"], attrs={"mode": "heavy"}),
           ["Momentum", "attribute 'mode'", "\"standard\" or \"nesterov\"", "heavy"])
load_error("Momentum", "mode-as-int", lambda: opt_model(KITS["Momentum"], attrs={"mode": 1}),
           ["Momentum", "attribute 'mode'", "expected a string attribute", "got an int attribute"])

# MixedPrecisionAdam's own rules.
MP = KITS["MixedPrecisionAdam"]
load_error("MixedPrecisionAdam", "copy-dtype-invalid", lambda: opt_model(MP, attrs={"copy_dtype": 3}),
           ["MixedPrecisionAdam", "attribute 'copy_dtype'", "10 (float16) or 16 (bfloat16)", "got 3"])
load_error("MixedPrecisionAdam", "copy-dtype-as-float",
           lambda: opt_model(MP, attrs={"copy_dtype": 10.0}),
           ["MixedPrecisionAdam", "attribute 'copy_dtype'", "expected an int attribute", "got a float"])
load_error("MixedPrecisionAdam", "copy-outputs-missing",
           lambda: opt_model(MP, attrs={"copy_dtype": 10}),
           ["MixedPrecisionAdam", "outputs", "X_copy", "got 7"])
load_error("MixedPrecisionAdam", "X-double", lambda: opt_model(MP, dtype=F64, g_dtype=F64),
           ["MixedPrecisionAdam", "input 3 (X_1)", ("float32 weights", "expected tensor(float)"),
            "tensor(double)"],
           feeds=lambda: {k: (v.astype(F64) if k[0] in "XGVH" else v)
                          for k, v in opt_feeds(MP).items()})
run_error("MixedPrecisionAdam", "loss-scale-two-elements", replace(loss_scale=np.ones(2, F32)),
          ["MixedPrecisionAdam", "input 2 (loss_scale)", "exactly one element", "shape [2]"])
load_error("MixedPrecisionAdam", "loss-scale-double",
           lambda: opt_model(MP, types={"loss_scale": F64}),
           ["MixedPrecisionAdam", "loss_scale", ("tensor(double)", "double")])


# --- non-finite input to the optimizers --------------------------------------------------

def onnx_reference(op: str, fed: dict) -> list[np.ndarray]:
    """An independent result: onnx's reference implementation (numpy) for the ONNX ops,
    plain numpy for MemoryCeiling, onnx's Adam on ``G / loss_scale`` for MixedPrecisionAdam
    (when that is finite everywhere; the caller checks the skip otherwise)."""
    kit = KITS[op]
    if op == "MemoryCeiling":
        outs = []
        for p in "XVH":
            outs += [fed[f"{p}_{i}"] + np.broadcast_to(fed[f"G_{i}"], fed[f"{p}_{i}"].shape)
                     for i in (1, 2)]
        return outs
    from onnx.reference import ReferenceEvaluator

    if op == "MixedPrecisionAdam":
        scale = fed["loss_scale"].astype(F32)
        ref_feeds = {k: v for k, v in fed.items() if k != "loss_scale"}
        for i in (1, 2):
            ref_feeds[f"G_{i}"] = fed[f"G_{i}"].astype(F32) / scale
        model = opt_model(KITS["Adam"])
    else:
        ref_feeds = fed
        model = opt_model(kit)
    with np.errstate(all="ignore"):
        return ReferenceEvaluator(model).run(None, ref_feeds)


def nonfinite_check(op: str, poisoned: str, index: int):
    def check(h: Harness, outs, fed):
        kit = KITS[op]
        m = len(kit.flags)
        with np.errstate(all="ignore"):
            scaled = [fed[f"G_{i}"].astype(F32) / fed["loss_scale"] for i in (1, 2)] \
                if op == "MixedPrecisionAdam" else []
        if not all(np.isfinite(g).all() for g in scaled):
            # The step is skipped: finite is false and every output is its input, bit for bit.
            assert outs[0].dtype == np.bool_ and outs[0].shape == () and not outs[0]
            inputs = [fed[f"{p}_{i}"] for p in kit.rewrites for i in (1, 2)]
            assert_same(outs[m:], inputs, "skipped step")
            return
        if op == "MixedPrecisionAdam":
            assert bool(outs[0]) is True
        ref = onnx_reference(op, fed)
        base = h.baseline(op)
        for j, (got, want) in enumerate(zip(outs[m:], ref)):
            want = np.asarray(want, np.float64)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaNs of output {m + j}")
            np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"+Inf of output {m + j}")
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"-Inf of output {m + j}")
            fin = np.isfinite(want)
            np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-6,
                                       err_msg=f"finite values of output {m + j}")
        if poisoned[0] in kit.groups:
            # Elementwise: nothing but the poisoned element (and its group) changes.
            for j in range(len(kit.rewrites)):
                other = m + 2 * j + 1 if poisoned.endswith("_1") else m + 2 * j
                assert_same([outs[other]], [base[other]], f"output {other} (other group)")
                same = m + 2 * j if poisoned.endswith("_1") else m + 2 * j + 1
                a, b = outs[same].reshape(-1), base[same].reshape(-1)
                keep = np.ones(a.size, bool)
                keep[index] = False
                assert a[keep].tobytes() == b[keep].tobytes(), f"output {same}: other elements changed"
    return check


for op in OPTIMIZERS:
    kit = KITS[op]
    names = list(kit.scalars[:1]) + list(kit.scalars[2:]) + [f"{p}_1" for p in kit.groups]
    for name in names:
        for label, value in [("nan", np.nan), ("inf", np.inf)]:
            index = 0 if name in kit.scalars else 3
            result(op, f"{label}-in-{name}", poke(name, index, value), nonfinite_check(op, name, index))


# --- IOBinding: outputs over overlapping memory, over other inputs ------------------------

def ortvalues(feeds):
    import onnxruntime as ort

    return {k: ort.OrtValue.ortvalue_from_numpy(np.array(v, copy=True)) for k, v in feeds.items()}


def bound_run(h, sess, feeds, custom: dict):
    """Runs with every input bound from its own OrtValue and the outputs bound in the
    model's order: ``custom[name](binding, values)`` binds output ``name``, the others are
    allocated by ONNX Runtime. Returns (outputs in order, input values)."""
    values = ortvalues(feeds)
    binding = sess.io_binding()
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for out in sess.get_outputs():
        if out.name in custom:
            custom[out.name](binding, values)
        else:
            binding.bind_output(out.name)
    sess.run_with_iobinding(binding)
    got = [np.array(v.numpy(), copy=True) for v in binding.get_outputs()]
    return got, values


def over(output: str, input_: str):
    """Binds ``output`` to input ``input_``'s own buffer."""
    return lambda binding, values: binding.bind_ortvalue_output(output, values[input_])


def at(output: str, buf: np.ndarray, byte_offset: int, dtype, shape):
    """Binds ``output`` to ``buf``'s memory from ``byte_offset``."""
    return lambda binding, values: binding.bind_output(output, "cpu", 0, dtype, list(shape),
                                                       buf.ctypes.data + byte_offset)


for op in OPTIMIZERS:
    kit = KITS[op]
    m = len(kit.flags)
    a_name, b_name = f"{kit.rewrites[0]}_1_new", f"{kit.rewrites[1]}_1_new"

    def overlapping(h, a_name=a_name, b_name=b_name, op=op, shift=4):
        sess = h.session(good_model(op))
        buf = np.zeros(64, F32)

        custom = {a_name: at(a_name, buf, 0, F32, SHAPES[0]),
                  b_name: at(b_name, buf, shift, F32, SHAPES[0])}
        with pytest.raises(Exception) as info:
            bound_run(h, sess, good_feeds(op), custom)
        assert_clear(str(info.value), [op, a_name, b_name, "overlapping memory"])
        h.assert_usable(op, sess)

    CASES.append(Case(op, "outputs-overlap-partly", overlapping))
    CASES.append(Case(op, "outputs-same-buffer",
                      lambda h, f=overlapping: f(h, shift=0)))

    def over_other_input(h, op=op, kit=kit, cross=False):
        """X_1_new written over the buffer of another input (the next rewritten group's
        first tensor), and with ``cross`` that group's output over X_1: the result is the
        out-of-place one."""
        sess = h.session(good_model(op))
        a_in, b_in = f"{kit.rewrites[0]}_1", f"{kit.rewrites[1]}_1"

        custom = {f"{a_in}_new": over(f"{a_in}_new", b_in)}
        if cross:
            custom[f"{b_in}_new"] = over(f"{b_in}_new", a_in)
        got, values = bound_run(h, sess, good_feeds(op), custom)
        assert_same(got, h.baseline(op), "bound over another input")
        x_new = h.baseline(op)[len(kit.flags)]
        assert_same([values[b_in].numpy()], [x_new], f"{b_in}'s buffer holds {a_in}_new")
        h.assert_usable(op, sess)

    CASES.append(Case(op, "output-over-another-input", over_other_input))
    CASES.append(Case(op, "outputs-over-each-others-inputs",
                      lambda h, f=over_other_input: f(h, cross=True)))


def mp_copy_over_gradient(h):
    """X_1_copy (float16) written over G_1 (float16, same shape): G is read first."""
    model = opt_model(MP, copy_dtype=F16)
    sess = h.session(model)
    feeds = good_feeds("MixedPrecisionAdam")
    want = sess.run(None, feeds)

    got, values = bound_run(h, sess, feeds, {"X_1_copy": over("X_1_copy", "G_1")})
    assert_same(got, want, "copy over the gradient")
    np.testing.assert_array_equal(want[7], want[1].astype(F16))  # X_copy = cast(X_new)
    h.assert_usable("MixedPrecisionAdam")


CASES.append(Case("MixedPrecisionAdam", "copy-output-over-gradient", mp_copy_over_gradient))


def mp_overflow_skips(h):
    """A finite float16 gradient that overflows once divided by a tiny scale: skipped."""
    sess = h.session(good_model("MixedPrecisionAdam"))
    feeds = {**good_feeds("MixedPrecisionAdam"), "loss_scale": np.array(1e-38, F32)}
    outs = sess.run(None, feeds)
    assert not outs[0]
    assert_same(outs[1:], [feeds[f"{p}_{i}"] for p in "XVH" for i in (1, 2)], "skipped")
    h.assert_usable("MixedPrecisionAdam", sess)


CASES.append(Case("MixedPrecisionAdam", "finite-gradient-overflowing-scale-skips", mp_overflow_skips))


# MemoryCeiling with float32 weights and float16 gradients: x + g (the op once left these
# outputs unwritten; a clear error would do too, but never garbage).
def ceiling_mixed(h):
    sess = h.session(opt_model(KITS["MemoryCeiling"], g_dtype=F16))
    fed = good_feeds("MemoryCeiling")
    fed = {**fed, "G_1": fed["G_1"].astype(F16), "G_2": fed["G_2"].astype(F16)}
    try:
        outs = sess.run(None, fed)
    except Exception as exc:  # noqa: BLE001
        assert_clear(str(exc), ["MemoryCeiling", "input 2 (X_1)", "tensor(float16)"])
    else:
        want = [fed[f"{p}_{i}"] + fed[f"G_{i}"].astype(F32) for p in "XVH" for i in (1, 2)]
        assert_same(outs, want, "x + g with float16 gradients")
    h.assert_usable("MemoryCeiling")


CASES.append(Case("MemoryCeiling", "float16-gradient-float32-weights", ceiling_mixed))


# --- Philox ------------------------------------------------------------------------------

def pfeeds(state=None, shape=None):
    def f(feeds):
        out = dict(feeds)
        if state is not None:
            out["state"] = np.asarray(state, U32) if not isinstance(state, np.ndarray) else state
        if shape is not None:
            out["shape"] = np.asarray(shape, I64) if not isinstance(shape, np.ndarray) else shape
        return out
    return f


def state_and_shape_cases(op):
    """The state and ``shape`` input checks Philox, PhiloxUniform and PhiloxNormal share
    (ops/random/state.rs), each named under ``op``; feeds named ``state`` and ``shape``."""
    run_error(op, "state-5-elements", pfeeds(state=np.zeros(5, U32)),
              [op, "input 0 (state)", "exactly 6 elements", "shape [5]"])
    run_error(op, "state-7-elements", pfeeds(state=np.zeros(7, U32)),
              [op, "input 0 (state)", "exactly 6 elements", "shape [7]"])
    run_error(op, "state-empty", pfeeds(state=np.zeros((0, 6), U32)),
              [op, "input 0 (state)", "exactly 6 elements", "shape [0, 6]"])
    run_error(op, "shape-2-D", pfeeds(shape=np.array([[3, 5]], I64)),
              [op, "input 1 (shape)", "1-D tensor(int64)", "shape [1, 2]"])
    run_error(op, "shape-scalar", pfeeds(shape=np.array(4, I64)),
              [op, "input 1 (shape)", "1-D tensor(int64)", "shape []"])
    run_error(op, "shape-negative", pfeeds(shape=[3, -5]),
              [op, "input 1 (shape)", "non-negative dimensions", "negative dimension -5"])
    run_error(op, "shape-i64-min", pfeeds(shape=[-(1 << 63)]),
              [op, "input 1 (shape)", "negative dimension"])
    run_error(op, "shape-over-limit", pfeeds(shape=[(1 << 31) + 1]),
              [op, "input 1 (shape)", "limit of 2147483648 elements"])
    run_error(op, "shape-over-limit-2-D", pfeeds(shape=[1 << 16, (1 << 15) + 1]),
              [op, "input 1 (shape)", "limit of 2147483648 elements"])
    run_error(op, "shape-count-overflows", pfeeds(shape=[1 << 62, 1 << 62, 1 << 62]),
              [op, "input 1 (shape)", "limit"])
    run_error(op, "shape-i64-max-squared", pfeeds(shape=[(1 << 63) - 1, (1 << 63) - 1]),
              [op, "input 1 (shape)", "limit"])


P = "Philox"
state_and_shape_cases(P)
load_error(P, "shape-int32", lambda: philox_model(shape_dtype=I32),
           [P, ("shape", "input parameter"), ("int32", "tensor(int32)")],
           feeds=lambda: {**philox_feeds(), "shape": np.array([3, 5], I32)})
load_error(P, "state-int32", lambda: philox_model(state_dtype=I32),
           [P, "state", ("int32", "tensor(int32)")],
           feeds=lambda: {**philox_feeds(), "state": np.zeros(6, I32)})
load_error(P, "state-float", lambda: philox_model(state_dtype=F32),
           [P, "state", ("float", "tensor(float)")],
           feeds=lambda: {**philox_feeds(), "state": np.zeros(6, F32)})
load_error(P, "three-inputs", lambda: philox_model(extra_inputs=1),
           [P, ("input", "Input", "3")],
           feeds=lambda: {**philox_feeds(), "Z_0": np.zeros(1, I64)})
load_error(P, "attribute-negative", lambda: philox_model(shape_attr=[4, -1], shape_input=False),
           [P, "attribute 'shape'", "negative dimension -1"])
load_error(P, "attribute-overflows", lambda: philox_model(shape_attr=[1 << 62, 1 << 62],
                                                          shape_input=False),
           [P, "attribute 'shape'", "limit"])
for label, value, got in [("floats", [3.0, 5.0], "a list of floats"), ("int", 15, "an int"),
                          ("float", 15.0, "a float"), ("string", "3,5", "a string"),
                          ("tensor", helper.make_tensor("s", TensorProto.INT64, [2], [3, 5]),
                           "a tensor")]:
    load_error(P, f"attribute-as-{label}",
               lambda value=value: philox_model(shape_attr=value, shape_input=False),
               [P, "attribute 'shape'", "expected a list of ints attribute", f"got {got} attribute"],
               feeds=lambda: {"state": philox_feeds()["state"]})


def always_failing(op, id_, bad_model, needles, feeds=None):
    """A node that is wrong whatever the input: the error (twice), and a fresh correct session
    working after each."""
    def run(h: Harness):
        sess = h.session(bad_model())
        fed = feeds() if feeds else good_feeds(op)
        names = {i.name for i in sess.get_inputs()}
        for _ in range(2):
            with pytest.raises(Exception) as info:
                sess.run(None, {k: v for k, v in fed.items() if k in names})
            assert_clear(str(info.value), needles)
            h.assert_usable(op)
    CASES.append(Case(op, id_, run))


always_failing(P, "shape-input-and-attribute", lambda: philox_model(shape_attr=[3, 5]),
               [P, "input 1 (shape)", "exactly one", "got both"])
always_failing(P, "neither-shape-source", lambda: philox_model(shape_input=False),
               [P, "input 1 (shape)", "exactly one", "got neither"])


def philox_zero_check(h, outs, fed):
    assert outs[0].shape == (0, 1 << 40)
    np.testing.assert_array_equal(outs[1], fed["state"])  # no block used: state unchanged


result(P, "zero-elements-enormous-dim", pfeeds(shape=[0, 1 << 40]), philox_zero_check)


def philox_state_shape_check(h, outs, fed):
    base = h.baseline(P)
    assert_same([outs[0]], [base[0]])
    assert outs[1].shape == (1, 1, 1, 6) and outs[1].ravel().tolist() == base[1].tolist()


result(P, "state-directml-shape", pfeeds(state=np.array([1, 2, 3, 4, 5, 6], U32).reshape(1, 1, 1, 6)),
       philox_state_shape_check)
result(P, "unknown-attribute-ignored", lambda f: f,
       lambda h, outs, fed: assert_same(outs, h.baseline(P)),
       model=lambda: philox_model(attrs={"seed": 5, "dtype": "uint32"}))


def optional_io_cases(op, build, feeds):
    """The optional ``shape`` input and ``state_out`` output of Philox, PhiloxUniform and
    PhiloxNormal (``build(**kw)`` makes the node, ``feeds()`` its correct input)."""

    def empty_optional_input(h):
        """``shape`` given as "" with the attribute: ONNX Runtime 1.17 crashed building the
        shape-inference context for Philox (it now registers none), and up to 1.23 for the
        distributions (the library installs their inference callback on 1.24+ only)."""
        model = build(shape_attr=[3, 5], shape_input=False)
        model.graph.node[0].input.append("")
        sess = h.session(model)
        assert_same(sess.run(None, {"state": feeds()["state"]}), h.baseline(op), "empty optional input")
        h.assert_usable(op)

    def without_state_out(h):
        """No ``state_out`` (ONNX Runtime 1.17 aborted when inference named the absent output)."""
        sess = h.session(build(state_out=False))
        assert_same(sess.run(None, feeds()), h.baseline(op)[:1], "without state_out")
        h.assert_usable(op)

    def empty_optional_output(h):
        """``state_out`` given as "" (left out): the output is computed. The random ops once
        failed with "KernelContext_GetOutput failed: no value for output 1" (ops/random/state.rs)."""
        model = build(state_out=False)
        model.graph.node[0].output.append("")
        sess = h.session(model)
        assert_same(sess.run(None, feeds()), h.baseline(op)[:1], "empty optional output")
        h.assert_usable(op)

    CASES.append(Case(op, "empty-optional-input", empty_optional_input))
    CASES.append(Case(op, "without-state-out", without_state_out))
    CASES.append(Case(op, "empty-optional-output", empty_optional_output))


optional_io_cases(P, philox_model, philox_feeds)


def outputs_overlap_case(op, out_dtype, feeds):
    """``output`` ([3, 5]) and ``state_out`` bound to overlapping memory: an error naming both
    (Philox, PhiloxUniform, PhiloxNormal)."""
    def run(h):
        sess = h.session(good_model(op))
        buf = np.zeros(32, U32)
        custom = {"output": at("output", buf, 0, out_dtype, (3, 5)),
                  "state_out": at("state_out", buf, 8, U32, (6,))}
        with pytest.raises(Exception) as info:
            bound_run(h, sess, feeds(), custom)
        assert_clear(str(info.value), [op, "output 0 (output)", "output 1 (state_out)", "overlapping memory"])
        h.assert_usable(op, sess)
    return run


def philox_output_over_state(h):
    """``output`` (6 words) written over the ``state`` input: the state is read first."""
    sess = h.session(good_model(P))
    feeds = {**philox_feeds(), "shape": np.array([6], I64)}
    want = sess.run(None, feeds)

    got, values = bound_run(h, sess, feeds, {"output": over("output", "state")})
    assert_same(got, want, "output over state")
    assert_same([values["state"].numpy()], [want[0]])
    h.assert_usable(P, sess)


CASES.append(Case(P, "outputs-overlap", outputs_overlap_case(P, U32, philox_feeds)))
CASES.append(Case(P, "output-over-state-input", philox_output_over_state))


# --- DynamicLossScale ---------------------------------------------------------------------

D = "DynamicLossScale"
run_error(D, "scale-two-elements", replace(scale=np.ones(2, F32)),
          [D, "input 0 (scale)", "tensor(float) with exactly one element", "shape [2]"])
run_error(D, "good-steps-empty", replace(good_steps=np.zeros(0, I64)),
          [D, "input 1 (good_steps)", "tensor(int64) with exactly one element", "shape [0]"])
run_error(D, "finite-two-elements", replace(finite=np.array([True, False])),
          [D, "input 2 (finite)", "tensor(bool) with exactly one element", "shape [2]"])
load_error(D, "finite-float", lambda: loss_scale_model(finite=F32),
           [D, "finite", ("float", "tensor(float)")],
           feeds=lambda: {**loss_scale_feeds(), "finite": np.array(1.0, F32)})
load_error(D, "scale-double", lambda: loss_scale_model(scale=F64),
           [D, "scale", ("double", "tensor(double)")],
           feeds=lambda: {**loss_scale_feeds(), "scale": np.array(1.0, F64)})
load_error(D, "growth-interval-zero", lambda: loss_scale_model(growth_interval=0),
           [D, "attribute 'growth_interval'", "positive", "got 0"])
load_error(D, "growth-interval-float", lambda: loss_scale_model(growth_interval=2000.0),
           [D, "attribute 'growth_interval'", "expected an int attribute", "got a float attribute"])
load_error(D, "growth-factor-negative", lambda: loss_scale_model(growth_factor=-2.0),
           [D, "attribute 'growth_factor'", "finite value >= 0", "got -2"])
load_error(D, "backoff-factor-nan", lambda: loss_scale_model(backoff_factor=float("nan")),
           [D, "attribute 'backoff_factor'", "finite value >= 0", "NaN"])
result(D, "unknown-attribute-ignored", lambda f: f,
       lambda h, outs, fed: assert_same(outs, h.baseline(D)),
       model=lambda: loss_scale_model(trainops_no_such_attribute=[1, 2]))
for label, scale, finite, want_scale, want_steps in [
        ("nan-scale-finite-step", np.nan, True, np.nan, 6),
        ("nan-scale-skipped-step", np.nan, False, 0.0, 0),  # max(NaN, min_scale) = min_scale
        ("inf-scale-finite-step", np.inf, True, np.inf, 6),
        ("inf-scale-skipped-step", np.inf, False, np.inf, 0),
        ("good-steps-max", 2.0, True, 2.0, (1 << 63) - 1)]:
    def check(h, outs, fed, want_scale=want_scale, want_steps=want_steps):
        assert outs[0].dtype == F32 and outs[1].dtype == I64
        np.testing.assert_array_equal(outs[0], np.float32(want_scale))
        assert int(outs[1]) == want_steps
    feeds = replace(scale=np.array(scale, F32), finite=np.array(finite),
                    good_steps=np.array((1 << 63) - 1 if label == "good-steps-max" else 5, I64))
    result(D, label, feeds, check)


# --- AllFinite ----------------------------------------------------------------------------

A = "AllFinite"
for dtype in (F32, F64, F16):
    name = {F32: "X_1", F64: "X_2", F16: "X_3"}[dtype]
    for label, value in [("nan", np.nan), ("inf", np.inf), ("neg-inf", -np.inf)]:
        def is_false(h, outs, fed):
            assert outs[0].dtype == np.bool_ and outs[0].shape == () and not outs[0]
        result(A, f"{label}-in-{np.dtype(dtype).name}", poke(name, 1, value), is_false)


def all_true(h, outs, fed):
    assert outs[0].shape == () and bool(outs[0]) is True


result(A, "zero-element-inputs", replace(X_1=np.zeros((0, 3), F32), X_2=np.zeros(0),
                                         X_3=np.zeros((4, 0), F16)), all_true)
result(A, "float16-max-is-finite", replace(X_3=np.full((2, 2), np.finfo(F16).max, F16)), all_true)
result(A, "unknown-attribute-ignored", lambda f: f, all_true,
       model=lambda: all_finite_model(trainops_no_such_attribute="x"))
CASES.append(Case(A, "int32-input", lambda h: _guarded_fresh(
    h, A, all_finite_model((F32, I32)), {"X_1": np.zeros(2, F32), "X_2": np.zeros(2, I32)},
    [A, "input 1 (X_2)", "tensor(float), tensor(double), tensor(float16) or tensor(bfloat16)",
     "got tensor(int32)"])))
CASES.append(Case(A, "bool-input", lambda h: _guarded_fresh(
    h, A, all_finite_model((np.bool_,)), {"X_1": np.zeros(2, np.bool_)},
    [A, "input 0 (X_1)", "tensor(float)", "got tensor(bool)"])))
load_error(A, "two-outputs", lambda: all_finite_model(outputs=2), [A, ("output", "Output")])
load_error(A, "no-inputs", lambda: all_finite_model(()), [A, ("input", "Input")], feeds=dict)


def _guarded_fresh(h, op, model, feeds, needles):
    sess = h.session(model)
    for _ in range(2):
        with pytest.raises(Exception) as info:
            sess.run(None, feeds)
        assert_clear(str(info.value), needles)
        h.assert_usable(op)


# --- PhiloxUniform, PhiloxNormal, PhiloxDropout -------------------------------------------
#
# Every correct run here is also checked against the contract re-implemented in numpy on
# randomgen's Philox (helpers.random_reference): bit for bit for uniform and dropout, within
# the contract's tolerance for normal (``Harness.baseline`` checks the baselines the same way).

U, N, DR = "PhiloxUniform", "PhiloxNormal", "PhiloxDropout"
RANDOM_DISTS = (U, N)
DIST_ATTRS = {U: ("low", "high"), N: ("mean", "scale")}


def dist_model(op, *, shape_attr=None, shape_input=True, state_dtype=U32, shape_dtype=I64,
               out_dtype=F32, state_out=True, extra_inputs=0, extra_outputs=0, attrs=None,
               drop_attrs=()):
    """A PhiloxUniform/PhiloxNormal node, every shape unknown; the kit's attributes unless
    dropped or overridden."""
    inputs = [("state", state_dtype, None)]
    if shape_input:
        inputs.append(("shape", shape_dtype, None))
    inputs += [(f"Z_{j}", I64, None) for j in range(extra_inputs)]
    outputs = [("output", out_dtype, None)] + ([("state_out", U32, None)] if state_out else [])
    outputs += [(f"Y_{j}", U32, None) for j in range(extra_outputs)]
    node_attrs = {k: v for k, v in KITS[op].attrs.items() if k not in drop_attrs}
    node_attrs.update(attrs or {})
    if shape_attr is not None:
        node_attrs["shape"] = shape_attr
    return node_model(op, inputs, outputs, domain=MP_DOMAIN, **node_attrs)


def dist_feeds() -> dict[str, np.ndarray]:
    # A counter whose blocks carry into the third word.
    return {"state": ref.make_state((1 << 64) - 3, 0xDEADBEEF, 0x12345678),
            "shape": np.array([3, 5], I64)}


DROP_INPUTS = ("data", "ratio", "training_mode", "state")
DROP_OUTPUTS = ("output", "mask", "state_out")


def drop_model(*, dtype=F32, ratio=F32, training=np.bool_, state=U32, inputs=DROP_INPUTS,
               outputs=DROP_OUTPUTS, attrs=None):
    """A PhiloxDropout node, every shape unknown; ``inputs``/``outputs`` are the node's names
    ("" leaves an optional one out; a name of none of the four is an extra float input)."""
    types = {"data": dtype, "ratio": ratio, "training_mode": training, "state": state}
    out_types = {"output": dtype, "mask": np.bool_, "state_out": U32}
    model = node_model(DR, [(n, types.get(n, F32), None) for n in inputs if n],
                       [(n, out_types.get(n, F32), None) for n in outputs if n],
                       domain=MP_DOMAIN, **dict(attrs or {}))
    node = model.graph.node[0]
    del node.input[:]
    node.input.extend(inputs)
    del node.output[:]
    node.output.extend(outputs)
    return model


def drop_feeds(ratio=0.3, training=True) -> dict[str, np.ndarray]:
    data = np.random.default_rng(11).standard_normal((3, 5)).astype(F32)
    return {"data": data, "ratio": np.array(ratio, F32), "training_mode": np.array(training),
            "state": ref.make_state((1 << 96) - 2, 0x0BADF00D, 7)}


def dist_reference(op, fed, attrs, elem=ref.FLOAT):
    """(values, z or None, r or None, state_out) the contract gives for ``fed`` and ``attrs``."""
    state = fed["state"]
    shape = tuple(int(d) for d in (attrs["shape"] if "shape" in attrs else fed["shape"]))
    n = int(np.prod(shape, dtype=np.int64))
    with np.errstate(all="ignore"):
        if op == U:
            vals, nxt = ref.uniform(state, n, elem, attrs.get("low", 0.0), attrs.get("high", 1.0))
            z = r = None
        else:
            vals, z, r, nxt = ref.normal(state, n, elem, attrs.get("mean", 0.0), attrs.get("scale", 1.0))
    s = np.asarray(state).ravel()
    nxt_state = ref.make_state(nxt, int(s[4]), int(s[5])).reshape(np.shape(state))
    return np.asarray(vals).reshape(shape), z, r, nxt_state


def assert_dist(op, outs, fed, attrs=None, elem=ref.FLOAT, state_out=True):
    """``outs`` are the contract's values for ``fed`` with ``attrs`` (the kit's by default):
    bit for bit for uniform and the state; for normal NaN, +-Inf where the float64 formula
    has them and the rest within the contract's tolerance (scaled by ``|scale|``)."""
    attrs = {**KITS[op].attrs, **(attrs or {})}
    want, z, r, nxt = dist_reference(op, fed, attrs, elem)
    got = outs[0]
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if op == U:
        assert_same([got], [want], f"{op} against the numpy reference")
    else:
        g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(g), test(w), err_msg=f"{op}: {test.__name__}")
        fin = np.isfinite(w)
        scale = abs(float(np.float32(attrs.get("scale", 1.0))))
        eps = {ref.DOUBLE: 1e-12, ref.FLOAT: 4e-6}.get(elem, 4e-3)
        tol = eps * np.maximum(1.0, r.reshape(-1)[fin]) * max(scale, 1.0) + 4 * np.spacing(np.abs(w[fin]).astype(got.dtype)).astype(np.float64)
        assert (np.abs(g[fin] - w[fin]) <= tol).all(), f"{op}: {np.abs(g[fin] - w[fin]).max()} beyond the tolerance"
    if state_out:
        assert_same([outs[1]], [nxt], f"{op}: state_out")
    else:
        assert len(outs) == 1


def assert_dropout(outs, fed, outputs=DROP_OUTPUTS):
    """``outs`` (of the outputs the node names) are the contract's for ``fed``, bit for bit."""
    training = "training_mode" in fed and bool(fed["training_mode"])
    data, state = fed["data"], fed["state"]
    if training:
        ratio = float(fed["ratio"]) if "ratio" in fed else 0.5
        out, keep, nxt = ref.dropout(state, data, ratio)
        s = np.asarray(state).ravel()
        nxt = ref.make_state(nxt, int(s[4]), int(s[5])).reshape(np.shape(state))
    else:
        out, keep, nxt = data, np.ones(data.shape, np.bool_), state
    want = {"output": out, "mask": keep, "state_out": nxt}
    named = [n for n in outputs if n]
    assert len(outs) == len(named), (len(outs), named)
    assert_same(outs, [want[n] for n in named], f"{DR} against the numpy reference")


REFERENCE_CHECKS = {
    U: lambda outs, fed: assert_dist(U, outs, fed),
    N: lambda outs, fed: assert_dist(N, outs, fed),
    DR: lambda outs, fed: assert_dropout(outs, fed),
}


def at_value(output: str, input_: str, dtype, shape):
    """Binds ``output`` (``dtype``, ``shape``) to input ``input_``'s buffer, whatever its type."""
    return lambda binding, values: binding.bind_output(output, "cpu", 0, dtype, list(shape),
                                                       values[input_].data_ptr())


def typed_note() -> str | None:
    """Why this onnxruntime cannot give PhiloxUniform/PhiloxNormal non-float outputs, or None."""
    if ref.typed_outputs_supported():
        return None
    import onnxruntime as ort
    return (f"onnxruntime {ort.__version__}: PhiloxUniform/PhiloxNormal give float outputs only "
            "(non-float outputs need onnxruntime 1.24+; README)")


for op in RANDOM_DISTS:
    state_and_shape_cases(op)
    for label, kw, feed, needles in [
            ("state-int32", {"state_dtype": I32}, {"state": np.zeros(6, I32)}, ["state", "tensor(int32)"]),
            ("state-float", {"state_dtype": F32}, {"state": np.zeros(6, F32)}, ["state", "tensor(float)"]),
            ("state-int64", {"state_dtype": I64}, {"state": np.zeros(6, I64)}, ["state", "tensor(int64)"]),
            ("shape-int32", {"shape_dtype": I32}, {"shape": np.array([3, 5], I32)},
             [("shape", "input parameter"), "tensor(int32)"]),
            ("three-inputs", {"extra_inputs": 1}, {"Z_0": np.zeros(1, I64)}, [("input", "Input")]),
            ("three-outputs", {"extra_outputs": 1}, {}, [("output", "Output")])]:
        load_error(op, label, lambda op=op, kw=kw: dist_model(op, **kw), [op] + needles,
                   feeds=lambda feed=feed: {**dist_feeds(), **feed})
    load_error(op, "no-inputs", lambda op=op: node_model(op, [], [("output", F32, None)], domain=MP_DOMAIN,
                                                         shape=[3]),
               [op, ("input", "Input")], feeds=dict)
    always = [("shape-input-and-attribute", dict(shape_attr=[3, 5]), ["exactly one", "got both"]),
              ("neither-shape-source", dict(shape_input=False), ["exactly one", "got neither"])]
    for label, kw, needles in always:
        always_failing(op, label, lambda op=op, kw=kw: dist_model(op, **kw), [op, "input 1 (shape)"] + needles)
    for label, shape_attr, needles in [
            ("attribute-negative", [4, -1], ["negative dimension -1"]),
            ("attribute-over-limit", [(1 << 31) + 1], ["limit of 2147483648 elements"]),
            ("attribute-overflows", [1 << 62, 1 << 62], ["limit"])]:
        load_error(op, label, lambda op=op, s=shape_attr: dist_model(op, shape_attr=s, shape_input=False),
                   [op, "attribute 'shape'"] + needles, feeds=lambda: {"state": dist_feeds()["state"]})
    for label, value, got in [("floats", [3.0, 5.0], "a list of floats"), ("string", "3,5", "a string"),
                              ("int", 15, "an int")]:
        load_error(op, f"shape-attribute-as-{label}",
                   lambda op=op, value=value: dist_model(op, shape_attr=value, shape_input=False),
                   [op, "attribute 'shape'", "expected a list of ints attribute", f"got {got} attribute"],
                   feeds=lambda: {"state": dist_feeds()["state"]})
    # dtype outside the list: refused when the session is made, naming the attribute.
    for value in (6, 0, 7, -1):
        load_error(op, f"dtype-{value}", lambda op=op, value=value: dist_model(op, attrs={"dtype": value}),
                   [op, "attribute 'dtype'", "1 (float), 11 (double), 10 (float16) or 16 (bfloat16)",
                    f"got {value}"])
    for label, value, got in [("float", 1.0, "a float"), ("string", "float", "a string"),
                              ("ints", [1, 1], "a list of ints")]:
        load_error(op, f"dtype-as-{label}", lambda op=op, value=value: dist_model(op, attrs={"dtype": value}),
                   [op, "attribute 'dtype'", "expected an int attribute", f"got {got} attribute"])
    for attr in DIST_ATTRS[op]:
        for label, value, got in [("int", 1, "an int"), ("string", "0.5", "a string"),
                                  ("floats", [0.5, 1.0], "a list of floats"),
                                  ("tensor", helper.make_tensor("a", TensorProto.FLOAT, [], [0.5]), "a tensor")]:
            load_error(op, f"{attr}-as-{label}",
                       lambda op=op, attr=attr, value=value: dist_model(op, attrs={attr: value}),
                       [op, f"attribute '{attr}'", "expected a float attribute", f"got {got} attribute"])
        # NaN and infinite attributes are arithmetic: the contract's values, NaN included.
        for label, value in [("nan", np.nan), ("inf", np.inf), ("neg-inf", -np.inf)]:
            result(op, f"{attr}-{label}", lambda f: f,
                   lambda h, outs, fed, op=op, a={attr: float(value)}: assert_dist(op, outs, fed, a),
                   model=lambda op=op, attr=attr, value=value: dist_model(op, attrs={attr: float(value)}))
    lo, hi = DIST_ATTRS[op]
    reversed_attrs = {lo: 3.0, hi: -2.0} if op == U else {lo: -1.0, hi: -0.5}
    result(op, "reversed-range" if op == U else "negative-scale", lambda f: f,
           lambda h, outs, fed, op=op, a=reversed_attrs: assert_dist(op, outs, fed, a),
           model=lambda op=op, a=reversed_attrs: dist_model(op, attrs=a))
    defaults = {U: {"low": 0.0, "high": 1.0}, N: {"mean": 0.0, "scale": 1.0}}[op]

    def missing_defaults(h, outs, fed, op=op, defaults=defaults):
        explicit = h.session(dist_model(op, attrs={**defaults, "dtype": 1})).run(None, fed)
        assert_same(outs, explicit, "missing attributes = explicit defaults")
        assert_dist(op, outs, fed, defaults)
    result(op, "missing-attributes-are-defaults", lambda f: f, missing_defaults,
           model=lambda op=op: dist_model(op, drop_attrs=DIST_ATTRS[op]))

    def zero_check(h, outs, fed):
        assert outs[0].shape == (0, 1 << 40) and outs[0].dtype == F32
        assert_same([outs[1]], [fed["state"]], "no words used: state unchanged")
    result(op, "zero-elements-enormous-dim", pfeeds(shape=[0, 1 << 40]), zero_check)

    def directml_check(h, outs, fed, op=op):
        base = h.baseline(op)
        assert_same([outs[0]], [base[0]])
        assert outs[1].shape == (1, 1, 1, 6) and outs[1].ravel().tolist() == base[1].tolist()
    result(op, "state-directml-shape",
           lambda f: {**f, "state": f["state"].reshape(1, 1, 1, 6)}, directml_check)
    result(op, "unknown-attribute-ignored", lambda f: f,
           lambda h, outs, fed, op=op: assert_same(outs, h.baseline(op)),
           model=lambda op=op: dist_model(op, attrs={"seed": 5, "trainops_no_such_attribute": "x"}))

    optional_io_cases(op, lambda op=op, **kw: dist_model(op, **kw), dist_feeds)

    def dtype_double(h, op=op):
        """dtype 11 with a double output: the contract's values on onnxruntime 1.24+; before,
        the documented refusal at session creation (float outputs only)."""
        model = dist_model(op, out_dtype=F64, attrs={"dtype": 11})
        if typed_note():
            with pytest.raises(Exception) as info:
                h.session(model)
            assert_clear(str(info.value), ["Type Error", "does not match expected type (tensor(float))"])
        else:
            outs = h.session(model).run(None, dist_feeds())
            assert_dist(op, outs, dist_feeds(), elem=ref.DOUBLE)
        h.assert_usable(op)

    def dtype_disagrees(h, op=op):
        """dtype 11 but the graph declares a float output: refused when the session is made."""
        with pytest.raises(Exception) as info:
            h.session(dist_model(op, attrs={"dtype": 11}))
        assert_clear(str(info.value), [("tensor(double)", "attribute 'dtype'"), ("output", "dtype")])
        h.assert_usable(op)

    def shape_input_declared_enormous(h, op=op):
        """A ``shape`` input declared with 2^40 elements (the output's rank): session creation
        once aborted the process, allocating 2^40 unknown dimensions in shape inference
        (onnxruntime 1.24+, where the library infers). Run in a child process with a 4 GiB
        address-space limit, so that a regression fails this case instead of the machine."""
        import subprocess
        import sys
        import textwrap

        code = textwrap.dedent(f"""
            import resource, numpy as np, onnxruntime as ort
            from trainops.models import node_model
            resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
            so = ort.SessionOptions()
            so.log_severity_level = 4
            so.register_custom_ops_library({h.library!r})
            for n in (1 << 40, 1 << 62, 1025):
                m = node_model({op!r}, [("state", np.uint32, [6]), ("shape", np.int64, [n])],
                               [("output", np.float32, None)], domain="com.trainops")
                ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            print("loaded")
        """)
        import os
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=120)
        assert proc.returncode == 0 and "loaded" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
        h.assert_usable(op)

    CASES.append(Case(op, "shape-input-declared-enormous", shape_input_declared_enormous))
    CASES.append(Case(op, "dtype-double", dtype_double))
    CASES.append(Case(op, "dtype-disagrees-with-output", dtype_disagrees))

    # --- IOBinding.
    def state_in_place(h, op=op):
        sess = h.session(good_model(op))
        got, values = bound_run(h, sess, dist_feeds(), {"state_out": over("state_out", "state")})
        assert_same(got, h.baseline(op), "state_out over state")
        assert_same([values["state"].numpy()], [h.baseline(op)[1]], "state's buffer holds state_out")
        h.assert_usable(op, sess)

    def output_over_state(h, op=op):
        """``output`` (6 floats, 24 bytes) over the state's buffer: the state is read first."""
        sess = h.session(good_model(op))
        fed = {**dist_feeds(), "shape": np.array([6], I64)}
        want = sess.run(None, fed)
        assert_dist(op, want, fed)
        got, values = bound_run(h, sess, fed, {"output": at_value("output", "state", F32, (6,))})
        assert_same(got, want, "output over state")
        assert values["state"].numpy().tobytes() == want[0].tobytes()
        h.assert_usable(op, sess)

    def output_over_shape(h, op=op):
        """``output`` (4 floats) over the ``shape`` input ([2, 2], 16 bytes): read first."""
        sess = h.session(good_model(op))
        fed = {**dist_feeds(), "shape": np.array([2, 2], I64)}
        want = sess.run(None, fed)
        assert_dist(op, want, fed)
        got, values = bound_run(h, sess, fed, {"output": at_value("output", "shape", F32, (2, 2))})
        assert_same(got, want, "output over shape")
        h.assert_usable(op, sess)

    def state_out_over_shape(h, op=op):
        """``state_out`` (6 words) over the ``shape`` input ([1, 2, 3], 24 bytes): read first."""
        sess = h.session(good_model(op))
        fed = {**dist_feeds(), "shape": np.array([1, 2, 3], I64)}
        want = sess.run(None, fed)
        assert_dist(op, want, fed)
        got, values = bound_run(h, sess, fed, {"state_out": at_value("state_out", "shape", U32, (6,))})
        assert_same(got, want, "state_out over shape")
        h.assert_usable(op, sess)

    CASES.append(Case(op, "state-out-over-state-in-place", state_in_place))
    CASES.append(Case(op, "outputs-overlap", outputs_overlap_case(op, F32, dist_feeds)))
    CASES.append(Case(op, "output-over-state-input", output_over_state))
    CASES.append(Case(op, "output-over-shape-input", output_over_shape))
    CASES.append(Case(op, "state-out-over-shape-input", state_out_over_shape))


# PhiloxDropout.
for label, dtype, needles in [("data-int32", I32, ["input 0 (data)", "got tensor(int32)"]),
                              ("data-int64", I64, ["input 0 (data)", "got tensor(int64)"]),
                              ("data-bool", np.bool_, ["input 0 (data)", "got tensor(bool)"])]:
    load_error(DR, label, lambda dtype=dtype: drop_model(dtype=dtype),
               [DR, "tensor(float), tensor(double), tensor(float16) or tensor(bfloat16)"] + needles,
               feeds=lambda dtype=dtype: {**drop_feeds(), "data": np.ones((3, 5), dtype)})
for label, kw, feed, needles in [
        ("ratio-double", {"ratio": F64}, {"ratio": np.array(0.3)}, ["ratio", "tensor(double)"]),
        ("ratio-int64", {"ratio": I64}, {"ratio": np.array(0, I64)}, ["ratio", "tensor(int64)"]),
        ("ratio-float16", {"ratio": F16}, {"ratio": np.array(0.3, F16)}, ["ratio", "tensor(float16)"]),
        ("training-mode-float", {"training": F32}, {"training_mode": np.array(1, F32)},
         ["training_mode", "tensor(float)"]),
        ("training-mode-int32", {"training": I32}, {"training_mode": np.array(1, I32)},
         ["training_mode", "tensor(int32)"]),
        ("state-int32", {"state": I32}, {"state": np.zeros(6, I32)}, ["state", "tensor(int32)"]),
        ("state-float", {"state": F32}, {"state": np.zeros(6, F32)}, ["state", "tensor(float)"])]:
    load_error(DR, label, lambda kw=kw: drop_model(**kw), [DR] + needles,
               feeds=lambda feed=feed: {**drop_feeds(), **feed})
for label, inputs, outputs in [("no-state-input", DROP_INPUTS[:3], DROP_OUTPUTS),
                               ("data-only", DROP_INPUTS[:1], DROP_OUTPUTS),
                               ("five-inputs", DROP_INPUTS + ("Z_0",), DROP_OUTPUTS),
                               ("four-outputs", DROP_INPUTS, DROP_OUTPUTS + ("Y_0",))]:
    load_error(DR, label, lambda i=inputs, o=outputs: drop_model(inputs=i, outputs=o),
               [DR, ("input", "Input", "output", "Output")],
               feeds=lambda i=inputs: {k: v for k, v in {**drop_feeds(), "Z_0": np.ones(1, F32)}.items()
                                       if k in i})
for label, feed, needles in [
        ("ratio-two-elements", {"ratio": np.array([0.1, 0.2], F32)},
         ["input 1 (ratio)", "exactly one element", "shape [2]"]),
        ("ratio-empty", {"ratio": np.zeros((0,), F32)}, ["input 1 (ratio)", "exactly one element", "shape [0]"]),
        ("training-mode-two-elements", {"training_mode": np.array([True, False])},
         ["input 2 (training_mode)", "tensor(bool) with exactly one element", "shape [2]"]),
        ("training-mode-empty", {"training_mode": np.zeros((1, 0), np.bool_)},
         ["input 2 (training_mode)", "exactly one element", "shape [1, 0]"]),
        ("state-5-elements", {"state": np.zeros(5, U32)}, ["input 3 (state)", "exactly 6 elements", "shape [5]"]),
        ("state-7-elements", {"state": np.zeros(7, U32)}, ["input 3 (state)", "exactly 6 elements", "shape [7]"]),
        ("state-empty", {"state": np.zeros((0, 6), U32)}, ["input 3 (state)", "exactly 6 elements", "shape [0, 6]"]),
        ("data-misaligned", {"data": np.frombuffer(np.zeros(61, np.uint8).data, F32, 15, 1).reshape(3, 5)},
         ["input 0 (data)", "aligned"])]:
    run_error(DR, label, replace(**feed), [DR] + needles)
# ratio outside [0, 1) in training mode: an error naming it; outside training it is ignored.
for label, value, shown in [("one", 1.0, "got 1"), ("above-one", 1.5, "got 1.5"),
                            ("negative", -0.25, "got -0.25"), ("nan", np.nan, "got NaN"),
                            ("inf", np.inf, "got inf"), ("neg-inf", -np.inf, "got -inf")]:
    run_error(DR, f"ratio-{label}", replace(ratio=np.array(value, F32)),
              [DR, "input 1 (ratio)", "a value in [0, 1) in training mode", shown])
for label, value in [("above-one", 1.5), ("nan", np.nan), ("negative", -3.0)]:
    result(DR, f"ratio-{label}-not-training", replace(ratio=np.array(value, F32),
                                                      training_mode=np.array(False)),
           lambda h, outs, fed: assert_dropout(outs, fed))
# Edge ratios in training mode, and non-finite or huge data: the contract's bits.
for label, value in [("zero", 0.0), ("negative-zero", -0.0),
                     ("below-one", float(np.nextafter(F32(1), F32(0)))), ("tiny", 1e-45)]:
    result(DR, f"ratio-{label}", replace(ratio=np.array(value, F32)),
           lambda h, outs, fed: assert_dropout(outs, fed))
for label, value in [("nan", np.nan), ("inf", np.inf), ("neg-inf", -np.inf), ("neg-zero", -0.0),
                     ("float-max", float(np.finfo(F32).max))]:
    def poke_all(feeds, value=value):
        d = np.array(feeds["data"], copy=True)
        d.reshape(-1)[::2] = value  # kept and dropped elements alike
        return {**feeds, "data": d}
    result(DR, f"{label}-in-data", poke_all, lambda h, outs, fed: assert_dropout(outs, fed))


def drop_zero_check(h, outs, fed):
    assert [o.shape for o in outs[:2]] == [(0, 1 << 40)] * 2
    assert_same([outs[2]], [fed["state"]], "no words used: state unchanged")


result(DR, "zero-elements-enormous-dim", replace(data=np.zeros((0, 1 << 40), F32)), drop_zero_check)
result(DR, "state-2x3-shape", lambda f: {**f, "state": f["state"].reshape(2, 3)},
       lambda h, outs, fed: assert_dropout(outs, fed))
result(DR, "unknown-attribute-ignored", lambda f: f,
       lambda h, outs, fed: assert_same(outs, h.baseline(DR)),
       model=lambda: drop_model(attrs={"seed": 5, "trainops_no_such_attribute": 1.5}))
for label, inputs in [("ratio-named-empty", ("data", "", "training_mode", "state")),
                      ("training-mode-named-empty", ("data", "ratio", "", "state")),
                      ("both-optional-inputs-named-empty", ("data", "", "", "state"))]:
    # "" ratio: the default 0.5; "" training_mode: not training (identity).
    result(DR, label, lambda f, i=inputs: {k: v for k, v in f.items() if k in i},
           lambda h, outs, fed: assert_dropout(outs, fed),
           model=lambda i=inputs: drop_model(inputs=i))
for label, outputs in [("mask-named-empty", ("output", "", "state_out")),
                       ("state-out-named-empty", ("output", "mask", "")),
                       ("both-optional-outputs-named-empty", ("output", "", "")),
                       ("output-only", ("output",))]:
    result(DR, label, lambda f: f, lambda h, outs, fed, o=outputs: assert_dropout(outs, fed, o),
           model=lambda o=outputs: drop_model(outputs=o))


def drop_in_place(h, custom_for, what):
    sess = h.session(good_model(DR))
    got, values = bound_run(h, sess, drop_feeds(), custom_for)
    assert_same(got, h.baseline(DR), what)
    return sess, values


def drop_output_over_data(h):
    sess, values = drop_in_place(h, {"output": over("output", "data")}, "output over data")
    assert_same([values["data"].numpy()], [h.baseline(DR)[0]], "data's buffer holds output")
    h.assert_usable(DR, sess)


def drop_state_in_place(h):
    sess, values = drop_in_place(h, {"state_out": over("state_out", "state")}, "state_out over state")
    assert_same([values["state"].numpy()], [h.baseline(DR)[2]], "state's buffer holds state_out")
    h.assert_usable(DR, sess)


def drop_both_in_place(h):
    sess, values = drop_in_place(h, {"output": over("output", "data"), "state_out": over("state_out", "state")},
                                 "output and state_out in place")
    assert_same([values["data"].numpy(), values["state"].numpy()],
                [h.baseline(DR)[0], h.baseline(DR)[2]], "buffers hold the outputs")
    h.assert_usable(DR, sess)


def drop_mask_over_state(h):
    """``mask`` (15 bools) over the state's 24 bytes: the state is read first."""
    sess, values = drop_in_place(h, {"mask": at_value("mask", "state", np.bool_, (3, 5))}, "mask over state")
    h.assert_usable(DR, sess)


def drop_error_binding(custom_for, needles):
    def run(h):
        sess = h.session(good_model(DR))
        with pytest.raises(Exception) as info:
            bound_run(h, sess, drop_feeds(), custom_for())
        assert_clear(str(info.value), [DR] + needles)
        h.assert_usable(DR, sess)
    return run


CASES.append(Case(DR, "output-over-data-in-place", drop_output_over_data))
CASES.append(Case(DR, "state-out-over-state-in-place", drop_state_in_place))
CASES.append(Case(DR, "output-and-state-out-in-place", drop_both_in_place))
CASES.append(Case(DR, "mask-over-state-input", drop_mask_over_state))
CASES.append(Case(DR, "mask-over-data", drop_error_binding(
    lambda: {"mask": at_value("mask", "data", np.bool_, (3, 5))},
    ["input 0 (data)", "output 1 (mask)", "overlapping memory"])))
CASES.append(Case(DR, "state-out-over-data", drop_error_binding(
    lambda: {"state_out": at_value("state_out", "data", U32, (6,))},
    ["input 0 (data)", "output 2 (state_out)", "overlapping memory"])))
_drop_buf = np.zeros(64, U32)
CASES.append(Case(DR, "outputs-overlap", drop_error_binding(
    lambda: {"output": at("output", _drop_buf, 0, F32, (3, 5)), "state_out": at("state_out", _drop_buf, 32, U32, (6,))},
    ["output 0 (output)", "output 2 (state_out)", "overlapping memory"])))


# --- the library as a whole ---------------------------------------------------------------

def registered_twice(h):
    """Twice on one SessionOptions: ONNX Runtime's own error (at registration or when a
    session is made from those options), never a crash; fresh options work."""
    so = h.options()
    try:
        so.register_custom_ops_library(h.library)
        h.session(good_model("Adam"), so=so)
    except Exception as exc:  # noqa: BLE001
        assert_clear(str(exc), [("Domain already set in registry", "already")])
    else:
        pytest.fail("registering the library twice on one SessionOptions was accepted")
    h.assert_usable("Adam")


def registered_on_many_options(h):
    """Many SessionOptions, one library: the domains are shared, every session works."""
    sessions = [h.session(good_model("Adam")) for _ in range(20)]
    for sess in sessions:
        h.assert_usable("Adam", sess)


CASES.append(Case("Adam", "library-registered-twice", registered_twice))
CASES.append(Case("Adam", "library-on-20-session-options", registered_on_many_options))


# --- running the cases --------------------------------------------------------------------

@pytest.fixture(scope="module")
def harness(library_path) -> Harness:
    return Harness(library_path)


def _params():
    out = []
    for c in CASES:
        marks = [pytest.mark.xfail(reason=c.xfail, strict=False)] if c.xfail else []
        out.append(pytest.param(c, id=f"{c.op}-{c.id}", marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_case(harness, case):
    why = harness.missing(case.op)
    if why:
        pytest.skip(why)
    case.run(harness)


def test_count():
    """The suite's size (scripts/robustness reports it): at least 40 cases."""
    ids = [f"{c.op}-{c.id}" for c in CASES]
    assert len(set(ids)) == len(ids), "duplicate case ids"
    by_op = {op: sum(c.op == op for c in CASES) for op in KITS}
    print(f"\nrobustness cases: {len(CASES)} ({', '.join(f'{k} {v}' for k, v in by_op.items())})")
    assert len(CASES) >= 40
    assert all(by_op[op] > 0 for op in KITS)
