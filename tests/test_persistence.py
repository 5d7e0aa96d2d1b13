"""Saving you can trust (checkpoints and training artifacts, Python and Rust):

- a save onto something that is not a regular file (a FIFO, a directory, a character
  device, a symlink to one) is refused with an OSError naming it, and the node stays what it
  was; a save through a symlink to a regular file writes that file and the link stays;
- a save that fails for real (a file-size limit: RLIMIT_FSIZE with SIGXFSZ ignored, EFBIG;
  a full tmpfs: ENOSPC, where one can be mounted) raises OSError with the errno and the
  path, leaves the previous file (all five artifacts) byte for byte, and no temporary file;
- temporary files of interrupted saves are removed by the next save, unless another writer
  holds them; the old ``training.onnx.tmp`` too;
- the checkpoint writer lays files out as safetensors' own writer does.

Every file is made inside pytest's temporary folders; FIFOs are never opened for writing."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import rust_trainer
from helpers.artifact_cases import CASES, make_trainer
from trainops import Trainer
from trainops.train import checkpoint

ROOT = Path(__file__).resolve().parent.parent
CASE = "mlp-momentum-nesterov"


def trained(steps=2):
    tr = make_trainer(CASE)
    for b in CASES[CASE][3](steps):
        tr.step(b)
    return tr


def _kind(path) -> str:
    mode = os.lstat(path).st_mode
    for test, name in ((stat.S_ISLNK, "link"), (stat.S_ISFIFO, "fifo"), (stat.S_ISDIR, "dir"),
                       (stat.S_ISCHR, "chr"), (stat.S_ISREG, "file")):
        if test(mode):
            return name
    return "other"


def _special(tmp_path: Path, kind: str) -> tuple[Path, str, int, str]:
    """(a target of ``kind`` in tmp_path, what the error calls it, its errno, the node
    kind that must stay)."""
    target = tmp_path / f"target-{kind}"
    if kind == "fifo":
        os.mkfifo(target)
        return target, "a FIFO", errno.EINVAL, "fifo"
    if kind == "directory":
        target.mkdir()
        (target / "inside").write_bytes(b"kept")
        return target, "a directory", errno.EISDIR, "dir"
    if kind == "char-device":  # a copy of /dev/null's node, made here (root only)
        try:
            os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except (PermissionError, AttributeError) as exc:
            pytest.skip(f"cannot make a character device here: {exc}")
        return target, "a character device", errno.EINVAL, "chr"
    assert kind == "symlink-to-fifo"
    os.mkfifo(tmp_path / "fifo")
    os.symlink("fifo", target)
    return target, "a FIFO", errno.EINVAL, "link"


def _temps(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


@pytest.mark.parametrize("kind", ["fifo", "directory", "char-device", "symlink-to-fifo"])
def test_save_refuses_what_is_not_a_regular_file(library_path, tmp_path, kind):
    target, called, code, node = _special(tmp_path, kind)
    tr = trained()
    with pytest.raises(OSError) as e:
        tr.save(target)
    assert e.value.errno == code and e.value.filename == str(target)
    assert f"is {called}, not a regular file" in str(e.value)
    assert _kind(target) == node
    if kind == "directory":
        assert (target / "inside").read_bytes() == b"kept"
    assert _temps(tmp_path) == []
    # The artifacts: one special target refuses the whole save before anything is written.
    art = tmp_path / "art"
    trained(0).save_artifacts(art)
    before = {n: (art / n).read_bytes() for n in os.listdir(art)}
    (art / "eval.onnx").unlink()
    shutil.move(str(target), art / "eval.onnx") if kind != "symlink-to-fifo" else \
        os.symlink(tmp_path / "fifo", art / "eval.onnx")
    with pytest.raises(OSError, match="not a regular file") as e:
        tr.save_artifacts(art)
    assert e.value.filename == str(art / "eval.onnx")
    assert {n: (art / n).read_bytes() for n in before if n != "eval.onnx"} == \
        {n: v for n, v in before.items() if n != "eval.onnx"}
    assert _temps(art) == []


def test_save_writes_through_a_symlink(library_path, tmp_path):
    tr = trained()
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    os.chmod(real, 0o640)
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "ckpt"
    os.symlink(real, link)
    tr.save(link)
    assert _kind(link) == "link" and os.readlink(link) == str(real)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o640
    assert Trainer.load(real, threads=1).T == tr.T == 3
    dangling = tmp_path / "links" / "later"
    os.symlink(tmp_path / "made.safetensors", dangling)
    tr.save(dangling)
    assert _kind(dangling) == "link" and Trainer.load(tmp_path / "made.safetensors").T == 3
    assert _temps(tmp_path) == [] and _temps(tmp_path / "links") == []


def test_leftover_temporary_files_are_removed_unless_held(library_path, tmp_path):
    tr = trained()
    stale = tmp_path / ".ck.safetensors.0123456789ab.tmp"
    rust_stale = tmp_path / ".ck.safetensors.4242.0badcafe.tmp"
    held = tmp_path / ".ck.safetensors.00000000beef.tmp"
    other = tmp_path / ".other.safetensors.0123456789ab.tmp"
    for p in (stale, rust_stale, held, other):
        p.write_bytes(b"partial")
    with open(held, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a save still writing it
        tr.save(tmp_path / "ck.safetensors")
        assert _temps(tmp_path) == sorted([held.name, other.name])
    tr.save(tmp_path / "ck.safetensors")  # released: now removed
    assert _temps(tmp_path) == [other.name]
    # save_artifacts: its own leftovers and the older versions' "<name>.tmp"
    art = tmp_path / "art"
    art.mkdir()
    for name in ("training.onnx.tmp", "manifest.json.tmp", ".checkpoint.safetensors.00ff.tmp"):
        (art / name).write_bytes(b"partial")
    tr.save_artifacts(art)
    assert _temps(art) == []
    assert Trainer.from_artifacts(art, threads=1).T == 3


# --- real failures: a file-size limit, a full disk -----------------------------------------

_CHILD = r"""
import json, os, sys
from trainops import Trainer
sys.path.insert(0, sys.argv[1])
from helpers.artifact_cases import CASES, make_trainer
folder, what = sys.argv[2], sys.argv[3]
tr = Trainer.load(os.path.join(folder, "ck.safetensors"), threads=1)
tr.step(CASES[sys.argv[4]][3](1)[0])
if what == "fill":  # fill the file system up
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    os.close(fd)
target = os.path.join(folder, "art" if what == "artifacts" else "ck.safetensors")
try:
    tr.save_artifacts(target) if what == "artifacts" else tr.save(target)
    print(json.dumps({"raised": None}))
