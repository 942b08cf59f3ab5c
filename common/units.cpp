#include "common/units.h"

#include <cstdio>

namespace ringd {
namespace {

// Leading decimal digits; nullopt when none or on overflow.
std::optional<uint64_t> leading_number(std::string_view &s) {
    uint64_t v = 0;
    size_t i = 0;
    for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, uint64_t(s[i] - '0'), &v))
            return std::nullopt;
    }
    if (i == 0) return std::nullopt;
    s.remove_prefix(i);
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    return v;
}

}  // namespace

std::optional<uint64_t> parse_size(std::string_view s) {
    auto n = leading_number(s);
    if (!n) return std::nullopt;
    struct Unit { std::string_view a, b; unsigned shift; };
    static constexpr Unit units[] = {{"", "B", 0}, {"K", "KiB", 10}, {"M", "MiB", 20}, {"G", "GiB", 30}, {"T", "TiB", 40}};
    for (const auto &u : units) {
        if (s == u.a || s == u.b) {
            if (u.shift && *n > (UINT64_MAX >> u.shift)) return std::nullopt;
            return *n << u.shift;
        }
    }
    return std::nullopt;
}

std::optional<std::chrono::milliseconds> parse_duration(std::string_view s) {
    auto n = leading_number(s);
    if (!n) return std::nullopt;
    uint64_t mult;
    if (s == "ms") mult = 1;
    else if (s == "s") mult = 1000;
    else if (s == "m" || s == "min") mult = 60'000;
    else if (s == "h") mult = 3'600'000;
    else return std::nullopt;
    uint64_t ms;
    if (__builtin_mul_overflow(*n, mult, &ms) || ms > (uint64_t{1} << 40)) return std::nullopt;
    return std::chrono::milliseconds(ms);
}

std::string format_bytes(uint64_t b) {
    static constexpr const char *names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    unsigned i = 0;
    double v = static_cast<double>(b);
    while (v >= 1024 && i < 4) {
        v /= 1024;
        ++i;
    }
    char buf[32];
    if (i == 0 || v == static_cast<double>(static_cast<uint64_t>(v)))
        std::snprintf(buf, sizeof buf, "%.0f %s", v, names[i]);
    else
        std::snprintf(buf, sizeof buf, "%.1f %s", v, names[i]);
    return buf;
}

}  // namespace ringd
