"""The training demo (trainops.demos.train) on a short schedule, and the CNN end to end."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from trainops import optim
from trainops.demos.train import cnn_model, digits, mlp_model, train
from trainops import Trainer


def test_demo_cnn_learns_and_exports(library_path):
    lines = []
    r = train(steps=80, every=40, out=lines.append, threads=1)
    text = "\n".join(lines)
    assert np.mean(r["losses"][-10:]) < 0.5 * r["losses"][0], text
    assert r["test_accuracy"] > 0.5, text  # chance is 0.1
    assert {n.domain for n in r["model"].graph.node} == {""}
    assert "plain onnxruntime InferenceSession: test accuracy" in lines[-1]


def test_demo_cnn_mixed_float16(library_path):
    r = train(steps=60, every=60, policy="mixed_float16", out=lambda s: None, threads=1)
    assert np.mean(r["losses"][-10:]) < 0.7 * r["losses"][0]


def test_mlp_model_trains(library_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    t = (x[:, :10].argmax(1)).astype(np.int64)
    tr = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1)
    losses = [tr.step({"x": x, "t": t}) for _ in range(40)]
    assert losses[-1] < 0.2 * losses[0]


def test_cnn_exported_model_matches_trainer_weights(library_path):
    x, t = digits(32)
    tr = Trainer(cnn_model(), "loss", optim.Adam(lr=0.01), threads=1)
    for _ in range(3):
        tr.step({"x": x, "t": t})
    sess = ort.InferenceSession(tr.export().SerializeToString(), providers=["CPUExecutionProvider"])
    loss_after = float(sess.run(["loss"], {"x": x, "t": t})[0])
    assert abs(loss_after - tr.step({"x": x, "t": t})) < 1e-5  # step returns the loss before


def test_bench_train_smoke(library_path, capsys, tmp_path):
    from trainops.bench.train import run

    out = tmp_path / "bench.json"
    assert run(["--models", "cnn", "--threads", "1", "--repeat", "1", "--steps", "1",
                "--no-torch", "--json", str(out)]) == 0
    assert "CNN (demo, 8x8 digits)" in capsys.readouterr().out
    assert out.read_text().count("\"trainops\"") == 1


def test_bench_train_is_a_bench_target(library_path, capsys):
    from trainops.__main__ import main as cli_main
    from trainops.bench import load_target

    assert load_target("train").command is not None
    assert cli_main(["bench", "train", "--models", "mlp", "--threads", "1", "--repeat", "1",
                     "--steps", "1", "--no-torch", "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "| MLP 256-512-512-10, LayerNorm+GELU | 64 | 1 |" in text
