"""The MPI job of tests/cluster/test_jobs.py::test_link_down_mid_collective (not a test module itself).

    mpiexec -n P python tests/cluster/link_down_job.py OUTDIR TIMEOUT ALGORITHM

Every rank all-reduces 8 MiB in a loop (each call crosses the node links for tens of ms at 1 Gbit/s) until a
call fails, then writes what happened to OUTDIR/rank<r>.json. A file, not stdout: a node whose link is down
cannot reach mpiexec, so its ranks' output would be lost. Rank 0 writes OUTDIR/ready once every rank is in the
loop; the test then takes one node's link down. The ranks end with os._exit once every rank has written its
file (hydra kills the others as soon as one rank exits without MPI_Finalize): MPI_Finalize could wait for
messages that can no longer arrive, and the job's verdict is in the files.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator, MpcommError

LOOP_SECONDS = 120.0  # the test takes the link down within a few seconds; this only bounds a broken test


def main() -> None:
    outdir, timeout, algorithm = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    comm = Communicator(MPI.COMM_WORLD, timeout=timeout)
    buf = np.ones(2 << 20, np.float32)
    comm.allreduce(buf, algorithm=algorithm)
    comm.barrier()
    if comm.rank == 0:
        with open(os.path.join(outdir, "ready"), "w") as f:
            f.write("ready\n")
    calls, start = 0, time.monotonic()
    result: dict = {"rank": comm.rank, "node": MPI.Get_processor_name(), "error": None}
    try:
        while time.monotonic() - start < LOOP_SECONDS:
            began = time.monotonic()
            comm.allreduce(buf, algorithm=algorithm)
            calls += 1
    except MpcommError as exc:
        result.update(error=type(exc).__name__, seconds_in_call=time.monotonic() - began, message=str(exc))
    result["calls"] = calls
    path = os.path.join(outdir, f"rank{comm.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    # hydra kills every rank once one exits without MPI_Finalize: stay until all have reported (or 60 s)
    others = [os.path.join(outdir, f"rank{r}.json") for r in range(comm.size)]
    deadline = time.monotonic() + 60
    while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
