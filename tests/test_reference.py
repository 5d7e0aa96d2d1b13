"""The test reference itself, checked against onnx's (no library needed)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.references import adam as adam_ref
from helpers.references import adjusted_rate, attr_f32
from trainops.models import adam_feeds, adam_model


@pytest.mark.parametrize("t", [0, 1, 3, 100])
@pytest.mark.parametrize("attrs", [{}, {"alpha": 0.8, "beta": 0.9, "epsilon": 1e-3,
                                        "norm_coefficient": 0.1,
                                        "norm_coefficient_post": 0.05}], ids=["defaults", "all"])
def test_reference_matches_onnx_reference_evaluator(t, attrs):
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(7)
    x, g, v = (rng.standard_normal((3, 4)) for _ in range(3))
    h = rng.random((3, 4))
    model = adam_model([(3, 4)], np.float64, **attrs)
    feeds = adam_feeds(0.05, t, [x], [g], [v], [h])
    theirs = ReferenceEvaluator(model).run(None, feeds)
    ours = adam_ref(0.05, t, [x], [g], [v], [h], **attrs)
    # onnx's evaluator holds attributes as np.float32, so its (1 - norm_coefficient_post)
    # is rounded to float32 (numpy scalar promotion); ours is float64 as the spec says.
    # (1 - alpha) and (1 - beta) are exact in float32 for alpha, beta in [0.5, 1].
    rtol = 1e-7 if attrs.get("norm_coefficient_post") else 1e-12
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-14)


def test_adjusted_rate():
    assert adjusted_rate(0.1, 0, 0.9, 0.999) == 0.1
    assert adjusted_rate(0.1, -4, 0.9, 0.999) == 0.1
    np.testing.assert_allclose(adjusted_rate(0.1, 1, 0.9, 0.999),
                               0.1 * np.sqrt(0.001) / 0.1, rtol=1e-12)
    assert adjusted_rate(0.1, 2**62, 0.9, 0.999) == 0.1  # both powers underflow


def test_attributes_are_float32():
    assert attr_f32(0.9) == float(np.float32(0.9)) != 0.9
