// The JSON document `ringctl status` shows. Its schema is stable for scripts: fields are only
// ever added. See README "ringctl status --json".
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "daemon/daemon.h"

namespace ringd {

std::string Daemon::status_json() const {
    using nlohmann::json;
    const auto now = Clock::now();
    json j;
    j["schema"] = 1;
    j["version"] = RINGD_VERSION;
    j["host"] = host_;
    j["cluster"] = config_.cluster;
    j["pid"] = ::getpid();
    j["uptime_s"] = std::chrono::duration<double>(now - started_).count();
    j["transport"] = std::string(transport_->name());
    j["poll"] = poll_mode_name(config_.poll);
    j["socket"] = config_.socket;

    json members = json::array();
    for (const auto &h : config_.hosts) {
        const bool self = h.name == host_;
        members.push_back({{"name", h.name},
                           {"address", h.address},
                           {"port", h.port},
                           {"self", self},
                           {"link", self ? "self" : "down"}});
    }
    j["ring"] = {{"generation", 1}, {"size", config_.hosts.size()}, {"members", members}};

    json groups = json::array();
    for (const auto &g : groups_.summaries()) {
        groups.push_back({{"name", g.name},
                          {"local_size", g.local_size},
                          {"joined_ranks", g.joined_ranks},
                          {"state", g.broken.empty() ? "ok" : "broken"},
                          {"error", g.broken},
                          {"ops_completed", g.ops_completed},
                          {"ops_failed", g.ops_failed},
                          {"bytes_reduced", g.bytes_reduced},
                          {"pending_ops", g.pending_ops},
                          {"running_ops", g.running_ops}});
    }
    j["groups"] = groups;
    size_t joined = 0;
    for (const auto &[id, c] : clients_) joined += c->state() == ClientConn::State::Joined;
    // The connection asking for this document is one of clients_; it is not counted.
    j["clients"] = {{"connected", clients_.empty() ? 0 : clients_.size() - 1}, {"joined", joined}, {"max_slots", config_.memory.max_slots}};
    const auto &t = groups_.totals();
    j["ops"] = {{"completed", t.ops_completed}, {"failed", t.ops_failed}, {"bytes_reduced", t.bytes_reduced}};
    const auto &ts = transport_->stats();
    j["memory"] = {{"registered_bytes", ts.registered_bytes},
                   {"registrations", ts.registrations},
                   {"live_regions", ts.live_regions},
                   {"slot_bytes_limit", config_.memory.slot_bytes}};
    json errors = json::array();
    const auto wall = std::chrono::system_clock::now();
    for (const auto &e : recent_errors_)
        errors.push_back({{"age_s", std::chrono::duration<double>(wall - e.when).count()}, {"message", e.message}});
    j["recent_errors"] = errors;
    j["cuda"] = {{"built", cuda_.built}, {"devices", cuda_.devices}, {"runtime_version", cuda_.runtime_version},
                 {"error", cuda_.error}};
    return j.dump();
}

}  // namespace ringd
