"""The Rust Trainer (crates/trainops-trainer, its example ``train``) trains from the
artifacts that ``Trainer.save_artifacts`` writes with no Python at run time: its printed
losses (C's ``%.9g``, which round-trips a float32) are ``Trainer.step``'s bit for bit (the
demo CNN for 100 steps; Dropout's Philox states; mixed_float16 with skipped steps), the
checkpoint it writes resumes in Python bit for bit, and it resumes from Python's.

The example is built here in debug (``cargo build -p trainops-trainer --example train``);
ONNX Runtime is this Python's onnxruntime wheel (``ORT_DYLIB_PATH``), so the 1.17.3 venv
runs it against 1.17.3."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import rust_trainer
from helpers.artifact_cases import CASES, make_trainer
from helpers.checks import same_bits
from trainops import Trainer

N_BATCHES = 7  # the example feeds batch i % 7: the batches cycle


@pytest.fixture(scope="module")
def train_rs():
    """(the example's executable, its environment); skips without cargo or a
    libonnxruntime.so in this onnxruntime package."""
    return rust_trainer.build()


def run_rs(train_rs, library_path, *args, ok=True):
    return rust_trainer.run(train_rs, library_path, *args, ok=ok)


def artifacts(tmp_path, case):
    """(the trainer, its artifacts folder, the batches file, the batches)."""
    tr = make_trainer(case)
    tr.save_artifacts(tmp_path / "art")
    batches = CASES[case][3](N_BATCHES)
    path = tmp_path / "batches.safetensors"
    save_file({f"{n}/{i}": v for i, b in enumerate(batches) for n, v in b.items()}, str(path))
    return tr, tmp_path / "art", path, batches


@pytest.mark.parametrize("case, steps", [("cnn-adam", 100), ("dropout-momentum", 30),
                                         ("mixed-float16-skips", 30)])
def test_rust_losses_are_the_python_trainers_bit_for_bit(library_path, tmp_path, train_rs,
                                                         case, steps):
    tr, art, path, batches = artifacts(tmp_path, case)
    out = tmp_path / "after.safetensors"
    r = run_rs(train_rs, library_path, art, path, steps, "--save", out)
    want = ["%.9g" % tr.step(batches[i % N_BATCHES]) for i in range(steps)]
    assert r.stdout.split() == want
    if case == "mixed-float16-skips":
        assert tr.skipped > 0  # the skip rule was exercised
    # The Rust checkpoint: every state as Python's after the same steps, the metadata's
    # counters and loss scale as Python writes them.
    tr.save(tmp_path / "python.safetensors")
    got, want_t = load_file(str(out)), load_file(str(tmp_path / "python.safetensors"))
    assert sorted(got) == sorted(want_t)
    for name in want_t:
        assert same_bits(got[name], want_t[name]), name
    from trainops.train import checkpoint

    _, meta = checkpoint.read(out)
    _, py_meta = checkpoint.read(tmp_path / "python.safetensors")
    assert meta == py_meta


def test_a_rust_checkpoint_resumes_in_python_bit_for_bit(library_path, tmp_path, train_rs):
    tr, art, path, batches = artifacts(tmp_path, "dropout-momentum")
    k, steps = 12, 25
    out = tmp_path / "rust.safetensors"
    run_rs(train_rs, library_path, art, path, k, "--save", out)
    want = [tr.step(batches[i % N_BATCHES]) for i in range(steps)]
    resumed = Trainer.load(out, threads=1)  # the checkpoint alone
    os.replace(out, art / "checkpoint.safetensors")
    from_art = Trainer.from_artifacts(art, threads=1)
    for t in (resumed, from_art):
        assert t.T == k + 1
        got = [t.step(batches[i % N_BATCHES]) for i in range(k, steps)]
        assert same_bits(np.float64(got), np.float64(want[k:]))


def test_rust_resumes_from_a_python_checkpoint(library_path, tmp_path, train_rs):
    tr, art, path, batches = artifacts(tmp_path, "mixed-float16-skips")
    k, steps = 9, 20
    for i in range(k):
        tr.step(batches[i % N_BATCHES])
    tr.save(tmp_path / "python.safetensors")
    r = run_rs(train_rs, library_path, art, path, steps - k, "--offset", k,
               "--checkpoint", tmp_path / "python.safetensors")
    assert r.stdout.split() == ["%.9g" % tr.step(batches[i % N_BATCHES])
                                for i in range(k, steps)]


def test_rust_errors_name_the_problem(library_path, tmp_path, train_rs):
    tr, art, path, batches = artifacts(tmp_path, "cnn-adam")
    only_x = tmp_path / "only_x.safetensors"
    save_file({f"x/{i}": b["x"] for i, b in enumerate(batches)}, str(only_x))
    r = run_rs(train_rs, library_path, art, only_x, 1, ok=False)
    assert r.returncode == 1 and r.stdout == ""
    assert 'Trainer::step: the batch has no tensor "t"' in r.stderr, r.stderr
    wrong = tmp_path / "wrong.safetensors"
    save_file({**{f"x/{i}": b["x"][:, :, :4] for i, b in enumerate(batches)},
               **{f"t/{i}": b["t"] for i, b in enumerate(batches)}}, str(wrong))
    r = run_rs(train_rs, library_path, art, wrong, 1, ok=False)
    assert 'input "x": expected shape [?, 1, 8, 8], got [8, 1, 4, 8]' in r.stderr, r.stderr
    # A checkpoint without a state and with a stray tensor: both problems in one error.
    ck = load_file(str(art / "checkpoint.safetensors"))
    from trainops.train import checkpoint

    _, meta = checkpoint.read(art / "checkpoint.safetensors")
    del ck["fc.b"]
    ck["stray"] = np.zeros(1, np.float32)
    save_file(ck, str(tmp_path / "bad.safetensors"), metadata=meta)
    r = run_rs(train_rs, library_path, art, path, 1, "--checkpoint",
               tmp_path / "bad.safetensors", ok=False)
    assert 'state "fc.b" (float32 [10]) is missing' in r.stderr, r.stderr
    assert 'tensors ["stray"] are not states of the training model' in r.stderr, r.stderr
