"""mpcomm: collective communication over MPI (mpi4py) for numpy and CuPy buffers, and training engines on it."""
from __future__ import annotations

from .buffers import AVG, MAX, MIN, PROD, SUM
from .comm import Communicator
from .cuda import cuda_aware
from .mesh import ParallelConfig, ParallelMesh
from .p2p import ANY_SOURCE, ANY_TAG, Status
from .errors import CollectiveMismatchError, CommTimeoutError, ConfigError, MpcommError
from .work import Work
from .launch import install_excepthook

install_excepthook()  # multi-rank worlds: an uncaught MpcommError ends the whole job (mpcomm.launch)

__all__ = [
    "Communicator",
    "Work",
    "ParallelMesh",
    "ParallelConfig",
    "SUM",
    "PROD",
    "MIN",
    "MAX",
    "AVG",
    "MpcommError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "ConfigError",
    "cuda_aware",
    "ANY_SOURCE",
    "ANY_TAG",
    "Status",
]
