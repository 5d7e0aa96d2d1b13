"""Training artifacts (docs/artifacts.md): the loop of tests/helpers/ort_loop.py (onnxruntime,
numpy and safetensors only, no trainops) reproduces Trainer.step bit for bit on the
artifacts Trainer.save_artifacts writes; from_artifacts resumes bit for bit (also from a
checkpoint the plain loop wrote); eval.onnx's loss is the step's loss; the CLI writes the
same artifacts; manifest.json validates against docs/manifest.schema.json."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from helpers.artifact_cases import CASES, dropout_mlp, make_trainer, mlp_batches
from helpers.checks import same_bits
from helpers.ort_loop import ArtifactLoop
from trainops import Trainer, optim

ROOT = Path(__file__).resolve().parent.parent
def states_of(trainer):
    return {e.input: trainer._arrays[e.input].copy() for e in trainer.step_graph.states}


def test_the_loop_imports_no_trainops():
    tree = ast.parse((ROOT / "tests" / "helpers" / "ort_loop.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in modules if m and m.split(".")[0] in ("trainops", "helpers")]
    assert {"onnxruntime", "numpy", "safetensors"} <= {m.split(".")[0] for m in modules}


@pytest.mark.parametrize("case", list(CASES))
def test_plain_onnxruntime_loop_reproduces_trainer_steps_bit_for_bit(library_path, tmp_path,
                                                                     case):
    steps = 25
    batches = CASES[case][3](steps)
    tr = make_trainer(case)
    tr.save_artifacts(tmp_path)
    loop = ArtifactLoop(tmp_path)
    for k, feeds in enumerate(batches):
        want, got = tr.step(feeds), loop.step(feeds)
        assert same_bits(np.float64(want), np.float64(got)), (case, k, want, got)
        assert loop.T == tr.T, (case, k)
    want_states = states_of(tr)
    assert set(want_states) == set(loop.buffers)
    for name, buf in loop.buffers.items():
        assert same_bits(want_states[name], buf), (case, name)
    if case == "mixed-float16-skips":  # the skip rule was exercised, and T held still
        assert 0 < tr.skipped < steps and loop.skipped == tr.skipped
        assert loop.T == 1 + steps - tr.skipped
    else:
        assert tr.skipped == 0 and loop.T == 1 + steps
    if case == "dropout-momentum":  # Philox states advanced in place, as the trainer's
        rng = [e.input for e in tr.step_graph.of_kind("rng")]
        assert rng and not same_bits(loop.buffers[rng[0]],
                                     tr.step_graph.of_kind("rng")[0].initial)


@pytest.mark.parametrize("case", ["dropout-momentum", "mixed-float16-skips"])
def test_from_artifacts_resumes_bit_for_bit(library_path, tmp_path, case):
    k, more = 6, 8
    batches = CASES[case][3](k + more)
    ref = make_trainer(case)
    a = make_trainer(case)
    for feeds in batches[:k]:
        ref.step(feeds)
        a.step(feeds)
    a.save_artifacts(tmp_path)
    b = Trainer.from_artifacts(tmp_path, threads=1)
    assert (b.T, b.lr, b.skipped, b.seed) == (ref.T, ref.lr, ref.skipped, ref.seed)
    for feeds in batches[k:]:
        want = ref.step(feeds)
        assert same_bits(np.float64(b.step(feeds)), np.float64(want))
    want = states_of(ref)
    for name, buf in states_of(b).items():
        assert same_bits(want[name], buf), name
    assert onnx.checker.check_model(b.export()) is None


def test_from_artifacts_continues_a_checkpoint_the_plain_loop_wrote(library_path, tmp_path):
    k, more = 5, 6
    batches = CASES["mixed-float16-skips"][3](k + more)
    ref = make_trainer("mixed-float16-skips")
    ref.save_artifacts(tmp_path)
    loop = ArtifactLoop(tmp_path)
    for feeds in batches[:k]:
        ref.step(feeds)
        loop.step(feeds)
    loop.save(tmp_path / "checkpoint.safetensors")  # what a C or Java loop would write
    b = Trainer.from_artifacts(tmp_path, threads=1)
    assert (b.T, b.skipped, b.loss_scale) == (ref.T, ref.skipped, ref.loss_scale)
    for feeds in batches[k:]:
        assert same_bits(np.float64(b.step(feeds)), np.float64(ref.step(feeds)))


@pytest.mark.parametrize("case", ["cnn-adam", "cnn-adagrad", "mlp-momentum-nesterov"])
def test_eval_loss_is_the_step_loss_before_the_update(library_path, tmp_path, case):
    tr = make_trainer(case)
    tr.save_artifacts(tmp_path)
    loop = ArtifactLoop(tmp_path)
    sess = loop.eval_session()
    man = loop.manifest
    assert [i.name for i in sess.get_inputs()] == man["eval_inputs"]
    assert man["eval_inputs"] == [d["name"] for d in man["data_inputs"]] + man["parameters"]
    for feeds in CASES[case][3](5):
        before = loop.evaluate(sess, feeds)  # over the loop's own parameter buffers
        assert same_bits(np.float64(before), np.float64(loop.step(feeds)))


def test_eval_runs_dropout_in_inference_mode_and_keeps_philox_states(library_path, tmp_path):
    import onnxruntime as ort

    tr = make_trainer("dropout-momentum")
    batches = mlp_batches(3)
    tr.step(batches[0])
    tr.save_artifacts(tmp_path)
    loop = ArtifactLoop(tmp_path)
    sess = loop.eval_session()
    rng = {n: b.copy() for n, b in loop.buffers.items() if n.startswith("trainops/")}
    e = onnx.load(tmp_path / "eval.onnx")
    assert not [n for n in e.graph.node if n.domain not in ("", "ai.onnx")]
    assert all(len(n.input) <= 2 for n in e.graph.node if n.op_type == "Dropout")
    plain = ort.InferenceSession(str(tmp_path / "inference.onnx"),
                                 providers=["CPUExecutionProvider"])
    for feeds in batches:
        got = loop.evaluate(sess, feeds)
        twice = loop.evaluate(sess, feeds)
        want = float(plain.run(["loss"], feeds)[0])
        assert same_bits(np.float64(got), np.float64(want)) and got == twice
    for n, b in rng.items():  # no state of any kind moved
        assert same_bits(b, loop.buffers[n]), n


def test_manifest_describes_the_training_model(library_path, tmp_path):
    tr = make_trainer("mixed-float16-skips")
    man = tr.save_artifacts(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text()) == man
    m = onnx.load(tmp_path / "training.onnx")
    ins = {i.name for i in m.graph.input}
    outs = {o.name for o in m.graph.output}
    assert {s["input"] for s in man["states"]} | {d["name"] for d in man["data_inputs"]} | \
        {man["learning_rate"]["input"], man["step"]["input"]} == ins
    assert {s["output"] for s in man["states"]} | {o["name"] for o in man["extra_outputs"]} | \
        {man["loss"]["training_output"]} == outs
    assert man["step"]["skip_output"] == "trainops/finite"
    assert man["custom_ops"] == ["com.trainops::DynamicLossScale",
                                 "com.trainops::MixedPrecisionAdam"]
    kinds = {s["kind"] for s in man["states"]}
    assert kinds == {"param", "optimizer", "loss_scale", "fp16_copy"}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "checkpoint.safetensors"), "np") as f:
        meta = f.metadata()
        for s in man["states"]:
            t = f.get_tensor(s["input"])
            assert (str(t.dtype), list(t.shape)) == (s["dtype"], s["shape"])
    assert meta["format"] == "trainops-checkpoint" and meta["step"] == "1"
    assert meta["loss_scale"] == repr(2.0 ** 15)
    d = tmp_path / "dropout"
    man = make_trainer("dropout-momentum").save_artifacts(d)
    # the CPU Trainer's fused backward adds its gradient kernels (ReluGrad, ...): listed too
    ops = man["custom_ops"]
    assert ops == sorted(ops)
    assert [o for o in ops if not o.endswith("Grad")] == [
        "ai.onnx.preview.training::Momentum", "com.trainops::PhiloxDropout"]
    assert {"com.trainops::ReluGrad", "com.trainops::SoftmaxCrossEntropyLossGrad"} <= set(ops)


def test_manifest_validates_against_the_schema(library_path, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "docs" / "manifest.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for case in CASES:
        man = make_trainer(case).save_artifacts(tmp_path / case)
        jsonschema.validate(man, schema)
    broken = dict(man, states=[dict(man["states"][0], dtype="float33")])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({k: v for k, v in man.items() if k != "step"}, schema)


def test_cli_writes_the_artifacts_save_artifacts_writes(library_path, tmp_path):
    from safetensors import safe_open

    from trainops.__main__ import main

    model = dropout_mlp()
    onnx.save(model, tmp_path / "m.onnx")
    params = ["fc0.w", "fc0.b", "fc1.w", "fc1.b", "fc2.w", "fc2.b"]
    assert main(["artifacts", str(tmp_path / "m.onnx"), "--loss", "loss", "--optimizer",
                 "momentum", "--lr", "0.05", "--params", *params, "--seed", "99",
                 "-o", str(tmp_path / "cli")]) == 0
    Trainer(model, "loss", optim.Momentum(lr=0.05), params=params, seed=99).save_artifacts(
        tmp_path / "api")
    for name in ("training.onnx", "eval.onnx", "inference.onnx", "manifest.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "api" / name).read_bytes()
    read = {}
    for which in ("cli", "api"):  # safetensors does not fix the metadata's byte order
        with safe_open(str(tmp_path / which / "checkpoint.safetensors"), "np") as f:
            read[which] = (f.metadata(), {k: f.get_tensor(k) for k in f.keys()})
    assert read["cli"][0] == read["api"][0]
    assert read["cli"][1].keys() == read["api"][1].keys()
    assert all(same_bits(read["cli"][1][k], read["api"][1][k]) for k in read["cli"][1])
    assert main(["artifacts", str(tmp_path / "nope.onnx"), "--loss", "loss",
                 "-o", str(tmp_path / "x")]) == 2


def test_from_artifacts_refuses_a_foreign_checkpoint(library_path, tmp_path):
    from trainops.train.checkpoint import CheckpointError

    make_trainer("cnn-adam").save_artifacts(tmp_path / "a")
    make_trainer("cnn-adagrad").save_artifacts(tmp_path / "b")
    os.replace(tmp_path / "b" / "checkpoint.safetensors", tmp_path / "a" / "checkpoint.safetensors")
    with pytest.raises((CheckpointError, ValueError), match="optimizer|states"):
        Trainer.from_artifacts(tmp_path / "a")
