"""Helpers shared by the Adagrad and Momentum tests: data, comparison with the float64
references, and in-place runs through IOBinding. Tolerances are Adam's (adam_helpers)."""

from __future__ import annotations

import numpy as np

from adam_helpers import TOLERANCES, same_bits

# float16 storage (math in float32): about one float16 rounding of each output.
TOLERANCES_16 = (2e-3, 2e-3)


def tensors(rng, shapes, dtype=np.float32, g_shapes=None, state="V"):
    """``(xs, gs, ss)`` for tensor groups of ``shapes``; the state ``ss`` is ``H`` (an
    accumulated square, >= 0) or ``V`` (a momentum, any sign)."""
    g_shapes = g_shapes or shapes
    xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
    gs = [rng.standard_normal(s).astype(dtype) for s in g_shapes]
    if state == "H":
        ss = [rng.random(s).astype(dtype) for s in shapes]
    else:
        ss = [(0.5 * rng.standard_normal(s)).astype(dtype) for s in shapes]
    return xs, gs, ss


def assert_outputs(outs, refs, xs, groups, dtype=None, tolerances=None):
    """Each output has X's dtype (or ``dtype``) and shape and is close to its reference;
    ``groups`` names the output groups (``"XH"`` gives X_1_new.., H_1_new..)."""
    dtype = np.dtype(dtype or xs[0].dtype)
    rtol, atol = tolerances or TOLERANCES[dtype]
    names = [f"{p}_{i + 1}_new" for p in groups for i in range(len(xs))]
    assert len(outs) == len(refs) == len(names)
    for name, out, ref, x in zip(names, outs, refs, list(xs) * len(groups)):
        assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
        assert out.shape == x.shape, f"{name}: shape {out.shape}, expected {x.shape}"
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol * scale,
                                   err_msg=name)


def run_in_place(sess, feeds, groups, n):
    """Runs with every ``<p>_<i>_new`` (``p`` in ``groups``) bound to ``<p>_<i>``'s own
    OrtValue; returns those values' new contents and every input's OrtValue."""
    import onnxruntime as ort

    values = {k: ort.OrtValue.ortvalue_from_numpy(np.array(a, copy=True)) for k, a in feeds.items()}
    binding = sess.io_binding()
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    names = [f"{p}_{i}" for p in groups for i in range(1, n + 1)]
    for name in names:
        binding.bind_ortvalue_output(f"{name}_new", values[name])
    sess.run_with_iobinding(binding)
    for name, out in zip(names, binding.get_outputs()):
        # The kernel really got output buffer == input buffer.
        assert out.data_ptr() == values[name].data_ptr(), name
    return [values[name].numpy() for name in names], values


def assert_in_place_equals_out_of_place(sess, feeds, groups, n):
    """In-place IOBinding gives the out-of-place bits, and leaves R, T and G alone."""
    expected = sess.run(None, feeds)
    actual, values = run_in_place(sess, feeds, groups, n)
    names = [f"{p}_{i}" for p in groups for i in range(1, n + 1)]
    for name, a, e in zip(names, actual, expected):
        assert same_bits(a, e), f"{name}: in place differs from out of place"
    for name in ["R", "T"] + [f"G_{i}" for i in range(1, n + 1)]:
        assert same_bits(values[name].numpy(), feeds[name]), f"{name} was written"
    return expected
