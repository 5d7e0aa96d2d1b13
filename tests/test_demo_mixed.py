"""The mixed-precision demo (trainops.demos.mixed) on a short schedule: the loss falls, the
first steps overflow at Keras' initial scale and are skipped, the scale backs off and later
grows again."""

from __future__ import annotations

import numpy as np

from trainops.demos.mixed import train_mixed


def test_train_mixed_short(library_path):
    lines = []
    r = train_mixed(steps=120, every=20, out=lines.append, library=library_path)
    text = "\n".join(lines)
    assert len(r.losses) == len(r.scales) == len(r.applied) == 120
    # the loss falls
    assert all(np.isfinite(r.losses))
    assert np.mean(r.losses[-10:]) < 0.3 * r.losses[0], text
    # at least one skipped overflow, the very first one at 2**15
    assert r.skipped and r.skipped[0] == 1, text
    assert "step 1 skipped: non-finite gradients, loss scale 32768 -> 16384" in lines, text
    assert r.skipped == [k for k, ok in enumerate(r.applied, 1) if not ok]
    # every skip halves the scale; every growth doubles it after 20 finite steps
    scales = r.scales + [r.final_scale]
    for k in r.skipped:
        assert scales[k] == scales[k - 1] / 2, (k, scales[k - 1], scales[k])
    for k in r.grown:
        assert scales[k] == scales[k - 1] * 2
        assert all(r.applied[k - 20:k]), k
    # the scale both decreased and, later, grew
    first_drop = next(k for k in range(1, len(scales)) if scales[k] < scales[k - 1])
    assert any(scales[k] > scales[k - 1] for k in range(first_drop + 1, len(scales))), text
    # the scale only ever changes by a skip or a growth
    changed = [k for k in range(1, len(scales)) if scales[k] != scales[k - 1]]
    assert changed == sorted(r.skipped + r.grown)


def test_train_mixed_main_exit_code(library_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINOPS_LIBRARY", library_path)
    from trainops.demos import mixed as demo_mixed

    assert demo_mixed.main(["--steps", "60"]) == 0
    assert "skipped: non-finite gradients" in capsys.readouterr().out
