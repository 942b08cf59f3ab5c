// ringctl [--socket PATH] status [--json]: what the host's ringd is doing.
// ringctl [--socket PATH] watch [--interval S] [--count N] [--json]: the same, refreshed.
// ringctl [--socket PATH] drain [--wait [--timeout S]] | undrain: the host takes no new groups / takes them again.
// ringctl [--socket PATH] reload: ringd reads its config file again (as systemctl reload).
// ringctl [--socket PATH] topology [--json]: the machine as ringd sees it, and where it put its threads and memory.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cstring>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/status_client.h"
#include "proto/frame.h"
#include "client/ringctl/status_view.h"

using namespace ringd;
using nlohmann::json;

namespace {

// One look: fetched, parsed and printed. Returns false (and says why on stderr) when ringd did
// not answer or answered with something that is not its status document.
bool show(const std::string &socket, bool as_json, bool compact, bool topology = false) {
    auto s = fetch_status(socket);
    if (!s) {
        std::fprintf(stderr, "ringctl: %s\n", s.error().message.c_str());
        return false;
    }
    try {
        const json j = json::parse(*s);
        if (topology && as_json) std::printf("%s\n", j.at("topology").dump(2).c_str());
        else if (topology) print_topology(j);
        else if (as_json) std::printf("%s\n", compact ? j.dump().c_str() : j.dump(2).c_str());
        else print_status(j);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "ringctl: bad status from ringd: %s\n", e.what());
        return false;
    }
    return true;
}

// ringctl reload: ringd reads its config file again (as systemctl reload); prints how it went
// (config.last_reload) and fails when ringd refused it.
int reload(const std::string &socket) {
    auto s = fetch_status(socket, 5000, proto::kStatusReload);
    if (!s) {
        std::fprintf(stderr, "ringctl: %s\n", s.error().message.c_str());
        return 1;
    }
    try {
        const json j = json::parse(*s);
        const std::string how = j.value("config", json::object()).value("last_reload", std::string());
        const bool refused = how.find(": refused: ") != std::string::npos;
        std::fprintf(refused ? stderr : stdout, "%sreload on host %s: %s\n", refused ? "ringctl: " : "",
                     j.value("host", std::string("?")).c_str(), how.c_str());
        return refused ? 1 : 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "ringctl: bad status from ringd: %s\n", e.what());
        return 1;
    }
}

// ringctl drain [--wait] / undrain: the host's state set, then (drain --wait) its groups waited
// for: until none has a trainer here, or the deadline.
int set_drain(const std::string &socket, bool drain, bool wait, double timeout_s) {
    auto s = fetch_status(socket, 5000, drain ? proto::kStatusDrain : proto::kStatusUndrain);
    if (!s) {
        std::fprintf(stderr, "ringctl: %s\n", s.error().message.c_str());
        return 1;
    }
    auto groups_here = [](const json &j) {
        std::string names;
        for (const auto &g : j.value("groups", json::array()))
            if (!g.value("joined_ranks", json::array()).empty())
                names += (names.empty() ? "" : ", ") + g.value("name", std::string("?"));
        return names;
    };
    try {
        json j = json::parse(*s);
        std::printf("host %s %s\n", j.value("host", std::string("?")).c_str(),
                    drain ? "drained: it takes no new groups; running ones go on" : "takes new groups again");
        if (!drain || !wait) return 0;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
        for (std::string left = groups_here(j); !left.empty(); left = groups_here(j)) {
            if (std::chrono::steady_clock::now() >= deadline) {
                std::fprintf(stderr, "ringctl: groups still running here after %.0f s: %s\n", timeout_s, left.c_str());
                return 1;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            auto again = fetch_status(socket);
            if (!again) {
                std::fprintf(stderr, "ringctl: %s\n", again.error().message.c_str());
                return 1;
            }
            j = json::parse(*again);
        }
        std::printf("no group runs here any more\n");
        return 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "ringctl: bad status from ringd: %s\n", e.what());
        return 1;
    }
}

}  // namespace

int main(int argc, char **argv) {
    CLI::App app{"ringctl: show what the host's ringd is doing"};
    // As for trainers (libringd-client): $RINGD_SOCKET, else the unit's socket.
    const char *env = std::getenv("RINGD_SOCKET");
    std::string socket = env && *env ? env : "/run/ringd/ringd.sock";
    bool as_json = false;
    double interval = 1.0;
    unsigned count = 0;
    app.add_option("-s,--socket", socket, "ringd's Unix socket (default: $RINGD_SOCKET, else /run/ringd/ringd.sock)")
        ->capture_default_str();
    auto *status = app.add_subcommand("status", "ring, groups, ops (and what each op not yet ended waits for), memory and recent errors");
    status->add_flag("--json", as_json, "machine-readable output (stable schema)");
    auto *watch = app.add_subcommand("watch", "status, refreshed until interrupted (or --count times)");
    watch->add_option("-n,--interval", interval, "seconds between looks")->capture_default_str()->check(CLI::Range(0.1, 3600.0));
    watch->add_option("-c,--count", count, "looks, then exit (0: until interrupted)")->capture_default_str();
    watch->add_flag("--json", as_json, "one status document per line per look");
    bool wait = false;
    double drain_timeout = 3600;
    auto *drain = app.add_subcommand("drain", "take no new groups on this host (running groups go on); root or ringd's user");
    drain->add_flag("--wait", wait, "then wait until no group runs here");
    drain->add_option("--timeout", drain_timeout, "seconds --wait waits at most")->capture_default_str()->check(CLI::Range(1.0, 1e6));
    auto *undrain = app.add_subcommand("undrain", "take new groups again");
    auto *reload_cmd = app.add_subcommand("reload", "read the config file again, as systemctl reload (root or ringd's user)");
    auto *topo = app.add_subcommand("topology", "the machine as ringd sees it (NUMA nodes, NICs, GPUs) and where it put its threads and memory, with the reasons");
    topo->add_flag("--json", as_json, "the status document's topology section");
    app.require_subcommand(1);
    CLI11_PARSE(app, argc, argv);

    if (*drain) return set_drain(socket, true, wait, drain_timeout);
    if (*undrain) return set_drain(socket, false, false, 0);
    if (*reload_cmd) return reload(socket);

    if (*status) return show(socket, as_json, false) ? 0 : 1;
    if (*topo) return show(socket, as_json, false, true) ? 0 : 1;

    // watch: a daemon that does not answer is shown as such and looked at again (a restart
    // shows up); the exit status is that of the last look.
    const bool tty = ::isatty(STDOUT_FILENO) && !as_json;
    bool ok = true;
    for (unsigned k = 0; count == 0 || k < count; ++k) {
        if (k > 0) std::this_thread::sleep_for(std::chrono::duration<double>(interval));
        if (tty) std::printf("\033[H\033[2J");  // top of the screen, cleared
        if (!as_json) {
            char when[32];
            const std::time_t t = std::time(nullptr);
            std::strftime(when, sizeof when, "%H:%M:%S", std::localtime(&t));
            std::printf("ringctl watch: %s every %.1fs (%s)\n\n", socket.c_str(), interval, when);
        }
        ok = show(socket, as_json, true);
        std::fflush(stdout);
    }
    return ok ? 0 : 1;
}
