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


def check_onnx_case(make_session, case_dir):
    """Runs one of onnx's node cases (``models/onnx-node/<case>``) in a session and checks
    every output against onnx's expected data: dtype, shape, and values (rtol 1e-3,
    atol 1e-7, the tolerances of onnx's backend tests)."""
    from helpers.data import read_case

    model, ins, expected = read_case(case_dir)
    feeds = {vi.name: a for vi, a in zip(model.graph.input, ins)}
    actual = make_session(model).run([o.name for o in model.graph.output], feeds)
    for vi, a, e in zip(model.graph.output, actual, expected):
        assert a.dtype == e.dtype, vi.name
        assert a.shape == e.shape, vi.name
        np.testing.assert_allclose(a, e, rtol=1e-3, atol=1e-7, err_msg=vi.name)


def check_reference_on_case(case_dir, reference, groups, attributes):
    """A float64 reference ``reference(R, T, *lists, **attributes(node))`` reproduces one of
    onnx's optimizer cases, whose variadic inputs are ``groups`` lists of equal length."""
    from helpers.data import read_case

    model, ins, expected = read_case(case_dir)
    n = (len(ins) - 2) // groups
    r, t, rest = ins[0], ins[1], ins[2:]
    lists = [rest[k * n:(k + 1) * n] for k in range(groups)]
    refs = reference(r, t, *lists, **attributes(model.graph.node[0]))
    for ref, e in zip(refs, expected):
        np.testing.assert_allclose(ref, e, rtol=1e-6, atol=1e-7)


def run_thread_counts(make_session, model, feeds, counts=(1, 2, 3)):
    """Runs ``model`` on ``feeds`` in one session per intra-op thread count, checks that
    every count gives bitwise the outputs of the first and that no input was written (numpy
    inputs are passed zero-copy); returns ``{count: outputs}``."""
    before = {k: np.array(a, copy=True) for k, a in feeds.items()}
    results = {threads: make_session(model, threads=threads).run(None, feeds) for threads in counts}
    first = counts[0]
    for threads in counts[1:]:
        for k, (a, b) in enumerate(zip(results[first], results[threads])):
            assert same_bits(a, b), f"output {k}: {threads} threads differ from {first} thread"
    for name, a in feeds.items():
        assert same_bits(a, before[name]), f"input {name} was written"
    return results
