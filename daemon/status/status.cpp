// The JSON document `ringctl status` shows. Its schema is stable for scripts: fields are only
// ever added. See docs/operations.md, "status --json".
#include <unistd.h>

#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

#include "daemon/daemon.h"

namespace ringd {

nlohmann::json Daemon::status_doc(uint32_t viewer) const {
    using nlohmann::json;
    const auto now = Clock::now();
    json j;
    j["schema"] = 1;
    j["version"] = RINGD_VERSION;
    // What trainers may submit (ringd_submit_coll), so that a client can tell before it relies on one.
    j["collectives"] = {"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "barrier", "all_to_all"};
    // And of device buffers (ringd_submit_coll_cuda), where ringd has a CUDA driver.
    j["device_collectives"] = cuda_ ? json{"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "all_to_all"} : json::array();
    // And an all_to_all of device buffers with split sizes (a ringd without the key: equal blocks only).
    j["device_all_to_all_splits"] = cuda_ != nullptr;
    j["host"] = host_;
    j["drained"] = gateway_ && gateway_->drained();
    j["config"] = {{"path", config_path_},
                   {"version", config_version_},
                   {"pending_restart", config_pending_},
                   {"last_reload", last_reload_}};
    j["cluster"] = config_.cluster;
    // The secret's key id (proto/peer.h: what handshakes name), and during a rotation the
    // previous one's, accepted for previous_left_s more.
    if (secret_.enabled())
        j["secret"] = {{"key_id", key_id_hex(secret_.key_id(0))},
                       {"previous_key_id", secret_.has_previous() ? key_id_hex(secret_.key_id(1)) : ""},
                       {"previous_left_s", std::chrono::duration<double>(secret_.previous_left()).count()}};
    j["pid"] = ::getpid();
    j["uptime_s"] = std::chrono::duration<double>(now - started_).count();
    j["transport"] = std::string(transport_->name());
    j["transport_detail"] = transport_->detail();
    j["poll"] = poll_mode_name(config_.poll);
    j["socket"] = config_.socket;

    const uint32_t n = static_cast<uint32_t>(config_.hosts.size());
    if (!domains_.empty()) {
        j["ring"] = domains_.front()->status();
    } else {
        json members = json::array();
        for (const auto &h : config_.hosts)
            members.push_back({{"name", h.name}, {"address", h.address}, {"port", h.port}, {"self", true},
                               {"link", "self"}, {"last_error", ""}, {"last_heard_s", -1}, {"next", true}, {"prev", true}});
        j["ring"] = {{"generation", 1}, {"state", "up"}, {"last_abort", ""}, {"ops_ring", 0}, {"ops_one_shot", 0},
                     {"ops_two_shot", 0}, {"ops_doubling", 0}, {"ops_halving_doubling", 0}, {"size", n}, {"members", members}, {"auth", "one host"}, {"handshakes_refused", 0}, {"frames_rejected", 0}};
    }
    // The other ring domains: the host sets of groups over part of the ring, each a ring of its
    // own (same fields as "ring", plus "hosts").
    json domains = json::array();
    for (size_t i = 1; i < domains_.size(); ++i)
        if (domains_[i]) domains.push_back(domains_[i]->status());
    j["domains"] = domains;

    auto names_of = [&](const std::vector<uint32_t> &hosts) {
        json v = json::array();
        if (hosts.empty())
            for (const auto &h : config_.hosts) v.push_back(h.name);
        for (uint32_t i : hosts) v.push_back(i < config_.hosts.size() ? config_.hosts[i].name : "?");
        return v;
    };
    std::set<std::string> mine;  // the groups `viewer` may see
    for (const auto &g : groups_.summaries())
        if (viewer == 0 || g.owner_uid == viewer) mine.insert(g.name);
    auto visible = [&](const std::string &group) { return mine.count(group) > 0; };
    json groups = json::array();
    size_t hidden = 0;
    for (const auto &g : groups_.summaries()) {
        if (viewer != 0 && g.owner_uid != viewer) {
            ++hidden;
            continue;
        }
        groups.push_back({{"name", g.name},
                          {"local_size", g.local_size},
                          {"joined_ranks", g.joined_ranks},
                          {"owner_uid", g.owner_uid},
                          // Its ops' deadline (timeouts.op, or what its trainers asked for).
                          {"op_timeout_ms", g.op_timeout_ms},
                          // The group's hosts in ring order (the hosts its trainers declared).
                          {"hosts", names_of(g.hosts)},
                          {"state", g.broken.empty() ? "ok" : "broken"},
                          {"error", g.broken},
                          {"ops_completed", g.ops_completed},
                          {"ops_failed", g.ops_failed},
                          {"bytes_reduced", g.bytes_reduced},
                          {"pending_ops", g.pending_ops},
                          {"running_ops", g.running_ops}});
    }
    j["groups"] = groups;
    j["groups_of_other_uids"] = hidden;  // left out above (only root sees every group)
    // Ops of multi-host groups past local matching, by state (daemon/ops/host_ops.h).
    HostOps::Counts oc;
    for (const auto &d : domains_) {
        if (!d) continue;
        const HostOps::Counts c = d->op_counts();
        oc.queued += c.queued;
        oc.reported += c.reported;
        oc.running += c.running;
        oc.releasing += c.releasing;
    }
    j["op_states"] = {{"queued", oc.queued}, {"reported", oc.reported}, {"running", oc.running}, {"releasing", oc.releasing}};
    // Every op not yet ended, oldest first, with what it waits for: the local ranks of this host
    // that have not submitted it ("matching"), then the states of ops past local matching; on
    // the coordinator's host also the hosts that have not submitted it. At most kShownOps.
    constexpr size_t kShownOps = 64;
    json pending = json::array();
    for (const auto &m : groups_.matching(now)) {
        if (viewer != 0 && !visible(m.group)) continue;
        std::string ranks;
        for (uint32_t r : m.missing_ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
        pending.push_back({{"group", m.group}, {"seq", m.seq}, {"state", "matching"}, {"age_s", m.age_s},
                           {"algorithm", ""}, {"missing_hosts", json::array()}, {"missing_ranks", m.missing_ranks},
                           {"waiting_for", "local rank(s) " + ranks + " of " + std::to_string(m.local_size) + " on host " +
                                               host_ + " (this host) to submit it"}});
    }
    for (const auto &m : groups_.running_on("local", now)) {
        if (viewer != 0 && !visible(m.group)) continue;
        pending.push_back({{"group", m.group}, {"seq", m.seq}, {"state", "local"}, {"age_s", m.age_s}, {"algorithm", "local"},
                           {"missing_hosts", json::array()}, {"missing_ranks", json::array()},
                           {"waiting_for", "the local path's progress thread (ringd-local): its reduction"}});
    }
    for (const auto &d : domains_) {
        if (!d) continue;
        for (auto &e : d->pending_ops(now))
            if (viewer == 0 || visible(e["group"].get<std::string>())) pending.push_back(std::move(e));
    }
    std::stable_sort(pending.begin(), pending.end(),
                     [](const json &a, const json &b) { return a["age_s"].get<double>() > b["age_s"].get<double>(); });
    j["pending_ops_total"] = pending.size();
    // The coordinators' views name groups too: other uids' are left out, and at most kShownOps.
    auto trim_coordinator = [&](json &ring) {
        if (!ring.contains("coordinator")) return;
        for (const char *list : {"pending", "joins_waiting"}) {
            if (!ring["coordinator"].contains(list)) continue;
            json kept = json::array();
            for (auto &x : ring["coordinator"][list])
                if ((viewer == 0 || visible(x["group"].get<std::string>())) && kept.size() < kShownOps) kept.push_back(std::move(x));
            ring["coordinator"][list] = std::move(kept);
        }
    };
    trim_coordinator(j["ring"]);
    for (auto &d : j["domains"]) trim_coordinator(d);
    if (pending.size() > kShownOps) pending.erase(pending.begin() + kShownOps, pending.end());
    j["pending_ops"] = pending;
    const size_t joined = gateway_->joined(), connected = gateway_->connected();
    // The connection asking for this document is one of them; it is not counted.
    j["clients"] = {{"connected", connected == 0 ? 0 : connected - 1}, {"joined", joined}, {"max_slots", config_.memory.max_slots}};
    const auto &t = groups_.totals();
    j["ops"] = {{"completed", t.ops_completed}, {"failed", t.ops_failed}, {"bytes_reduced", t.bytes_reduced}};
    // What the trainers copied to hand their tensors over and back (ringd_note_copies; 0 where
    // they hand over buffers that lie in their slots).
    const auto [copied_in, copied_out] = gateway_->copies();
    j["copies"] = {{"in_bytes", copied_in}, {"out_bytes", copied_out}};
    const auto &ts = transport_->stats();
    j["memory"] = {{"registered_bytes", ts.registered_bytes},
                   {"registrations", ts.registrations},
                   {"live_regions", ts.live_regions},
                   {"slot_bytes_limit", config_.memory.slot_bytes}};
    json errors = json::array();
    const auto wall = std::chrono::system_clock::now();
    for (const auto &e : recent_errors_)
        errors.push_back({{"age_s", std::chrono::duration<double>(wall - e.last).count()},
                          {"message", e.message},
                          {"count", e.count},  // of this kind (numbers aside); message is the last
                          {"first_age_s", std::chrono::duration<double>(wall - e.first).count()}});
    j["recent_errors"] = errors;
    j["errors_recorded"] = errors_recorded_;
    // metrics.listen: where /metrics serves (port: the one bound, also for port 0).
    j["metrics"] = metrics_ ? json{{"listen", config_.metrics.listen}, {"address", metrics_->address()},
                                   {"port", metrics_->port()}, {"scrapes", metrics_->scrapes()},
                                   {"unanswered", metrics_->unanswered()}}
                            : json{{"listen", ""}};
#ifdef RINGD_HAVE_CUDA
    constexpr bool built = true;
#else
    constexpr bool built = false;
#endif
    j["topology"] = topology_status();
    j["cuda"] = cuda_ ? cuda_->status() : json::object();
    j["cuda"]["built"] = built;
    j["cuda"]["available"] = cuda_ != nullptr;
    j["cuda"]["error"] = no_cuda_;
    return j;
}

}  // namespace ringd
