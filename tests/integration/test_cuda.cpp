// CUDA: ringd built with CUDA reports the devices its driver sees. Skipped (77) where ringd was
// built without CUDA or no device is present.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "common/status_client.h"
#include "tests/support/harness.h"
#include "tests/support/skip.h"

using namespace ringd;
using namespace ringd::test;

TEST_CASE("ringd reports the CUDA devices it can use", "[cuda]") {
    Daemon d;
    REQUIRE(d.ready());
    auto s = fetch_status(d.socket());
    REQUIRE(s.ok());
    const auto j = nlohmann::json::parse(*s);
    REQUIRE(j.contains("cuda"));
    if (!j["cuda"]["built"].get<bool>()) {
        d.stop();
        RINGD_SKIP("ringd was built without CUDA");
    }
    CHECK(j["cuda"]["runtime_version"].get<int>() > 0);
    if (j["cuda"]["devices"].get<int>() == 0) {
        d.stop();
        RINGD_SKIP("no CUDA device: " << j["cuda"]["error"].get<std::string>());
    }
    CHECK(j["cuda"]["error"].get<std::string>().empty());
    // Every GPU the driver lists is visible to the daemon.
    FILE *p = ::popen("nvidia-smi -L 2>/dev/null | grep -c '^GPU'", "r");
    int listed = -1;
    if (p && std::fscanf(p, "%d", &listed) == 1 && listed > 0) CHECK(j["cuda"]["devices"].get<int>() == listed);
    if (p) ::pclose(p);
}
