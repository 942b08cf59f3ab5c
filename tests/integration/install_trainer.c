/* A trainer built only from what `meson install` put in place: <ringd/ringd.h>, ringd-client.pc
 * and libringd-client.so. Two local ranks (this process and a forked child) allreduce f32 sum,
 * then f32 avg, each rank at its own offset between guard bytes; every rank checks every value
 * and every guard byte itself and exits non-zero on any difference.
 * Usage: install-trainer SOCKET */
#include <ringd/ringd.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { COUNT = 10007, GUARD = 256, SLOT = 1 << 20 };

/* In [-8, 12], no period within an op: exact sums and averages of two ranks in f32. */
static float value(int rank, size_t i) {
    uint64_t x = i * 0x9e3779b97f4a7c15ull + (uint64_t)rank * 0x632be59bd9b4e019ull + 1;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return (float)((int)(x % 17) - 8 + rank);
}

static unsigned char guard_byte(size_t pos, int rank) { return (unsigned char)((pos * 131 + (size_t)rank * 71 + 17) >> 1); }

static int run_rank(const char *sock, int rank) {
    char err[256];
    ringd_client *c = ringd_connect(sock, "installed", rank, 2, SLOT, err, sizeof err);
    if (!c) {
        fprintf(stderr, "rank %d: connect: %s\n", rank, err);
        return 1;
    }
    size_t bytes = 0;
    unsigned char *slot = ringd_slot(c, &bytes);
    const size_t offset = 4096 + (size_t)rank * 1000 * sizeof(float); /* a different place per rank */
    const size_t end = offset + COUNT * sizeof(float);
    if (bytes < end + GUARD) {
        fprintf(stderr, "rank %d: slot of %zu bytes\n", rank, bytes);
        return 1;
    }
    int bad = 0;
    for (int pass = 0; pass < 2; ++pass) {
        const ringd_op op = pass == 0 ? RINGD_SUM : RINGD_AVG;
        for (size_t p = offset - GUARD; p < offset; ++p) slot[p] = guard_byte(p, rank);
        for (size_t p = end; p < end + GUARD; ++p) slot[p] = guard_byte(p, rank);
        float *data = (float *)(slot + offset);
        for (size_t i = 0; i < COUNT; ++i) data[i] = value(rank, i);
        const int rc = ringd_allreduce(c, offset, COUNT, RINGD_F32, op, 10000);
        if (rc != 0) {
            fprintf(stderr, "rank %d: allreduce: %s (%d)\n", rank, ringd_last_error(c), rc);
            ringd_close(c);
            return 1;
        }
        for (size_t i = 0; i < COUNT; ++i) {
            const float sum = value(0, i) + value(1, i);
            const float want = op == RINGD_SUM ? sum : sum / 2;
            if (data[i] != want && bad++ < 5)
                fprintf(stderr, "rank %d pass %d: element %zu is %g, not %g\n", rank, pass, i, data[i], want);
        }
        for (size_t p = offset - GUARD; p < end + GUARD; p = p + 1 == offset ? end : p + 1)
            if (slot[p] != guard_byte(p, rank) && bad++ < 5)
                fprintf(stderr, "rank %d pass %d: guard byte at %zu changed\n", rank, pass, p);
    }
    ringd_close(c);
    if (bad) return 1;
    printf("rank %d: %d values and %d guard bytes right, twice\n", rank, COUNT, 2 * GUARD);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    fflush(stdout);
    const pid_t child = fork();
    if (child < 0) return 1;
    if (child == 0) {
        const int rc = run_rank(argv[1], 1);
        fflush(stdout);
        _exit(rc);
    }
    const int rc0 = run_rank(argv[1], 0);
    int st = 0;
    if (waitpid(child, &st, 0) != child) return 1;
    return rc0 != 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0;
}
