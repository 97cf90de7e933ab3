"""What every benchmarked collective shares: exact test inputs, the reference reduction, the check, the raw call.

Inputs are small integers (in the benchmark's dtype) chosen so that every reduction is exact in that dtype
for any summation order: then every correct algorithm gives *bitwise* the numpy reference computed here in
float64/int64, independently of mpcomm's own code (as nccl-tests does with its integer-valued data).
Each rank can regenerate any rank's input from ``(seed, rank)``, so the reference needs no communication.

Timed calls run on *steady* data instead (:func:`steady_input`): an in-place all-reduce feeds each call's result
to the next, so thousands of timed sums of the check inputs would grow by a factor p per call and overflow
(float16 after ~6 calls at p = 2, float32 after ~120). The check refills the inputs right before its one call.

Every case also times :data:`RAW`: the MPI library's blocking collective called straight from mpi4py on a
private duplicate communicator, on the same element count in the dtype mpcomm hands MPI (:func:`wire_dtype`:
float16/bfloat16 reduce as float32, bool as uint8; data movement as bytes), so mpcomm's own cost shows.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..buffers import BFLOAT16, OPS, wire_dtype

RAW = "mpi4py-raw"  # the algorithm name of the raw mpi4py rows

# nccl-tests' bus-bandwidth factors by formula: busbw = algbw * factor(p), comparable across process counts
BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "1": lambda p: 1.0,
    "(p-1)/p": lambda p: (p - 1) / p,
    "2(p-1)/p": lambda p: 2 * (p - 1) / p,
}

# Largest integer every value up to which is exact in the dtype (floats) or fits it (integers).
_EXACT = {
    np.dtype(np.float16): 2**11,
    BFLOAT16: 2**8,
    np.dtype(np.float32): 2**24,
    np.dtype(np.float64): 2**53,
    np.dtype(np.complex64): 2**24,
    np.dtype(np.complex128): 2**53,
}
# Largest power of two the dtype holds (for products of ±1 and 2).
_POW2 = {np.dtype(np.float16): 2**15, BFLOAT16: 2**127, np.dtype(np.float32): 2**127,
         np.dtype(np.complex64): 2**127}


def kind(dtype) -> str:
    """numpy's kind letter, with ml_dtypes' bfloat16 (kind 'V') counted as a float."""
    dtype = np.dtype(dtype)
    return "f" if dtype == BFLOAT16 else dtype.kind


def exact_limit(dtype: np.dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype in _EXACT:
        return _EXACT[dtype]
    return int(np.iinfo(dtype).max)


def rank_input(rank: int, count: int, dtype, redop: str, p: int, seed: int = 1234) -> np.ndarray:
    """Rank ``rank``'s deterministic input: values whose ``redop`` over ``p`` ranks is exact in ``dtype``."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([seed, rank, count])
    if dtype == np.bool_:
        return rng.integers(0, 2, count).astype(np.bool_)
    unsigned = kind(dtype) == "u"
    if redop == "prod":
        limit = _POW2.get(dtype, 2**1023) if kind(dtype) in "fc" else exact_limit(dtype)
        choices = ([1, 2] if unsigned else [-1, 1, 2]) if 2**p < limit else ([1] if unsigned else [-1, 1])
        values = rng.choice(np.array(choices, dtype=np.int64), count)
    else:
        if redop in ("sum", "avg"):
            r = max(1, min(1000, (exact_limit(dtype) - 1) // p))
        else:  # min / max / no reduction
            r = min(100, exact_limit(dtype) - 1)
        values = rng.integers(0 if unsigned else -r, r + 1, count, dtype=np.int64)
    if kind(dtype) == "c":
        imag = rng.integers(-1, 2, count, dtype=np.int64) if redop == "prod" else values[::-1]
        return (values + 1j * imag).astype(dtype)
    if kind(dtype) == "f":
        return values.astype(np.float64).astype(dtype)
    return values.astype(dtype)


def steady_input(values: np.ndarray, redop: str) -> np.ndarray:
    """Timing data that an in-place reduction over any number of ranks maps to itself, so that no number of
    timed calls can overflow or drift: 0 for sum/avg, 1 for prod; for min/max ``values`` (after the first call
    every rank holds the same result, which min/max leave as it is)."""
    if redop in ("sum", "avg"):
        return np.zeros_like(values)
    if redop == "prod":
        return np.ones_like(values)
    return values.copy()


def wire_buffer(array: np.ndarray) -> np.ndarray:
    """``array`` itself where MPI reduces its dtype directly, else a copy in the dtype MPI reduces for mpcomm
    (float16/bfloat16 -> float32, bool -> uint8)."""
    wire = wire_dtype(array.dtype)
    return array if wire == array.dtype else array.astype(wire)


def from_the_wire(wire: np.ndarray, dtype, redop: str, p: int) -> np.ndarray:
    """A raw reduction's result in ``dtype``: cast back, and for avg (MPI has none: the raw call sums) the sum
    divided by p once in the dtype, as :func:`reference_reduce` does."""
    dtype = np.dtype(dtype)
    result = wire.astype(dtype)
    return result / np.array(p, dtype=dtype) if redop == "avg" else result


def reference_reduce(inputs, dtype, redop: str) -> np.ndarray:
    """numpy reduction of ``inputs`` (an iterable of arrays, one per rank) in float64/complex128/int64.

    The inputs make every result exact, so this equals any correct reduction order; for "avg" the exact
    sum is divided by p once in ``dtype`` (numpy's complex division is not correctly rounded, so dividing
    in complex128 and rounding would differ from a library that divides in complex64 by 1 ulp).
    """
    dtype = np.dtype(dtype)
    acc_dtype = {"f": np.float64, "c": np.complex128, "i": np.int64, "u": np.uint64, "b": np.bool_}[kind(dtype)]
    ufunc = OPS[redop].ufunc
    acc: Any = None
    p = 0
    for array in inputs:
        p += 1
        array = array.astype(acc_dtype)
        acc = array if acc is None else ufunc(acc, array, out=acc)
    if redop == "avg":  # the exact sum, divided once in the dtype itself (numpy's division for that dtype)
        return acc.astype(dtype) / np.array(p, dtype=dtype)
    return acc.astype(dtype)


def sentinel_like(expected: np.ndarray) -> np.ndarray:
    """An array that differs from ``expected`` in every element (so an unwritten output counts as wrong)."""
    dtype = expected.dtype
    if dtype == np.bool_:
        return ~expected
    if kind(dtype) in "fc":
        return np.full_like(expected, np.nan)
    info = np.iinfo(dtype)
    # exact inputs never reach the extreme values (see rank_input), so these are never a correct result
    return np.full_like(expected, info.min if kind(dtype) == "i" else info.max)


def count_wrong(result: np.ndarray, expected: np.ndarray) -> int:
    """Elements of ``result`` not equal to ``expected`` (by value: +0 == -0, NaN matches only NaN).

    Values, not bytes: the sign of a zero legitimately depends on the order of a reduction (e.g. a complex
    product's imaginary part). Ranks are compared bitwise separately (``digest``).
    """
    if result.shape != expected.shape:
        return max(result.size, expected.size)
    if result.size == 0:
        return 0
    if result.dtype == BFLOAT16:
        result, expected = result.astype(np.float32), expected.astype(np.float32)
    same = result == expected
    if kind(result.dtype) in "fc":
        same |= np.isnan(result) & np.isnan(expected)
    return int(result.size - np.count_nonzero(same))


def digest(array: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8).tobytes(), digest_size=16).digest()


class Collective(ABC):
    """One benchmark case: a collective at one (count, dtype, redop) on one communicator.

    Subclasses (one small file each) say how to allocate and refill their buffers, how to run one call of
    an algorithm (and of :data:`RAW`), which array is the result and what it should be. The driver does
    everything else.
    """

    name = ""          # the --op name (nccl-tests' where it has one)
    operation = ""     # the Communicator method and REGISTRY key, where it differs from ``name``
    raw_call = ""      # the mpi4py call timed as RAW, for the header
    reduces = True     # takes a reduction op
    rooted = False     # takes --root
    per_rank_count = False   # "count" is elements per rank (per peer for alltoall) and "size" the full buffer
    replicated = True  # every rank ends with the same result (checked bitwise across ranks)
    busbw_formula = ""  # nccl-tests' bus-bandwidth factor, one of BUSBW_FACTORS (also the header's text)

    @classmethod
    def busbw_factor(cls, p: int) -> float:
        """nccl-tests' bus-bandwidth factor for p ranks."""
        return BUSBW_FACTORS[cls.busbw_formula](p)

    @classmethod
    def operation_name(cls) -> str:
        """The name the Communicator, the algorithm registry and the ``auto`` selector know this operation by."""
        return cls.operation or cls.name

    @classmethod
    def algorithms(cls) -> list[str]:
        """The algorithm names the library has registered for this operation, plus "auto"."""
        from ..algorithms import REGISTRY

        return list(REGISTRY.get(cls.operation_name(), {})) + ["auto"]

    @classmethod
    def layout(cls, nbytes: int, itemsize: int, p: int) -> tuple[int, int]:
        """(count, size in bytes) for a requested size, as nccl-tests defines them for this operation."""
        if cls.per_rank_count:
            count = max(1, nbytes // (itemsize * p))
            return count, count * itemsize * p
        count = max(1, nbytes // itemsize)
        return count, count * itemsize

    def __init__(self, comm, count: int, dtype, redop: str, root: int = 0, seed: int = 1234):
        self.comm, self.count, self.dtype, self.redop, self.root, self.seed = comm, count, np.dtype(dtype), redop, root, seed
        self.p, self.rank = comm.size, comm.rank
        self._expected: np.ndarray | None = None
        self.raw_comm = comm.mpi.Dup()  # the raw calls' own communicator: nothing of mpcomm's can match them
        self.setup()
        self.fill(check=False)

    # -- helpers for subclasses
    def input_of(self, rank: int, count: int | None = None) -> np.ndarray:
        return rank_input(rank, self.count if count is None else count, self.dtype,
                          self.redop if self.reduces else "none", self.p, self.seed)

    def expected(self) -> np.ndarray:
        if self._expected is None:
            self._expected = self.compute_expected()
        return self._expected

    def expected_of(self, algorithm: str) -> np.ndarray:
        """The reference result of ``algorithm``'s call (the same for every algorithm unless a subclass says)."""
        return self.expected()

    def block(self, array: np.ndarray, index: int) -> np.ndarray:
        """Block ``index`` of ``count`` elements of a buffer of ``p`` blocks (per-rank-count collectives)."""
        return array[index * self.count:(index + 1) * self.count]

    def nothing(self) -> np.ndarray:
        """The result, and the expected result, of a rank that receives nothing (off the root)."""
        return np.empty(0, self.dtype)

    # -- what subclasses define
    @abstractmethod
    def setup(self) -> None:
        """Allocate the buffers (:meth:`fill` fills them)."""

    @abstractmethod
    def call(self, algorithm: str) -> Callable[[], object]:
        """One call of the collective with ``algorithm`` (or :data:`RAW`) as a function of no arguments,
        bound once so that the timed loop pays nothing but the call (positional arguments, as the raw call's: a
        partial with keywords costs 80 ns a call more)."""

    @abstractmethod
    def fill(self, check: bool) -> None:
        """Fill the inputs: the check inputs with poisoned outputs (``check``), else the timing data
        (which must stay finite however many calls run on it: :func:`steady_input`)."""

    @abstractmethod
    def result(self, algorithm: str) -> np.ndarray:
        """The result of the checked call of ``algorithm``, in the benchmark's dtype."""

    @abstractmethod
    def compute_expected(self) -> np.ndarray:
        """The reference result, from numpy on every rank's inputs."""

    def close(self) -> None:
        """Release what ``setup`` acquired beyond memory (the raw calls' communicator)."""
        self.raw_comm.Free()

    # -- the check, used by the driver
    def check(self, algorithm: str) -> tuple[int, bool | None]:
        """Run once on fresh inputs: (wrong elements summed over ranks, whether the result is bitwise equal on
        all ranks; None where results differ per rank by design). Leaves the timing data in place."""
        self.fill(check=True)
        self.call(algorithm)()
        result = self.result(algorithm)
        wrong = count_wrong(result, self.expected_of(algorithm))
        world = self.comm.mpi
        total = world.allreduce(wrong, op=MPI.SUM)
        identical = self.identical_across_ranks(result) if self.replicated else None
        self.fill(check=False)
        return total, identical

    def identical_across_ranks(self, result: np.ndarray) -> bool:
        """Whether every rank holds the same bytes (only meaningful where the result is replicated)."""
        digests = self.comm.mpi.allgather(digest(result))
        return all(d == digests[0] for d in digests)


class DataMovement(Collective):
    """A collective that only moves data from read-only inputs to ``self.recv`` (None on a rank that receives
    nothing): the inputs are their own timing data, and the check poisons ``recv`` first."""

    reduces = False
    recv: np.ndarray | None = None

    def fill(self, check: bool) -> None:
        if check and self.recv is not None:
            self.recv[...] = sentinel_like(self.expected())

    def result(self, algorithm: str) -> np.ndarray:
        return self.nothing() if self.recv is None else self.recv
