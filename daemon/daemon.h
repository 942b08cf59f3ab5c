// Daemon: the control thread. One epoll loop over the Unix socket listener, client sockets and
// doorbells (ClientGateway, daemon/gateway/), a signalfd (SIGTERM/SIGINT), a timerfd (deadlines,
// watchdog), the progress engine's result eventfd and the control plane's connections to the
// other hosts. An event handler only records what it caused (completions in done_, ops every
// local rank submitted in ready_, frames to this host's own coordinator in its inbox, the control
// plane's events in its queue); settle() then applies them step by step until nothing moves, so
// no step re-enters the one that caused it.
//
// daemon.cpp: set-up, the loop, settle() and the local path (groups on this host alone); the
// op's way across hosts is a ring domain's (daemon/ring/ring_domain.h): one for every configured
// host, and one per host set of the groups over part of the ring, each with its own control
// plane, coordinator, links and progress thread.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>

#include "common/unique_fd.h"
#include "daemon/config.h"
#include "daemon/control/control_plane.h"
#include "daemon/control/peer_auth.h"
#include "daemon/engine/coordinator.h"
#include "daemon/exchange/direct_exchange.h"
#include "daemon/cuda/cuda_service.h"
#include "daemon/engine/group_table.h"
#include "daemon/engine/progress.h"
#include "daemon/engine/tuner.h"
#include "daemon/gateway/client_gateway.h"
#include "daemon/ipc/client_conn.h"
#include "daemon/ops/host_ops.h"
#include "daemon/ring/ring_domain.h"
#include "daemon/topology/topology.h"
#include "daemon/status/metrics_server.h"
#include "daemon/transport/transport.h"

namespace ringd {

class Daemon {
public:
    // config_path: the file `config` came from, read again on SIGHUP (reload); empty: no reload.
    static Result<std::unique_ptr<Daemon>> create(Config config, std::string host, std::string config_path = {});
    ~Daemon();

    // Runs until SIGTERM/SIGINT; returns the process exit code.
    int run();

private:
    Daemon() = default;

    Status setup();
    void on_engine_results();
    void on_timer();
    void settle();
    bool complete_and_start();
    bool hand_over_failures();
    static std::string run_left(const OpRun &run);
    void record_error(const std::string &message);
    // SIGHUP (systemctl reload): the config file read again; what may change while ringd runs is
    // applied, the rest reported by key.
    void reload();
    // A ring of one host: what a ring of more would need (this host's address and port, the
    // secret) checked at start, with a warning for each problem.
    void check_single_host();
    std::string stuck_thread(Clock::time_point now) const;
    void shutdown();
    // The status document as `viewer` (a uid) may see it: other uids' groups are left out for
    // anyone but root (their names would let a uid join them on a host where they are not yet).
    nlohmann::json status_doc(uint32_t viewer = 0) const;
    std::string status_json(uint32_t viewer = 0) const { return status_doc(viewer).dump(); }
    // The Prometheus text /metrics serves (daemon/status/metrics.cpp): a view of status_doc(0).
    std::string metrics_text() const;

