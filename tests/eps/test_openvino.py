"""The OpenVINO lane: the ``onnxruntime-openvino`` build (a whole onnxruntime with
``OpenVINOExecutionProvider``) on its CPU device, float32, trains an MLP and the demo CNN
like the CPU portable Trainer (tests/eps/ep_pairs.py says within what), the step's nodes
on the EP (``trainer.assignment``).

The CNN's weight-gradient Conv is refused by OpenVINO's CPU plugin while the batch
dimension is symbolic ("Doesn't support dynamic weights shape"): the CNN trains with the
batch fixed, in the model (``static``) or by the Trainer's ``free_dimensions={"N": 16}``.

Runs where ``OpenVINOExecutionProvider`` is in onnxruntime: ``scripts/test_eps`` sets up
that build (``scripts/webgpu_env``) and sets ``EPS_REQUIRE=openvino``, so that a missing EP
fails there; anywhere else (the default pytest run) the module skips.
"""

from __future__ import annotations

import pytest

from ep_pairs import BATCH, MODELS, Run, static_batch, unavailable

OPENVINO = "OpenVINOExecutionProvider"
PROVIDERS = [(OPENVINO, {"device_type": "CPU", "precision": "FP32"}), "CPUExecutionProvider"]


@pytest.fixture(scope="module")
def providers():
    import onnxruntime as ort

    if OPENVINO not in ort.get_available_providers():
        unavailable("openvino", f"{OPENVINO} is not in this onnxruntime ({ort.__version__}: "
                                "the onnxruntime-openvino build has it)")
    return PROVIDERS


_RUNS: dict = {}


def run(name: str, providers) -> Run:
    """``mlp``, ``cnn`` (its batch fixed in the model) or ``cnn-free-dims`` (fixed by the
    Trainer), trained on the CPU portable Trainer and on OpenVINO, once per module."""
    if name not in _RUNS:
        model, batches, params = MODELS[name.split("-")[0]]()
        where = {"providers": providers}
        if name == "cnn":
            model = static_batch(model)
        elif name == "cnn-free-dims":
            where["free_dimensions"] = {"N": BATCH}
        _RUNS[name] = Run(model, batches, params, **where)
    return _RUNS[name]


@pytest.mark.parametrize("name", ["mlp", "cnn", "cnn-free-dims"])
def test_trains_like_the_cpu(name, providers):
    run(name, providers).check_matches_cpu()


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_step_runs_on_the_ep(name, providers):
    dev = run(name, providers).trained()
    assert dev.session.get_providers()[0] == OPENVINO
    counts = dev.assignment
    # OpenVINO compiles what it takes into fused partitions: nodes of the session's graph
    assert counts.get(OPENVINO, 0) > 0, counts
