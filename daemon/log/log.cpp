#include "daemon/log/log.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/uio.h>
#include <syslog.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>

#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#define SD_JOURNAL_SUPPRESS_LOCATION
#include <systemd/sd-journal.h>

namespace ringd::logging {
namespace {

using LogClock = std::chrono::steady_clock;

int syslog_priority(spdlog::level::level_enum l) {
    switch (l) {
    case spdlog::level::trace:
    case spdlog::level::debug: return LOG_DEBUG;
    case spdlog::level::info: return LOG_INFO;
    case spdlog::level::warn: return LOG_WARNING;
    case spdlog::level::err: return LOG_ERR;
    case spdlog::level::critical: return LOG_CRIT;
    default: return LOG_INFO;
    }
}

bool name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'; }

// The journal: one entry per line, with ringd's fields.
class JournalSink final : public spdlog::sinks::base_sink<std::mutex> {
public:
    JournalSink(std::string host, std::string cluster, std::set<std::string> peers)
        : host_(std::move(host)), cluster_(std::move(cluster)), peers_(std::move(peers)) {}
    void send(spdlog::level::level_enum level, const std::string &text, const std::vector<std::string> &extra) {
        std::lock_guard lock(mutex_);
        send_locked(level, text, extra);
    }

protected:
    void sink_it_(const spdlog::details::log_msg &msg) override {
        send_locked(msg.level, std::string(msg.payload.data(), msg.payload.size()), {});
    }
    void flush_() override {}

private:
    void send_locked(spdlog::level::level_enum level, const std::string &text, const std::vector<std::string> &extra) {
        std::vector<std::string> f = {"MESSAGE=" + text,
                                      "PRIORITY=" + std::to_string(syslog_priority(level)),
                                      "SYSLOG_IDENTIFIER=ringd",
                                      "RINGD_HOST=" + host_,
                                      "RINGD_CLUSTER=" + cluster_,
                                      "RINGD_KIND=" + error_kind(text)};
        for (auto &x : fields_of(text)) f.push_back(std::move(x));
        // Another configured host the message names: the peer it is about.
        for (size_t i = 0; i < text.size();) {
            while (i < text.size() && !name_char(text[i])) ++i;
            size_t j = i;
            while (j < text.size() && name_char(text[j])) ++j;
            if (j > i) {
                std::string w = text.substr(i, j - i);
                while (!w.empty() && w.back() == '.') w.pop_back();
                if (w != host_ && peers_.count(w)) {
                    f.push_back("RINGD_PEER=" + w);
                    break;
                }
            }
            i = j;
        }
        for (const auto &x : extra) f.push_back(x);
        std::vector<iovec> iov;
        for (auto &x : f) iov.push_back({x.data(), x.size()});
        if (sd_journal_sendv(iov.data(), static_cast<int>(iov.size())) < 0)  // no journal after all: not lost
            std::fprintf(stderr, "[%s] %s\n", spdlog::level::to_string_view(level).data(), text.c_str());
    }
    std::string host_, cluster_;
    std::set<std::string> peers_;
};

// Warnings and worse, rate-limited by kind (log.h); everything else passes.
class RepeatLimitSink final : public spdlog::sinks::base_sink<std::mutex> {
public:
    RepeatLimitSink(std::shared_ptr<spdlog::sinks::sink> out, std::shared_ptr<JournalSink> journal)
        : out_(std::move(out)), journal_(std::move(journal)) {}
    void flush_ended(LogClock::time_point now) {
        std::lock_guard lock(mutex_);
        flush_ended_locked(now);
    }

protected:
    void sink_it_(const spdlog::details::log_msg &msg) override {
        const auto now = LogClock::now();
        flush_ended_locked(now);
        if (msg.level < spdlog::level::warn) {
            out_->log(msg);
            return;
        }
        const std::string text(msg.payload.data(), msg.payload.size());
        const std::string kind = error_kind(text);
        auto it = kinds_.find(kind);
        if (it == kinds_.end()) {
            if (kinds_.size() >= kMaxKinds) {  // a flood of distinct kinds: the limit does not grow
                out_->log(msg);
                return;
            }
            it = kinds_.emplace(kind, Kind{now, 0, 0, {}, msg.level}).first;
        }
        Kind &k = it->second;
        if (++k.in_window <= kRepeatBurst) {
            out_->log(msg);
            return;
        }
        ++k.left_out;
        k.last = text;
        k.level = msg.level;
    }
    void flush_() override { out_->flush(); }

private:
    struct Kind {
        LogClock::time_point window_start;
        size_t in_window = 0;
        uint64_t left_out = 0;
        std::string last;
        spdlog::level::level_enum level = spdlog::level::warn;
    };
    static constexpr size_t kMaxKinds = 1024;

