// Baseline: OpenMPI's collectives, float32, the same sweep, data and check as ringd-bench
// (--coll allreduce (the default: MPI_Allreduce's sum, then the division a trainer needs for
// avg), reduce_scatter (MPI_Reduce_scatter_block), allgather (MPI_Allgather), broadcast
// (MPI_Bcast), reduce (MPI_Reduce, sum), all_to_all (MPI_Alltoall); --root for broadcast and
// reduce, rank 1 by default), in place where MPI has it. Run under mpirun; choose the algorithm
// with OpenMPI's own MCA parameters (e.g. --mca coll_tuned_use_dynamic_rules 1
// --mca coll_tuned_allreduce_algorithm 4 for ring).
#include <mpi.h>

#include <cstdlib>
#include <string>
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
            if (rank == 0) std::fprintf(stderr, "mpi-bench: bad argument %s %s\n", argv[i], argv[i + 1]);
            MPI_Finalize();
            return 2;
        }
    }
    const int root = static_cast<int>(s.root_of(size));
    if (root >= size) {
        if (rank == 0) std::fprintf(stderr, "mpi-bench: --root %d: there are %d ranks\n", root, size);
        MPI_Finalize();
        return 2;
    }
    // The op's floats lie kOpOffset into the buffer, with guard bytes before and after them.
    std::vector<float> mem(bench::buffer_bytes(s) / 4 + 1);
    float *buf = mem.data() + bench::kOpOffset / 4;
    const float inv = 1.0f / static_cast<float>(size);
    auto run = [&](size_t count) -> const void * {
        const int n = static_cast<int>(count), block = static_cast<int>(count / static_cast<size_t>(size));
        switch (s.coll) {
        case Collective::ReduceScatter:
            // In place: the input is the range; MPI leaves this rank's block at its start.
            MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            return buf;
        case Collective::Allgather:
            MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, block, MPI_FLOAT, MPI_COMM_WORLD);
            return buf;
        case Collective::Broadcast: MPI_Bcast(buf, n, MPI_FLOAT, root, MPI_COMM_WORLD); return buf;
        case Collective::Reduce:
            MPI_Reduce(rank == root ? MPI_IN_PLACE : buf, rank == root ? buf : nullptr, n, MPI_FLOAT, MPI_SUM, root,
                       MPI_COMM_WORLD);
            return buf;
        case Collective::AllToAll:
            MPI_Alltoall(buf, block, MPI_FLOAT, buf + count, block, MPI_FLOAT, MPI_COMM_WORLD);
            return buf + count;
        default:
            MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            for (size_t i = 0; i < count; ++i) buf[i] *= inv;
            return buf;
        }
    };
    // Each rank checks its own result and prints its verdict; nothing is summed through MPI.
    const std::string name = "OpenMPI " + std::string(collective_name(s.coll));
    const uint64_t bad = bench::run_sweep(s, name.c_str(), rank, size, mem.data(), run, [] { MPI_Barrier(MPI_COMM_WORLD); });
    MPI_Finalize();
    return bad ? 1 : 0;
}
