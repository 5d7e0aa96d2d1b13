"""Portable training artifacts (docs/artifacts.md, "Portable artifacts"):
``save_artifacts(dir, portable=True)`` from any Trainer (the default CPU one, with its fused
gradient kernels, included) writes models of default-domain ONNX ops only, and the loop of
tests/helpers/ort_loop.py, run in a process that never loads libtrainops.so (checked in its
/proc/self/maps), trains them bit for bit as ``Trainer(portable=True)`` does: losses and
every state, several steps, Dropout included. ``Trainer.from_artifacts`` resumes them (also
from a checkpoint the plain loop wrote); a step the rewrite cannot make portable is refused
before anything is written, naming its ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from helpers.artifact_cases import CASES, dropout_mlp, make_trainer
from helpers.checks import same_bits
from helpers.ort_loop import ArtifactLoop
from trainops import Trainer, optim
from trainops.train.artifacts import read_manifest
from trainops.train.artifacts_portable import NotPortableError

ROOT = Path(__file__).resolve().parent.parent
STEPS = 16  # the mixed_float16 case skips its first 12 steps (the loss scale halves)

# The loop in a process of its own: no trainops, no library path; it fails if the library
# was loaded anyway. Batches in, losses, T and every state buffer out.
LOOP = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from helpers.ort_loop import ArtifactLoop
d = np.load(sys.argv[3])
steps = int(d["steps"])
loop = ArtifactLoop(sys.argv[2])
losses = [loop.step({"x": d[f"x{k}"], "t": d[f"t{k}"]}) for k in range(steps)]
loop.save(sys.argv[2] + "/loop.safetensors")
maps = open("/proc/self/maps").read()
assert "libtrainops" not in maps, "the library was loaded"
np.savez(sys.argv[4], losses=np.array(losses), T=loop.T, skipped=loop.skipped,
         **{"state:" + k: v for k, v in loop.buffers.items()})
"""


def portable_trainer(case, seed=77):
    model, opt, policy, _ = CASES[case]
    params = [i.name for i in model().graph.initializer if i.name not in ("ratio", "k")]
    return Trainer(model(), "loss", opt(), params=params, policy=policy, threads=1, seed=seed,
                   portable=True)


def run_plain_loop(directory, batches, tmp_path):
    """The loop over ``batches`` in a fresh process without the library."""
    data = tmp_path / "batches.npz"
    np.savez(data, steps=len(batches), **{f"{k}{i}": b[k] for i, b in enumerate(batches)
                                          for k in ("x", "t")})
    out = tmp_path / "loop.npz"
    env = {k: v for k, v in os.environ.items() if k != "TRAINOPS_LIBRARY"}
    env.pop("PYTHONPATH", None)  # no trainops on the path either
    subprocess.run([sys.executable, "-c", LOOP, str(ROOT / "tests"), str(directory),
                    str(data), str(out)], check=True, env=env, timeout=300)
    r = np.load(out)
    states = {k[len("state:"):]: r[k] for k in r.files if k.startswith("state:")}
    return list(r["losses"]), int(r["T"]), int(r["skipped"]), states


def states_of(trainer):
    return {e.input: trainer._arrays[e.input].copy() for e in trainer.step_graph.states}


def default_domain_only(directory):
    for name in ("training.onnx", "eval.onnx", "inference.onnx"):
        m = onnx.load(directory / name)
        assert {n.domain for n in m.graph.node} <= {"", "ai.onnx"}, name
        assert {o.domain for o in m.opset_import} <= {"", "ai.onnx"}, name


