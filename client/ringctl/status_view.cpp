// The human-readable view of ringd's status document (ringctl status). The document comes from a
// daemon: the view checks what it reads (at(), get<>() and integer<>() throw on a missing key or a
// wrong type, and the caller reports that; operator[] on a const document would be undefined for a missing
// key) and never trusts a number's range.
#include "client/ringctl/status_view.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

#include "common/units.h"

namespace ringd {
namespace {

using nlohmann::json;

std::string duration(double s) {
    char b[64];
    if (!std::isfinite(s) || s < 0 || s > 1e12) return "?";  // not a time ringd reports
    const auto t = static_cast<long long>(s);
    if (t >= 86400) std::snprintf(b, sizeof b, "%lldd %02lldh%02lldm", t / 86400, t % 86400 / 3600, t % 3600 / 60);
    else if (t >= 3600) std::snprintf(b, sizeof b, "%lldh%02lldm%02llds", t / 3600, t % 3600 / 60, t % 60);
    else if (t >= 60) std::snprintf(b, sizeof b, "%lldm%02llds", t / 60, t % 60);
    else std::snprintf(b, sizeof b, "%.1fs", s);
    return b;
}

// An integer field: a JSON integer that fits T. nlohmann's get<integer>() converts a float
// with a cast, undefined when it does not fit (found by tests/fuzz/fuzz_status_view.cpp).
template <class T>
T integer(const json &v) {
    if (v.is_number_unsigned()) {
        const auto u = v.get<uint64_t>();
        if (u <= static_cast<uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(u);
    } else if (v.is_number_integer()) {
        const auto i = v.get<int64_t>();
        if (i >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
            (i < 0 || static_cast<uint64_t>(i) <= static_cast<uint64_t>(std::numeric_limits<T>::max())))
            return static_cast<T>(i);
    }
    throw std::invalid_argument("status: " + v.dump() + " is not an integer of the expected range");
}

// A counter the status may leave out (an older ringd): 0 then; else as integer<>() checks it
// (json::value() would convert a negative or fractional number to an unsigned one unchecked).
uint64_t count(const json &o, const char *key) { return o.contains(key) ? integer<uint64_t>(o.at(key)) : 0; }

}  // namespace

void print_status(const nlohmann::json &j) {
    std::printf("ringd %s on %s (cluster %s, pid %d), up %s\n", j.at("version").get<std::string>().c_str(),
                j.at("host").get<std::string>().c_str(), j.at("cluster").get<std::string>().c_str(), integer<int>(j.at("pid")),
                duration(j.at("uptime_s").get<double>()).c_str());
    const std::string detail = j.value("transport_detail", "");
    std::printf("transport %s%s, poll %s, socket %s\n", j.at("transport").get<std::string>().c_str(),
                detail.empty() ? "" : (" (" + detail + ")").c_str(), j.at("poll").get<std::string>().c_str(),
                j.at("socket").get<std::string>().c_str());
    if (j.value("drained", false)) std::printf("DRAINED: this host takes no new groups; running ones go on (ringctl undrain)\n");
    if (j.contains("config") && j["config"].is_object()) {
        const auto &c = j["config"];
        std::printf("config %s, version %s\n", c.value("path", "").c_str(), c.value("version", "").c_str());
        if (c.contains("pending_restart") && c["pending_restart"].is_array() && !c["pending_restart"].empty()) {
            std::string keys;
            for (const auto &k : c["pending_restart"]) keys += (keys.empty() ? "" : ", ") + (k.is_string() ? k.get<std::string>() : "?");
            std::printf("  changed in the file, applied at the next restart: %s\n", keys.c_str());
        }
        if (!c.value("last_reload", "").empty()) std::printf("  last reload %s\n", c.value("last_reload", "").c_str());
    }
    if (j.contains("secret") && j["secret"].is_object()) {
        const auto &s = j["secret"];
        std::printf("secret: key id %s", s.value("key_id", "?").c_str());
        if (!s.value("previous_key_id", "").empty())
            std::printf(" (rotated: the previous one, %s, accepted for %.0f s more)", s.value("previous_key_id", "").c_str(),
                        s.value("previous_left_s", 0.0));
        std::printf("\n");
    }
    std::printf("\n");
    // The whole ring, then each ring domain (the host set of groups over part of the ring).
    auto print_ring = [](const std::string &title, const json &ring) {
        std::printf("%s: %s, generation %llu, %zu host(s), peers authenticated: %s\n", title.c_str(),
                    ring.value("state", "up").c_str(), integer<unsigned long long>(ring.at("generation")), ring.at("members").size(),
                    ring.value("auth", "?").c_str());
        if (!ring.value("last_abort", "").empty()) std::printf("  last abort: %s\n", ring.at("last_abort").get<std::string>().c_str());
        if (ring.contains("protocol") && ring.at("protocol").is_number() && ring.at("members").size() > 1)
            std::printf("  protocol %d (this generation's, the oldest any of its hosts speaks: the coordinator decides)\n", integer<int>(ring.at("protocol")));
        if (ring.contains("hosts_differ") && ring.at("hosts_differ").is_array() && !ring.at("hosts_differ").empty()) {
            std::string names;
            for (const auto &h : ring.at("hosts_differ")) names += (names.empty() ? "" : ", ") + (h.is_string() ? h.get<std::string>() : "?");
            std::printf("  HOST LISTS DIFFER: the hosts: of %s differ from this host's (docs/operations.md)\n", names.c_str());
        }
        if (ring.at("members").size() > 1)
            std::printf("  ops by algorithm: ring %llu, one-shot %llu, two-shot %llu, doubling %llu, halving-doubling %llu\n",
                        static_cast<unsigned long long>(count(ring, "ops_ring")),
                        static_cast<unsigned long long>(count(ring, "ops_one_shot")),
                        static_cast<unsigned long long>(count(ring, "ops_two_shot")),
                        static_cast<unsigned long long>(count(ring, "ops_doubling")),
                        static_cast<unsigned long long>(count(ring, "ops_halving_doubling")));
        if (ring.contains("coordinator")) {
            const json &c = ring.at("coordinator");
            std::printf("  coordinator: %s%s\n", c.at("host").get<std::string>().c_str(), c.value("here", false) ? " (this host)" : "");
            for (const auto &w : c.value("joins_waiting", json::array())) {
                std::string joined, missing;
                for (const auto &h : w.at("joined")) joined += (joined.empty() ? "" : ",") + h.get<std::string>();
                for (const auto &h : w.at("missing")) missing += (missing.empty() ? "" : ",") + h.get<std::string>();
                std::printf("    group %s: its next incarnation waits for host(s) %s to join (joined: %s)\n",
                            w.at("group").get<std::string>().c_str(), missing.c_str(), joined.c_str());
            }
        }
        std::printf("  %-16s %-22s %-12s %-10s %-34s %s\n", "HOST", "ADDRESS", "CONTROL", "BACKLOG", "DATA", "LAST ERROR");
        for (const auto &m : ring.at("members")) {
            const std::string addr = m.at("address").get<std::string>() + ":" + std::to_string(integer<int>(m.at("port")));
            std::string data;
            auto link = [&](const char *key, const char *arrow) {
                if (!m.contains(key)) return;
                char b[96];
                std::snprintf(b, sizeof b, "%s%s %s %.1f MB/s", data.empty() ? "" : ", ", arrow,
                              format_bytes(integer<uint64_t>(m.at(key).at("bytes"))).c_str(), m.at(key).at("rate_Bps").get<double>() / 1e6);
                data += b;
            };
            link("data_out", "->");
            link("data_in", "<-");
            const uint64_t backlog = m.contains("backlog_bytes") ? integer<uint64_t>(m.at("backlog_bytes")) : 0;
            std::printf("  %-16s %-22s %-12s %-10s %-34s %s\n", m.at("name").get<std::string>().c_str(), addr.c_str(),
                        m.at("link").get<std::string>().c_str(), backlog ? format_bytes(backlog).c_str() : "-",
                        data.empty() ? "-" : data.c_str(), m.value("last_error", "").c_str());
        }
        // Several NICs: what each rail of this host carried to the next host.
        const json rails = ring.value("rails", json::array());
        if (rails.size() > 1)
            for (const auto &r : rails)
                std::printf("  rail %u  %-22s weight %-6g %-4s -> %s %.1f MB/s%s\n", integer<unsigned>(r.at("rail")),
                            r.at("address").get<std::string>().c_str(), r.at("weight").get<double>(),
                            r.value("to_next", "up") == "up" && r.value("from_prev", "up") == "up" ? "up" : "DOWN",
                            format_bytes(integer<uint64_t>(r.at("bytes_out"))).c_str(), r.at("rate_Bps").get<double>() / 1e6,
                            r.value("to_next", "up") != r.value("from_prev", "up")
                                ? (" (to next host " + r.value("to_next", "up") + ", from previous " + r.value("from_prev", "up") + ")").c_str()
                                : "");
        if (rails.size() > 1 && count(ring, "resent_messages") > 0)
            std::printf("  messages sent again on another rail: %s (%s)\n", std::to_string(count(ring, "resent_messages")).c_str(),
                        format_bytes(integer<uint64_t>(ring.at("resent_bytes"))).c_str());
        // Where all_to_all runs, and what it moved over the data links.
        if (ring.contains("all_to_all")) {
            const json &a = ring.at("all_to_all");
            std::printf("  all_to_all over the %s (%s mesh link(s)), %s out, %s in over the data links\n",
                        a.value("path", "control connections").c_str(), std::to_string(count(a, "mesh_links")).c_str(),
                        format_bytes(count(a, "bytes_out")).c_str(), format_bytes(count(a, "bytes_in")).c_str());
        }
    };
    print_ring("ring", j.at("ring"));
    const json domains = j.value("domains", json::array());
    for (const auto &d : domains) {
        std::string hosts;
        for (const auto &h : d.value("hosts", json::array())) hosts += (hosts.empty() ? "" : ",") + h.get<std::string>();
        std::printf("\n");
        print_ring("ring domain " + hosts, d);
    }
    const auto others = count(j, "groups_of_other_uids");
    std::printf("\ngroups: %zu%s\n", j.at("groups").size(),
                others ? (" (and " + std::to_string(others) + " of other users, shown to root only)").c_str() : "");
    if (!j.at("groups").empty())
        std::printf("  %-16s %-6s %-6s %-14s %-7s %10s %8s %12s  %s\n", "GROUP", "OWNER", "LOCAL", "JOINED", "STATE",
                    "COMPLETED", "FAILED", "REDUCED", "HOSTS");
    for (const auto &g : j.at("groups")) {
        std::string ranks;
        for (const auto &r : g.at("joined_ranks")) ranks += (ranks.empty() ? "" : ",") + std::to_string(integer<int>(r));
        std::string hosts;
        for (const auto &h : g.value("hosts", json::array())) hosts += (hosts.empty() ? "" : ",") + h.get<std::string>();
        std::printf("  %-16s %-6s %-6d %-14s %-7s %10llu %8llu %12s  %s\n", g.at("name").get<std::string>().c_str(),
                    g.contains("owner_uid") ? std::to_string(integer<uint32_t>(g.at("owner_uid"))).c_str() : "-",
                    integer<int>(g.at("local_size")), ranks.empty() ? "-" : ranks.c_str(), g.at("state").get<std::string>().c_str(),
                    integer<unsigned long long>(g.at("ops_completed")), integer<unsigned long long>(g.at("ops_failed")),
                    format_bytes(integer<uint64_t>(g.at("bytes_reduced"))).c_str(), hosts.empty() ? "-" : hosts.c_str());
        if (!g.at("error").get<std::string>().empty()) std::printf("    error: %s\n", g.at("error").get<std::string>().c_str());
    }
    // What every op not yet ended waits for, oldest first: the explanation of a stall.
    const json pending = j.value("pending_ops", json::array());
    if (!pending.empty()) {
        const auto total = j.contains("pending_ops_total") ? integer<unsigned long long>(j.at("pending_ops_total")) : pending.size();
        std::printf("\nops not yet ended: %llu (oldest first%s)\n", total,
                    total > pending.size() ? (", " + std::to_string(pending.size()) + " shown").c_str() : "");
        std::printf("  %-16s %8s %-10s %8s  %s\n", "GROUP", "OP", "STATE", "AGE", "WAITING FOR");
        for (const auto &e : pending)
            std::printf("  %-16s %8llu %-10s %8s  %s\n", e.at("group").get<std::string>().c_str(),
                        integer<unsigned long long>(e.at("seq")), e.at("state").get<std::string>().c_str(),
                        duration(e.at("age_s").get<double>()).c_str(), e.at("waiting_for").get<std::string>().c_str());
    }
    const auto &ops = j.at("ops");
    const auto &mem = j.at("memory");
    const auto &cl = j.at("clients");
    std::printf("\nclients: %d connected, %d with a slot (max %d)\n", integer<int>(cl.at("connected")), integer<int>(cl.at("joined")),
                integer<int>(cl.at("max_slots")));
    std::printf("ops: %llu completed, %llu failed, %s reduced\n", integer<unsigned long long>(ops.at("completed")),
                integer<unsigned long long>(ops.at("failed")), format_bytes(integer<uint64_t>(ops.at("bytes_reduced"))).c_str());
    if (j.contains("op_states")) {
        const auto &st = j.at("op_states");
        std::printf("  across hosts now: %llu queued, %llu reported, %llu running, %llu releasing\n",
                    integer<unsigned long long>(st.at("queued")), integer<unsigned long long>(st.at("reported")),
                    integer<unsigned long long>(st.at("running")), integer<unsigned long long>(st.at("releasing")));
    }
    std::printf("memory registered: %s in %llu region(s); %llu registration(s) since start\n",
                format_bytes(integer<uint64_t>(mem.at("registered_bytes"))).c_str(),
                integer<unsigned long long>(mem.at("live_regions")), integer<unsigned long long>(mem.at("registrations")));
    if (j.contains("cuda")) {
        const auto &cu = j.at("cuda");
        if (cu.value("available", false)) {
            std::printf("cuda: %s provider, %zu GPU(s); %llu registration(s) of %llu client(s), %s mapped (cap %s); "
                        "%llu open(s), %llu close(s), %llu eviction(s); %llu device op(s) in flight\n",
                        cu.at("provider").get<std::string>().c_str(), cu.at("devices").size(),
                        integer<unsigned long long>(cu.at("registrations")), integer<unsigned long long>(cu.at("clients")),
                        format_bytes(integer<uint64_t>(cu.at("mapped_bytes"))).c_str(),
                        format_bytes(integer<uint64_t>(cu.at("max_mapped_bytes"))).c_str(),
                        integer<unsigned long long>(cu.at("opens")), integer<unsigned long long>(cu.at("closes")),
                        integer<unsigned long long>(cu.at("evictions")), integer<unsigned long long>(cu.at("ops_in_flight")));
            for (const auto &d : cu.at("devices"))
                std::printf("  GPU %d %s %s\n", integer<int>(d.at("ordinal")), d.at("uuid").get<std::string>().c_str(),
                            d.at("name").get<std::string>().c_str());
        } else {
            std::printf("cuda: %s\n", cu.value("error", std::string("none")).c_str());
        }
    }
    const auto &errs = j.at("recent_errors");
    std::printf("\nrecent errors: %s\n", errs.empty() ? "none" : "");
    for (const auto &e : errs) {
        const auto count = e.contains("count") ? integer<unsigned long long>(e.at("count")) : 1ull;
        std::string times;
        if (count > 1)
            times = " (" + std::to_string(count) + " times, first " + duration(e.value("first_age_s", 0.0)) + " ago)";
        std::printf("  %8s ago  %s%s\n", duration(e.at("age_s").get<double>()).c_str(), e.at("message").get<std::string>().c_str(),
                    times.c_str());
    }
}


void print_topology(const nlohmann::json &j) {
    const auto &t = j.at("topology");
    std::printf("host %s, sysfs %s, pinning %s\n", j.at("host").get<std::string>().c_str(),
                t.at("sysfs_root").get<std::string>().c_str(), t.at("pin").get<bool>() ? "on" : "off (topology.pin)");
    if (t.contains("error")) {
        std::printf("machine not known: %s\n", t.at("error").get<std::string>().c_str());
        return;
    }
    std::printf("ringd may run on CPUs %s\n\nNUMA nodes\n", t.at("allowed_cpus").get<std::string>().c_str());
    for (const auto &n : t.at("nodes")) std::printf("  node %d: CPUs %s\n", integer<int>(n.at("node")), n.at("cpus").get<std::string>().c_str());
    auto node = [](const nlohmann::json &x) { return integer<int>(x.at("node")) < 0 ? std::string("?") : std::to_string(integer<int>(x.at("node"))); };
    std::printf("\nNICs (PCI)\n");
    if (t.at("nics").empty()) std::printf("  none\n");
    for (const auto &n : t.at("nics"))
        std::printf("  %-12s %-10s node %-2s %s\n", n.at("name").get<std::string>().c_str(), n.at("kind").get<std::string>().c_str(),
                    node(n).c_str(), n.at("pci_path").get<std::string>().c_str());
    std::printf("\nrails\n");
    for (const auto &r : t.at("rails")) {
        const std::string cpus = r.at("cpus").get<std::string>();
        std::printf("  rail %u (%s, node %s)\n    progress threads on CPUs %s: %s\n    staging memory on %s: %s\n",
                    integer<unsigned>(r.at("rail")), r.at("nic").get<std::string>().c_str(), node(r).c_str(),
                    cpus.empty() ? "any" : cpus.c_str(), r.at("cpus_why").get<std::string>().c_str(),
                    integer<int>(r.at("memory_node")) < 0 ? "any node" : ("node " + std::to_string(integer<int>(r.at("memory_node")))).c_str(),
                    r.at("memory_why").get<std::string>().c_str());
    }
    auto lanes = [](const char *what, const nlohmann::json &d) {
        if (!d.is_object() || !d.contains("placement")) return;
        for (const auto &l : d.at("placement"))
            std::printf("  %s lane %u: runs on CPUs %s; staging: %s\n", what, integer<unsigned>(l.at("lane")),
                        l.at("cpus").get<std::string>().c_str(), l.at("staging").get<std::string>().c_str());
    };
    if (j.contains("ring") && j.at("ring").is_object() && j.at("ring").contains("placement")) {
        std::printf("\nring lanes (read back)\n");
        lanes("ring", j.at("ring"));
        if (j.contains("domains"))
            for (const auto &d : j.at("domains")) lanes(("domain " + d.value("key", std::string("?"))).c_str(), d);
    }
    std::printf("\nGPUs (PCI bus order)\n");
    if (t.at("gpus").empty()) std::printf("  none\n");
    for (const auto &g : t.at("gpus"))
        std::printf("  GPU %u %s node %s -> %s\n", integer<unsigned>(g.at("gpu")), g.at("bus_id").get<std::string>().c_str(),
                    node(g).c_str(), g.at("why").get<std::string>().c_str());
    std::printf("\ntrainers' slots\n");
    if (t.at("slots").empty()) std::printf("  none\n");
    for (const auto &s : t.at("slots"))
        std::printf("  %s rank %u (pid %d): %s: %s\n", s.at("group").get<std::string>().c_str(), integer<unsigned>(s.at("local_rank")),
                    integer<int>(s.at("pid")), integer<int>(s.at("node")) < 0 ? "any node" : ("node " + std::to_string(integer<int>(s.at("node")))).c_str(),
                    s.at("why").get<std::string>().c_str());
}

}  // namespace ringd
