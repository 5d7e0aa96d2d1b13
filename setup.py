"""Build glue that pyproject.toml cannot express: ship ONNX's conformance cases
(models/onnx-node, exported by scripts/export_conformance.py) inside the package, so that
`python -m trainops conformance` works from an installed wheel too."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithModels(build_py):
    def run(self):
        super().run()
        src = Path(__file__).parent / "models" / "onnx-node"
        if src.is_dir():
            dst = Path(self.build_lib) / "trainops" / "data" / "onnx-node"
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)


setup(cmdclass={"build_py": BuildPyWithModels})
