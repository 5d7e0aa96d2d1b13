"""The runtime of a step graph: :class:`StepRuntime` makes the session of a
:class:`~trainops.train.spec.StepGraph` and binds every state in place (its input and its
output to one OrtValue over one numpy buffer), so a step is one ``run_with_iobinding`` and
the state never leaves ONNX Runtime's buffers. Built from the StepGraph alone."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..autodiff import GradientError
from .buffers import Buffers, Memory, Transfers
from .host_reads import split_host_reads
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
    a fresh session's, fused optimizer or standard ops alike; onnxruntime's GitHub issue
    #18672 reports this kind of bug). Off, each tensor comes from the arena; measured on
    the demo CNN with onnxruntime 1.32, one thread, a step takes within 1% of the time it
    took with it."""
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
    ``placement`` (:class:`~trainops.train.placement.Placement`) says.

    ``arrays`` (:class:`~.buffers.Buffers`): name -> value of every state (by its input
    name, in ``graph.states`` order, starting at its ``initial``), then the loss output
    and the extra outputs (by output name); ``values``: their OrtValues. Each state is
    bound as its input AND its output (updated in place), once:

    - on the CPU, in host numpy buffers the OrtValues wrap (``arrays[name]`` is the
      buffer itself);
    - on a device placement whose memory is known (:meth:`Placement.state_memory`: the
      CUDA EP, a plugin EP's device), in device memory: a step moves the data inputs,
      ``lr`` and ``T`` host->device and the loss and extra outputs back, no state;
      ``arrays[name]`` copies a state device->host on demand and ``arrays.write``
      host->device. The states are re-bound each step (no copy for the nodes on their
      device; ONNX Runtime copies a state at bind time to a node that runs elsewhere, e.g.
      the CPU forward pass beside the plugin EP's optimizer node: not counted here, the
      EP's counters see it);
    - on another device placement, in host buffers re-bound every step (ONNX Runtime
      copies host inputs to a device when they are bound: every state crosses twice a
      step, counted).

    ``transfers`` (:class:`~.buffers.Transfers`) counts the copies. :meth:`run` does one
    step. ``configure``, when given, is called with the SessionOptions before the session
    is made (the benchmark's profiler, the optimised model's file). ``state_memory``
    overrides the placement's (tests: ``Memory("cpu")`` runs the device code path over
    ONNX Runtime-allocated host memory). ``frozen``: the
    :class:`~trainops.offload.FrozenStore` of a step graph whose frozen weights are held
    outside it: on the CPU the float32 ones up to 1 GiB are given to the session as its
    initializers (its copy, prepacked: :func:`trainops.offload.session_copies`), the others
    become graph inputs bound once to OrtValues over the store's arrays (no copy)."""

    def __init__(self, graph: StepGraph, threads: int | None = None,
                 library: str | None = None, placement=None, *, configure=None,
                 state_memory: Memory | None = None, frozen=None):
        import onnxruntime as ort

        from ..offload import as_inputs, session_copies

        self.graph = graph
        self._host_aliases: dict[str, str] = {}
        on_cpu = placement is None or placement.is_cpu
        given = session_copies(graph.model, frozen) if on_cpu else []
        model, held = as_inputs(graph.model, set(given))
        if (held or given) and frozen is None:
            raise ValueError(f"StepRuntime: the step graph's initializers {held[:3]} are held "
                             "outside it, and no frozen= store holds them")
        if on_cpu:
            so = session_options(threads, library)
            if given:  # copied into the session as it is made
                so.add_external_initializers(
                    given, [ort.OrtValue.ortvalue_from_numpy(frozen[n]) for n in given])
            if configure is not None:  # e.g. the bench's profiler
                configure(so)
            self.session = ort.InferenceSession(model.SerializeToString(), so,
                                                providers=["CPUExecutionProvider"])
        else:
            so = session_options(threads, library, register=False)
            custom = any(n.domain not in ("", "ai.onnx") for n in graph.model.graph.node)
            placement.configure(so, library, needs_library=custom)
            if configure is not None:  # e.g. scripts/gpu_check's profiler
                configure(so)
            if state_memory is None:
                state_memory = placement.state_memory()
            if placement.ep_supplies_domains and state_memory is not None:
                # the weights' host readers under names of their own (.host_reads)
                model, self._host_aliases = split_host_reads(model, [e.input for e in graph.states])
            self.session = placement.session(model.SerializeToString(), so)
        self.memory = state_memory
        # Host data crosses to a device each step unless everything runs on the CPU.
        self._count_data = not (on_cpu or placement.host_only) or state_memory is not None
        # IOBinding copies an input to the device of the node that takes it when it is
        # BOUND, not when the session runs: off the CPU every state is bound again on every
        # run, so a node on another device than the state's memory reads this step's values,
        # not the first step's. Re-binding a value its consumers' device already holds copies
        # nothing (ONNX Runtime checks the device): a device-resident state read on its own
        # device never crosses; a host state in a device session crosses twice per step.
        self._rebind = not on_cpu
        self.transfers = Transfers()
        self.arrays = Buffers(state_memory, self.transfers)
        self.values = self.arrays.values
        self.binding = bind = self.session.io_binding()
        # The frozen weights: bound once, never re-bound (a device session copies them
        # to its device when bound, once).
        self._frozen = {n: ort.OrtValue.ortvalue_from_numpy(frozen[n]) for n in held}
        for n, v in self._frozen.items():
            bind.bind_ortvalue_input(n, v)
        for e in graph.states:
            v = self.arrays.put(e.input, e.initial)
            bind.bind_ortvalue_input(e.input, v)
            bind.bind_ortvalue_output(e.output, v)
        for alias, state in self._host_aliases.items():
            bind.bind_ortvalue_input(alias, self.values[state])
        outputs = {o.name: o for o in self.session.get_outputs()}
        loss = outputs[graph.loss_output]
        shape, name = loss.shape, graph.options.loss
        if shape is None or not all(isinstance(d, int) for d in shape):
            raise GradientError(f"loss {name!r} must have a static shape (one element), "
                                f"got {shape}")
        if int(np.prod(shape)) != 1:
            raise GradientError(f"loss {name!r} must be a scalar, has shape {shape}")
        self._outputs = [graph.loss_output] + list(graph.extra_outputs)
        for out in self._outputs:
            o = outputs[out]
            if o.shape is None or not all(isinstance(d, int) for d in o.shape):
                raise GradientError(f"output {out!r} must have a static shape, got {o.shape}")
            buf = np.zeros(o.shape, NUMPY_TYPES[o.type])
            bind.bind_ortvalue_output(out, self.arrays.put_host(out, buf))
        # Bytes of the states re-bound per step (host states in a device session).
        self._state_bytes = sum(self.arrays.nbytes(e.input) for e in graph.states)

    def run(self, feeds: Mapping[str, Any], lr: float, t: int) -> float:
        """One step: ``feeds`` (every data input), learning rate ``lr``, update count ``t``.
        Returns the loss (before the update)."""
        g, bind, tr = self.graph, self.binding, self.transfers
        tr.begin_step()
        try:
            if self._rebind:
                for alias, state in self._host_aliases.items():  # copied as bound: before
                    bind.bind_ortvalue_input(alias, self.values[state])  # the update
                for e in g.states:
                    bind.bind_ortvalue_input(e.input, self.values[e.input])
                    if self.memory is None and self._count_data:  # to the device and back
                        n = self.arrays.nbytes(e.input)
                        tr.add("to_device", n, state=True)
                        tr.add("to_host", n, state=True)
            host = [np.ascontiguousarray(feeds[name]) for name in g.data_inputs]
            host += [np.array([lr], g.lr_dtype), np.array([t], np.int64)]
            for name, arr in zip(list(g.data_inputs) + [g.lr_input, g.step_input], host):
                bind.bind_cpu_input(name, arr)
                if self._count_data:
                    tr.add("to_device", arr.nbytes)
            self.session.run_with_iobinding(bind)
            if self._count_data:
                for out in self._outputs:  # ONNX Runtime copies each into its host buffer
                    tr.add("to_host", self.arrays.nbytes(out))
        finally:
            tr.end_step()
        return float(self.arrays[g.loss_output].reshape(-1)[0])

    @property
    def finite(self) -> bool:
        """Whether the last step's gradients were finite (always True without a finite flag)."""
        f = self.graph.finite_output
        return True if f is None else bool(self.arrays[f])
