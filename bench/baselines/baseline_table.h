// What the baseline programs share with ringd-bench: the size sweep, the exact-result data and
// check, and the nccl-tests columns, so that their tables compare line for line.
#pragma once

#include <cstdio>
#include <string>

#include "bench/bench_data.h"
#include "common/units.h"

namespace ringd::bench {

struct Sweep {
    uint64_t min_bytes = 4096, max_bytes = 64 << 20;
    uint64_t factor = 2;
    int iters = 20, warmup = 5, check = 1;
};

inline void print_header(const char *system, int ranks, const Sweep &s) {
    std::printf("# %s: %d ranks, float avg, %d iters (+%d warm-up)\n#\n# %12s %12s %8s %6s %11s %12s %12s %8s\n", system,
                ranks, s.iters, s.warmup, "size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                "#wrong");
}

inline double print_row(uint64_t bytes, int ranks, double us, uint64_t wrong, bool checked) {
    const double algbw = static_cast<double>(bytes) / (us * 1e3);
    const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
    char w[32];
    std::snprintf(w, sizeof w, "%llu", static_cast<unsigned long long>(wrong));
    std::printf("  %12llu %12llu %8s %6s %11.2f %12.3f %12.3f %8s\n", static_cast<unsigned long long>(bytes),
                static_cast<unsigned long long>(bytes / 4), "float", "avg", us, algbw, busbw, checked ? w : "N/A");
    std::fflush(stdout);
    return busbw;
}

}  // namespace ringd::bench