    void flush_ended_locked(LogClock::time_point now) {
        for (auto it = kinds_.begin(); it != kinds_.end();) {
            Kind &k = it->second;
            if (now - k.window_start < kRepeatWindow) {
                ++it;
                continue;
            }
            if (k.left_out > 0) {
                const std::string text = "left out " + std::to_string(k.left_out) + " more like this in the last " +
                                         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - k.window_start).count()) +
                                         " s; the last: " + k.last;
                if (journal_) {
                    journal_->send(k.level, text, {"RINGD_REPEATS=" + std::to_string(k.left_out)});
                } else {
                    spdlog::details::log_msg m("ringd", k.level, text);
                    out_->log(m);
                }
            }
            // A kind quiet for a whole window is forgotten; one still repeating starts a new one.
            if (k.in_window == 0 && k.left_out == 0) {
                it = kinds_.erase(it);
                continue;
            }
            k = Kind{now, 0, 0, {}, k.level};
            ++it;
        }
    }

    std::shared_ptr<spdlog::sinks::sink> out_;
    std::shared_ptr<JournalSink> journal_;
    std::map<std::string, Kind> kinds_;
};

std::shared_ptr<RepeatLimitSink> g_limiter;  // set once by setup(), before any other thread

}  // namespace

std::string error_kind(const std::string &message) {
    std::string k;
    k.reserve(message.size());
    for (size_t i = 0; i < message.size(); ++i) {
        if (std::isdigit(static_cast<unsigned char>(message[i]))) {
            while (i + 1 < message.size() && std::isdigit(static_cast<unsigned char>(message[i + 1]))) ++i;
            k += 'N';
        } else {
            k += message[i];
        }
    }
    return k;
}

std::vector<std::string> fields_of(const std::string &message) {
    std::vector<std::string> f;
    auto word_after = [&](const std::string &key, bool digits) -> std::string {
        for (size_t at = message.find(key); at != std::string::npos; at = message.find(key, at + 1)) {
            if (at > 0 && name_char(message[at - 1])) continue;  // part of a longer word ("subgroup ")
            size_t i = at + key.size(), j = i;
            while (j < message.size() && (digits ? std::isdigit(static_cast<unsigned char>(message[j])) != 0 : name_char(message[j])))
                ++j;
            if (j > i) return message.substr(i, j - i);
        }
        return {};
    };
    if (auto g = word_after("group ", false); !g.empty()) f.push_back("RINGD_GROUP=" + g);
    if (auto o = word_after("op ", true); !o.empty()) f.push_back("RINGD_OP=" + o);
    if (auto g = word_after("generation ", true); !g.empty()) f.push_back("RINGD_GENERATION=" + g);
    return f;
}

bool stderr_is_journal() {
    const char *js = std::getenv("JOURNAL_STREAM");
    if (!js) return false;
    struct stat st{};
    if (::fstat(STDERR_FILENO, &st) != 0) return false;
    return std::string(js) == std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

bool journal_reachable() {
    const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof a.sun_path, "%s", kJournalSocket);
    const bool ok = ::connect(fd, reinterpret_cast<const sockaddr *>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
}

void setup(const std::string &host, const std::string &cluster, bool journal, const std::vector<std::string> &hosts) {
    auto logger = spdlog::default_logger();
    std::shared_ptr<spdlog::sinks::sink> out;
    std::shared_ptr<JournalSink> js;
    if (journal) {
        js = std::make_shared<JournalSink>(host, cluster, std::set<std::string>(hosts.begin(), hosts.end()));
        out = js;
    } else {
        out = logger->sinks().empty() ? std::make_shared<spdlog::sinks::stderr_color_sink_mt>() : logger->sinks().front();
    }
    g_limiter = std::make_shared<RepeatLimitSink>(out, js);
    logger->sinks().clear();
    logger->sinks().push_back(g_limiter);
}

void flush_repeats() {
    if (g_limiter) g_limiter->flush_ended(LogClock::now());
}

}  // namespace ringd::logging
