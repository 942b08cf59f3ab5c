// ringctl [--socket PATH] status [--json]: what the host's ringd is doing.
// ringctl [--socket PATH] watch [--interval S] [--count N] [--json]: the same, refreshed.
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
#include "client/ringctl/status_view.h"

using namespace ringd;
using nlohmann::json;

namespace {

// One look: fetched, parsed and printed. Returns false (and says why on stderr) when ringd did
// not answer or answered with something that is not its status document.
bool show(const std::string &socket, bool as_json, bool compact) {
    auto s = fetch_status(socket);
    if (!s) {
        std::fprintf(stderr, "ringctl: %s\n", s.error().message.c_str());
        return false;
    }
    try {
        const json j = json::parse(*s);
        if (as_json) std::printf("%s\n", compact ? j.dump().c_str() : j.dump(2).c_str());
        else print_status(j);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "ringctl: bad status from ringd: %s\n", e.what());
        return false;
    }
    return true;
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
    app.require_subcommand(1);
    CLI11_PARSE(app, argc, argv);

    if (*status) return show(socket, as_json, false) ? 0 : 1;

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
