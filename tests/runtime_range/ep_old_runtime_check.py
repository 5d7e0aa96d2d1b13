"""The plugin-EP entry (`CreateEpFactories`) against an onnxruntime that has plugin EPs but not
the kernel API trainops' EP needs (1.23.x); no pytest, no onnx:

    TRAINOPS_FAKE_DEVICE=1 python tests/runtime_range/ep_old_runtime_check.py path/to/libtrainops.so

`register_execution_provider_library` must succeed with zero factories (no device listed, even
in fake-device mode), print nothing (the library reads the version string before asking for an
API table the runtime lacks), and the custom-op door must still work in the same process.
Exit status 0 when that holds, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import tempfile

import onnxruntime as ort

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from old_runtime_check import check_supported  # noqa: E402


def main(library: str) -> int:
    problems = []
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            ort.register_execution_provider_library("trainops", library)
            listed = [d.ep_name for d in ort.get_ep_devices()]
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        printed = err.read().decode(errors="replace")
    if "TrainopsExecutionProvider" in listed:
        problems.append(f"onnxruntime {ort.__version__} lists a trainops device: {listed}")
    if printed.strip():
        problems.append(f"registration printed to stderr: {printed.strip()[:300]}")
    problems += check_supported(library)
    for p in problems:
        print("FAIL:", p)
    if not problems:
        print(f"onnxruntime {ort.__version__}: plugin EP offers no device, no message; custom-op door works")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