except Exception as e:
    print(json.dumps({"raised": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                      "errno": getattr(e, "errno", None), "filename": getattr(e, "filename", None),
                      "message": str(e)}))
"""


def _limit_file_size(limit):
    def child():
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return child


def _child_env(library_path):
    return dict(os.environ, TRAINOPS_LIBRARY=library_path,
                PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                            os.environ.get("PYTHONPATH", "")]))


def _run_child(tmp_path, library_path, what, preexec_fn=None, wrap=()):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    r = subprocess.run([*wrap, sys.executable, str(script), str(ROOT / "tests"), str(tmp_path),
                        what, CASE], capture_output=True, text=True, timeout=300,
                       env=_child_env(library_path), preexec_fn=preexec_fn)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("what", ["checkpoint", "artifacts"])
def test_a_file_size_limit_raises_oserror_efbig_and_keeps_the_previous_files(
        library_path, tmp_path, what):
    tr = trained()
    tr.save(tmp_path / "ck.safetensors")
    tr.save_artifacts(tmp_path / "art")
    files = [tmp_path / "ck.safetensors"] + sorted((tmp_path / "art").iterdir())
    before = {p: p.read_bytes() for p in files}
    limit = os.path.getsize(tmp_path / "ck.safetensors") // 2
    got = _run_child(tmp_path, library_path, what, _limit_file_size(limit))
    target = tmp_path / ("art" if what == "artifacts" else "ck.safetensors")
    if what == "artifacts":  # the first file over the limit: training.onnx (13 KB)
        target = target / "training.onnx"
    assert got["raised"] == "OSError" and "OSError" in got["mro"], got
    assert got["errno"] == errno.EFBIG and got["filename"] == str(target), got
    assert "File too large" in got["message"] and str(target) in got["message"], got
    assert {p: p.read_bytes() for p in files} == before
    assert _temps(tmp_path) == [] and _temps(tmp_path / "art") == []


def test_a_full_disk_raises_oserror_enospc_and_keeps_the_previous_file(library_path,
                                                                       tmp_path):
    """A 256 KiB tmpfs mounted in a mount namespace of the child's own (``unshare -m``:
    it vanishes with the child; nothing outside tmp_path is touched). Skipped where the
    machine allows no such mount (an unprivileged CI)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs -o size=256k tmpfs {disk} && umount {disk}"],
                           capture_output=True, text=True, timeout=60) \
        if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here: "
                    f"{probe.stderr.strip() if probe else 'no unshare'}")
    trained().save(tmp_path / "ck.safetensors")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    inner = (f"mount -t tmpfs -o size=256k tmpfs {disk} && cp {tmp_path / 'ck.safetensors'} "
             f"{disk} && cp {disk}/ck.safetensors {disk}/before && "
             f"{sys.executable} {script} {ROOT / 'tests'} {disk} fill {CASE} && "
             f"cmp {disk}/ck.safetensors {disk}/before && echo SAME && ls -a {disk}")
    r = subprocess.run(["unshare", "-m", "sh", "-c", inner], capture_output=True, text=True,
                       timeout=300, env=_child_env(library_path))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    got = json.loads(lines[0])
    assert got["raised"] == "OSError" and got["errno"] == errno.ENOSPC, got
    assert got["filename"] == str(disk / "ck.safetensors"), got
    assert "No space left on device" in got["message"], got
    assert lines[1] == "SAME"  # the previous checkpoint, byte for byte
    assert not [n for n in lines[2:] if n.endswith(".tmp")], lines
    assert os.listdir(disk) == []  # the mount was the child's alone


