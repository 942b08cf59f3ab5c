// Asks the ringd listening on `socket_path` for its status document (JSON text).
#pragma once

#include <cstdint>
#include <string>

#include "proto/result.h"

namespace ringd {

// flags: proto::kStatusDrain / kStatusUndrain set the host's state first (ringctl drain).
Result<std::string> fetch_status(const std::string &socket_path, int timeout_ms = 5000, uint32_t flags = 0);
// The same over a socket already connected to ringd (which may have refused it and closed).
Result<std::string> fetch_status_over(int sock, int timeout_ms = 5000, uint32_t flags = 0);

}  // namespace ringd
