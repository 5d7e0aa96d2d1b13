"""The step session's execution providers: the session options a Trainer passes on
(``session_config=``, ``free_dimensions=``), the check that every execution provider asked
for runs the step (no silent fallback to the CPU), and ``trainer.assignment``.

:class:`StepSession` does the three for one step session:

- :meth:`StepSession.configure` gives ``so.add_session_config_entry`` each
  ``session_config`` entry and ``so.add_free_dimension_override_by_name`` each
  ``free_dimensions`` entry (a name that is no symbolic dimension of the step graph's inputs
  is refused: onnxruntime would ignore it), and asks onnxruntime to record which EP runs
  which node (``session.record_ep_graph_assignment_info``, onnxruntime 1.24+); where the
  record is missing (older onnxruntime), it profiles the first step instead.
- :meth:`StepSession.check` raises, once the session is made, when an EP asked for is not
  among ``session.get_providers()`` (saying why: not installed, a plugin EP given by name,
  installed but without a usable device), or claims none of the step's nodes, unless the
  caller listed ``CPUExecutionProvider`` after it (then a warning is logged). Nodes an EP
  leaves to the CPU (onnxruntime keeps shape arithmetic there, an op the EP lacks) are
  allowed either way: ``assignment`` shows them.
- :attr:`StepSession.assignment`: ``{ep_name: node count}`` of the step session, from the
  record (the nodes as onnxruntime partitioned the optimised graph; a few of them may be
  folded away later, e.g. a Transpose of a constant), else from the profile of the first
  step (the nodes it ran; None before it).

Without the record the claims are known after the first step only: a zero claim is raised
by that step (which ran, on the CPU).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import weakref
from typing import Mapping

from .placement import CPU, check_running

__all__ = ["RECORD_KEY", "StepSession", "check_session_config", "check_free_dimensions",
           "profile_counts", "recorded_counts"]

RECORD_KEY = "session.record_ep_graph_assignment_info"

log = logging.getLogger("trainops")


def check_session_config(entries) -> dict[str, str]:
    """``session_config`` as ``add_session_config_entry`` takes it: str keys, values str,
    int or bool (bool as "1"/"0", int as its decimal text). TypeError / ValueError naming
    the entry otherwise."""
    if entries is None:
        return {}
    if not isinstance(entries, Mapping):
        raise TypeError(f"Trainer: session_config must be a dict {{key: value}}, got "
                        f"{type(entries).__name__}")
    out = {}
    for k, v in entries.items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"Trainer: session_config keys must be non-empty str, got {k!r}")
        if k == RECORD_KEY:
            raise ValueError(f"Trainer: session_config[{k!r}]: trainops sets it (the record "
                             "behind trainer.assignment)")
        if isinstance(v, bool):
            v = "1" if v else "0"
        elif isinstance(v, int):
            v = str(v)
        elif not isinstance(v, str):
            raise TypeError(f"Trainer: session_config[{k!r}] must be a str (or int / bool), "
                            f"got {type(v).__name__} {v!r}")
        out[k] = v
    return out


def check_free_dimensions(dims) -> dict[str, int]:
    """``free_dimensions``: symbolic dimension name -> size (an int >= 1)."""
    if dims is None:
        return {}
    if not isinstance(dims, Mapping):
        raise TypeError(f"Trainer: free_dimensions must be a dict {{name: size}}, got "
                        f"{type(dims).__name__}")
    out = {}
    for k, v in dims.items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"Trainer: free_dimensions keys must be dimension names (str), "
                            f"got {k!r}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Trainer: free_dimensions[{k!r}] must be an int >= 1, got {v!r}")
        out[k] = int(v)
    return out


def _remove(path: str) -> None:
    try:
        if path:
            os.remove(path)
    except OSError:
        pass


def _end_profile(inner) -> None:
    """Ends a profiling session (onnxruntime's C++ one) and removes the file it writes."""
    try:
        _remove(inner.end_profiling())
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass


def _symbolic_dims(model) -> list[str]:
    names = []
    for vi in model.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param and d.dim_param not in names:
                names.append(d.dim_param)
    return names


def has_record() -> bool:
    """Whether this onnxruntime records the EP of each node (1.24+)."""
    import onnxruntime as ort

    return hasattr(ort.InferenceSession, "get_provider_graph_assignment_info")


def recorded_counts(session) -> dict[str, int]:
    """{ep: node count} from onnxruntime's graph-assignment record of ``session``."""
    counts: dict[str, int] = {}
    for sub in session.get_provider_graph_assignment_info():
        counts[sub.ep_name] = counts.get(sub.ep_name, 0) + len(sub.get_nodes())
    return counts


def profile_counts(path: str) -> dict[str, int]:
    """{provider: node count} of one profiled run: the distinct ``node_index`` of the
    kernel events of each provider in onnxruntime's JSON trace at ``path``."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)
    nodes: dict[str, set] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time") \
                and "provider" in args:
            nodes.setdefault(args["provider"], set()).add(args.get("node_index", e["name"]))
    return {ep: len(v) for ep, v in nodes.items()}


class StepSession:
    """The options, check and assignment of one step session (see the module).
    ``single``: False for the runtimes of ``accumulate > 1`` and ``comm`` (their CPU
    sessions take no options here: ``session_config`` / ``free_dimensions`` are refused)."""

    def __init__(self, placement, session_config=None, free_dimensions=None,
                 single: bool = True):
        self.placement = placement
        self.session_config = check_session_config(session_config)
        self.free_dimensions = check_free_dimensions(free_dimensions)
        if not single and (self.session_config or self.free_dimensions):
            raise NotImplementedError("Trainer: session_config and free_dimensions apply to "
                                      "the one step session: not with accumulate > 1 or comm")
        self._counts: dict[str, int] | None = None
        self._session = None
        self._profile: str | None = None

    def configure(self, model):
        """The callable that sets up the step session's SessionOptions for ``model`` (the
        step graph): ValueError now for a free dimension ``model``'s inputs lack."""
        symbolic = _symbolic_dims(model)
        unknown = [n for n in self.free_dimensions if n not in symbolic]
        if unknown:
            raise ValueError(f"Trainer: free_dimensions {unknown}: no input of the step graph "
                             f"has such a dimension (its symbolic dimensions: {symbolic})")

        def apply(so) -> None:
            for k, v in self.session_config.items():
                try:
                    so.add_session_config_entry(k, v)
                except Exception as e:  # onnxruntime's own refusal (a key over 1024 chars, ...)
                    raise ValueError(f"Trainer: session_config[{k!r}] = {v!r}: onnxruntime "
                                     f"refused it: {e}") from e
            for k, v in self.free_dimensions.items():
                so.add_free_dimension_override_by_name(k, v)
            if has_record():
                so.add_session_config_entry(RECORD_KEY, "1")
            else:  # the first step's profile gives the counts
                so.enable_profiling = True
                name = f"trainops_assignment_{os.getpid()}_{id(self)}"
                so.profile_file_prefix = os.path.join(tempfile.gettempdir(), name)
        return apply

    @property
    def assignment(self) -> dict[str, int] | None:
        """{ep_name: node count} of the step session (None: not known yet, or no step
        session of this kind)."""
        return None if self._counts is None else dict(self._counts)

    def check(self, session) -> None:
        """After the session is made: every EP asked for is in it and (where the record
        is there) claims nodes; RuntimeError naming the EP and why otherwise."""
        self._session = session
        check_running(self.placement, session)  # (Placement.session checked it already)
        if has_record():
            self._counts = recorded_counts(session)
            self._check_claims()
        else:
            self._profile = "pending"
            # A session still profiling writes its file when it is destroyed: a trainer that
            # never steps ends it then, and the file goes (the C++ session, held by the
            # finalizer until the Python one is gone, is ended first).
            inner = getattr(session, "_sess", None)
            if inner is not None:
                self._finalizer = weakref.finalize(session, _end_profile, inner)

    def after_step(self) -> None:
        """After a step: without the record, the first step's profile read (and removed)
        and the claims checked."""
        if self._profile != "pending" or self._session is None:
            return
        self._profile = "done"
        session, self._session = self._session, None
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        path = ""
        try:
            path = session.end_profiling()
            self._counts = profile_counts(path)
        except (OSError, ValueError) as e:  # a file that could not be written or read back
            log.warning("trainer.assignment: the first step's profile could not be read (%s); "
                        "the node counts stay unknown", e)
            return
        finally:
            _remove(path)
        self._check_claims()

    def _check_claims(self) -> None:
        counts, total = self._counts or {}, sum((self._counts or {}).values())
        for name in (n for n in self.placement.names if n != CPU):
            if counts.get(name, 0) > 0:
                continue
            where = ", ".join(f"{k}: {v}" for k, v in counts.items())
            if getattr(self.placement, "cpu_after", False):
                log.warning("%s claims none of the step's %d nodes (%s); they run on the CPU, "
                            "as CPUExecutionProvider is listed after it", name, total, where)
                continue
            raise RuntimeError(f"Trainer: {name} claims none of the step's {total} nodes "
                               f"({where}): the step would run on the CPU. List "
                               f"'{CPU}' after it to allow that")
