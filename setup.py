"""Build glue that pyproject.toml cannot express.

- ONNX's conformance cases (models/onnx-node, exported by scripts/export_conformance.py)
  ship inside the package, so that `python -m trainops conformance` works from an
  installed wheel too.
- The library is a plain shared library that ONNX Runtime loads: it has no Python binding
  and no Python ABI. setuptools-rust would install it under an extension module's name
  (libtrainops.cpython-311-x86_64-linux-gnu.so) and tag the wheel for one CPython
  (cp311-cp311); here it keeps its own name (libtrainops.so) beside the package's modules
  and the wheel is tagged py3-none-<platform>: one wheel per platform for every Python 3.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools_rust import build_rust

try:  # setuptools >= 70.1 has its own bdist_wheel; before that it came from wheel
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - older setuptools
    from wheel.bdist_wheel import bdist_wheel

class BuildPyWithModels(build_py):
    def run(self):
        super().run()
        src = Path(__file__).parent / "models" / "onnx-node"
        if src.is_dir():
            dst = Path(self.build_lib) / "trainops" / "data" / "onnx-node"
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)


class BuildRustPlainName(build_rust):
    """Installs the cdylib beside the package's modules under the name cargo gave it
    (libtrainops.so, libtrainops.dylib, trainops.dll: what trainops.get_library_path()
    looks for), not under an extension module's name."""

    def install_extension(self, ext, dylib_paths, *args, **kwargs):
        self._cargo_names = {m.module_name: Path(m.path).name for m in dylib_paths}
        super().install_extension(ext, dylib_paths, *args, **kwargs)

    def get_dylib_ext_path(self, ext, target_fname):
        path = Path(super().get_dylib_ext_path(ext, target_fname))
        return str(path.with_name(self._cargo_names[target_fname]))


class BdistWheelAnyPython3(bdist_wheel):
    """py3-none-<platform>: the platform of the library, no Python version or ABI."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"build_py": BuildPyWithModels, "build_rust": BuildRustPlainName,
                "bdist_wheel": BdistWheelAnyPython3})
