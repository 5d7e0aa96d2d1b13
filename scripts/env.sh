# Sourced by scripts/demo and scripts/test: makes the project's virtual environment
# (.venv, or $TRAINOPS_VENV) on first use, installs requirements-dev.txt from PyPI, and
# exports PYTHON and ORT_DYLIB_PATH (the onnxruntime wheel's libonnxruntime.so.<version>,
# which the Rust tests load through ort's load-dynamic).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRAINOPS_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    python3 -m venv "$VENV"
fi
PYTHON="$VENV/bin/python"
"$PYTHON" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
ORT_DYLIB_PATH="$("$PYTHON" - <<'PY'
import glob, os, onnxruntime
libs = sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))
print(libs[0] if libs else "")
PY
)"
export PYTHON ORT_DYLIB_PATH ROOT VENV
