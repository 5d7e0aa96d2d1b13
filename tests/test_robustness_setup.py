"""Clear errors at setup time: a ``PhiloxUniform``/``PhiloxNormal`` node
whose ``dtype`` attribute is not a float type fails at session creation naming the op, the
attribute, the value and the allowed values; ``trainops.configure`` checks ``device_id``, is
idempotent, and accepts a library the user registered as an EP library themselves.

The configure tests that need the plugin EP run in a fresh process each (ONNX Runtime keeps
EP libraries per process, and ``TRAINOPS_FAKE_DEVICE=1`` is read when the library is first
registered as one), skipped before onnxruntime 1.24.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
from trainops import device as td  # noqa: E402
from trainops.models import node_model  # noqa: E402

PYTHON_DIR = os.path.join(os.path.dirname(__file__), "..", "python")
ALLOWED = "expected 1 (float), 11 (double), 10 (float16) or 16 (bfloat16)"
# The inference callback that lets a node of a non-float declared output type reach trainops'
# kernel creation runs for these ops (which have an optional input) from 1.24 on only; before,
# ONNX Runtime's own type check fires first (see ops/random/distributions.rs).
TYPED_INFERENCE = td.runtime_version() >= (1, 24)


def _message(excinfo) -> str:
    return str(excinfo.value)


# (dtype attribute, declared output element type): the value given is its TensorProto number
CASES = [
    (6, np.int32),  # the case: dtype=int32, output declared int32
    (12, np.uint32),
    (7, np.int64),
    (9, np.bool_),
    (6, np.float32),  # dtype=int32 with a float output declared
    (0, np.float32),  # not an element type at all
    (99, np.float32),
]


@pytest.mark.parametrize("op", ["PhiloxUniform", "PhiloxNormal"])
@pytest.mark.parametrize("dtype, declared", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_non_float_dtype_fails_at_session_creation_naming_the_attribute(make_session, op, dtype, declared):
    if declared is not np.float32 and not TYPED_INFERENCE:
        pytest.skip(f"onnxruntime {ort.__version__} type-checks the output before any trainops code runs (< 1.24)")
    model = node_model(op, [("state", np.uint32, [6])], [("output", declared, None)],
                       domain="com.trainops", shape=[4], dtype=dtype)
    with pytest.raises(Exception) as excinfo:
        make_session(model)  # session creation, not the first run
    assert f"{op}: attribute 'dtype': {ALLOWED}, got {dtype}" in _message(excinfo), _message(excinfo)


@pytest.mark.parametrize("op", ["PhiloxUniform", "PhiloxNormal"])
def test_a_float_dtype_declared_as_int32_is_onnx_runtimes_type_error(make_session, op):
    """``dtype=1`` says float: an int32 output declaration is the model's type error, which
    ONNX Runtime reports itself (the expected type it names is the one ``dtype`` gives)."""
    model = node_model(op, [("state", np.uint32, [6])], [("output", np.int32, None)],
                       domain="com.trainops", shape=[4], dtype=1)
    with pytest.raises(Exception) as excinfo:
        make_session(model)
    assert "tensor(int32)" in _message(excinfo) and "expected type (tensor(float))" in _message(excinfo)


@pytest.mark.parametrize("op", ["PhiloxUniform", "PhiloxNormal"])
@pytest.mark.parametrize("dtype, np_dtype", [(1, np.float32), (11, np.float64), (10, np.float16)])
def test_float_dtypes_still_run(make_session, op, dtype, np_dtype):
    """The catch-all registration behind the error never takes a node of a valid type."""
    if np_dtype is not np.float32 and not TYPED_INFERENCE:
        pytest.skip(f"onnxruntime {ort.__version__} types these outputs float (no inference callback before 1.24)")
    model = node_model(op, [("state", np.uint32, [6])], [("output", np_dtype, None)],
                       domain="com.trainops", shape=[4], dtype=dtype)
    (out,) = make_session(model).run(None, {"state": np.zeros(6, np.uint32)})
    assert out.dtype == np_dtype and out.shape == (4,)


# --- configure(device_id=...) --------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -7])
@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
def test_negative_device_id_is_a_value_error_naming_it(library_path, device, bad):
    so = ort.SessionOptions()
    with pytest.raises(ValueError, match=rf"^configure: device_id must be >= 0, got {bad}$"):
        td.configure(so, device=device, library=library_path, device_id=bad)
    assert td.configure(so, device="cpu", library=library_path) == "cpu"  # nothing was half-done


@pytest.mark.parametrize("bad", ["0", 1.0, None, True])
def test_non_int_device_id_is_a_type_error_naming_it(library_path, bad):
    with pytest.raises(TypeError, match=r"^configure: device_id must be an int, got "):
        td.configure(ort.SessionOptions(), device="auto", library=library_path, device_id=bad)


def test_cpu_configure_is_idempotent(library_path, make_session):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    assert td.configure(so, device="cpu", library=library_path) == "cpu"
    assert td.configure(so, device="cpu", library=library_path) == "cpu"
    assert td.configure(so, device="auto", library=library_path) == "cpu"  # the door chosen first
    model = node_model("PhiloxUniform", [("state", np.uint32, [6])], [("output", np.float32, None)],
                       domain="com.trainops", shape=[3])
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    assert sess.run(None, {"state": np.zeros(6, np.uint32)})[0].shape == (3,)
    with pytest.raises(ValueError, match="already load trainops through 'cpu'"):
        td.configure(so, device="cuda", library=library_path)


def _run(code: str, library_path: str, fake: bool = True) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINOPS_FAKE_DEVICE", "TRAINOPS_CUDA")}
    if fake:
        env["TRAINOPS_FAKE_DEVICE"] = "1"
    prelude = f"import sys; sys.path.insert(0, {PYTHON_DIR!r})\nLIB = {library_path!r}\n"
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()


needs_ep = pytest.mark.skipif(not td.plugin_ep_supported(),
                              reason=f"onnxruntime {ort.__version__} has no plugin EPs (1.24+)")


@needs_ep
def test_device_id_beyond_the_offered_devices_is_a_value_error(library_path):
    lines = _run("""
        import onnxruntime as ort
        from trainops import device as td
        for device in ("auto", "cuda"):
            try:
                td.configure(ort.SessionOptions(), device=device, library=LIB, device_id=1)
            except ValueError as e:
                print(e)
        print(td.configure(ort.SessionOptions(), device="cuda", library=LIB, device_id=0))
    """, library_path)
    msg = ("configure: device_id 1 is out of range: TrainopsExecutionProvider offers 1 device(s) "
           "(ids 0 to 0)")
    assert lines == [msg, msg, "TrainopsExecutionProvider"]


@needs_ep
def test_ep_configure_is_idempotent(library_path):
    lines = _run("""
        import onnxruntime as ort
        from trainops import device as td
        so = ort.SessionOptions()
        print(td.configure(so, device="auto", library=LIB))
        print(td.configure(so, device="cuda", library=LIB))
        print(td.configure(so, device="auto", library=LIB))
        try:
            td.configure(so, device="cpu", library=LIB)
        except ValueError as e:
            print("ValueError", "already load trainops through 'TrainopsExecutionProvider'" in str(e))
        print(len(td.devices(LIB)))
    """, library_path)
    assert lines == ["TrainopsExecutionProvider"] * 3 + ["ValueError True", "1"]


@needs_ep
@pytest.mark.parametrize("name", ["trainops", "my_trainops"])
def test_library_registered_by_the_user_is_used_as_is(library_path, name):
    """The user registered the library as an EP library (under our usual name, which made
    ``configure`` fail with "EP library is already registered under trainops", or another):
    ``configure`` uses it, and the device is listed once."""
    lines = _run(f"""
        import onnxruntime as ort
        from trainops import device as td
        ort.register_execution_provider_library({name!r}, LIB)
        so = ort.SessionOptions()
        print(td.configure(so, device="auto", library=LIB))
        print(len(td.devices(LIB)))
        print(sum(d.ep_name == td.EP_NAME for d in ort.get_ep_devices()))
    """, library_path)
    assert lines == ["TrainopsExecutionProvider", "1", "1"]


@needs_ep
def test_library_registered_by_the_user_without_devices_is_not_an_error(library_path):
    """With no device offered (no fake device, no GPU), a user registration under "trainops"
    cannot be seen in the device list: ONNX Runtime's "already registered" answer is taken
    as it, and ``auto`` falls back to the CPU door."""
    lines = _run("""
        import onnxruntime as ort
        from trainops import device as td
        ort.register_execution_provider_library("trainops", LIB)
        print(td.configure(ort.SessionOptions(), device="auto", library=LIB))
    """, library_path, fake=False)
    assert lines == ["cpu"]
