// ringctl's view of the status document: a document that lacks a field or has one of another type
// is an error it reports, never a crash (found by fuzz-status_view: operator[] on a const
// document with a missing key asserted).
#include <catch2/catch.hpp>

#include <cstdio>

#include <nlohmann/json.hpp>

#include "client/ringctl/status_view.h"

using nlohmann::json;

TEST_CASE("ringctl's view refuses a status document that lacks a field", "[ringctl]") {
    std::FILE *saved = std::freopen("/dev/null", "w", stdout);
    REQUIRE(saved != nullptr);
    CHECK_THROWS_AS(ringd::print_status(json::object()), json::exception);
    CHECK_THROWS_AS(ringd::print_status(json::parse(R"({"version":"0.1.0","host":"h","cluster":"c","pid":"not a number"})")),
                    json::exception);
    CHECK_THROWS_AS(ringd::print_status(json::parse(R"({"version":"0.1.0","host":"h","cluster":"c","pid":1,"uptime_s":1e300})")),
                    json::exception);  // a time out of range prints "?"; the next missing field throws
}
