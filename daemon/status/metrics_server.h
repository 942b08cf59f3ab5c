// MetricsServer: metrics.listen's HTTP endpoint (cpp-httplib). GET /metrics answers with the
// Prometheus text the control thread renders (Daemon::metrics_text): the server's thread asks
// through an eventfd in the control loop and waits for the text, at most kAnswerWithin; a control
// thread that does not answer in time gets a 503 naming it (a scrape that fails is itself a
// signal). Nothing of the daemon's state is read off the control thread.
//
// Two worker threads at most, one request per connection, 2 s to send it and 5 s to take the
// answer, bodies refused: a scraper that misbehaves holds a worker for seconds, never the daemon.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <unistd.h>

#include "common/unique_fd.h"
#include "daemon/config.h"
#include "proto/result.h"

namespace httplib {
class Server;
}

namespace ringd {

class MetricsServer {
public:
    static constexpr auto kAnswerWithin = std::chrono::seconds(2);

    // Binds metrics.listen (as the config checked it; port 0: any free one, see port()) and serves
    // from its own thread. Errors (an address not on this host, a port in use) name it.
    static Result<std::unique_ptr<MetricsServer>> start(const Config::Metrics &config);
    ~MetricsServer();  // stops serving; a scrape waiting for the control thread gets a 503

    int event_fd() const { return wake_.get(); }  // readable: a scrape waits for answer()
    // Control thread, when event_fd() is readable: renders once for every scrape waiting.
    template <class Render>
    void answer(Render &&render) {
        uint64_t n;
        (void)!::read(wake_.get(), &n, sizeof n);
        uint64_t asked;
        {
            std::lock_guard lock(mu_);
            asked = asked_;
        }
        if (asked == answered_seen_) return;
        std::string text = render();
        std::lock_guard lock(mu_);
        text_ = std::move(text);
        answered_ = answered_seen_ = asked;
        cv_.notify_all();
    }
    uint16_t port() const { return port_; }
    const std::string &address() const { return address_; }
    uint64_t scrapes() const;
    uint64_t unanswered() const;

private:
    MetricsServer() = default;
    // The server's thread: asks the control thread, waits for its text.
    bool fetch(std::string &text);

    std::unique_ptr<httplib::Server> server_;
    std::thread thread_;
    std::atomic<bool> thread_done_{false};  // listen_after_bind returned
    UniqueFd wake_;
    std::string address_;
    uint16_t port_ = 0;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    uint64_t asked_ = 0, answered_ = 0;  // under mu_
    uint64_t answered_seen_ = 0;         // control thread only
    std::string text_;                   // under mu_: the last answer
    bool stopping_ = false;              // under mu_
    uint64_t scrapes_ = 0, unanswered_ = 0;  // under mu_
};

}  // namespace ringd
