// Catch2's runner for every test binary: its exit code is the number of failed cases, or 77
// (skipped) when none failed and a case called RINGD_SKIP.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <csignal>

#include "tests/support/skip.h"

int main(int argc, char **argv) {
    // As ringd (daemon.cpp): a TCP link's sendfile to a peer that is gone must fail with EPIPE,
    // not kill the process (sendfile has no MSG_NOSIGNAL).
    std::signal(SIGPIPE, SIG_IGN);
    const int failed = Catch::Session().run(argc, argv);
    if (failed != 0) return failed == 77 ? 78 : failed;
    return ringd::test::skip_noted() ? 77 : 0;
}
