// Little-endian field access for wire encoders/decoders. Byte-wise so that it is independent of
// host endianness and alignment.
#pragma once

#include <cstdint>
#include <cstring>

namespace ringd::proto::le {

template <typename T>
inline void put(uint8_t *p, T v) {
    for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
}

template <typename T>
inline T get(const uint8_t *p) {
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
    return static_cast<T>(v);
}

}  // namespace ringd::proto::le
