// ringctl [--socket PATH] status [--json]: what the host's ringd is doing.
#include <cstdio>
#include <cstring>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/status_client.h"
#include "client/ringctl/status_view.h"

using namespace ringd;
using nlohmann::json;

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
        else print_status(j);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "ringctl: bad status from ringd: %s\n", e.what());
        return 1;
    }
    return 0;
}