@pytest.mark.parametrize("case", list(CASES))
def test_the_plain_loop_without_the_library_is_the_portable_trainer_bit_for_bit(
        library_path, tmp_path, case):
    batches = CASES[case][3](STEPS)
    fused = make_trainer(case)  # the default CPU trainer: fused gradient kernels
    man = fused.save_artifacts(tmp_path / "art", portable=True)
    assert man["portable"] is True and man["custom_ops"] == [] \
        and man["custom_op_library"] is None
    default_domain_only(tmp_path / "art")
    ref = portable_trainer(case)
    want = [ref.step(f) for f in batches]
    losses, T, skipped, states = run_plain_loop(tmp_path / "art", batches, tmp_path)
    assert same_bits(np.array(losses, np.float64), np.array(want, np.float64)), case
    assert (T, skipped) == (ref.T, ref.skipped)
    ref_states = states_of(ref)
    assert set(states) == set(ref_states)
    for name, buf in states.items():
        assert same_bits(ref_states[name], buf), (case, name)
    # the run trains (equal because nothing moved would prove nothing)
    assert any(not same_bits(ref_states[p], fused._arrays[p]) for p in ref.param_names)
    if case == "dropout-momentum":  # masks drawn: the loss of a batch differs from eval's
        assert [d["seed"] for d in man["dropout"]] and all(
            isinstance(d["seed"], int) for d in man["dropout"])
    else:
        assert man["dropout"] == []
    if case == "mixed-float16-skips":
        assert 0 < skipped < STEPS


def test_portable_manifest_validates_and_reads(library_path, tmp_path):
    man = make_trainer("dropout-momentum").save_artifacts(tmp_path, portable=True)
    assert json.loads((tmp_path / "manifest.json").read_text()) == man
    assert read_manifest(tmp_path) == man  # trainops' reader: schema and rules
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "docs" / "manifest.schema.json").read_text())
    jsonschema.validate(man, schema)
    m = onnx.load(tmp_path / "training.onnx")
    seeds = {n.name: a.i for n in m.graph.node if n.op_type == "Dropout"
             for a in n.attribute if a.name == "seed"}
    assert {d["node"]: d["seed"] for d in man["dropout"]} == seeds and seeds
    # the library's artifacts say nothing of portability (absent: not portable)
    plain = make_trainer("cnn-adam").save_artifacts(tmp_path / "plain")
    assert "portable" not in plain and plain["custom_ops"]


@pytest.mark.parametrize("case", ["cnn-adam", "mixed-float16-skips"])
def test_from_artifacts_resumes_portable_artifacts_bit_for_bit(library_path, tmp_path, case):
    k, more = 5, 6
    batches = CASES[case][3](k + more)
    ref, a = portable_trainer(case), make_trainer(case)
    for feeds in batches[:k]:
        ref.step(feeds)
        a.step(feeds)
    ref.save_artifacts(tmp_path, portable=True)  # a portable trainer's own step graph
    b = Trainer.from_artifacts(tmp_path, threads=1)
    assert (b.T, b.lr, b.skipped, b.seed) == (ref.T, ref.lr, ref.skipped, ref.seed)
    assert not [n for n in b.training_model.graph.node if n.domain not in ("", "ai.onnx")]
    for feeds in batches[k:]:
        want = ref.step(feeds)
        assert same_bits(np.float64(b.step(feeds)), np.float64(want))
    want = states_of(ref)
    for name, buf in states_of(b).items():
        assert same_bits(want[name], buf), name
    # saved again from the resumed trainer: still portable
    assert b.save_artifacts(tmp_path / "again", portable=True)["portable"] is True


def test_from_artifacts_continues_a_checkpoint_the_plain_loop_wrote(library_path, tmp_path):
    k, more = 4, 5
    batches = CASES["cnn-adam"][3](k + more)
    ref = portable_trainer("cnn-adam")
    make_trainer("cnn-adam").save_artifacts(tmp_path / "art", portable=True)
    for feeds in batches[:k]:
        ref.step(feeds)
    run_plain_loop(tmp_path / "art", batches[:k], tmp_path)  # writes loop.safetensors
    os.replace(tmp_path / "art" / "loop.safetensors", tmp_path / "art" / "checkpoint.safetensors")
    b = Trainer.from_artifacts(tmp_path / "art", threads=1)
    assert b.T == ref.T == k + 1
    for feeds in batches[k:]:
        assert same_bits(np.float64(b.step(feeds)), np.float64(ref.step(feeds)))


