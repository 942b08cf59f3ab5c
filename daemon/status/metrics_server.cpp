#include "daemon/status/metrics_server.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <httplib.h>
#include <spdlog/spdlog.h>

#include "common/fd_io.h"

namespace ringd {

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const Config::Metrics &config) {
    std::unique_ptr<MetricsServer> m(new MetricsServer());
    const std::string &listen = config.listen;
    const int port = config.port;
    m->address_ = config.address;
    m->wake_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!m->wake_) return make_error(-errno, "metrics: eventfd: " + errno_string(errno));
    m->server_ = std::make_unique<httplib::Server>();
    auto &svr = *m->server_;
    svr.new_task_queue = [] { return new httplib::ThreadPool(2); };
    // One request per connection (a scrape every few seconds gains nothing from keep-alive, and
    // an idle kept-alive connection would hold a worker), at most 2 s to send it.
    svr.set_read_timeout(2, 0);
    svr.set_write_timeout(5, 0);
    svr.set_keep_alive_max_count(1);
    svr.set_keep_alive_timeout(1);
    svr.set_payload_max_length(4096);
    MetricsServer *self = m.get();
    svr.Get("/metrics", [self](const httplib::Request &, httplib::Response &res) {
        std::string text;
        if (!self->fetch(text)) {
            res.status = 503;
            res.set_content("ringd's control thread did not answer within 2 s (or ringd is stopping)\n", "text/plain");
            return;
        }
        res.set_content(text, "text/plain; version=0.0.4; charset=utf-8");
    });
    svr.Get("/", [](const httplib::Request &, httplib::Response &res) {
        res.set_content("ringd: metrics at /metrics\n", "text/plain");
    });
    if (port == 0) {
        const int p = svr.bind_to_any_port(m->address_);
        if (p <= 0) return make_error(-EADDRNOTAVAIL, "metrics.listen " + listen + ": cannot bind");
        m->port_ = static_cast<uint16_t>(p);
    } else {
        if (!svr.bind_to_port(m->address_, port))
            return make_error(-EADDRINUSE, "metrics.listen " + listen + ": cannot bind (in use, or no such address here)");
        m->port_ = static_cast<uint16_t>(port);
    }
    m->thread_ = std::thread([self] {
        if (!self->server_->listen_after_bind()) spdlog::error("metrics endpoint stopped serving");
        self->thread_done_.store(true);
    });
    // stop() acts only once the server runs: wait for it (or for its thread to give up), so that
    // a ringd stopped at once still joins the thread.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!svr.is_running() && !m->thread_done_.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!svr.is_running()) return make_error(-EIO, "metrics.listen " + listen + ": the HTTP server did not start");
    return m;
}

MetricsServer::~MetricsServer() {
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
        cv_.notify_all();
    }
    // stop() may come before the accept loop looks at its flag: repeat it until the thread ends.
    while (server_ && thread_.joinable() && !thread_done_.load()) {
        server_->stop();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (thread_.joinable()) thread_.join();
}

bool MetricsServer::fetch(std::string &text) {
    std::unique_lock lock(mu_);
    ++scrapes_;
    const uint64_t mine = ++asked_;
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
    const bool answered = cv_.wait_for(lock, kAnswerWithin, [&] { return answered_ >= mine || stopping_; });
    if (!answered || stopping_) {
        ++unanswered_;
        return false;
    }
    text = text_;
    return true;
}

uint64_t MetricsServer::scrapes() const {
    std::lock_guard lock(mu_);
    return scrapes_;
}

uint64_t MetricsServer::unanswered() const {
    std::lock_guard lock(mu_);
    return unanswered_;
}

}  // namespace ringd
