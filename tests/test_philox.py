"""com.trainops::Philox through onnxruntime: Random123's published known answers, a
cross-check against an independent implementation (randomgen's Philox4x32), the
state-in/state-out semantics, thread invariance, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from trainops.models import philox_model

# Random123 kat_vectors, philox4x32 with 10 rounds: (c0 c1 c2 c3, k0 k1) -> block.
KNOWN_ANSWERS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]
M128 = (1 << 128) - 1


def counter(state) -> int:
    s = [int(w) for w in np.asarray(state).ravel()]
    return s[0] | s[1] << 32 | s[2] << 64 | s[3] << 96


def make_state(c: int, k0: int, k1: int) -> np.ndarray:
    return np.array([(c >> (32 * i)) & 0xFFFFFFFF for i in range(4)] + [k0, k1], np.uint32)


def randomgen_words(c: int, k0: int, k1: int, n: int) -> np.ndarray:
    """n words from randomgen's Philox4x32-10, which increments its counter before each
    block: block(c) comes from counter c - 1."""
    randomgen = pytest.importorskip("randomgen")
    gen = randomgen.Philox(number=4, width=32, counter=(c - 1) & M128, key=k0 | k1 << 32)
    return gen.random_raw(n).astype(np.uint32) if n else np.zeros(0, np.uint32)


@pytest.fixture(scope="module")
def by_input(make_session):
    return make_session(philox_model())


@pytest.fixture(scope="module")
def dynamic(make_session):
    """Inputs of unknown rank: every check is the op's own."""
    return make_session(philox_model(dynamic=True))


def run(sess, state, shape):
    return sess.run(None, {"state": state, "shape": np.asarray(shape, np.int64)})


@pytest.mark.parametrize("c, k, block", KNOWN_ANSWERS)
def test_known_answers(by_input, c, k, block):
    out, state_out = run(by_input, np.array(c + k, np.uint32), [4])
    assert out.tolist() == block
    assert counter(state_out) == (counter(c + k) + 1) & M128
    assert state_out[4:].tolist() == k


def test_four_and_five_elements(by_input):
    out, st = run(by_input, np.zeros(6, np.uint32), [4])
    assert out.tolist() == KNOWN_ANSWERS[0][2] and st.tolist() == [1, 0, 0, 0, 0, 0]
    out, st = run(by_input, np.zeros(6, np.uint32), [5])
    assert out[:4].tolist() == KNOWN_ANSWERS[0][2] and st.tolist() == [2, 0, 0, 0, 0, 0]
    assert out[4] == randomgen_words(1, 0, 0, 1)[0]


EDGE_COUNTERS = [0, (1 << 32) - 3, (1 << 64) - 2, (1 << 96) - 5, M128, M128 - 1, 0x48656C6C6F46726F6D53656174746C65]


