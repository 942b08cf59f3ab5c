// libFuzzer: ringd.yaml text of any shape through the config loader. It returns a config or an
// error naming the key; it never crashes, hangs or throws past its caller.
#include <cstdint>
#include <string>

#include "daemon/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 16384) return 0;  // config files are small; the loader's cost is not what is tested
    const std::string text(reinterpret_cast<const char *>(data), size);
    auto c = ringd::parse_config(text);
    if (c && c->hosts.empty()) __builtin_trap();  // a config without hosts must have been refused
    return 0;
}
