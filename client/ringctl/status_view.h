// ringctl's human-readable view of the status document (the JSON of `ringctl status --json`).
#pragma once

#include <nlohmann/json.hpp>

namespace ringd {

// Prints the document to stdout. Throws (nlohmann::json's exceptions) when a field it shows is
// missing or of another type.
void print_status(const nlohmann::json &j);
// The machine as ringd sees it (status: topology) and each choice it made, with the reason.
void print_topology(const nlohmann::json &j);

}  // namespace ringd
