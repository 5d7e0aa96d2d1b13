"""Running models: feeds to outputs through ``session.run``, and in place through an
IOBinding whose outputs are bound to their inputs' own OrtValues."""

from __future__ import annotations

import numpy as np

from helpers.checks import same_bits
from trainops.models import adam_feeds


def run(sess, r, t, xs, gs, vs, hs, r_dtype=None):
    feeds = adam_feeds(r, t, xs, gs, vs, hs, r_dtype=r_dtype)
    return sess.run(None, feeds)


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