@pytest.mark.parametrize("c", EDGE_COUNTERS)
@pytest.mark.parametrize("n", [1, 3, 4, 7, 64, 1001])
def test_matches_randomgen_near_carries(by_input, c, n):
    k0, k1 = 0x9E3779B9, 0x01234567
    out, st = run(by_input, make_state(c, k0, k1), [n])
    np.testing.assert_array_equal(out, randomgen_words(c, k0, k1, n))
    assert counter(st) == (c + (n + 3) // 4) & M128
    assert st[4:].tolist() == [k0, k1]


def test_matches_randomgen_on_random_states(by_input, rng):
    for _ in range(20):
        words = rng.integers(0, 1 << 32, size=6, dtype=np.uint64).astype(np.uint32)
        n = int(rng.integers(0, 5000))
        shape = [n] if rng.random() < 0.5 else [1, n, 1]
        out, st = run(by_input, words, shape)
        assert out.shape == tuple(shape)
        c = counter(words)
        np.testing.assert_array_equal(out.ravel(), randomgen_words(c, int(words[4]), int(words[5]), n))
        assert counter(st) == (c + (n + 3) // 4) & M128


def test_large_output_is_one_stream_and_thread_invariant(make_session, rng):
    """Big enough for the threaded path; equal for 1 and 2 threads and to randomgen."""
    n = (1 << 20) + 3
    state = make_state((1 << 64) - 100, 7, 9)
    outs = [run(make_session(philox_model(), threads=t), state, [n]) for t in (1, 2)]
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    np.testing.assert_array_equal(outs[0][0], randomgen_words(counter(state), 7, 9, n))


def test_state_out_continues_the_stream(by_input):
    state = make_state((1 << 32) - 1, 1, 2)
    whole, end = run(by_input, state, [40])
    first, mid = run(by_input, state, [12])
    second, end2 = run(by_input, mid, [28])
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)
    np.testing.assert_array_equal(end, end2)


def test_state_shapes_and_attribute_source(make_session):
    state = np.arange(6, dtype=np.uint32)
    want, want_state = run(make_session(philox_model()), state, [3, 5])
    for shape in [(1, 1, 1, 6), (2, 3), (6, 1)]:
        sess = make_session(philox_model([3, 5], state_shape=shape))
        out, st = sess.run(None, {"state": state.reshape(shape)})
        np.testing.assert_array_equal(out, want)
        assert st.shape == shape and st.ravel().tolist() == want_state.tolist()


def test_zero_size_output_keeps_the_state(by_input):
    state = make_state(12345, 6, 7)
    for shape in ([0], [3, 0], [0, 0, 2]):
        out, st = run(by_input, state, shape)
        assert out.shape == tuple(shape)
        np.testing.assert_array_equal(st, state)


def test_without_state_out(make_session):
    sess = make_session(philox_model([8], state_out=False))
    (out,) = sess.run(None, {"state": np.zeros(6, np.uint32)})
    assert out[:4].tolist() == KNOWN_ANSWERS[0][2]


def test_state_updated_in_place_through_iobinding(make_session):
    import onnxruntime as ort

    sess = make_session(philox_model([10]))
    state = ort.OrtValue.ortvalue_from_numpy(make_state(M128, 3, 4))
    binding = sess.io_binding()
    binding.bind_ortvalue_input("state", state)
    binding.bind_output("output")  # copy_outputs_to_cpu keeps the binding order
    binding.bind_ortvalue_output("state_out", state)
    seen = []
    for _ in range(3):
        sess.run_with_iobinding(binding)
        seen.append(binding.copy_outputs_to_cpu()[0])
    np.testing.assert_array_equal(np.concatenate(seen), randomgen_words(M128, 3, 4, 36).reshape(3, 12)[:, :10].ravel())
    assert counter(state.numpy()) == (M128 + 9) & M128


def _message(excinfo) -> str:
    return " ".join(str(excinfo.value).split())


@pytest.mark.parametrize("state, shape, needles", [
    (np.zeros(5, np.uint32), [4], ["Philox", "input 0 (state)", "exactly 6 elements", "shape [5]"]),
    (np.zeros((2, 6), np.uint32), [4], ["input 0 (state)", "exactly 6 elements"]),
    (np.zeros(6, np.uint32), [[2, 2]], ["input 1 (shape)", "1-D tensor(int64)", "[1, 2]"]),
    (np.zeros(6, np.uint32), [2, -3], ["input 1 (shape)", "negative dimension -3"]),
    (np.zeros(6, np.uint32), [1 << 16, 1 << 16], ["input 1 (shape)", "limit"]),
    (np.zeros(6, np.uint32), [1 << 62, 8], ["input 1 (shape)", "limit"]),  # count overflows
])
def test_bad_inputs_are_clear_errors_and_the_session_lives(dynamic, state, shape, needles):
    with pytest.raises(Exception) as excinfo:
        run(dynamic, state, shape)
    msg = _message(excinfo)
    for needle in needles:
        assert needle in msg, msg
    out, _ = run(dynamic, np.zeros(6, np.uint32), [4])  # still usable
    assert out.tolist() == KNOWN_ANSWERS[0][2]


def test_both_or_neither_shape_source(make_session):
    from trainops.models import node_model

    both = node_model("Philox", [("state", np.uint32, [6]), ("shape", np.int64, [1])],
                      [("output", np.uint32, None)], domain="com.trainops", shape=[4])
    with pytest.raises(Exception) as excinfo:
        make_session(both).run(None, {"state": np.zeros(6, np.uint32), "shape": np.array([4], np.int64)})
    assert "input 1 (shape)" in _message(excinfo) and "both" in _message(excinfo)
    neither = node_model("Philox", [("state", np.uint32, [6])], [("output", np.uint32, None)],
                         domain="com.trainops")
    with pytest.raises(Exception) as excinfo:
        make_session(neither).run(None, {"state": np.zeros(6, np.uint32)})
    assert "neither" in _message(excinfo)


def test_bad_attribute_shapes_fail_at_load(make_session):
    # Checked when the kernel is created, i.e. when the session is made.
    with pytest.raises(Exception) as excinfo:
        make_session(philox_model([4, -1]))
    assert "attribute 'shape'" in _message(excinfo) and "negative dimension -1" in _message(excinfo)


def test_wrong_state_type_fails_at_load(make_session):
    from trainops.models import node_model

    model = node_model("Philox", [("state", np.int32, [6])], [("output", np.uint32, None)],
                       domain="com.trainops", shape=[4])
    with pytest.raises(Exception) as excinfo:
        make_session(model)
    assert "state" in _message(excinfo) and "int32" in _message(excinfo)
