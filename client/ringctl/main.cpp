// ringctl [--socket PATH] status [--json]: what the host's ringd is doing.
#include <cstdio>
#include <cstring>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/status_client.h"
#include "common/units.h"

using namespace ringd;
using nlohmann::json;

namespace {

std::string duration(double s) {
    char b[64];
    const auto t = static_cast<long long>(s);
    if (t >= 86400) std::snprintf(b, sizeof b, "%lldd %02lldh%02lldm", t / 86400, t % 86400 / 3600, t % 3600 / 60);
    else if (t >= 3600) std::snprintf(b, sizeof b, "%lldh%02lldm%02llds", t / 3600, t % 3600 / 60, t % 60);
    else if (t >= 60) std::snprintf(b, sizeof b, "%lldm%02llds", t / 60, t % 60);
    else std::snprintf(b, sizeof b, "%.1fs", s);
    return b;
}

void print_human(const json &j) {
    std::printf("ringd %s on %s (cluster %s, pid %d), up %s\n", j["version"].get<std::string>().c_str(),
                j["host"].get<std::string>().c_str(), j["cluster"].get<std::string>().c_str(), j["pid"].get<int>(),
                duration(j["uptime_s"].get<double>()).c_str());
    const std::string detail = j.value("transport_detail", "");
    std::printf("transport %s%s, poll %s, socket %s\n\n", j["transport"].get<std::string>().c_str(),
                detail.empty() ? "" : (" (" + detail + ")").c_str(), j["poll"].get<std::string>().c_str(),
                j["socket"].get<std::string>().c_str());
    // The whole ring, then each ring domain (the host set of groups over part of the ring).
    auto print_ring = [](const std::string &title, const json &ring) {
        std::printf("%s: %s, generation %llu, %zu host(s), peers authenticated: %s\n", title.c_str(),
                    ring.value("state", "up").c_str(), ring["generation"].get<unsigned long long>(), ring["members"].size(),
                    ring.value("auth", "?").c_str());
        if (!ring.value("last_abort", "").empty()) std::printf("  last abort: %s\n", ring["last_abort"].get<std::string>().c_str());
        if (ring["members"].size() > 1)
            std::printf("  ops by algorithm: ring %llu, one-shot %llu, two-shot %llu\n", ring.value("ops_ring", 0ull),
                        ring.value("ops_one_shot", 0ull), ring.value("ops_two_shot", 0ull));
        std::printf("  %-16s %-22s %-12s %-34s %s\n", "HOST", "ADDRESS", "CONTROL", "DATA", "LAST ERROR");
        for (const auto &m : ring["members"]) {
            const std::string addr = m["address"].get<std::string>() + ":" + std::to_string(m["port"].get<int>());
            std::string data;
            auto link = [&](const char *key, const char *arrow) {
                if (!m.contains(key)) return;
                char b[96];
                std::snprintf(b, sizeof b, "%s%s %s %.1f MB/s", data.empty() ? "" : ", ", arrow,
                              format_bytes(m[key]["bytes"].get<uint64_t>()).c_str(), m[key]["rate_Bps"].get<double>() / 1e6);
                data += b;
            };
            link("data_out", "->");
            link("data_in", "<-");
            std::printf("  %-16s %-22s %-12s %-34s %s\n", m["name"].get<std::string>().c_str(), addr.c_str(),
                        m["link"].get<std::string>().c_str(), data.empty() ? "-" : data.c_str(),
                        m.value("last_error", "").c_str());
        }
    };
    print_ring("ring", j["ring"]);
    const json domains = j.value("domains", json::array());
    for (const auto &d : domains) {
        std::string hosts;
        for (const auto &h : d.value("hosts", json::array())) hosts += (hosts.empty() ? "" : ",") + h.get<std::string>();
        std::printf("\n");
        print_ring("ring domain " + hosts, d);
    }
    const auto others = j.value("groups_of_other_uids", 0ull);
    std::printf("\ngroups: %zu%s\n", j["groups"].size(),
                others ? (" (and " + std::to_string(others) + " of other users, shown to root only)").c_str() : "");
    if (!j["groups"].empty())
        std::printf("  %-16s %-6s %-6s %-14s %-7s %10s %8s %12s  %s\n", "GROUP", "OWNER", "LOCAL", "JOINED", "STATE",
                    "COMPLETED", "FAILED", "REDUCED", "HOSTS");
    for (const auto &g : j["groups"]) {
        std::string ranks;
        for (const auto &r : g["joined_ranks"]) ranks += (ranks.empty() ? "" : ",") + std::to_string(r.get<int>());
        std::string hosts;
        for (const auto &h : g.value("hosts", json::array())) hosts += (hosts.empty() ? "" : ",") + h.get<std::string>();
        std::printf("  %-16s %-6s %-6d %-14s %-7s %10llu %8llu %12s  %s\n", g["name"].get<std::string>().c_str(),
                    g.contains("owner_uid") ? std::to_string(g["owner_uid"].get<uint32_t>()).c_str() : "-",
                    g["local_size"].get<int>(), ranks.empty() ? "-" : ranks.c_str(), g["state"].get<std::string>().c_str(),
                    g["ops_completed"].get<unsigned long long>(), g["ops_failed"].get<unsigned long long>(),
                    format_bytes(g["bytes_reduced"].get<uint64_t>()).c_str(), hosts.empty() ? "-" : hosts.c_str());
        if (!g["error"].get<std::string>().empty()) std::printf("    error: %s\n", g["error"].get<std::string>().c_str());
    }
    const auto &ops = j["ops"];
    const auto &mem = j["memory"];
    const auto &cl = j["clients"];
    std::printf("\nclients: %d connected, %d with a slot (max %d)\n", cl["connected"].get<int>(), cl["joined"].get<int>(),
                cl["max_slots"].get<int>());
    std::printf("ops: %llu completed, %llu failed, %s reduced\n", ops["completed"].get<unsigned long long>(),
                ops["failed"].get<unsigned long long>(), format_bytes(ops["bytes_reduced"].get<uint64_t>()).c_str());
    if (j.contains("op_states")) {
        const auto &st = j["op_states"];
        std::printf("  across hosts now: %llu queued, %llu reported, %llu running, %llu releasing\n",
                    st["queued"].get<unsigned long long>(), st["reported"].get<unsigned long long>(),
                    st["running"].get<unsigned long long>(), st["releasing"].get<unsigned long long>());
    }
    std::printf("memory registered: %s in %llu region(s); %llu registration(s) since start\n",
                format_bytes(mem["registered_bytes"].get<uint64_t>()).c_str(),
                mem["live_regions"].get<unsigned long long>(), mem["registrations"].get<unsigned long long>());
    if (j.contains("cuda")) {
        const auto &cu = j["cuda"];
        if (cu.value("available", false)) {
            std::printf("cuda: %s provider, %zu GPU(s); %llu registration(s) of %llu client(s), %s mapped (cap %s); "
                        "%llu open(s), %llu close(s), %llu eviction(s); %llu device op(s) in flight\n",
                        cu["provider"].get<std::string>().c_str(), cu["devices"].size(),
                        cu["registrations"].get<unsigned long long>(), cu["clients"].get<unsigned long long>(),
                        format_bytes(cu["mapped_bytes"].get<uint64_t>()).c_str(),
                        format_bytes(cu["max_mapped_bytes"].get<uint64_t>()).c_str(),
                        cu["opens"].get<unsigned long long>(), cu["closes"].get<unsigned long long>(),
                        cu["evictions"].get<unsigned long long>(), cu["ops_in_flight"].get<unsigned long long>());
            for (const auto &d : cu["devices"])
                std::printf("  GPU %d %s %s\n", d["ordinal"].get<int>(), d["uuid"].get<std::string>().c_str(),
                            d["name"].get<std::string>().c_str());
        } else {
            std::printf("cuda: %s\n", cu.value("error", std::string("none")).c_str());
        }
    }
    const auto &errs = j["recent_errors"];
    std::printf("\nrecent errors: %s\n", errs.empty() ? "none" : "");
    for (const auto &e : errs)
        std::printf("  %8s ago  %s\n", duration(e["age_s"].get<double>()).c_str(), e["message"].get<std::string>().c_str());
}

}  // namespace

int main(int argc, char **argv) {
    CLI::App app{"ringctl: show what the host's ringd is doing"};
    std::string socket = "/run/ringd/ringd.sock";
    bool as_json = false;
    app.add_option("-s,--socket", socket, "ringd's Unix socket")->capture_default_str();
    auto *status = app.add_subcommand("status", "ring, groups, ops, memory and recent errors");
    status->add_flag("--json", as_json, "machine-readable output (stable schema)");
    app.require_subcommand(1);
    CLI11_PARSE(app, argc, argv);

    auto s = fetch_status(socket);
    if (!s) {
        std::fprintf(stderr, "ringctl: %s\n", s.error().message.c_str());
        return 1;
    }
    try {
        const json j = json::parse(*s);
        if (as_json) std::printf("%s\n", j.dump(2).c_str());
        else print_human(j);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "ringctl: bad status from ringd: %s\n", e.what());
        return 1;
    }
    return 0;
}
