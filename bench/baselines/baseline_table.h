// What the baseline programs share with ringd-bench: the size sweep, the exact-result data and
// check, and the nccl-tests columns, so that their tables compare line for line.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "bench/bench_data.h"
#include "bench/cluster_cpu.h"
#include "common/units.h"

namespace ringd::bench {

// Before each size's timed loop every system leaves its links idle for this long, then passes a
// barrier. An emulated link (tc tbf, bench/cluster --rate) turns idle time into a burst of up to
// its bucket (1 MB at 2 Gbit/s: 4 ms of the rate), so a loop that started after a longer pause
// (a slower barrier) would get more of its bytes through for free; this way every system's
// timed loop starts with full buckets and its ranks together.
constexpr auto kIdleBeforeTiming = std::chrono::milliseconds(10);
inline void idle_links() { std::this_thread::sleep_for(kIdleBeforeTiming); }

struct Sweep {
    uint64_t min_bytes = 4096, max_bytes = 64 << 20;
    uint64_t factor = 2;
    int iters = 20, warmup = 5, check = 1;
    Collective coll = Collective::Allreduce;
    int root = -1;  // broadcast, reduce (-1: rank 1, or 0 with one rank: ringd-bench's default)
    uint64_t root_of(int size) const { return root >= 0 ? static_cast<uint64_t>(root) : (size > 1 ? 1 : 0); }
    // allreduce averages, as a trainer does (the sum, then the division); the others sum.
    ReduceOp op() const { return coll == Collective::Allreduce ? ReduceOp::Avg : ReduceOp::Sum; }
};

// -b -e -f -n -w -c with ringd-bench's meaning, --coll and --root as ringd-bench's; false when
// `flag` is none of them or its value is bad.
inline bool parse_sweep_arg(const std::string &flag, const char *value, Sweep &s) {
    if (flag == "--coll") {
        const auto c = parse_collective(value);
        if (!c || *c == Collective::Barrier) return false;
        s.coll = *c;
        return true;
    }
    const auto n = parse_size(value);
    if (!n) return false;
    if (flag == "-b") s.min_bytes = *n;
    else if (flag == "-e") s.max_bytes = *n;
    else if (flag == "-f") s.factor = *n;
    else if (flag == "-n") s.iters = static_cast<int>(*n);
    else if (flag == "-w") s.warmup = static_cast<int>(*n);
    else if (flag == "-c") s.check = static_cast<int>(*n);
    else if (flag == "--root") s.root = static_cast<int>(*n);
    else return false;
    return true;
}

inline void print_header(const char *system, int ranks, const Sweep &s) {
    std::printf("# %s: %s, %d ranks, float %s, %d iters (+%d warm-up)\n", system,
                std::string(collective_name(s.coll)).c_str(), ranks, std::string(reduce_op_name(s.op())).c_str(), s.iters,
                s.warmup);
    std::printf("# #wrong: rank 0's own wrong values; every rank checks its own result and prints its verdict\n");
    std::printf("#\n# %12s %12s %8s %6s %11s %12s %12s %8s\n", "size(B)", "count", "type", "redop", "time(us)",
                "algbw(GB/s)", "busbw(GB/s)", "#wrong");
}

// nccl-tests' bus bandwidth factor: allreduce 2(n-1)/n, broadcast and reduce 1, the others (n-1)/n.
inline double bus_share(Collective coll, int ranks) {
    const double rest = static_cast<double>(ranks - 1) / static_cast<double>(ranks);
    if (coll == Collective::Allreduce) return 2 * rest;
    if (coll == Collective::Broadcast || coll == Collective::Reduce) return 1;
    return rest;
}

inline double print_row(uint64_t bytes, int ranks, double us, uint64_t wrong, bool checked, const Sweep &s) {
    const double algbw = static_cast<double>(bytes) / (us * 1e3);
    const double busbw = algbw * bus_share(s.coll, ranks);
    char w[32];
    std::snprintf(w, sizeof w, "%llu", static_cast<unsigned long long>(wrong));
    std::printf("  %12llu %12llu %8s %6s %11.2f %12.3f %12.3f %8s\n", static_cast<unsigned long long>(bytes),
                static_cast<unsigned long long>(bytes / 4), "float", std::string(reduce_op_name(s.op())).c_str(), us, algbw,
                busbw, checked ? w : "N/A");
    std::fflush(stdout);
    return busbw;
}

// A rank's verdict, the one line harnesses gather from every rank (bench/cluster prints them all;
// tests/integration/cluster_bench.sh and bench/compare need one from each rank and sum them).
// Each rank checks its own result; no count is ever summed through the system under test.
inline void print_verdict(uint64_t rank, uint64_t nranks, uint64_t wrong, uint64_t guard) {
    std::printf("# rank %llu of %llu: wrong values %llu, guard bytes damaged %llu\n", static_cast<unsigned long long>(rank),
                static_cast<unsigned long long>(nranks), static_cast<unsigned long long>(wrong),
                static_cast<unsigned long long>(guard));
    std::fflush(stdout);
}

// Where a baseline's op lies in its buffer: kGuardBytes in, with guard bytes on both sides; an
// all_to_all's output right after its input (as ringd-bench lays them out).
constexpr size_t kOpOffset = kGuardBytes;
inline size_t buffer_bytes(const Sweep &s) {
    return s.max_bytes * (s.coll == Collective::AllToAll ? 2 : 1) + 2 * kGuardBytes;
}

// The whole sweep on the op at `base` + kOpOffset (a buffer of buffer_bytes(s)): for each size,
// fill (and the guards), warm up, idle the links, barrier, time `iters` ops, then check on fresh
// data (untimed) — this rank's values and the guard bytes around the op, after the timed ops too.
// run(count) runs s.coll on the range (count: the larger buffer's floats, whole blocks for
// reduce_scatter, allgather and all_to_all; in place, each rank's input filled over it) and
// returns where its result lies: the range itself, a reduce_scatter's block wherever the system
// leaves it, an all_to_all's output after its input. Rank 0 prints the table (its own count in
// #wrong); every rank prints its verdict. Returns this rank's wrong values plus damaged guard bytes.
template <typename Run, typename Barrier>
uint64_t run_sweep(const Sweep &s, const char *system, int rank, int size, void *base, Run run, Barrier barrier) {
    if (rank == 0) {
        print_header(system, size, s);
        std::fflush(stdout);
    }
    double sum_busbw = 0;
    int rows = 0;
    uint64_t wrong_total = 0, guard_total = 0;
    const auto r = static_cast<uint64_t>(rank), n = static_cast<uint64_t>(size);
    const bool a2a = s.coll == Collective::AllToAll, blocks = s.coll != Collective::Allreduce &&
                                                               s.coll != Collective::Broadcast && s.coll != Collective::Reduce;
    const ClusterCpu cpu;
    for (uint64_t bytes = s.min_bytes; bytes <= s.max_bytes; bytes *= s.factor) {
        const size_t count = blocks ? bytes / 4 / n * n : bytes / 4;
        if (count == 0) continue;
        const GuardedRange range{kOpOffset, count * (a2a ? 2 : 1), buffer_bytes(s), DType::F32, mix64(r * 0x10001 + bytes)};
        range.prepare(base, r);
        for (int i = 0; i < std::max(1, s.warmup); ++i) run(count);
        idle_links();
        barrier();
        const double cpu0 = rank == 0 ? cpu.seconds() : -1;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < s.iters; ++i) run(count);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / s.iters;
        const double cpu1 = rank == 0 ? cpu.seconds() : -1;
        guard_total += guard_damage(base, range.guard_begin(), kOpOffset, range.salt) +
                       guard_damage(base, kOpOffset + range.bytes(), range.guard_end(), range.salt);
        uint64_t wrong = 0;
        if (s.check) {
            range.prepare(base, r);
            const void *out = run(count);
            wrong = collective_wrong(s.coll, out, count, DType::F32, s.op(), n, r, s.root_of(size));
            guard_total += guard_damage(base, range.guard_begin(), kOpOffset, range.salt) +
                           guard_damage(base, kOpOffset + range.bytes(), range.guard_end(), range.salt);
        }
        wrong_total += wrong;
        if (rank == 0) {
            sum_busbw += print_row(count * 4, size, us, wrong, s.check, s);
            ClusterCpu::print(count * 4, s.iters, cpu0, cpu1);
        }
        ++rows;
    }
    if (rank == 0) std::printf("# Avg bus bandwidth : %.3f\n", rows ? sum_busbw / rows : 0.0);
    print_verdict(r, n, wrong_total, guard_total);
    return wrong_total + guard_total;
}

}  // namespace ringd::bench
