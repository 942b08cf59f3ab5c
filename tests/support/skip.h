// Skipping honestly: a test case that cannot run here calls RINGD_SKIP(reason) and returns; the
// test binary's main (tests/unit/test_main.cpp) exits 77 (meson's SKIP) only when no case failed.
// A failed case is never reported as a skip, and a binary whose cases all ran never exits 77.
#pragma once

#include <catch2/catch.hpp>

namespace ringd::test {

inline bool &skip_noted() {
    static bool skipped = false;
    return skipped;
}

}  // namespace ringd::test

#define RINGD_SKIP(why)                           \
    do {                                          \
        ::ringd::test::skip_noted() = true;       \
        WARN("skipped: " << why);                 \
        return;                                   \
    } while (0)
