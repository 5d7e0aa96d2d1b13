"""The demo's training-curve plot: loss per step and test accuracy, one line per policy
(float32 against mixed_float16), written beside the printed table.

matplotlib is optional (``pip install matplotlib``); it draws with the Agg backend, so the
demo needs no display. :func:`write_plot` returns a line for the demo to print either way.
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["DEFAULT_PATH", "plot_training", "write_plot"]

DEFAULT_PATH = "demo-training.png"


def plot_training(runs: Mapping[str, dict], path: str, title: str = "") -> None:
    """Draw ``runs`` (policy -> the dict :func:`trainops.demos.train.train` returns: its
    ``losses`` per step and ``accuracies`` as ``(step, accuracy)`` pairs) into ``path``
    (PNG). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, r in runs.items():
        losses = r["losses"]
        ax_loss.plot(range(1, len(losses) + 1), losses, label=policy, linewidth=1)
        steps = [s for s, _ in r["accuracies"]]
        ax_acc.plot(steps, [a for _, a in r["accuracies"]], marker="o", label=policy)
    ax_loss.set(xlabel="step", ylabel="training loss (batch)", yscale="log",
                title="loss per step")
    ax_acc.set(xlabel="step", ylabel="test accuracy", ylim=(0, 1), title="test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plot(runs: Mapping[str, dict], path: str, title: str = "") -> str:
    """:func:`plot_training`, then the line to print: where the plot went, or why none was
    written (matplotlib missing, or the file could not be written). Never raises for those."""
    try:
        plot_training(runs, path, title)
    except ImportError:
        return "training curves: not plotted (needs matplotlib: pip install matplotlib)"
    except OSError as exc:
        return f"training curves: not plotted ({path}: {exc.strerror or exc})"
    return f"training curves (loss and test accuracy per step) written to {os.path.abspath(path)}"
