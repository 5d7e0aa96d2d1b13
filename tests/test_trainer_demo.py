"""The training demo (trainops.demos.train) on a short schedule, and the CNN end to end."""

from __future__ import annotations

import numpy as np
import pytest
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


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_demo_main_writes_the_training_plot(library_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from trainops.demos.train import main

    path = tmp_path / "curves.png"
    main(["--steps", "12", "--mixed-steps", "12", "--threads", "1", "--plot", str(path)])
    out = capsys.readouterr().out
    assert _is_png(path), out
    assert f"written to {path}" in out.splitlines()[-1]  # said where, after the table


def test_demo_main_default_plot_and_no_plot(library_path, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from trainops.demos.train import main

    monkeypatch.chdir(tmp_path)
    main(["--steps", "5", "--mixed-steps", "0", "--threads", "1", "--no-plot"])
    assert not (tmp_path / "demo-training.png").exists()
    main(["--steps", "5", "--mixed-steps", "0", "--threads", "1"])
    assert _is_png(tmp_path / "demo-training.png")  # the default: the working directory
    assert str(tmp_path / "demo-training.png") in capsys.readouterr().out


def test_demo_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    import sys

    from trainops.demos.plot import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    runs = {"float32": {"losses": [2.0, 1.0], "accuracies": [(1, 0.1), (2, 0.5)]}}
    line = write_plot(runs, str(tmp_path / "x.png"), "t")
    assert "not plotted (needs matplotlib" in line
    assert not (tmp_path / "x.png").exists()


def test_demo_plot_unwritable_path_says_so(tmp_path):
    pytest.importorskip("matplotlib")
    from trainops.demos.plot import write_plot

    runs = {"float32": {"losses": [2.0, 1.0], "accuracies": [(1, 0.1), (2, 0.5)]}}
    line = write_plot(runs, str(tmp_path / "missing-dir" / "x.png"))
    assert line.startswith("training curves: not plotted") and "missing-dir" in line
