/* What a meeting of the ranks costs in MPI alone, issued four ways (issue 32: native's meeting before its blocking
 * all-reduce on Open MPI, from 4 KiB).
 *
 * Where native meets and then blocks, the meeting is a non-blocking MAX all-reduce of 4 int64 polled with MPI_Test
 * (algorithms/native.py, native_calls.c). Here, on the same 4 int64, in C (mpi4py's calls cost more than the calls
 * themselves at this size): that all-reduce; every rank's 4 int64 sent to every other rank with MPI_Isend/MPI_Irecv
 * and polled with MPI_Testall (a meeting that also compares, p - 1 messages each way); MPI_Ibarrier (meets, cannot
 * compare counts); the blocking MPI_Allreduce of the same 4 int64 (no deadline possible: the reference). Best of 7
 * loops of 20 000, microseconds per call, the slowest rank's:
 *
 *     mpicc -O2 bench/experiments/meeting_calls.c -o /tmp/meeting_calls && mpiexec -n 2 /tmp/meeting_calls
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>

enum { IALLREDUCE, POINT_TO_POINT, IBARRIER, BLOCKING, WAYS, MAX_RANKS = 64, TAG = 77 };

static void meet(int way, MPI_Comm comm, int rank, int size, int64_t *mine, int64_t (*theirs)[4]) {
    MPI_Request requests[2 * MAX_RANKS];
    int done = 0, count = 0;
    switch (way) {
        case IALLREDUCE:
            MPI_Iallreduce(mine, theirs[0], 4, MPI_INT64_T, MPI_MAX, comm, requests);
            while (!done) MPI_Test(requests, &done, MPI_STATUS_IGNORE);
            break;
        case POINT_TO_POINT:
            for (int q = 0; q < size; q++)
                if (q != rank) MPI_Irecv(theirs[q], 4, MPI_INT64_T, q, TAG, comm, &requests[count++]);
            for (int q = 0; q < size; q++)
                if (q != rank) MPI_Isend(mine, 4, MPI_INT64_T, q, TAG, comm, &requests[count++]);
            while (!done) MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
            break;
        case IBARRIER:
            MPI_Ibarrier(comm, requests);
            while (!done) MPI_Test(requests, &done, MPI_STATUS_IGNORE);
            break;
        default:
            MPI_Allreduce(mine, theirs[0], 4, MPI_INT64_T, MPI_MAX, comm);
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > MAX_RANKS) MPI_Abort(MPI_COMM_WORLD, 2);
    const char *names[WAYS] = {"MPI_Iallreduce + MPI_Test", "MPI_Isend/Irecv + MPI_Testall", "MPI_Ibarrier + MPI_Test",
                               "MPI_Allreduce (blocking)"};
    double best[WAYS] = {1e9, 1e9, 1e9, 1e9};
    int64_t mine[4] = {4096, 7, -4096, -7}, theirs[MAX_RANKS][4];
    for (int round = 0; round < 7; round++)
        for (int way = 0; way < WAYS; way++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double start = MPI_Wtime(), us, slowest;
            for (int i = 0; i < 20000; i++) meet(way, MPI_COMM_WORLD, rank, size, mine, theirs);
            us = (MPI_Wtime() - start) / 20000 * 1e6;
            MPI_Allreduce(&us, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (slowest < best[way]) best[way] = slowest;
        }
    if (rank == 0)
        for (int way = 0; way < WAYS; way++) printf("%-32s %6.2f us\n", names[way], best[way]);
    MPI_Finalize();
    return 0;
}
