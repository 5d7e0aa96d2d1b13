"""The library against the installed onnxruntime, whatever its version; no pytest, no onnx
(run in a bare venv with an old onnxruntime and numpy):

    python tests/runtime_range/old_runtime_check.py path/to/libtrainops.so

onnxruntime older than 1.17: registering the library must fail with a clear error that
names the version it needs (1.17), and the process carries on: the same SessionOptions
still runs a plain model, and an Adam model is refused cleanly at load.
onnxruntime 1.17 or newer: registration succeeds and a one-node Adam model runs.

Exit status 0 when the expectation holds, 1 otherwise.
"""

from __future__ import annotations

import base64
import re
import sys

import numpy as np
import onnxruntime as ort

# Serialized with onnx 1.23 (IR version 8) so that this script needs no onnx package:
# Identity(x: float[2]) -> y, opset 13.
IDENTITY_MODEL = base64.b64decode(
    "CAgSDnRyYWlub3BzLXRlc3RzOj4KEAoBeBIBeSIISWRlbnRpdHkSCGlkZW50aXR5Wg8KAXgSCgoICAESBAoCCAJi"
    "DwoBeRIKCggIARIECgIIAkIECgAQDQ=="
)
# trainops.models.adam_model([(2,)]): Adam over one float[2] tensor, R float, T int64.
ADAM_MODEL = base64.b64decode(
    "CAgSCHRyYWlub3BzOpQCClsKAVIKAVQKA1hfMQoDR18xCgNWXzEKA0hfMRIHWF8xX25ldxIHVl8xX25ldxIHSF8x"
    "X25ldxoEYWRhbSIEQWRhbToYYWkub25ueC5wcmV2aWV3LnRyYWluaW5nEgphZGFtX2dyYXBoWgsKAVISBgoECAES"
    "AFoLCgFUEgYKBAgHEgBaEQoDWF8xEgoKCAgBEgQKAggCWhEKA0dfMRIKCggIARIECgIIAloRCgNWXzESCgoICAES"
    "BAoCCAJaEQoDSF8xEgoKCAgBEgQKAggCYhUKB1hfMV9uZXcSCgoICAESBAoCCAJiFQoHVl8xX25ldxIKCggIARIE"
    "CgIIAmIVCgdIXzFfbmV3EgoKCAgBEgQKAggCQgQKABARQhwKGGFpLm9ubngucHJldmlldy50cmFpbmluZxAB"
)
MIN_VERSION = (1, 17)


def _version(text: str) -> tuple[int, int]:
    major, minor = (int(p) for p in re.findall(r"\d+", text)[:2])
    return major, minor


def _session(model: bytes, so):
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _adam_feeds():
    x = np.array([1.0, -2.0], np.float32)
    return {"R": np.array(0.1, np.float32), "T": np.array(1, np.int64), "X_1": x,
            "G_1": np.array([0.5, 0.25], np.float32), "V_1": np.zeros(2, np.float32),
            "H_1": np.zeros(2, np.float32)}


def check_old(library: str) -> list[str]:
    problems = []
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        so.register_custom_ops_library(library)
    except Exception as exc:  # noqa: BLE001
        message = str(exc)
        print(f"refused as expected: {message}")
        if "1.17" not in message:
            problems.append(f"the error does not name the version needed (1.17): {message}")
    else:
        problems.append("registration succeeded on an onnxruntime older than 1.17")
        return problems
    # The process lives, and the same options still work for models without the op.
    out = _session(IDENTITY_MODEL, so).run(None, {"x": np.array([1.5, -2.0], np.float32)})[0]
    if out.tolist() != [1.5, -2.0]:
        problems.append(f"Identity after the refusal gave {out.tolist()}")
    try:
        _session(ADAM_MODEL, so)
    except Exception as exc:  # noqa: BLE001
        print(f"an Adam model is refused at load: {' '.join(str(exc).split())[:200]}")
    else:
        problems.append("an Adam model loaded although the library was refused")
    return problems


def check_supported(library: str) -> list[str]:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.register_custom_ops_library(library)
    feeds = _adam_feeds()
    x_new, v_new, h_new = _session(ADAM_MODEL, so).run(None, feeds)
    g = feeds["G_1"].astype(np.float64)
    alpha, beta, eps = float(np.float32(0.9)), float(np.float32(0.999)), float(np.float32(1e-6))
    v = (1 - alpha) * g
    h = (1 - beta) * g * g
    r = 0.1 * np.sqrt(1 - beta) / (1 - alpha)
    x = feeds["X_1"] - r * v / (np.sqrt(h) + eps)
    problems = []
    for name, got, want in (("X_1_new", x_new, x), ("V_1_new", v_new, v), ("H_1_new", h_new, h)):
        if got.dtype != np.float32 or not np.allclose(got, want, rtol=1e-5, atol=1e-7):
            problems.append(f"{name}: got {got!r}, expected {want!r}")
    print(f"Adam ran: X_1_new = {x_new.tolist()}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    library = argv[1]
    version = ort.__version__
    old = _version(version) < MIN_VERSION
    print(f"onnxruntime {version}: expecting the library to be "
          f"{'refused' if old else 'loaded'}")
    problems = check_old(library) if old else check_supported(library)
    for p in problems:
        print(f"FAIL: {p}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
