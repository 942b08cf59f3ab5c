// libFuzzer: a submit descriptor as a client may write it into its slot (256 bytes, any value),
// checked against a slot of any data size, as the daemon checks each copied descriptor. Whatever
// it accepts lies inside the slot, aligned, with its byte count exact.
#include <cstdint>
#include <cstring>

#include "proto/slot.h"

using namespace ringd::proto;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    SubmitDesc d{};
    std::memcpy(&d, data, std::min(size, sizeof d));
    uint64_t data_bytes = 1 << 20;
    if (size > sizeof d) std::memcpy(&data_bytes, data + sizeof d, std::min<size_t>(size - sizeof d, 8));
    auto s = validate_submit(d, data_bytes, (size & 1) != 0);
    if (!s) return 0;
    const uint64_t esize = dtype_size(s->dtype);
    if (s->bytes != s->count * esize || s->bytes / esize != s->count || s->offset % esize != 0 ||
        s->offset > data_bytes || data_bytes - s->offset < s->bytes || s->cuda != (d.buffer_kind == 1))
        __builtin_trap();
    return 0;
}
