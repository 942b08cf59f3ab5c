// Daemon: the control thread. One epoll loop over the Unix socket listener, client sockets and
// doorbells (ClientGateway, daemon/gateway/), a signalfd (SIGTERM/SIGINT), a timerfd (deadlines,
// watchdog), the progress engine's result eventfd and the control plane's connections to the
// other hosts. An event handler only records what it caused (completions in done_, ops every
// local rank submitted in ready_, frames to this host's own coordinator in its inbox, the control
// plane's events in its queue); settle() then applies them step by step until nothing moves, so
// no step re-enters the one that caused it.
//
// daemon.cpp: set-up, the loop, settle() and the local path (one host); daemon_ring.cpp: the op's
// way across hosts (incarnations, reports, the coordinator's decisions, one-/two-shot data, what
// a ring generation's end fails).
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
#include "daemon/cuda/cuda_probe.h"
#include "daemon/engine/group_table.h"
#include "daemon/engine/progress.h"
#include "daemon/engine/tuner.h"
#include "daemon/gateway/client_gateway.h"
#include "daemon/ipc/client_conn.h"
#include "daemon/ops/host_ops.h"
#include "daemon/transport/transport.h"

namespace ringd {

class Daemon {
public:
    static Result<std::unique_ptr<Daemon>> create(Config config, std::string host);
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
    static std::string run_left(const OpRun &run);
    void record_error(const std::string &message);
    void shutdown();
    // The status document as `viewer` (a uid) may see it: other uids' groups are left out for
    // anyone but root (their names would let a uid join them on a host where they are not yet).
    std::string status_json(uint32_t viewer = 0) const;

    // Rings of several hosts (daemon_ring.cpp).
    Status setup_ring();
    void on_ring_up(uint64_t generation, std::vector<UniqueFd> to_next, std::vector<UniqueFd> from_prev);
    void on_ring_down(const std::string &why);
    void on_peer_message(uint32_t host, Frame &frame);
    void on_op_data(uint32_t host, Frame &frame);
    void report_direct(HostOp op, proto::OpReport r, Algorithm algorithm);
    void try_progress_direct(const OpKey &key);
    void fail_ahead(const proto::OpReport &data, int32_t code, const std::string &why);
    bool queue_host_ops();
    bool flush_reports_now();
    void forget_gone_runs();
    bool deliver_self_frames();
    bool join_groups();
    void send_to_coordinator(const proto::Bytes &frame);
    void on_group_incarnation(const proto::GroupIncarnation &g);
    void on_report(uint32_t host, const proto::OpReport &r);
    void broadcast(const Coordinator::Decisions &d);
    void on_start(const proto::OpStart &s);
    void on_fail(const proto::OpFail &f);
    void expire_host_ops(Clock::time_point now);
    bool multi_host() const { return config_.hosts.size() > 1; }
    Config config_;
    std::string host_;
    Clock::time_point started_ = Clock::now();
    UniqueFd epoll_;
    UniqueFd signal_fd_;
    UniqueFd timer_fd_;
    CudaInfo cuda_;
    std::unique_ptr<NetworkTransport> transport_;
    GroupTable groups_{"", std::chrono::milliseconds(1)};
    uint64_t watchdog_usec_ = 0;
    Clock::time_point next_watchdog_{};
    struct RecentError {
        std::chrono::system_clock::time_point when;
        std::string message;
    };
    std::deque<RecentError> recent_errors_;
    bool running_ = true;

    // Rings of several hosts.
    uint32_t self_index_ = 0;
    PeerSecret secret_;
    std::unique_ptr<std::byte[]> staging_mem_;
    RegisteredRegion staging_;  // after staging_mem_: deregistered before it is freed
    std::unique_ptr<ControlPlane> control_;
    std::optional<Coordinator> coordinator_;  // on the first host in ring order
    // This host's side of each group's incarnation (proto/peer.h): its local incarnation, and
    // what the coordinator agreed it is in this generation.
    struct GroupRun {
        uint64_t local_id = 0;
        uint64_t agreed = 0;    // 0 until GroupIncarnation came in this generation
        uint64_t previous = 0;  // agreed in an earlier generation (sent with GroupJoin)
        bool join_sent = false;
        uint64_t last_seq = 0;  // the highest seq reported
        int32_t refused_code = 0;  // the coordinator refused this local incarnation: its ops fail
        std::string refused;
    };
    std::map<std::string, GroupRun> runs_;
    std::map<OpKey, std::pair<int32_t, std::string>> failed_ahead_;  // OpFails for ops not reported yet
    // One- and two-shot ops' data (daemon/exchange/direct_exchange.h).
    std::unique_ptr<DirectExchange> exchange_;
    uint64_t ops_one_shot_ = 0, ops_two_shot_ = 0, ops_ring_ = 0;
    uint64_t local_generation_ = 0;
    uint64_t coord_generation_ = 0;   // the coordinator's generation we report in
    uint64_t coord_generation_used_ = 0;
    bool coord_known_ = false;
    std::string ring_down_reason_ = "the ring has not formed yet";
    std::string last_abort_;  // for status: empty until a generation has been aborted
    // What events caused, applied by settle(): completions for the clients, ops every local rank
    // submitted, and frames this host (the coordinator) sent itself.
    std::vector<Completion> done_;
    std::vector<OpRun> ready_;
    // In the order sent; a one-/two-shot report travels as the report itself (its algorithm is
    // implied by the OpData the other hosts get).
    struct SelfMessage {
        Frame frame;
        std::optional<proto::OpReport> direct_report;
    };
    std::vector<SelfMessage> self_inbox_;
    // Every op of a multi-host group past local matching, in its state (daemon/ops/host_ops.h).
    HostOps ops_{groups_, done_};
    // Per-link throughput, sampled every second by on_timer.
    Clock::time_point rate_at_{};
    uint64_t rate_bytes_next_ = 0, rate_bytes_prev_ = 0;
    double rate_next_ = 0, rate_prev_ = 0;
    // The trainers' side (after groups_, done_ and ready_, which it uses).
    std::unique_ptr<ClientGateway> gateway_;
    // Last: the progress thread stops (and drops its references to slots and links) before
    // anything above goes away.
    std::unique_ptr<ProgressEngine> engine_;
};

}  // namespace ringd