    // Ring domains (daemon/ring/ring_domain.h).
    Status setup_ring();
    // The domain of `hosts` (config indices, ring order), made if there is none yet (a group joins).
    Result<RingDomain *> domain_for(const std::vector<uint32_t> &hosts);
    // The domain a group's ops go to (made when it joined); nullptr for a group on this host alone
    // (the local path). Never makes or lets go a domain.
    RingDomain *domain_of(const std::string &group);
    Status foreign_check(const proto::PeerHello &hello);
    void adopt(UniqueFd fd, const proto::PeerHello &hello, const std::string &ip, const SessionKeys &keys);
    Result<std::vector<uint32_t>> domain_hosts(const std::string &key) const;
    Status watch_domain(const RingDomain &d, uint32_t index);
    void unwatch_domain(const RingDomain &d);
    RingDomain *find_domain(const std::vector<uint32_t> &hosts);  // a live one; empty: every host
    size_t idle_domain(Clock::duration idle_for);
    void let_go(size_t at);
    void forget_idle_domains();
    void forget_groups();
    bool multi_host() const { return config_.hosts.size() > 1; }
    Config config_;
    std::string host_;
    // The config file: its path, the text ringd runs (at start, or the last reload), that text's
    // SHA-256 (the config version, in the log and status), the keys changed in the file that
    // wait for a restart, and how the last reload went.
    std::string config_path_, config_text_, config_version_;
    std::string started_text_;  // the file ringd started with: what keys not applied by a reload still run
    std::vector<std::string> config_pending_;
    std::string last_reload_;
    Clock::time_point started_ = Clock::now();
    UniqueFd epoll_;
    UniqueFd signal_fd_;
    UniqueFd timer_fd_;
    std::unique_ptr<NetworkTransport> transport_;
    // The trainers' device memory (null: no CUDA here, no_cuda_ says why). Before the gateway,
    // which uses it, and after the transport, which its slots' registrations need.
    std::unique_ptr<CudaService> cuda_;
    std::string no_cuda_;
    // The machine (topology.sysfs_root) and where ringd's threads and memory go (setup_topology;
    // before the ring domains, whose lanes follow plan_).
    std::optional<topology::Machine> machine_;
    std::string machine_error_;
    topology::Plan plan_;
    void setup_topology();
    nlohmann::json topology_status() const;
    GroupTable groups_{"", std::chrono::milliseconds(1)};
    uint64_t watchdog_usec_ = 0;
    Clock::time_point next_watchdog_{};
    Clock::time_point stuck_since_{};  // a progress thread is stuck (stuck_thread) since
    // Memory (create): allocations below kLargeFrameHeap come from the heap, which keeps up to
    // kHeapKeep free while ops run and is trimmed once no op has ended for kTrimAfter.
    // (32 MiB: the most every glibc takes for M_MMAP_THRESHOLD, HEAP_MAX_SIZE / 2 on 64-bit.)
    static constexpr size_t kLargeFrameHeap = 32 << 20, kHeapKeep = 512 << 20;
    static constexpr auto kTrimAfter = std::chrono::seconds(5);
    uint64_t trim_ops_ = 0;  // ops ended here at the last look
    Clock::time_point quiet_since_{};
    bool trimmed_ = true;
    // The last kRecentErrors kinds of error (logging::error_kind: numbers aside, the same text),
    // in the order they first came, each with its count: one error repeated ten thousand times
    // is one entry, and the one before it that caused it stays in view.
    struct RecentError {
        std::chrono::system_clock::time_point first, last;
        std::string kind, message;  // message: the last of its kind
        uint64_t count = 0;
    };
    std::deque<RecentError> recent_errors_;
    uint64_t errors_recorded_ = 0;  // every record_error(); recent_errors_ keeps the last kinds
    uint64_t let_go_refused_ = 0, let_go_rejected_ = 0;  // handshakes refused, frames rejected by domains let go
    bool running_ = true;

    uint32_t self_index_ = 0;
    PeerSecret secret_;
    // What events caused, applied by settle(): completions for the clients, ops every local rank
    // submitted.
    std::vector<Completion> done_;
    std::vector<OpRun> ready_;
    RingDomain::Shared shared_;
    // The newest ring generation run here, and where it is kept across restarts (daemon_domains.cpp).
    void load_generation();
    void keep_generation(uint64_t g);
    // A reload's host list (daemon_domains.cpp): "" when applied, else why it waits for a restart.
    std::string apply_hosts(const std::vector<HostEntry> &next);
    uint64_t generation_kept_ = 0;
    std::string generation_file_;
    bool generation_write_failed_ = false;
    std::map<std::string, RingDomain *> group_domain_;  // groups seen, to their domain
    // The trainers' side (after groups_, done_ and ready_, which it uses).
    std::unique_ptr<ClientGateway> gateway_;
    // Several hosts: [0] is the whole ring; the others are made as groups over part of it come,
    // at most limits.ring_domains in all (null: one let go, its place free again).
    std::vector<std::unique_ptr<RingDomain>> domains_;
    // metrics.listen's endpoint (null: off). Its thread reads nothing of the daemon: it asks this
    // loop for the text (MetricsServer::answer).
    std::unique_ptr<MetricsServer> metrics_;
    // Last: the progress thread stops (and drops its references to slots and links) before
    // anything above goes away.
    std::unique_ptr<ProgressEngine> engine_;
};

}  // namespace ringd
