// libFuzzer: ringctl's view of a status document of any shape (what a daemon, or something
// listening on its socket, may answer). Bad JSON, a missing field or a wrong type end in an
// exception that ringctl reports; nothing else may happen.
#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "client/ringctl/status_view.h"

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    if (!std::freopen("/dev/null", "w", stdout)) return 1;
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const auto j = nlohmann::json::parse(data, data + size, nullptr, false);
    if (j.is_discarded()) return 0;
    try {
        ringd::print_status(j);
    } catch (const std::exception &) {  // what ringctl catches and reports
    }
    return 0;
}
