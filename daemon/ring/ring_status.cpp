// RingDomain (ring_domain.h): what the domain shows of itself: bytes moved, the status
// document's ring, coordinator and pending ops, the most stalled lane.
#include <systemd/sd-daemon.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "daemon/ring/ring_domain.h"

#include <nlohmann/json.hpp>

#include "daemon/gateway/client_gateway.h"
#include "daemon/engine/reduce.h"
#include "daemon/engine/tuner.h"
#include "daemon/ipc/slot.h"

namespace ringd {

uint64_t RingDomain::bytes_to_next() const {
    uint64_t b = 0;
    for (const auto &l : lanes_) b += l->engine->bytes_to_next();
    return b;
}

uint64_t RingDomain::bytes_by_reference_to_next() const {
    uint64_t b = 0;
    for (const auto &l : lanes_) b += l->engine->bytes_by_reference_to_next();
    return b;
}

uint64_t RingDomain::bytes_from_prev() const {
    uint64_t b = 0;
    for (const auto &l : lanes_) b += l->engine->bytes_from_prev();
    return b;
}

uint64_t RingDomain::bytes_to_next_on_rail(uint32_t r) const {
    uint64_t b = 0;
    for (const auto &l : lanes_) b += l->engine->bytes_to_next_on_rail(r);
    return b;
}

nlohmann::json RingDomain::status() const {
    using nlohmann::json;
    json members = json::array();
    const uint32_t n = static_cast<uint32_t>(config_.hosts.size());
    const uint32_t next = (self_index_ + 1) % n, prev = (self_index_ + n - 1) % n;
    const auto peers = control_->status();
    for (uint32_t i = 0; i < n; ++i) {
        const auto &p = peers[i];
        json m = {{"name", p.name}, {"address", p.address}, {"port", p.port}, {"self", p.self},
                  {"link", p.self ? "self" : p.control}, {"last_error", p.last_error},
                  {"last_heard_s", p.last_heard_s}, {"next", i == next}, {"prev", i == prev},
                  // Its control connection's protocol version (0: not up), its config version (a
                  // ringd of 7 or later says it), and whether its host list differs from this host's.
                  {"protocol", p.self ? proto::kPeerProtocolVersion : p.protocol},
                  {"config_version", p.self && sh_.config_version ? *sh_.config_version : p.config_version},
                  {"hosts_differ", p.hosts_differ},
                  // Control frames (heartbeats, reports, small ops' data) its socket has not taken yet.
                  {"backlog_bytes", p.self ? 0 : control_->queued_bytes(i)}};
        if (i == next)
            m["data_out"] = {{"bytes", bytes_to_next()}, {"by_reference_bytes", bytes_by_reference_to_next()}, {"rate_Bps", rate_next_}};
        if (i == prev) m["data_in"] = {{"bytes", bytes_from_prev()}, {"rate_Bps", rate_prev_}};
        members.push_back(std::move(m));
    }
    json hosts = json::array();
    for (const auto &h : config_.hosts) hosts.push_back(h.name);
    const HostOps::Counts oc = ops_.counts();
    // This host's rails (NICs): the ring data it sent to the next host on each, and the rate.
    json rails = json::array();
    const HostEntry &me = config_.hosts[self_index_];
    // Its state on the links to the next host and from the previous one (down on any lane's link:
    // down), and what the links sent again on other rails.
    uint32_t down_next = 0, down_prev = 0;
    uint64_t resent = 0, resent_bytes = 0, held = 0;
    for (const auto &l : lanes_) {
        if (l->engine->links_generation() != 0) {
            down_next |= rails_down_of(l->engine->next_rails());
            down_prev |= rails_down_of(l->engine->prev_rails());
        }
        resent += l->engine->messages_resent();
        resent_bytes += l->engine->bytes_resent();
        held += l->engine->messages_held();
    }
    for (uint32_t r = 0; r < me.rail_count() && r < kMaxRailsPerLink; ++r)
        rails.push_back({{"rail", r}, {"address", me.rail_address(r)}, {"weight", me.rail_weight(r)},
                         {"bytes_out", bytes_to_next_on_rail(r)}, {"rate_Bps", rate_rail_[r]},
                         {"to_next", (down_next >> r) & 1u ? "down" : "up"}, {"from_prev", (down_prev >> r) & 1u ? "down" : "up"}});
    json placement = json::array();
    for (uint32_t k = 0; k < lanes_.size(); ++k)
        placement.push_back({{"lane", k},
                             {"cpus", topology::format_cpulist(lanes_[k]->engine->cpus())},
                             {"staging", lanes_[k]->staging_mem.why()}});
    // Compressed wires (docs/wire.md): ring ops by format, and the error-feedback residuals the
    // group runs here keep.
    json wire = json::object(), by_format = json::object();
    for (uint32_t f = 0; f < kWireFormatCount; ++f) by_format[std::string(wire_format_name(static_cast<WireFormat>(f)))] = wire_ops_[f];
    uint64_t fb_bytes = 0, fb_tags = 0;
    for (const auto &[name, run] : runs_) {
        fb_bytes += run.feedback_bytes;
        fb_tags += run.feedback.size();
    }
    uint64_t x_ops = 0, x_out = 0, x_in = 0;
    for (const auto &l : lanes_) {
        x_ops += l->engine->exchange_ops();
        x_out += l->engine->exchange_bytes_sent();
        x_in += l->engine->exchange_bytes_received();
    }
    wire = {{"ops_ring", by_format},
            // Compressed f32 allreduces and reduce_scatters of 3 hosts or more: how they run here now (wire.schedule,
            // and whether the lanes have links to every host), and those run so.
            {"schedule", exchange_schedule() ? "exchange" : "ring"},
            {"exchange_ops", x_ops},
            {"exchange_bytes_out", x_out},
            {"exchange_bytes_in", x_in},
            {"feedback_bytes", fb_bytes},
            {"feedback_tags", fb_tags},
            {"feedback_limit_bytes", config_.wire.feedback_max_bytes},
            {"feedback_evicted", feedback_evicted_},
            {"feedback_refused", feedback_refused_}};
    // all_to_all's path, the mesh links (to hosts that are not ring neighbours) and what it moved
    // over the lanes' data links.
    uint64_t a2a_out = 0, a2a_in = 0, a2a_ref = 0, mesh = 0;
    for (const auto &l : lanes_) {
        a2a_out += l->engine->a2a_bytes_sent();
        a2a_ref += l->engine->a2a_bytes_by_reference();
        a2a_in += l->engine->a2a_bytes_received();
        mesh = std::max<uint64_t>(mesh, l->engine->mesh_links());  // (every lane has its own to the same hosts)
    }
    const json all_to_all = {{"path", control_->ring_up() && mesh_links() ? "data links" : "control connections"},
                             {"mesh_links", mesh},
                             {"bytes_out", a2a_out},
                             {"by_reference_bytes", a2a_ref},
                             {"bytes_in", a2a_in}};
    return {{"generation", control_->generation()},
            {"state", control_->ring_up() ? "up" : "forming"},
            // The version the ring's generation runs at, as its coordinator decided it for every
            // host (the oldest any of them can: a rolling upgrade); while it forms, this host's.
            {"protocol", control_->ring_up() ? control_->generation_protocol() : control_->protocol()},
            // Hosts whose host list differs from this host's: a ring cannot form with them.
            {"hosts_differ", control_->hosts_differ()},
            {"last_abort", last_abort_},
            {"ops_ring", ops_ring_},
            {"ops_ring_solo", ops_solo_},
            {"ops_one_shot", ops_one_shot_},
            {"ops_two_shot", ops_two_shot_},
            {"ops_doubling", ops_doubling_},
            {"ops_halving_doubling", ops_halving_doubling_},
            {"deferred_reports", deferred_reports_},
            {"wire", wire},
            // Frames of this ring domain since it was made, heartbeats and ring formation aside:
            // coordination (reports, joins, decisions) and op data (one-/two-shot, doubling,
            // halving-doubling); and the reports this host's coordinator handled (one-/two-shot data
            // counts as its sender's report).
            {"frames",
             {{"control_sent", frames_.control_sent},
              {"control_received", frames_.control_received},
              {"data_sent", frames_.data_sent},
              {"data_received", frames_.data_received}}},
            {"coordinator_reports", coordinator_reports_},
            {"size", n},
            {"lanes", lanes_.size()},
            // Where each lane's progress thread may run (read back) and its staging lies.
            {"placement", placement},
            {"rails", rails},
            {"resent_messages", resent},
            {"resent_bytes", resent_bytes},
            {"held_messages", held},
            {"all_to_all", all_to_all},
            {"hosts", hosts},
            {"members", members},
            {"op_states", {{"queued", oc.queued}, {"reported", oc.reported}, {"running", oc.running}, {"releasing", oc.releasing}}},
            // Whether the daemons of the ring prove themselves to each other (HMAC-SHA256
            // handshake), and which frames carry MACs afterwards (daemon/transport/frame_mac.h).
            {"auth", !sh_.secret->enabled() ? "none (auth.insecure)"
                     : config_.data_mac     ? "hmac-sha256; control and data frames MACed"
                     : config_.transport == "tcp" ? "hmac-sha256; control frames MACed, data not (auth.data: none)"
                                                  : "hmac-sha256; control frames MACed (RDMA data: not)"},
            // Peer connections closed because too many were still in their handshake (the
            // oldest go first; the whole ring's plane accepts for every domain).
            {"handshakes_refused", control_->handshakes_refused()},
            // Control connections closed for a frame that failed its MAC check.
            {"frames_rejected", control_->frames_rejected()},
            {"coordinator", coordinator_status()}};
}

// The coordinator's view (on its host): ops some hosts reported and others not, groups waiting
// for hosts to join their next incarnation. Elsewhere: which host it is.
nlohmann::json RingDomain::coordinator_status() const {
    using nlohmann::json;
    json c = {{"host", config_.hosts.at(kCoordinator).name}, {"here", coordinator_.has_value()}};
    if (!coordinator_) return c;
    auto names = [&](const std::vector<uint32_t> &hosts) {
        json v = json::array();
        for (uint32_t h : hosts) v.push_back(config_.hosts.at(h).name);
        return v;
    };
    json pending = json::array(), joins = json::array();
    for (const auto &p : coordinator_->pending_view(Clock::now()))
        pending.push_back({{"group", p.group}, {"incarnation", p.incarnation}, {"seq", p.seq}, {"reported", names(p.reported)},
                           {"missing", names(p.missing)}, {"fails_in_s", p.fails_in_s}});
    for (const auto &j : coordinator_->joins_view())
        joins.push_back({{"group", j.group}, {"joined", names(j.joined)}, {"missing", names(j.missing)}});
    c["pending"] = pending;
    c["joins_waiting"] = joins;
    return c;
}

nlohmann::json RingDomain::pending_ops(Clock::time_point now) const {
    using nlohmann::json;
    auto names = [&](const std::vector<uint32_t> &hosts) {
        json v = json::array();
        for (uint32_t h : hosts) v.push_back(config_.hosts.at(h).name);
        return v;
    };
    auto join = [](const json &v) {
        std::string s;
        for (const auto &x : v) s += (s.empty() ? "" : ", ") + x.get<std::string>();
        return s;
    };
    const std::string coord = config_.hosts.at(kCoordinator).name;
    std::map<OpKey, const Coordinator::PendingView *> waiting;
    std::vector<Coordinator::PendingView> pv;
    std::map<std::string, Coordinator::JoinView> joins;
    if (coordinator_) {
        pv = coordinator_->pending_view(now);
        for (const auto &p : pv) waiting[{p.group, p.incarnation, p.seq}] = &p;
        for (auto &j : coordinator_->joins_view()) joins[j.group] = std::move(j);
    }
    json out = json::array();
    for (const auto &v : ops_.view(now)) {
        json e = {{"group", v.group}, {"seq", v.seq}, {"state", op_state_name(v.state)}, {"age_s", v.age_s},
                  {"algorithm", algorithm_name(v.algorithm)}, {"missing_hosts", json::array()}, {"missing_ranks", json::array()}};
        std::string why;
        switch (v.state) {
        case OpState::Queued: {
            auto run = runs_.find(v.group);
            if (v.failed_here) {
                why = v.seq == proto::kIncarnationEnds ? "its turn to tell the other hosts that this incarnation ended here"
                                                       : "its turn to be reported as this host's failure";
            } else if (run == runs_.end() || run->second.agreed == 0) {
                why = "the group's incarnation to be agreed: every host of the group joins it";
                if (auto j = joins.find(v.group); j != joins.end()) {
                    e["missing_hosts"] = names(j->second.missing);
                    why += "; not joined yet: " + join(e["missing_hosts"]);
                } else if (!coordinator_) {
                    why += " (the coordinator, " + coord + ", knows which have not)";
                }
            } else {
                why = "an earlier op of the group to be reported first";
            }
            break;
        }
        case OpState::Reported:
            if (auto w = waiting.find({v.group, v.incarnation, v.seq}); w != waiting.end()) {
                e["missing_hosts"] = names(w->second->missing);
                e["fails_in_s"] = w->second->fails_in_s;
                why = "host(s) " + join(e["missing_hosts"]) + " to submit it (reported by " + join(names(w->second->reported)) + ")";
            } else if (coordinator_) {
                why = v.algorithm == Algorithm::Ring ? "its start" : "the other hosts' data";
            } else {
                why = std::string(v.algorithm == Algorithm::Ring ? "the coordinator's start" : "the other hosts' data") +
                      " (the coordinator, " + coord + ", names the hosts that have not submitted it)";
            }
            break;
        case OpState::Running:
            if (auto w = waiting.find({v.group, v.incarnation, v.seq}); w != waiting.end()) {
                // A solo lane's op that stalled: the coordinator knows which hosts have not run it.
                e["missing_hosts"] = names(w->second->missing);
                e["fails_in_s"] = w->second->fails_in_s;
                why = "host(s) " + join(e["missing_hosts"]) + " to submit it (reported by " + join(names(w->second->reported)) + ")";
            } else if (solo_running({v.group, v.incarnation, v.seq}) &&
                       now - lanes_.at(solo_lane({v.group, v.incarnation, v.seq}))->engine->last_progress() >= kSoloStallReport) {
                why = "the other hosts to start it (a solo lane; the coordinator, " + coord +
                      ", names the hosts that have not submitted it)";
            } else {
                why = "the ring: its data is moving";
            }
            break;
        case OpState::Releasing: why = "the progress thread to give it back (its ring generation ended)"; break;
        }
        e["waiting_for"] = why;
        out.push_back(std::move(e));
    }
    return out;
}

std::pair<uint32_t, Clock::duration> RingDomain::most_stalled_lane(Clock::time_point now) const {
    std::pair<uint32_t, Clock::duration> worst{0, Clock::duration::zero()};
    for (uint32_t k = 0; k < lanes_.size(); ++k)
        if (const auto d = lanes_[k]->engine->stalled_for(now); d > worst.second) worst = {k, d};
    return worst;
}

}  // namespace ringd
