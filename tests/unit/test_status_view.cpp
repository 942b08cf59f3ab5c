// ringctl's view of the status document: a document that lacks a field or has one of another type
// is an error it reports, never a crash (found by fuzz-status_view: operator[] on a const
// document with a missing key asserted; get<integer>() of a float out of range was undefined).
#include <catch2/catch.hpp>

#include <cstdio>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "client/ringctl/status_view.h"

using nlohmann::json;

TEST_CASE("ringctl's view refuses a status document that lacks a field", "[ringctl]") {
    std::FILE *saved = std::freopen("/dev/null", "w", stdout);
    REQUIRE(saved != nullptr);
    CHECK_THROWS_AS(ringd::print_status(json::object()), json::exception);
    CHECK_THROWS_AS(ringd::print_status(json::parse(R"({"version":"0.1.0","host":"h","cluster":"c","uptime_s":1,"pid":"not a number"})")),
                    std::invalid_argument);
    // An integer field holding a float out of the integer's range: nlohmann's get<> would cast it,
    // which is undefined (found by fuzz-status_view under UBSan); it is refused instead.
    CHECK_THROWS_AS(ringd::print_status(json::parse(R"({"version":"0.1.0","host":"h","cluster":"c","uptime_s":1,"pid":1.5e41})")),
                    std::invalid_argument);
    CHECK_THROWS_AS(ringd::print_status(json::parse(R"({"version":"0.1.0","host":"h","cluster":"c","uptime_s":1,"pid":-5e18})")),
                    std::invalid_argument);
    CHECK_THROWS_AS(ringd::print_status(json::parse(R"({"version":"0.1.0","host":"h","cluster":"c","pid":1,"uptime_s":1e300})")),
                    json::exception);  // a time out of range prints "?"; the next missing field throws
}