# --- the Rust trainer's saves ----------------------------------------------------------------

@pytest.fixture(scope="module")
def train_rs():
    return rust_trainer.build()


def test_rust_save_refuses_special_files_and_reports_a_file_size_limit(library_path, tmp_path,
                                                                       train_rs):
    tr = make_trainer(CASE)
    tr.save_artifacts(tmp_path / "art")
    from safetensors.numpy import save_file

    batches = tmp_path / "batches.safetensors"
    save_file({f"{n}/{i}": v for i, b in enumerate(CASES[CASE][3](2)) for n, v in b.items()},
              str(batches))
    for kind in ("fifo", "directory", "symlink-to-fifo"):
        target, called, _, node = _special(tmp_path, kind)
        r = rust_trainer.run(train_rs, library_path, tmp_path / "art", batches, 1, "--save",
                             target, ok=False, timeout=120)
        assert r.returncode == 1, r.stderr
        assert r.stderr.startswith(f"train: {target}: ") and \
            f"is {called}, not a regular file" in r.stderr, r.stderr
        assert _kind(target) == node
    assert _temps(tmp_path) == []
    # Through a symlink: the file it points to.
    os.symlink("real.safetensors", tmp_path / "link")
    rust_trainer.run(train_rs, library_path, tmp_path / "art", batches, 1, "--save",
                     tmp_path / "link", timeout=120)
    assert _kind(tmp_path / "link") == "link"
    assert Trainer.load(tmp_path / "real.safetensors", threads=1).T == 2
    # A file-size limit: the system's error, naming the path; the previous file intact.
    previous = (tmp_path / "real.safetensors").read_bytes()
    limit = len(previous) // 2
    r = rust_trainer.run(train_rs, library_path, tmp_path / "art", batches, 2, "--save",
                         tmp_path / "real.safetensors", ok=False, timeout=120,
                         preexec_fn=_limit_file_size(limit))
    assert r.returncode == 1
    assert r.stderr.strip() == f"train: {tmp_path / 'real.safetensors'}: File too large " \
                               f"(os error {errno.EFBIG})", r.stderr
    assert (tmp_path / "real.safetensors").read_bytes() == previous
    assert _temps(tmp_path) == []


