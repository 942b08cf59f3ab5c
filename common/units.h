// Parsing of human-written sizes ("256MiB", "4K", "4096") and durations ("30s", "500ms").
// K/KiB, M/MiB, G/GiB and T/TiB are all powers of 1024 (as in nccl-tests' -b/-e arguments).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ringd {

std::optional<uint64_t> parse_size(std::string_view s);
// Requires a unit: ms, s, m or h.
std::optional<std::chrono::milliseconds> parse_duration(std::string_view s);
std::string format_bytes(uint64_t bytes);  // "256 MiB", "4 KiB", "123 B"

}  // namespace ringd
