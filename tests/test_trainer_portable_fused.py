"""``portable=True`` against the DEFAULT CPU Trainer, whose backward uses trainops' gradient
kernels: the portable graph keeps the standard-op backward, so the two agree to
rounding, not bit for bit (tests/test_trainer_portable.py compares the optimizers bit for bit
against the CPU Trainer's standard-op backward). This bounds the difference a user sees on
the demo CNN, and checks that the portable model really has only standard ops while the
default one has the kernels."""

from __future__ import annotations

import numpy as np

from helpers.adam_pair import assert_runs_agree, record
from trainops import Trainer, optim
from trainops.demos.train import cnn_model, digits

STEPS = 20


def test_portable_demo_cnn_tracks_the_default_cpu_trainer(library_path, monkeypatch):
    monkeypatch.delenv("TRAINOPS_FUSED_GRADS", raising=False)
    x, t = digits(STEPS * 16, seed=5)
    model = cnn_model(seed=1)
    fused = Trainer(model, "loss", optim.Adam(lr=0.01), seed=0, threads=1)
    port = Trainer(model, "loss", optim.Adam(lr=0.01), seed=0, threads=1, portable=True)
    domains = {n.domain for n in port.training_model().graph.node}
    assert domains <= {"", "ai.onnx"}, domains
    fused_ops = {n.op_type for n in fused.training_model().graph.node if n.domain == "com.trainops"}
    assert "ConvWeightGrad" in fused_ops and "ReluGrad" in fused_ops, fused_ops
    batches = [{"x": x[k * 16:(k + 1) * 16], "t": t[k * 16:(k + 1) * 16]} for k in range(STEPS)]
    # Losses, weights and Adam's moments after every step within helpers/adam_pair.py's
    # bound: each backward within gamma(n) sum|terms| of the exact gradient (float64
    # reference of the model), carried through Adam's moments and update (the portable
    # optimizer is the kernel's arithmetic, bit for bit), with the exact effect of the
    # weights having moved apart; a fixed rtol on the weights has no such argument, and
    # Adam moves an element whose gradient cancels by up to lr a step either way.
    assert_runs_agree(model, batches, fused.optimizer, record(fused, batches, STEPS),
                      record(port, batches, STEPS))
