// The journal test's storm: two local ranks of group "storm" in one process submit N ops that
// disagree on the count (16 floats on rank 0, 17 on rank 1); every op must fail with a mismatch.
// Usage: storm-trainer SOCKET N. Exits non-zero if an op does not fail that way.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ringd/ringd.hpp"

int main(int argc, char **argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: storm-trainer SOCKET N\n");
        return 2;
    }
    try {
        ringd::Client a(argv[1], "storm", 0, 2, 1 << 16), b(argv[1], "storm", 1, 2, 1 << 16);
        const int n = std::atoi(argv[2]);
        for (int k = 0; k < n; ++k) {
            const uint64_t ta = a.submit(0, 16, RINGD_F32, RINGD_SUM), tb = b.submit(0, 17, RINGD_F32, RINGD_SUM);
            for (auto [c, t] : {std::pair{&a, ta}, std::pair{&b, tb}}) {
                if (ringd_wait(c->get(), t, 5000) == 0) {
                    std::fprintf(stderr, "op %d: no error\n", k + 1);
                    return 1;
                }
                if (std::string(ringd_last_error(c->get())).find("mismatch") == std::string::npos) {
                    std::fprintf(stderr, "op %d: %s\n", k + 1, ringd_last_error(c->get()));
                    return 1;
                }
            }
        }
        std::printf("storm: %d mismatches\n", n);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "storm-trainer: %s\n", e.what());
        return 1;
    }
    return 0;
}
