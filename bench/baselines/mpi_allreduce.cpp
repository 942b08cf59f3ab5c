// Baseline: OpenMPI MPI_Allreduce (sum, then the division a trainer needs for avg), float32,
// the same sweep, data and check as ringd-bench. Run under mpirun; choose the algorithm with
// OpenMPI's own MCA parameters (e.g. --mca coll_tuned_use_dynamic_rules 1
// --mca coll_tuned_allreduce_algorithm 4 for ring).
#include <mpi.h>

#include <cstdlib>
#include <vector>

#include "bench/baselines/baseline_table.h"

using namespace ringd;

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    bench::Sweep s;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!bench::parse_sweep_arg(argv[i], argv[i + 1], s)) {
            if (rank == 0) std::fprintf(stderr, "mpi-allreduce: bad argument %s %s\n", argv[i], argv[i + 1]);
            MPI_Finalize();
            return 2;
        }
    }
    // The op's floats lie kOpOffset into the buffer, with guard bytes before and after them.
    std::vector<float> mem(bench::buffer_bytes(s) / 4 + 1);
    float *buf = mem.data() + bench::kOpOffset / 4;
    const float inv = 1.0f / static_cast<float>(size);
    auto allreduce = [&](size_t count) {
        MPI_Allreduce(MPI_IN_PLACE, buf, static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (size_t i = 0; i < count; ++i) buf[i] *= inv;
    };
    // Each rank checks its own result and prints its verdict; nothing is summed through MPI.
    const uint64_t bad = bench::run_sweep(s, "OpenMPI MPI_Allreduce", rank, size, mem.data(), allreduce,
                                          [] { MPI_Barrier(MPI_COMM_WORLD); });
    MPI_Finalize();
    return bad ? 1 : 0;
}
