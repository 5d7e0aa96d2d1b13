"""The runtime of a step graph: :class:`StepRuntime` makes the session of a
:class:`~trainops.train.spec.StepGraph` and binds every state in place (its input and its
output to one OrtValue over one numpy buffer), so a step is one ``run_with_iobinding`` and
the state never leaves ONNX Runtime's buffers. Built from the StepGraph alone."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..autodiff import GradientError
from .spec import StepGraph

__all__ = ["StepRuntime", "session_options"]

# ONNX Runtime's output type strings -> numpy dtypes, for the buffers of outputs.
NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64,
               "tensor(float16)": np.float16, "tensor(bool)": np.bool_,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32,
               "tensor(uint32)": np.uint32}


def session_options(threads: int | None, library: str | None = None, *, spin: bool = True,
                    register: bool = True):
    """SessionOptions with the trainops library registered (``library``, default
    :func:`trainops.get_library_path`; ``register=False``: not, the caller's placement
    decides), ``threads`` intra-op threads (None: ONNX Runtime's choice) and one inter-op
    thread, warnings off; ``spin=False``: idle intra-op workers do not spin (ranks may
    outnumber cores).

    ONNX Runtime's memory pattern (the buffer layout recorded on the first run and reused
    on later ones) is off: with it, onnxruntime 1.17.3 overlaps live tensors of a CNN's
    step from the second run on (the conv layers' new weights and moments then differ from
    a fresh session's, fused optimizer or standard ops alike; its issue 18672 reports this
    kind of bug). Off, each tensor comes from the arena; measured on the demo CNN with
    onnxruntime 1.32, one thread, a step takes within 1% of the time it took with it."""
    import onnxruntime as ort

    from .. import get_library_path

    so = ort.SessionOptions()
    if register:
        so.register_custom_ops_library(library or get_library_path())
    if threads is not None:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    so.enable_mem_pattern = False
    return so


class StepRuntime:
    """A session of ``graph.model`` with its buffers bound: on the CPU, or where
    ``placement`` (:class:`~trainops.train.placement.Placement`) says; the buffers are host
    numpy arrays either way (on another EP ONNX Runtime copies them in and out each run).

    ``arrays``: name -> numpy buffer the session reads and writes in place: every state
    (by its input name, in ``graph.states`` order, starting at its ``initial``), then the
    loss output and the extra outputs (by output name). ``values``: their OrtValues.
    :meth:`run` does one step. ``configure``, when given, is called with the
    SessionOptions before the session is made (the benchmark's profiler, the optimised
    model's file)."""

    def __init__(self, graph: StepGraph, threads: int | None = None,
                 library: str | None = None, placement=None, *, configure=None):
        import onnxruntime as ort

        self.graph = graph
        if placement is None or placement.is_cpu:
            so = session_options(threads, library)
            if configure is not None:  # e.g. the bench's profiler
                configure(so)
            self.session = ort.InferenceSession(graph.model.SerializeToString(), so,
                                                providers=["CPUExecutionProvider"])
        else:
            so = session_options(threads, library, register=False)
            custom = any(n.domain not in ("", "ai.onnx") for n in graph.model.graph.node)
            placement.configure(so, library, needs_library=custom)
            self.session = placement.session(graph.model.SerializeToString(), so)
        # IOBinding copies a host input to the device of the node that takes it when it is
        # BOUND, not when the session runs: off the CPU, the states are bound again on every
        # run so a device node reads this step's values, not the first step's.
        self._rebind = placement is not None and not placement.is_cpu
        self.arrays: dict[str, np.ndarray] = {}
        self.values: dict[str, Any] = {}
        self.binding = bind = self.session.io_binding()
        for e in graph.states:
            v = self._put(e.input, e.initial)
            bind.bind_ortvalue_input(e.input, v)
            bind.bind_ortvalue_output(e.output, v)
        outputs = {o.name: o for o in self.session.get_outputs()}
        loss = outputs[graph.loss_output]
        shape, name = loss.shape, graph.options.loss
        if shape is None or not all(isinstance(d, int) for d in shape):
            raise GradientError(f"loss {name!r} must have a static shape (one element), "
                                f"got {shape}")
        if int(np.prod(shape)) != 1:
            raise GradientError(f"loss {name!r} must be a scalar, has shape {shape}")
        for out in [graph.loss_output] + list(graph.extra_outputs):
            o = outputs[out]
            if o.shape is None or not all(isinstance(d, int) for d in o.shape):
                raise GradientError(f"output {out!r} must have a static shape, got {o.shape}")
            bind.bind_ortvalue_output(out, self._put(out, np.zeros(o.shape, NUMPY_TYPES[o.type])))

    def _put(self, name: str, arr) -> Any:
        from ..bfloat16 import to_ortvalue

        # The OrtValue wraps this array's memory (and keeps it alive): the session
        # updates it in place, and numpy reads it without a copy (a bfloat16 array
        # through a uint16 view: the bfloat16-state optimizers' moments).
        arr = np.array(arr, order="C", copy=True)
        self.arrays[name] = arr
        self.values[name] = to_ortvalue(arr)
        return self.values[name]

    def run(self, feeds: Mapping[str, Any], lr: float, t: int) -> float:
        """One step: ``feeds`` (every data input), learning rate ``lr``, update count ``t``.
        Returns the loss (before the update)."""
        g, bind = self.graph, self.binding
        if self._rebind:
            for e in g.states:
                bind.bind_ortvalue_input(e.input, self.values[e.input])
        for name in g.data_inputs:
            bind.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        bind.bind_cpu_input(g.lr_input, np.array([lr], g.lr_dtype))
        bind.bind_cpu_input(g.step_input, np.array([t], np.int64))
        self.session.run_with_iobinding(bind)
        return float(self.arrays[g.loss_output].reshape(-1)[0])

    @property
    def finite(self) -> bool:
        """Whether the last step's gradients were finite (always True without a finite flag)."""
        f = self.graph.finite_output
        return True if f is None else bool(self.arrays[f])
