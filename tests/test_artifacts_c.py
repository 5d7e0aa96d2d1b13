"""examples/c/train.c, compiled with gcc against the onnxruntime wheel's libonnxruntime.so,
trains from the artifacts: its printed losses (%.9g) are Trainer.step's for 20 steps, and
the checkpoint it writes resumes in Trainer.from_artifacts bit for bit.

The header: $ORT_INCLUDE_DIR (ONNX Runtime's include/ directory) when set, else
examples/c/ort_abi (the declarations train.c uses at their OrtApi slots; the wheel ships
no header and nothing may be downloaded here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from helpers import rust_trainer
from helpers.artifact_cases import CASES, make_trainer
from helpers.checks import same_bits
from trainops import Trainer

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20


@pytest.fixture(scope="module")
def train_c(tmp_path_factory):
    """The compiled examples/c/train.c (skips without gcc or off Linux)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the C example's test links the Linux wheel's libonnxruntime.so")
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler (gcc) on PATH")
    lib = rust_trainer.onnxruntime_library()
    d = tmp_path_factory.mktemp("train_c")
    # The wheel's file is libonnxruntime.so.<version>; its SONAME may be shorter.
    for name in {"libonnxruntime.so", "libonnxruntime.so.1", lib.name}:
        (d / name).symlink_to(lib)
    include = os.environ.get("ORT_INCLUDE_DIR") or str(ROOT / "examples" / "c" / "ort_abi")
    exe = d / "train"
    r = subprocess.run([gcc, "-O2", "-std=c11", "-Wall", str(ROOT / "examples" / "c" / "train.c"),
                        "-I", include, "-o", str(exe), f"-L{d}", "-lonnxruntime",
                        f"-Wl,-rpath,{d}", "-lm"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


@pytest.mark.parametrize("case", ["cnn-adam", "cnn-adagrad", "dropout-momentum",
                                  "mixed-float16-skips"])
def test_c_loop_prints_the_trainer_losses_and_writes_a_resumable_checkpoint(
        library_path, tmp_path, train_c, case):
    batches = CASES[case][3](STEPS + 5)
    tr = make_trainer(case)
    tr.save_artifacts(tmp_path)
    save_file({f"{k}/{n}": v for k, b in enumerate(batches[:STEPS]) for n, v in b.items()},
              str(tmp_path / "batches.safetensors"))
    out = tmp_path / "after.safetensors"
    r = subprocess.run([str(train_c), str(tmp_path), library_path,
                        str(tmp_path / "batches.safetensors"), str(STEPS), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    want = ["%.9g" % tr.step(b) for b in batches[:STEPS]]
    assert r.stdout.split() == want
    os.replace(out, tmp_path / "checkpoint.safetensors")
    resumed = Trainer.from_artifacts(tmp_path, threads=1)
    assert (resumed.T, resumed.skipped, resumed.loss_scale) == (tr.T, tr.skipped, tr.loss_scale)
    for e in tr.step_graph.states:
        assert same_bits(resumed._arrays[e.input], tr._arrays[e.input]), e.input
    for b in batches[STEPS:]:
        assert same_bits(np.float64(resumed.step(b)), np.float64(tr.step(b)))


def test_c_loop_reports_a_missing_batch(library_path, tmp_path, train_c):
    make_trainer("cnn-adam").save_artifacts(tmp_path)
    save_file({"0/x": np.zeros((8, 1, 8, 8), np.float32)}, str(tmp_path / "b.safetensors"))
    r = subprocess.run([str(train_c), str(tmp_path), library_path, str(tmp_path / "b.safetensors"),
                        "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "batches: no tensor 0/t" in r.stderr


def test_c_loop_saves_through_symlinks_and_refuses_special_files(library_path, tmp_path,
                                                                 train_c):
    """Its save follows docs/artifacts.md's rules: a FIFO or a directory is refused (the
    node stays), a symlink is written through (the link stays)."""
    import stat

    case = "mlp-momentum-nesterov"
    tr = make_trainer(case)
    tr.save_artifacts(tmp_path / "art")
    save_file({f"0/{n}": v for n, v in CASES[case][3](1)[0].items()},
              str(tmp_path / "b.safetensors"))

    def run(out):
        return subprocess.run([str(train_c), str(tmp_path / "art"), library_path,
                               str(tmp_path / "b.safetensors"), "1", str(out)],
                              capture_output=True, text=True, timeout=120)

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for special in ("fifo", "dir"):
        r = run(tmp_path / special)
        assert r.returncode == 1 and "is not a regular file" in r.stderr, r.stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert (tmp_path / "dir").is_dir() and not list((tmp_path / "dir").iterdir())
    (tmp_path / "real.safetensors").write_bytes(b"old")
    os.symlink("real.safetensors", tmp_path / "link")
    assert run(tmp_path / "link").returncode == 0
    assert os.path.islink(tmp_path / "link")
    assert Trainer.load(tmp_path / "real.safetensors", threads=1).T == 2
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
