// Baseline: OpenMPI MPI_Allreduce (sum, then the division a trainer needs for avg), float32,
// the same sweep, data and check as ringd-bench. Run under mpirun; choose the algorithm with
// OpenMPI's own MCA parameters (e.g. --mca coll_tuned_use_dynamic_rules 1
// --mca coll_tuned_allreduce_algorithm 4 for ring).
#include <mpi.h>

#include <chrono>
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
        const std::string k = argv[i];
        const auto v = parse_size(argv[i + 1]);
        if (!v) continue;
        if (k == "-b") s.min_bytes = *v;
        else if (k == "-e") s.max_bytes = *v;
        else if (k == "-f") s.factor = *v;
        else if (k == "-n") s.iters = static_cast<int>(*v);
        else if (k == "-w") s.warmup = static_cast<int>(*v);
        else if (k == "-c") s.check = static_cast<int>(*v);
    }
    std::vector<float> buf(s.max_bytes / 4 + 1);
    const float inv = 1.0f / static_cast<float>(size);
    auto allreduce = [&](size_t count) {
        MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (size_t i = 0; i < count; ++i) buf[i] *= inv;
    };
    if (rank == 0) bench::print_header("OpenMPI MPI_Allreduce", size, s);
    double sum_busbw = 0;
    int rows = 0;
    uint64_t wrong_total = 0;
    for (uint64_t bytes = s.min_bytes; bytes <= s.max_bytes; bytes *= s.factor) {
        const size_t count = bytes / 4;
        bench::fill(buf.data(), count, DType::F32, static_cast<uint64_t>(rank));
        for (int i = 0; i < s.warmup; ++i) allreduce(count);
        MPI_Barrier(MPI_COMM_WORLD);
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < s.iters; ++i) allreduce(count);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / s.iters;
        unsigned long long wrong = 0;
        if (s.check) {
            bench::fill(buf.data(), count, DType::F32, static_cast<uint64_t>(rank));
            allreduce(count);
            unsigned long long mine = bench::count_wrong(buf.data(), count, DType::F32, ReduceOp::Avg, static_cast<uint64_t>(size));
            MPI_Allreduce(&mine, &wrong, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
        }
        wrong_total += wrong;
        if (rank == 0) sum_busbw += bench::print_row(count * 4, size, us, wrong, s.check);
        ++rows;
    }
    if (rank == 0) std::printf("# Avg bus bandwidth : %.3f\n# Wrong values : %llu\n", rows ? sum_busbw / rows : 0.0,
                               static_cast<unsigned long long>(wrong_total));
    MPI_Finalize();
    return wrong_total ? 1 : 0;
}
