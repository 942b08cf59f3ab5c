// ringd --config FILE --host NAME
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/log/log.h"

int main(int argc, char **argv) {
    CLI::App app{"ringd: per-host gradient allreduce daemon"};
    std::string config_path = "/etc/ringd/ringd.yaml";
    std::string host;
    app.add_option("-c,--config", config_path, "configuration file")->capture_default_str();
    app.add_option("--host", host, "this host's name in the config's hosts list")->required();
    app.set_version_flag("--version", RINGD_VERSION);
    CLI11_PARSE(app, argc, argv);

    auto logger = spdlog::stderr_color_mt("ringd");
    spdlog::set_default_logger(logger);
    // journald adds its own timestamps; keep ours for runs outside systemd.
    spdlog::set_pattern(std::getenv("JOURNAL_STREAM") ? "[%l] %v" : "%Y-%m-%d %H:%M:%S.%e [%l] %v");

    // A config that cannot run (unreadable, invalid, or without this host) exits with EX_CONFIG,
    // which ringd.service does not restart: only an edit of the file helps.
    constexpr int kExitConfig = 78;
    auto config = ringd::load_config(config_path);
    if (!config) {
        spdlog::critical("{}", config.error().message);
        return kExitConfig;
    }
    if (auto self = ringd::find_host(*config, host); !self) {
        spdlog::critical("{}: {} (set hosts: and cluster: in it, or --host)", config_path, self.error().message);
        return kExitConfig;
    }
    spdlog::set_level(spdlog::level::from_str(config->log_level));
    // The journal with fields when systemd connected stderr to it (or log.journal: on), stderr
    // otherwise; repeats rate-limited either way (daemon/log/log.h).
    bool journal = config->log_journal == "on" || (config->log_journal == "auto" && ringd::logging::stderr_is_journal());
    if (journal && !ringd::logging::journal_reachable()) {
        // log.journal: on where no journald listens (a container, a host without systemd): every
        // line would be lost, so stderr it is, and the operator is told once why.
        spdlog::warn("log.journal is on, but no journal listens at {}: logging to stderr instead",
                     ringd::logging::kJournalSocket);
        journal = false;
    }
    std::vector<std::string> names;
    for (const auto &h : config->hosts) names.push_back(h.name);
    ringd::logging::setup(host, config->cluster, journal, names);
    try {
        auto daemon = ringd::Daemon::create(std::move(*config), host, config_path);
        if (!daemon) {
            spdlog::critical("{}", daemon.error().message);
            return 1;
        }
        return (*daemon)->run();
    } catch (const std::exception &e) {
        // Nothing a client or peer sends is allowed to get here; this is resource exhaustion.
        spdlog::critical("fatal: {}", e.what());
        return 1;
    }
}