def test_dropout_masks_restart_with_each_session(library_path, tmp_path):
    """What the manifest's "dropout" says: a resumed run (a new session) draws the masks of
    runs 1, 2, ... again; from_artifacts and the plain loop, both fresh, agree bit for bit."""
    batches = CASES["dropout-momentum"][3](8)
    tr = portable_trainer("dropout-momentum")
    for feeds in batches[:3]:
        tr.step(feeds)
    tr.save_artifacts(tmp_path / "art", portable=True)
    b = Trainer.from_artifacts(tmp_path / "art", threads=1)
    want = [b.step(f) for f in batches[3:]]
    losses, _, _, states = run_plain_loop(tmp_path / "art", batches[3:], tmp_path)
    assert same_bits(np.array(losses, np.float64), np.array(want, np.float64))
    for name, buf in states_of(b).items():
        assert same_bits(states[name], buf), name


def test_every_conv_states_its_strides_dilations_and_pads(library_path, tmp_path):
    """onnxruntime-web's WebGPU Conv refuses a Conv that leaves them to their defaults (the
    demo CNN does); the portable artifacts write them out (the same convolutions)."""
    make_trainer("cnn-adam").save_artifacts(tmp_path, portable=True)
    for name in ("training.onnx", "eval.onnx", "inference.onnx"):
        convs = [n for n in onnx.load(tmp_path / name).graph.node if n.op_type == "Conv"]
        assert convs, name
        for n in convs:
            attrs = {a.name: list(a.ints) for a in n.attribute}
            assert len(attrs["strides"]) == len(attrs["dilations"]) == 2, (name, n.name)
            assert len(attrs["pads"]) == 4, (name, n.name)
    forward = next(n for n in onnx.load(tmp_path / "training.onnx").graph.node
                   if n.name == "conv1")
    assert {a.name: list(a.ints) for a in forward.attribute} == {
        "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1]}


def test_eval_of_portable_artifacts_needs_no_library(library_path, tmp_path):
    tr = make_trainer("cnn-adam")
    tr.save_artifacts(tmp_path, portable=True)
    loop = ArtifactLoop(tmp_path)
    sess = loop.eval_session()
    for feeds in CASES["cnn-adam"][3](3):
        before = loop.evaluate(sess, feeds)
        assert same_bits(np.float64(before), np.float64(loop.step(feeds)))


def noisy_mlp():
    """The Dropout MLP with RandomNormal noise on its logits: the step gets a PhiloxNormal,
    which has no default-domain form."""
    m = dropout_mlp()
    g = m.graph
    last = g.node[-1]
    g.node.insert(len(g.node) - 1, helper.make_node("RandomNormal", [], ["noise"],
                                                    shape=[16, 3], scale=0.1))
    g.node.insert(len(g.node) - 1, helper.make_node("Add", [last.input[0], "noise"], ["noisy"]))
    last.input[0] = "noisy"
    return m


def test_a_step_that_cannot_be_portable_is_refused_naming_its_ops(library_path, tmp_path):
    tr = Trainer(noisy_mlp(), "loss", optim.Momentum(lr=0.05), threads=1, seed=3)
    with pytest.raises(NotPortableError, match=r"training\.onnx would keep "
                                               r"com\.trainops::PhiloxNormal"):
        tr.save_artifacts(tmp_path / "a", portable=True)
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").iterdir())
    eight = Trainer(dropout_mlp(), "loss", optim.Adam(lr=0.01, state_dtype="int8"),
                    threads=1, seed=3)
    with pytest.raises(NotPortableError, match="int8"):
        eight.save_artifacts(tmp_path / "b", portable=True)
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").iterdir())


def test_cli_writes_portable_artifacts(library_path, tmp_path):
    from trainops.demos.train import cnn_model

    onnx.save(cnn_model(), tmp_path / "cnn.onnx")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, "-m", "trainops", "artifacts", str(tmp_path / "cnn.onnx"),
                        "--loss", "loss", "--seed", "5", "--portable", "-o", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "portable" in r.stdout and "custom ops none" in r.stdout
    man = read_manifest(tmp_path / "o")
    assert man["portable"] is True and man["custom_ops"] == []
    default_domain_only(tmp_path / "o")
