// A sabotage library for the benchmark's own tests: LD_PRELOADed into a trainer (ringd-bench), it
// wraps libringd-client's ringd_allreduce, calls the real one and, when the op succeeded, damages
// the slot as a broken ringd would while still reporting success. The trainer must notice.
//
//   RINGD_SABOTAGE=zero    (default) every element of the op's result is set to 0
//   RINGD_SABOTAGE=past    the 8 bytes just past the op's range are overwritten (the result is left right)
//   RINGD_SABOTAGE=before  the 8 bytes just before the op's range are overwritten
//   RINGD_SABOTAGE_MIN_BYTES / RINGD_SABOTAGE_MAX_BYTES  only ops of at least / at most that many
//                          bytes (e.g. only those small enough for the direct exchange)
//
// Ops whose range would leave the slot are not touched (nothing outside the slot is written).
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ringd/ringd.h"

namespace {

using AllreduceFn = int (*)(ringd_client *, size_t, size_t, ringd_dtype, ringd_op, int);

size_t element_size(ringd_dtype t) {
    switch (t) {
    case RINGD_F16:
    case RINGD_BF16: return 2;
    case RINGD_F32:
    case RINGD_I32: return 4;
    case RINGD_F64:
    case RINGD_I64: return 8;
    }
    return 0;
}

enum class Mode { Zero, Past, Before };

Mode mode() {
    const char *m = std::getenv("RINGD_SABOTAGE");
    if (!m || !*m || std::strcmp(m, "zero") == 0) return Mode::Zero;
    if (std::strcmp(m, "past") == 0) return Mode::Past;
    if (std::strcmp(m, "before") == 0) return Mode::Before;
    std::fprintf(stderr, "zero-results preload: unknown RINGD_SABOTAGE=%s (zero, past, before)\n", m);
    std::abort();
}

size_t env_bytes(const char *name, size_t fallback) {
    const char *v = std::getenv(name);
    return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int ringd_allreduce(ringd_client *c, size_t offset, size_t count,
                                                                      ringd_dtype dtype, ringd_op op, int timeout_ms) {
    static const auto real = reinterpret_cast<AllreduceFn>(::dlsym(RTLD_NEXT, "ringd_allreduce"));
    if (!real) {
        std::fprintf(stderr, "zero-results preload: no ringd_allreduce after this library\n");
        std::abort();
    }
    const int rc = real(c, offset, count, dtype, op, timeout_ms);
    if (rc != 0) return rc;
    size_t slot = 0;
    auto *base = static_cast<unsigned char *>(ringd_slot(c, &slot));
    const size_t bytes = count * element_size(dtype);
    if (!base || offset > slot || bytes > slot - offset) return rc;
    static const size_t min_bytes = env_bytes("RINGD_SABOTAGE_MIN_BYTES", 0);
    static const size_t max_bytes = env_bytes("RINGD_SABOTAGE_MAX_BYTES", SIZE_MAX);
    if (bytes < min_bytes || bytes > max_bytes) return rc;
    switch (mode()) {
    case Mode::Zero: std::memset(base + offset, 0, bytes); break;
    case Mode::Past:
        for (size_t p = offset + bytes; p < offset + bytes + 8 && p < slot; ++p) base[p] = static_cast<unsigned char>(base[p] + 1);
        break;
    case Mode::Before:
        for (size_t p = offset >= 8 ? offset - 8 : 0; p < offset; ++p) base[p] = static_cast<unsigned char>(base[p] + 1);
        break;
    }
    return rc;
}