def test_rust_refuses_to_read_a_fifo(library_path, tmp_path, train_rs):
    """A checkpoint, manifest or model that is a FIFO: refused at once (reading one would
    wait for a writer forever)."""
    make_trainer(CASE).save_artifacts(tmp_path / "art")
    from safetensors.numpy import save_file

    batches = tmp_path / "batches.safetensors"
    save_file({f"{n}/0": v for n, v in CASES[CASE][3](1)[0].items()}, str(batches))
    os.mkfifo(tmp_path / "fifo")
    r = rust_trainer.run(train_rs, library_path, tmp_path / "art", batches, 1, "--checkpoint",
                         tmp_path / "fifo", ok=False, timeout=60)
    assert r.returncode == 1 and f"{tmp_path / 'fifo'}: not a regular file" in r.stderr, \
        r.stderr
    for name in ("training.onnx", "manifest.json"):
        copy = tmp_path / name
        shutil.copytree(tmp_path / "art", copy)
        (copy / name).unlink()
        os.mkfifo(copy / name)
        r = rust_trainer.run(train_rs, library_path, copy, batches, 1, ok=False, timeout=60)
        assert r.returncode == 1 and f"{copy / name}: not a regular file" in r.stderr, r.stderr


# --- the file layout -----------------------------------------------------------------------

def test_the_writer_lays_files_out_as_safetensors_does(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save as st_save

    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([True, False]),
               "t": np.array(7, np.int64), "h": np.array([1.5], np.float16),
               "z": np.zeros((0, 2), np.float64), "m": np.frombuffer(b"abc", np.uint8),
               "q": np.array([-1, 2], np.int8), "u": np.array([5], np.uint32),
               "f": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))}
    meta = {"k": "v", "x": "\u00e9"}
    ours = b"".join(bytes(c) for c in checkpoint.serialize(tensors, meta))
    theirs = st_save({k: np.ascontiguousarray(v) if v.ndim else v for k, v in tensors.items()},
                     metadata=meta)

    def header(b):
        (n,) = struct.unpack("<Q", b[:8])
        return n, json.loads(b[8:8 + n]), b[8 + n:]
    n1, h1, d1 = header(ours)
    n2, h2, d2 = header(theirs)
    assert (n1 % 8, h1, d1) == (0, h2, d2)  # the same tensors at the same offsets
    back = load_file_from(ours, tmp_path)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and \
            back[k].tobytes() == np.ascontiguousarray(v).tobytes(), k
    bf = {"x": np.array([1.0, -2.5], ml_dtypes.bfloat16)}
    path = tmp_path / "bf.safetensors"
    checkpoint.write(path, bf, {})
    with open(path, "rb") as f:
        n, h, data = header(f.read())
    assert h["x"] == {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}
    assert data == bf["x"].tobytes()
    with pytest.raises(TypeError, match=r"tensor 'c' has dtype complex64"):
        checkpoint.serialize({"c": np.zeros(1, np.complex64)}, {})


def load_file_from(data: bytes, folder: Path) -> dict:
    from safetensors.numpy import load_file

    path = folder / "ours.safetensors"
    path.write_bytes(data)
    return load_file(str(path))


def test_artifacts_of_a_trainops_loss_resume(library_path, tmp_path):
    """A trainer with a trainops.losses loss: its artifacts bind the loss's target input
    (the source model has none), and from_artifacts resumes bit for bit."""
    from onnx import TensorProto, helper

    from trainops import losses, optim
    from trainops.demos.train import mlp_model

    m = mlp_model(sizes=(8, 16, 3))
    del m.graph.node[-1]  # the model's own loss; z1: the logits
    del m.graph.output[:]
    m.graph.input.remove(next(i for i in m.graph.input if i.name == "t"))
    m.graph.output.append(helper.make_tensor_value_info("z1", TensorProto.FLOAT, None))
    a = Trainer(m, losses.cross_entropy("z1", "labels"), optim.Adam(lr=0.01), seed=3,
                threads=1)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((4, 8)).astype(np.float32),
                "labels": rng.integers(0, 3, 4).astype(np.int64)} for _ in range(4)]
    a.step(batches[0])
    man = a.save_artifacts(tmp_path)
    assert [d["name"] for d in man["data_inputs"]] == ["x", "labels"]
    b = Trainer.from_artifacts(tmp_path, threads=1)
    for feeds in batches[1:]:
        assert np.float64(a.step(feeds)).tobytes() == np.float64(b.step(feeds)).tobytes()
