// The Prometheus text exposition (format 0.0.4) that metrics.listen serves at /metrics: a view of
// the status document (daemon/status/status.cpp), so that `ringctl status` and a dashboard never
// disagree, plus the per-op counters and durations of OpMetrics. README "Metrics" lists the
// families; names and label sets are only ever added.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/daemon.h"

namespace ringd {
namespace {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Exposition {
public:
    // Every family once, with its HELP and TYPE before its samples.
    void family(const std::string &name, const char *type, const char *help) {
        out_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    }
    void sample(const std::string &name, const Labels &labels, double value) {
        out_ += name;
        if (!labels.empty()) {
            out_ += '{';
            for (size_t i = 0; i < labels.size(); ++i) {
                if (i) out_ += ',';
                out_ += labels[i].first + "=\"" + escape(labels[i].second) + '"';
            }
            out_ += '}';
        }
        out_ += ' ' + number(value) + '\n';
    }
    std::string take() { return std::move(out_); }

    static std::string number(double v) {
        if (std::isnan(v)) return "NaN";
        if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
        char buf[64];
        // Integers (counters, bytes) exactly; the rest with enough digits to round-trip.
        if (v == std::floor(v) && std::fabs(v) < 9e15) {
            std::snprintf(buf, sizeof buf, "%.0f", v);
            return buf;
        }
        for (int digits = 15; digits <= 17; ++digits) {  // the shortest that reads back the same
            std::snprintf(buf, sizeof buf, "%.*g", digits, v);
            if (std::strtod(buf, nullptr) == v) break;
        }
        return buf;
    }

private:
    // Label values: backslash, double quote and newline escaped (group names are the trainers').
    static std::string escape(const std::string &s) {
        std::string r;
        for (char c : s) {
            if (c == '\\') r += "\\\\";
            else if (c == '"') r += "\\\"";
            else if (c == '\n') r += "\\n";
            else r += c;
        }
        return r;
    }
    std::string out_;
};

double num(const nlohmann::json &j, const char *key) {
    auto it = j.find(key);
    return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

// A ring domain's label: its hosts in ring order, comma-separated.
std::string hosts_label(const nlohmann::json &ring) {
    std::string s;
    if (auto it = ring.find("hosts"); it != ring.end() && it->is_array())
        for (const auto &h : *it) s += (s.empty() ? "" : ",") + h.get<std::string>();
    if (s.empty() && ring.contains("members"))
        for (const auto &m : ring["members"]) s += (s.empty() ? "" : ",") + m.value("name", std::string());
    return s;
}

}  // namespace

std::string Daemon::metrics_text() const {
    using nlohmann::json;
    const json st = status_doc(0);
    const OpMetrics &om = groups_.op_metrics();
    Exposition e;

    e.family("ringd_build_info", "gauge", "ringd's version and transport (always 1).");
    e.sample("ringd_build_info", {{"version", st.value("version", "")}, {"transport", st.value("transport", "")},
                                  {"host", host_}}, 1);
    e.family("ringd_uptime_seconds", "gauge", "Seconds since this ringd started.");
    e.sample("ringd_uptime_seconds", {}, num(st, "uptime_s"));

    // Ops by group and algorithm (local, ring, one-shot, two-shot; none: failed before one was
    // chosen). Series of groups gone for 10 minutes are dropped (OpMetrics); the *_all_total
    // families keep every op since the start.
    e.family("ringd_ops_completed_total", "counter", "Ops completed on this host, by group and algorithm.");
    for (const auto &[group, g] : om.groups())
        for (const auto &[alg, s] : g.by_algorithm) e.sample("ringd_ops_completed_total", {{"group", group}, {"algorithm", alg}}, double(s.completed));
    e.family("ringd_ops_failed_total", "counter", "Ops that ended in an error on this host, by group and algorithm.");
    for (const auto &[group, g] : om.groups())
        for (const auto &[alg, s] : g.by_algorithm) e.sample("ringd_ops_failed_total", {{"group", group}, {"algorithm", alg}}, double(s.failed));
    e.family("ringd_bytes_reduced_total", "counter",
             "Bytes of one rank's buffer in ops completed on this host, by group and algorithm.");
    for (const auto &[group, g] : om.groups())
        for (const auto &[alg, s] : g.by_algorithm) e.sample("ringd_bytes_reduced_total", {{"group", group}, {"algorithm", alg}}, double(s.bytes));
    e.family("ringd_ops_completed_all_total", "counter", "Ops completed on this host since it started, by algorithm.");
    for (const auto &[alg, s] : om.totals()) e.sample("ringd_ops_completed_all_total", {{"algorithm", alg}}, double(s.completed));
    e.family("ringd_ops_failed_all_total", "counter", "Ops failed on this host since it started, by algorithm.");
    for (const auto &[alg, s] : om.totals()) e.sample("ringd_ops_failed_all_total", {{"algorithm", alg}}, double(s.failed));

    e.family("ringd_op_duration_seconds", "histogram",
             "Seconds from an op's first local submission to its end, by algorithm (ops that took a path).");
    for (const auto &[alg, h] : om.durations()) {
        uint64_t cumulative = 0;
        for (size_t i = 0; i < OpMetrics::kBuckets.size(); ++i) {
            cumulative += h.counts[i];
            e.sample("ringd_op_duration_seconds_bucket", {{"algorithm", alg}, {"le", Exposition::number(OpMetrics::kBuckets[i])}},
                     double(cumulative));
        }
        e.sample("ringd_op_duration_seconds_bucket", {{"algorithm", alg}, {"le", "+Inf"}}, double(h.count));
        e.sample("ringd_op_duration_seconds_sum", {{"algorithm", alg}}, h.sum);
        e.sample("ringd_op_duration_seconds_count", {{"algorithm", alg}}, double(h.count));
    }

    // Ops by lifecycle state: matching (waiting for this host's local ranks), then the states of
    // ops of multi-host groups (daemon/ops/host_ops.h), then running on the local path.
    e.family("ringd_ops_in_state", "gauge", "Ops on this host now, by lifecycle state.");
    double matching = 0;
    for (const auto &g : st["groups"]) matching += num(g, "pending_ops");
    const json &os = st["op_states"];
    e.sample("ringd_ops_in_state", {{"state", "matching"}}, matching);
    for (const char *s : {"queued", "reported", "running", "releasing"}) e.sample("ringd_ops_in_state", {{"state", s}}, num(os, s));
    e.sample("ringd_ops_in_state", {{"state", "local"}}, double(groups_.running_on("local", Clock::now()).size()));

    // Rings: the whole ring and the domains of groups over part of it.
    std::vector<const json *> rings;
    if (st.contains("ring")) rings.push_back(&st["ring"]);
    for (const auto &d : st["domains"]) rings.push_back(&d);
    e.family("ringd_ring_up", "gauge", "1 while the ring of these hosts is up, 0 while it forms.");
    for (const json *r : rings) e.sample("ringd_ring_up", {{"hosts", hosts_label(*r)}}, r->value("state", "") == "up" ? 1 : 0);
    e.family("ringd_ring_generation", "gauge", "The ring's generation: it grows each time the ring re-forms.");
    for (const json *r : rings) e.sample("ringd_ring_generation", {{"hosts", hosts_label(*r)}}, num(*r, "generation"));
    e.family("ringd_link_bytes_total", "counter",
             "Bytes of ring data sent to the next host (out) and received from the previous one (in).");
    for (const json *r : rings)
        for (const auto &m : (*r)["members"]) {
            if (m.contains("data_out"))
                e.sample("ringd_link_bytes_total", {{"hosts", hosts_label(*r)}, {"peer", m.value("name", "")}, {"direction", "out"}},
                         num(m["data_out"], "bytes"));
            if (m.contains("data_in"))
                e.sample("ringd_link_bytes_total", {{"hosts", hosts_label(*r)}, {"peer", m.value("name", "")}, {"direction", "in"}},
                         num(m["data_in"], "bytes"));
        }
    e.family("ringd_link_bytes_by_reference_total", "counter",
             "Of the bytes sent to the next host: those sent by reference from the trainers' slots, not copied (tcp.zero_copy).");
    for (const json *r : rings)
        for (const auto &m : (*r)["members"])
            if (m.contains("data_out") && m["data_out"].contains("by_reference_bytes"))
                e.sample("ringd_link_bytes_by_reference_total", {{"hosts", hosts_label(*r)}, {"peer", m.value("name", "")}},
                         num(m["data_out"], "by_reference_bytes"));
    e.family("ringd_rail_bytes_total", "counter",
             "Bytes of ring data sent to the next host on each of this host's rails (NICs: hosts[].address).");
    for (const json *r : rings)
        if (r->contains("rails"))
            for (const auto &rail : (*r)["rails"])
                e.sample("ringd_rail_bytes_total",
                         {{"hosts", hosts_label(*r)}, {"rail", std::to_string(rail.value("rail", 0))}, {"address", rail.value("address", "")}},
                         num(rail, "bytes_out"));
    e.family("ringd_rail_up", "gauge",
             "Whether each of this host's rails carries ring data to the next host (1) or is down (0; its messages go on the others).");
    for (const json *r : rings)
        if (r->contains("rails") && (*r)["rails"].size() > 1)
            for (const auto &rail : (*r)["rails"])
                e.sample("ringd_rail_up", {{"hosts", hosts_label(*r)}, {"rail", std::to_string(rail.value("rail", 0))}, {"address", rail.value("address", "")}},
                         rail.value("to_next", "up") == "up" ? 1.0 : 0.0);
    e.family("ringd_rail_resent_messages_total", "counter",
             "Ring messages sent again on another rail because theirs failed before the peer had them.");
    for (const json *r : rings)
        if (r->contains("resent_messages") && r->contains("rails") && (*r)["rails"].size() > 1)
            e.sample("ringd_rail_resent_messages_total", {{"hosts", hosts_label(*r)}}, num(*r, "resent_messages"));
    e.family("ringd_all_to_all_bytes_total", "counter",
             "Bytes all_to_all moved over the data links to every host (peer protocol 12), out and in.");
    for (const json *r : rings)
        if (r->contains("all_to_all"))
            for (const char *d : {"out", "in"})
                e.sample("ringd_all_to_all_bytes_total", {{"hosts", hosts_label(*r)}, {"direction", d}},
                         num((*r)["all_to_all"], d[0] == 'o' ? "bytes_out" : "bytes_in"));
    e.family("ringd_mesh_links", "gauge", "Data links each lane has to hosts that are not ring neighbours (all_to_all's).");
    for (const json *r : rings)
        if (r->contains("all_to_all")) e.sample("ringd_mesh_links", {{"hosts", hosts_label(*r)}}, num((*r)["all_to_all"], "mesh_links"));
    e.family("ringd_wire_ops_total", "counter", "Ring ops by wire format (exact, or compressed: bf16, fp16, int8).");
    for (const json *r : rings)
        if (r->contains("wire"))
            for (const auto &[f, n] : (*r)["wire"]["ops_ring"].items())
                e.sample("ringd_wire_ops_total", {{"hosts", hosts_label(*r)}, {"wire", f}}, n.get<double>());
    e.family("ringd_wire_exchange_ops_total", "counter",
             "Compressed f32 allreduces and reduce_scatters run as the exchange of shards (each value encoded twice, resp. once) rather than the ring.");
    for (const json *r : rings)
        if (r->contains("wire")) e.sample("ringd_wire_exchange_ops_total", {{"hosts", hosts_label(*r)}}, num((*r)["wire"], "exchange_ops"));
    e.family("ringd_wire_feedback_bytes", "gauge", "Error-feedback residuals the group runs keep (wire.feedback_max_bytes each).");
    for (const json *r : rings)
        if (r->contains("wire")) e.sample("ringd_wire_feedback_bytes", {{"hosts", hosts_label(*r)}}, num((*r)["wire"], "feedback_bytes"));
    e.family("ringd_wire_feedback_evicted_total", "counter",
             "Error-feedback residuals let go for newer tags (a run past wire.feedback_max_bytes).");
    for (const json *r : rings)
        if (r->contains("wire"))
            e.sample("ringd_wire_feedback_evicted_total", {{"hosts", hosts_label(*r)}}, num((*r)["wire"], "feedback_evicted"));
    e.family("ringd_wire_feedback_refused_total", "counter", "Ops that ran without error feedback: larger than wire.feedback_max_bytes.");
    for (const json *r : rings)
        if (r->contains("wire"))
            e.sample("ringd_wire_feedback_refused_total", {{"hosts", hosts_label(*r)}}, num((*r)["wire"], "feedback_refused"));
    e.family("ringd_peer_backlog_bytes", "gauge", "Control frames queued for a peer that its socket has not taken yet.");
    for (const json *r : rings)
        for (const auto &m : (*r)["members"])
            if (!m.value("self", false))
                e.sample("ringd_peer_backlog_bytes", {{"hosts", hosts_label(*r)}, {"peer", m.value("name", "")}}, num(m, "backlog_bytes"));
    e.family("ringd_peer_up", "gauge", "1 while the control connection to a peer is up.");
    for (const json *r : rings)
        for (const auto &m : (*r)["members"])
            if (!m.value("self", false))
                e.sample("ringd_peer_up", {{"hosts", hosts_label(*r)}, {"peer", m.value("name", "")}}, m.value("link", "") == "up" ? 1 : 0);
    e.family("ringd_auth_enabled", "gauge", "1 when the daemons prove a shared secret to each other and MAC control frames.");
    e.sample("ringd_auth_enabled", {}, secret_.enabled() ? 1 : 0);
    e.family("ringd_drained", "gauge", "1 while the host is drained (ringctl drain): it takes no new groups.");
    e.sample("ringd_drained", {}, gateway_ && gateway_->drained() ? 1 : 0);
    e.family("ringd_auth_data_mac", "gauge", "1 when ring data frames carry MACs too (auth.data: mac).");
    e.sample("ringd_auth_data_mac", {}, secret_.enabled() && config_.data_mac ? 1 : 0);
    // Let-go domains' counts stay in (a counter never goes down).
    double refused = double(let_go_refused_), rejected = double(let_go_rejected_);
    for (const json *r : rings) {
        refused += num(*r, "handshakes_refused");
        rejected += num(*r, "frames_rejected");
    }
    e.family("ringd_handshakes_refused_total", "counter", "Peer connections closed while still in their handshake.");
    e.sample("ringd_handshakes_refused_total", {}, refused);
    e.family("ringd_frames_rejected_total", "counter", "Control connections closed for a frame that failed its MAC check.");
    e.sample("ringd_frames_rejected_total", {}, rejected);

    const json &cl = st["clients"];
    e.family("ringd_clients_connected", "gauge", "Client connections (trainers, ringctl) on the Unix socket.");
    e.sample("ringd_clients_connected", {}, double(gateway_->connected()));  // no scraper among them
    e.family("ringd_clients_joined", "gauge", "Clients that joined a group.");
    e.sample("ringd_clients_joined", {}, num(cl, "joined"));
    e.family("ringd_groups", "gauge", "Groups with ranks on this host.");
    e.sample("ringd_groups", {}, double(st["groups"].size()));
    const json &mem = st["memory"];
    e.family("ringd_memory_registered_bytes", "gauge", "Memory registered with the transport (slots and staging).");
    e.sample("ringd_memory_registered_bytes", {}, num(mem, "registered_bytes"));
    e.family("ringd_memory_regions", "gauge", "Registered memory regions live now.");
    e.sample("ringd_memory_regions", {}, num(mem, "live_regions"));
    const json &cu = st["cuda"];
    e.family("ringd_cuda_available", "gauge", "1 when ringd can map trainers' device memory (CUDA).");
    e.sample("ringd_cuda_available", {}, cu.value("available", false) ? 1 : 0);
    e.family("ringd_cuda_mapped_bytes", "gauge", "Trainers' device memory mapped now (CUDA IPC).");
    e.sample("ringd_cuda_mapped_bytes", {}, num(cu, "mapped_bytes"));
    e.family("ringd_errors_recorded_total", "counter", "Errors ringd logged as warnings or worse (recent_errors keeps the last 16 kinds).");
    e.sample("ringd_errors_recorded_total", {}, double(errors_recorded_));
    return e.take();
}

}  // namespace ringd
