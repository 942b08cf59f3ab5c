// Asks the ringd listening on `socket_path` for its status document (JSON text).
#pragma once

#include <string>

#include "proto/result.h"

namespace ringd {

Result<std::string> fetch_status(const std::string &socket_path, int timeout_ms = 5000);
// The same over a socket already connected to ringd (which may have refused it and closed).
Result<std::string> fetch_status_over(int sock, int timeout_ms = 5000);

}  // namespace ringd
