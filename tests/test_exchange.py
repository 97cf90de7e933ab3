"""rhd's all-reduce of two ranks as one exchange (``algorithms/rhd.py``): its plan's one C call on host arrays
(``rhd.express``), and Python's sendrecv where that call is not made or does not take the buffer, the two pairing
with each other. Against numpy on the gathered inputs for every dtype and op (NaNs, infinities and signed zeros
too), bitwise alike on both ranks; a late rank waited for within the deadline, a silent one timed out, ranks that
disagree on the count told so on both.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_exchange.py`` (N >= 2: the ranks
are split into pairs, a last rank alone skips; the timeout case runs where N = 2).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import WORLD, assert_bitwise_equal, assert_reduced, make_input
from test_nan import special_values
from test_native_wait import reduced
from test_timeouts import SILENT, TIMEOUT, assert_every_waiting_rank_timed_out, with_silent_rank

from mpcomm import Communicator, native_calls
from mpcomm.algorithms import EXPRESS, native, rhd
from mpcomm.buffers import BFLOAT16
from mpcomm.errors import MpcommError

pytestmark = pytest.mark.mpi

PAIR = WORLD.Split(WORLD.Get_rank() // 2, WORLD.Get_rank())
INTEGERS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
DTYPES = [*INTEGERS, np.float32, np.float64, np.complex64, np.complex128]
# Element counts: none, one, odd, prime, the exchange's last size (EXCHANGE_UPTO bytes), and one past it (halving)
COUNTS = [0, 1, 7, 4099, "upto", "past"]
REAL = {np.dtype(np.complex64): np.dtype(np.float32), np.dtype(np.complex128): np.dtype(np.float64)}


def ops_of(dtype) -> list[str]:
    kind = np.dtype(dtype).kind
    return ["sum", "prod"] + (["max", "min"] if kind != "c" else []) + (["avg"] if kind in "fc" else [])


def count_of(count, dtype) -> int:
    last = rhd.EXCHANGE_UPTO // np.dtype(dtype).itemsize
    return last if count == "upto" else last + 1 if count == "past" else count


def inputs(dtype, op: str, n: int, rank: int) -> np.ndarray:
    """Floats full of NaNs (other payloads too), infinities and signed zeros; finite values for the rest (complex
    products of infinities are C's in MPI's op and numpy's own in numpy: native's tests keep them finite too)."""
    if np.dtype(dtype).kind == "f" and n:
        return special_values(dtype, rank, n)
    return make_input(dtype, op, (n,), rank, seed=5)


@pytest.fixture
def pair():
    if PAIR.Get_size() != 2:
        pytest.skip("the last rank of an odd number has no partner")
    if native_calls.load() is None:
        pytest.skip("native_calls is not built here")
    comm = Communicator(PAIR)
    yield comm
    comm.free()


def runs_counted(monkeypatch, comm: Communicator) -> list:
    runs: list = []
    run = comm.run
    monkeypatch.setattr(comm, "run", lambda *args, **kwargs: runs.append(args[0]) or run(*args, **kwargs))
    return runs


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=str)
def test_a_16_bit_exchange_is_one_c_call_on_its_float32_work_array(pair, monkeypatch, dtype):
    """float16/bfloat16 by rhd: widened to a float32 work array, exchanged and reduced there in the plan's one C call
    from the first call on (run() not called), narrowed back: numpy's float32 reduction rounded once (NaNs,
    infinities and signed zeros too, a NaN numpy's own), the same bits on both ranks, up to the last count whose
    work array the exchange takes."""
    comm = pair
    runs = runs_counted(monkeypatch, comm)
    cases = [(op, n) for op in ("sum", "prod", "max", "min", "avg") for n in (1, 7, rhd.EXCHANGE_UPTO // 4)]
    results = []
    for op, n in cases:
        x = inputs(dtype, op, n, comm.rank)
        results.append((x, comm.allreduce(x.copy(), op, "rhd")))
    everyone = PAIR.allgather((results, len(runs)))
    nan = np.array(np.nan, dtype).tobytes()
    for (op, n), *pairs in zip(cases, *[r for r, _ in everyone]):
        label = f"allreduce[rhd] {op} {np.dtype(dtype)} x{n}"
        assert_bitwise_equal([result for _, result in pairs], label)
        np.testing.assert_array_equal(pairs[0][1], reduced([x for x, _ in pairs], op), err_msg=label)
        assert {v.tobytes() for v in pairs[0][1][np.isnan(pairs[0][1])]} <= {nan}, f"{label}: a NaN not numpy's"
    assert everyone[comm.rank][1] == 0, f"{everyone[comm.rank][1]} calls went through run()"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["C", "Python", "C beside Python"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_op_is_numpys_on_both_ranks(pair, monkeypatch, path, dtype):
    """Each (op, count) all-reduced twice with rhd: the first call makes the plan (Python's exchange), the second
    is the plan's express C call ("C"), or Python's again where there is none ("Python"), or the C call on rank 0
    while rank 1 has none ("C beside Python": the two pair). Every result numpy's on the gathered inputs and the
    same bits on both ranks (the exchange's NaNs numpy's own); only the first call of each goes through run() where the C call is
    made, where native's one C call would take the (dtype, op), as auto's model assumes (and none past
    EXCHANGE_UPTO, whose halving has no C call)."""
    comm = pair
    if path == "Python" or (path == "C beside Python" and comm.rank == 1):
        monkeypatch.setitem(EXPRESS, "rhd", (lambda *args: None, rhd.complete))
    runs = runs_counted(monkeypatch, comm)
    cases = [(op, count_of(count, dtype)) for op in ops_of(dtype) for count in COUNTS]
    results, expected_runs = [], 0
    for op, n in cases:
        x = inputs(dtype, op, n, comm.rank)
        results.append((x, comm.allreduce(x.copy(), op, "rhd"), comm.allreduce(x.copy(), op, "rhd")))
        in_c = path == "C" and native.one_call_takes(np.dtype(dtype), op, True)  # (what auto's model assumes)
        expected_runs += 1 if in_c and n and n * np.dtype(dtype).itemsize <= rhd.EXCHANGE_UPTO else 2
    everyone = PAIR.allgather((results, len(runs)))
    for (op, n), *pairs in zip(cases, *[r for r, _ in everyone]):
        label = f"allreduce[rhd] {op} {np.dtype(dtype)} x{n}"
        expected = reduced([x for x, _, _ in pairs], op)
        for call in (1, 2):
            assert_bitwise_equal([p[call] for p in pairs], f"{label} (call {call})")
            if np.dtype(dtype).kind == "f":  # (two real floats: one rounding, NaNs and zeros as numpy's)
                np.testing.assert_array_equal(pairs[0][call], expected, err_msg=f"{label} (call {call})")
            else:  # (complex products: the MPI library's multiplication, within a rounding of numpy's)
                assert_reduced(pairs[0][call], [x for x, _, _ in pairs], op, what=f"{label} (call {call})")
            if np.dtype(dtype).kind in "fc" and n * np.dtype(dtype).itemsize <= rhd.EXCHANGE_UPTO:
                parts = pairs[0][call].view(REAL.get(np.dtype(dtype), np.dtype(dtype)))
                assert {v.tobytes() for v in parts[np.isnan(parts)]} <= {np.array(np.nan, parts.dtype).tobytes()}, \
                    f"{label} (call {call}): a NaN that is not numpy's"
    if path != "C beside Python":
        assert everyone[comm.rank][1] == expected_runs, f"{everyone[comm.rank][1]} calls through run()"


@pytest.mark.mpi(min_size=2)
def test_every_plans_c_call_shares_the_transports_one_buffer(pair):
    """Plans of many shapes keep one exchange buffer between them (the transport's, of twice EXCHANGE_UPTO), not one
    each: results still numpy's when shapes alternate."""
    comm = pair
    counts = [1, 100, 4099, rhd.EXCHANGE_UPTO // 8]
    xs = [np.arange(n, dtype=np.float64) + comm.rank for n in counts]
    for _ in range(2):  # (the first calls make the plans)
        results = [comm.allreduce(x.copy(), algorithm="rhd") for x in xs]
    owns = [comm._planned_allreduce(x, "sum", "rhd").express.bound[4] for x in xs]
    assert all(np.shares_memory(owns[0], own) for own in owns[1:])
    assert {own.base.nbytes if own.base is not None else own.nbytes for own in owns} == {2 * rhd.EXCHANGE_UPTO}
    for n, result in zip(counts, results):
        np.testing.assert_array_equal(result, 2 * np.arange(n) + 1)


LATE_CASES = [(np.float32, "sum"), (np.float64, "avg"), (np.int32, "prod"), (np.float32, "max")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,op", LATE_CASES, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("shape", [(12,), (3, 4)], ids=str)
def test_a_rank_late_to_the_exchange_is_waited_for_then_reduced(pair, monkeypatch, dtype, op, shape):
    """A C call whose messages are not done within its Tests returns its requests: rank 1 waits for them within the
    deadline (rank 0 comes 20 ms late), then reduces and finishes in C as the call would have: numpy's result, the
    same bits on both ranks, in the caller's shape."""
    comm = pair
    waited: list = []
    monkeypatch.setitem(EXPRESS, "rhd", (rhd.express, lambda *args: waited.append(1) or rhd.complete(*args)))
    x = inputs(dtype, op, 12, comm.rank).reshape(shape)
    comm.allreduce(x.copy(), op, "rhd")  # (the plan is made)
    PAIR.Barrier()
    if comm.rank == 0:
        time.sleep(0.02)
    everyone = PAIR.allgather((x, comm.allreduce(x.copy(), op, "rhd"), len(waited)))
    assert everyone[1][2] == 1, "rank 1, which waited for rank 0, did not take the wait"
    label = f"allreduce[rhd] {op} {np.dtype(dtype)}"
    assert_bitwise_equal([y for _, y, _ in everyone], label)
    assert everyone[0][1].shape == shape
    np.testing.assert_array_equal(everyone[0][1], reduced([x for x, _, _ in everyone], op), err_msg=label)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("planned", [False, True], ids=["Python's exchange", "the C call"])
def test_ranks_that_disagree_on_the_count_are_told_on_both(pair, planned):
    """Rank 0 all-reduces 8 doubles, rank 1 nine: an error on both ranks asking whether they pass the same sizes
    (rank 1 short of bytes, rank 0 given too many: the library's truncation), not a hang or a wrong result, whether
    the calls are Python's exchange or (both shapes planned first on both ranks) the C call."""
    comm = pair
    for n in (8, 9) if planned else ():
        comm.allreduce(np.ones(n), algorithm="rhd")

    def disagree():
        try:
            comm.allreduce(np.ones(8 if comm.rank == 0 else 9), algorithm="rhd")
        except MpcommError as exc:
            return str(exc)
        return None

    for rank, message in enumerate(PAIR.allgather(disagree())):
        assert message is not None, f"rank {rank} did not raise"
        assert f"rank {rank}: allreduce[rhd]" in message and "the same sizes and dtypes?" in message, message


@pytest.mark.mpi(min_size=2)
def test_a_silent_rank_times_out_the_exchange():
    """The C call's requests, waited for within the deadline: a rank that never comes is a timeout naming the call
    on the rank waiting for it, and the communicator is unusable after it."""
    if WORLD.Get_size() != 2 or native_calls.load() is None:
        pytest.skip("two ranks, with native_calls built")
    comm = Communicator(WORLD, timeout=TIMEOUT)
    try:
        comm.allreduce(np.ones(8), algorithm="rhd")  # (the plan is made)
        has_express = comm._planned_allreduce(np.ones(8), "sum", "rhd").express is not None
        silence = with_silent_rank(comm, lambda c, _: c.allreduce(np.ones(8), algorithm="rhd"))
        unusable = comm._unusable
    finally:
        comm.free()
    assert has_express
    assert_every_waiting_rank_timed_out(silence, ["allreduce[rhd]"])
    if WORLD.Get_rank() != SILENT:
        assert unusable is not None and "stopped midway" in unusable, unusable
