// How much of a slow suite's matrix to run. `meson test --setup full` (./dev test --full, the one
// run of each matrix in .ci/run) sets RINGD_TEST_MATRIX=full and every case runs whole; otherwise
// (./dev test, the sanitizer suites, a test binary run by hand) the reduced matrix still takes
// every path the full one takes (every transport, dtype family and algorithm), with fewer host
// counts and repetitions. docs/testing.md lists what only the full matrix runs.
#pragma once

#include <cstdlib>
#include <string_view>

namespace ringd::test {

inline bool full_matrix() {
    const char *m = std::getenv("RINGD_TEST_MATRIX");
    return m != nullptr && std::string_view(m) == "full";
}

}  // namespace ringd::test
