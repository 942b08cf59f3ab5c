// Daemon: the control thread. One epoll loop over the Unix socket listener, client sockets and
// doorbells, a signalfd (SIGTERM/SIGINT), a timerfd (deadlines, watchdog) and the progress
// engine's result eventfd. Everything a client or peer sends is validated here; a bad client is
// answered with an error and dropped, never allowed to disturb the others.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include "common/unique_fd.h"
#include "daemon/config.h"
#include "daemon/cuda/cuda_probe.h"
#include "daemon/engine/group_table.h"
#include "daemon/engine/progress.h"
#include "daemon/ipc/client_conn.h"
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
    Status listen_socket();
    void on_accept();
    void on_client_readable(MemberId id);
    void on_doorbell(MemberId id);
    void on_engine_results();
    void on_timer();
    void handle_hello(ClientConn &c, const proto::Hello &h);
    void send_status(ClientConn &c);
    void drop(MemberId id, const Error &why, bool tell_client);
    void deliver(std::vector<Completion> &completions, std::vector<OpRun> &ready);
    void record_error(const std::string &message);
    void shutdown();
    std::string status_json() const;

    Config config_;
    std::string host_;
    Clock::time_point started_ = Clock::now();
    UniqueFd epoll_;
    UniqueFd signal_fd_;
    UniqueFd timer_fd_;
    UniqueFd listener_;
    UniqueFd spare_fd_;  // released to accept-and-close when the fd limit is hit
    CudaInfo cuda_;
    std::unique_ptr<Transport> transport_;
    std::unique_ptr<ProgressEngine> engine_;
    GroupTable groups_{"", std::chrono::milliseconds(1)};
    std::map<MemberId, std::unique_ptr<ClientConn>> clients_;
    MemberId next_id_ = 1;
    size_t live_slots_ = 0;
    uint64_t watchdog_usec_ = 0;
    Clock::time_point next_watchdog_{};
    struct RecentError {
        std::chrono::system_clock::time_point when;
        std::string message;
    };
    std::deque<RecentError> recent_errors_;
    uint64_t clients_dropped_ = 0;
    bool running_ = true;
};

}  // namespace ringd
