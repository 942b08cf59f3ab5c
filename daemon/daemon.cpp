#include "daemon/daemon.h"

#include <malloc.h>
#include <netdb.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <systemd/sd-daemon.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include <openssl/evp.h>
#include <yaml-cpp/yaml.h>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/ipc/slot.h"
#include "daemon/log/log.h"

namespace ringd {
namespace {

enum Kind : uint32_t { kListener = 1, kSignal, kTimer, kEngine, kClientSock, kClientDoorbell, kControl, kRingEngine, kCuda, kMetrics };

constexpr uint64_t tag(Kind k, MemberId id = 0) { return (uint64_t{k} << 32) | id; }
constexpr auto kTick = std::chrono::milliseconds(100);
constexpr size_t kRecentErrors = 16;
// Ops that move at most this many bytes in total (all local ranks) are reduced on the control
// thread when the progress thread is idle: two thread hops cost more than the reduction.
constexpr uint64_t kInlineOpBytes = 256 << 10;

Status epoll_add(int ep, int fd, uint64_t t, uint32_t events = EPOLLIN) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = t;
    if (::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) return make_error(-errno, "epoll_ctl: " + errno_string(errno));
    return Ok{};
}

void epoll_del(int ep, int fd) {
    if (fd >= 0) ::epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
}

}  // namespace

namespace {

std::string read_text(const std::string &path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// The config version: the first 12 hex digits of the file's SHA-256.
std::string config_hash(const std::string &text) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (EVP_Digest(text.data(), text.size(), md, &n, EVP_sha256(), nullptr) != 1) return "unknown";
    std::string hex;
    char b[3];
    for (unsigned i = 0; i < 6 && i < n; ++i) {
        std::snprintf(b, sizeof b, "%02x", md[i]);
        hex += b;
    }
    return hex;
}

// The top-level keys whose values differ between two config texts (both valid YAML maps).
std::vector<std::string> changed_keys(const std::string &a, const std::string &b) {
    std::map<std::string, std::string> x, y;
    for (auto [text, out] : {std::pair{&a, &x}, std::pair{&b, &y}}) {
        const YAML::Node n = YAML::Load(*text);
        if (!n.IsMap()) continue;
        for (const auto &kv : n) (*out)[kv.first.as<std::string>()] = YAML::Dump(kv.second);
    }
    std::set<std::string> keys;
    for (const auto &[k, v] : x) keys.insert(k);
    for (const auto &[k, v] : y) keys.insert(k);
    std::vector<std::string> out;
    for (const auto &k : keys)
        if (x.count(k) != y.count(k) || (x.count(k) && x.at(k) != y.at(k))) out.push_back(k);
    return out;
}

std::string join(const std::vector<std::string> &v) {
    std::string s;
    for (const auto &x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
}

}  // namespace

Result<std::unique_ptr<Daemon>> Daemon::create(Config config, std::string host, std::string config_path) {
    // Large frames (all_to_all's parts of 4 MiB, one-shot data) come and go with every op.
    // From the heap they are reused; left to glibc (which mmaps a large block until a freed one
    // raises its threshold, and trims the heap's top past twice that) many are fresh mappings that
    // the kernel faults in and zeroes page by page: with 64 MiB all_to_alls on 4 x 2 namespace hosts
    // that was a sixth of the daemons' CPU (0.64 s an op against 0.55 s). The heap keeps up to
    // kHeapKeep of free memory while ops run and gives it back once none has ended for
    // kTrimAfter (on_timer). An operator's own malloc settings (MALLOC_*_ or GLIBC_TUNABLES in the
    // unit's environment) are left as they are; so is the dynamic threshold if the first call is
    // refused (the second alone would pin the threshold at 128 KiB).
    const char *tunables = std::getenv("GLIBC_TUNABLES");
    if (!std::getenv("MALLOC_MMAP_THRESHOLD_") && !std::getenv("MALLOC_TRIM_THRESHOLD_") &&
        !(tunables && std::strstr(tunables, "glibc.malloc."))) {
        if (::mallopt(M_MMAP_THRESHOLD, static_cast<int>(kLargeFrameHeap)) != 1 ||
            ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(kHeapKeep)) != 1)
            spdlog::warn("mallopt refused the heap settings for large frames: they come from fresh mappings");
    }
    std::unique_ptr<Daemon> d(new Daemon());
    d->config_ = std::move(config);
    d->host_ = std::move(host);
    d->config_path_ = std::move(config_path);
    if (!d->config_path_.empty()) {
        d->config_text_ = d->started_text_ = read_text(d->config_path_);
        d->config_version_ = config_hash(d->config_text_);
        spdlog::info("config {} (version {})", d->config_path_, d->config_version_);
    }
    // Local incarnations of groups start at a random number: a restarted ringd never reuses one.
    std::random_device rd;
    d->groups_ = GroupTable(d->host_, d->config_.timeouts.op, (uint64_t{rd()} << 32 | rd()) >> 8);
    if (auto s = d->setup(); !s) return s.error();
    return d;
}

Daemon::~Daemon() {
    if (engine_) engine_->stop();
}

Status Daemon::setup() {
    auto self = find_host(config_, host_);
    if (!self) return self.error();
    self_index_ = static_cast<uint32_t>(*self);
    // Clients hold an fd each for their socket, doorbell and slot: lift the soft limit.
    rlimit nofile{};
    if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        ::setrlimit(RLIMIT_NOFILE, &nofile);
    }
    ::signal(SIGPIPE, SIG_IGN);
    // Block the signals before any thread exists so that only the signalfd sees them.
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);  // reload (systemctl reload: ExecReload), never an exit
    if (::pthread_sigmask(SIG_BLOCK, &mask, nullptr) != 0) return make_error(-EINVAL, "cannot block signals");
    signal_fd_ = UniqueFd(::signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC));
    if (!signal_fd_) return make_error(-errno, "signalfd: " + errno_string(errno));

    epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_) return make_error(-errno, "epoll_create1: " + errno_string(errno));
    timer_fd_ = UniqueFd(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    if (!timer_fd_) return make_error(-errno, "timerfd_create: " + errno_string(errno));
    const auto tick_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(kTick).count();
    itimerspec its{{0, tick_ns}, {0, tick_ns}};
    ::timerfd_settime(timer_fd_.get(), 0, &its, nullptr);

    auto t = make_transport(config_);
    if (!t) return t.error();
    transport_ = std::move(*t);
    // No driver or no GPU is a normal state: trainers asking for CUDA are told why.
    if (auto c = CudaService::start(config_.cuda); c) cuda_ = std::move(*c);
    else no_cuda_ = "no CUDA on host " + host_ + ": " + c.error().message;
    // The local path's progress thread (groups on this host alone); ring domains have their own.
    auto e = ProgressEngine::start();
    if (!e) return e.error();
    engine_ = std::move(*e);
    engine_->set_name("ringd-local");
    setup_topology();
    if (multi_host()) {
        if (auto s = setup_ring(); !s) return s;
    } else {
        check_single_host();
    }

    ClientGateway::Hooks hooks;
    hooks.watch = [this](int fd, MemberId id, bool doorbell) {
        // Doorbells edge-triggered: every ring is an event of its own, so the gateway never reads
        // the eventfd back (one syscall less per op); it takes the whole queue at each event.
        return epoll_add(epoll_.get(), fd, tag(doorbell ? kClientDoorbell : kClientSock, id),
                         doorbell ? EPOLLIN | EPOLLET : EPOLLIN);
    };
    hooks.unwatch = [this](int fd) { epoll_del(epoll_.get(), fd); };
    hooks.status_json = [this](uint32_t viewer) { return status_json(viewer); };
    hooks.reload = [this](const std::string &by) {
        spdlog::info("reload asked by {} (ringctl reload)", by);
        reload();
    };
    hooks.record_error = [this](const std::string &m) { record_error(m); };
    hooks.open_domain = [this](const std::vector<uint32_t> &hosts) -> Status {
        if (hosts.size() <= 1) return Ok{};  // this host alone: the local path
        auto d = domain_for(hosts);
        if (!d) return d.error();
        return Ok{};
    };
    hooks.before_welcome = [this] { hand_over_failures(); };
    hooks.slot_node = [this](pid_t pid, std::string &why) {
        if (!machine_ || !config_.topology.pin) {
            why = machine_ ? "topology.pin is off" : "the machine is not known (" + machine_error_ + ")";
            return -1;
        }
        int current = -1;
        const auto cpus = topology::process_cpus(pid, &current);
        return topology::slot_node(*machine_, cpus, current, why);
    };
    gateway_ = std::make_unique<ClientGateway>(config_, self_index_, *transport_, groups_, cuda_.get(), no_cuda_,
                                               std::move(hooks), done_, ready_);
    shared_.gateway = gateway_.get();
    if (auto s = gateway_->listen(); !s) return s;
    for (auto [fd, k] : {std::pair{gateway_->listener_fd(), kListener}, {signal_fd_.get(), kSignal},
                         {timer_fd_.get(), kTimer}, {engine_->result_fd(), kEngine}})
        if (auto s = epoll_add(epoll_.get(), fd, tag(k)); !s) return s;
    if (cuda_)
        if (auto s = epoll_add(epoll_.get(), cuda_->event_fd(), tag(kCuda)); !s) return s;

    if (!config_.metrics.listen.empty()) {
        auto m = MetricsServer::start(config_.metrics);
        if (!m) return m.error();
        metrics_ = std::move(*m);
        if (auto s = epoll_add(epoll_.get(), metrics_->event_fd(), tag(kMetrics)); !s) return s;
    }
    if (::sd_watchdog_enabled(0, &watchdog_usec_) <= 0) watchdog_usec_ = 0;
    return Ok{};
}


int Daemon::run() {
    spdlog::info("ringd {} host {} listening on {} (transport {}, {} max slots of up to {} bytes)", RINGD_VERSION,
                 host_, config_.socket, transport_->name(), config_.memory.max_slots, config_.memory.slot_bytes);
    if (const std::string d = transport_->detail(); !d.empty()) spdlog::info("transport {}: {}", transport_->name(), d);
    if (metrics_) {
        const std::string &a = metrics_->address();
        spdlog::info("metrics at http://{}:{}/metrics", a.find(':') != std::string::npos ? "[" + a + "]" : a, metrics_->port());
    }
    ::sd_notify(0, "READY=1\nSTATUS=listening");
    if (cuda_) {
        const auto st = cuda_->status();
        spdlog::info("CUDA ({} provider): {} GPU(s)", st["provider"].get<std::string>(), st["devices"].size());
    } else {
        spdlog::info("{}", no_cuda_);
    }
    if (watchdog_usec_) {
        spdlog::info("systemd watchdog on: every {} ms", watchdog_usec_ / 2000);
        ::sd_notify(0, "WATCHDOG=1");
        next_watchdog_ = Clock::now() + std::chrono::microseconds(watchdog_usec_ / 2);
    }
    epoll_event events[64];
    // After work, look again for tuning.control_spin_us, yielding the core between looks, before
    // blocking (docs/design.md, Threads). The timer's tick, signals and peers' heartbeats are not
    // work: an idle daemon does not spin after them.
    const auto spin = std::chrono::microseconds(config_.tuning.control_spin_us);
    auto last_work = Clock::now() - spin;
    while (running_) {
        int n = 0;
        while (Clock::now() - last_work < spin) {
            if ((n = ::epoll_wait(epoll_.get(), events, 64, 0)) != 0) break;
            ::sched_yield();
        }
        if (n == 0) n = ::epoll_wait(epoll_.get(), events, 64, -1);  // the timerfd bounds every wait
        bool work = false;
        if (n < 0) {
            if (errno == EINTR) continue;
            spdlog::critical("epoll_wait: {}", errno_string(errno));
            break;
        }
        for (int i = 0; i < n && running_; ++i) {
            const auto kind = static_cast<Kind>(events[i].data.u64 >> 32);
            const auto id = static_cast<MemberId>(events[i].data.u64 & 0xffffffffu);
            work |= kind != kTimer && kind != kSignal && kind != kControl && kind != kMetrics;
            switch (kind) {
            case kListener: gateway_->on_accept(); break;
            case kSignal: {
                signalfd_siginfo si{};
                (void)!::read(signal_fd_.get(), &si, sizeof si);
                if (si.ssi_signo == SIGHUP) {
                    reload();
                    break;
                }
                spdlog::info("signal {} received", si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
                running_ = false;
                break;
            }
            case kTimer: on_timer(); break;
            case kEngine: on_engine_results(); break;
            case kRingEngine:  // id: domain << 8 | lane
                if (domains_.at(id >> 8)) domains_[id >> 8]->on_engine_results(id & 0xff);
                break;
            case kClientSock: gateway_->on_readable(id); break;
            case kClientDoorbell: gateway_->on_doorbell(id); break;
            case kCuda: gateway_->on_cuda_events(); break;
            case kMetrics: metrics_->answer([this] { return metrics_text(); }); break;
            case kControl:
                if (domains_.at(id)) work |= domains_[id]->on_control_ready();
                break;
            }
        }
        settle();
        if (work) last_work = Clock::now();  // the window opens when the work is done (the next op follows from it)
    }
    shutdown();
    return 0;
}






// Submissions that waited for credits, taken once completions freed them (a step of settle,
// never from inside the completion).


// Applies what the last events caused, one step after another until nothing moves: completions
// to the clients, ops that became ready, reports, frames to this host's own coordinator, the
// control plane's events (ring up and down, the peers' frames) in the order they happened. No step
// calls back into the one that caused it: each leaves its results in done_, ready_, the inbox or
// the control plane's queue for a later step.
void Daemon::settle() {
    constexpr int kRounds = 64;  // anything left goes on at the next tick
    for (int round = 0; round < kRounds; ++round) {
        // This host's new work, then each domain's step (the peers' frames, then its reports).
        bool moved = gateway_->take_held_submissions();
        moved |= complete_and_start();
        // Index, not iterator: a domain's step may make another (a peer dialed in for it).
        for (size_t i = 0; i < domains_.size(); ++i)
            if (domains_[i]) moved |= domains_[i]->settle_step();
        if (!moved) return;
    }
}

// This host's local failures go to the other hosts of their groups (groups on this host alone:
// nobody else needs to hear of them). Returns whether there were any.
bool Daemon::hand_over_failures() {
    bool any = false;
    for (const LocalFailure &f : groups_.take_failures()) {
        any = true;
        // The incarnation's own hosts: a group of the same name may have joined since over others.
        if (RingDomain *d = find_domain(f.hosts)) d->take_failure(f);
    }
    return any;
}

// Completions to the clients; ops every local rank submitted go on to the other hosts (several
// hosts) or to the engine (one host). Returns whether anything moved.
bool Daemon::complete_and_start() {
    const std::vector<Completion> completions = std::exchange(done_, {});
    std::set<std::string> failures;
    for (const auto &cm : completions)
        if (cm.status != 0) failures.insert(cm.message);
    for (const auto &m : failures) {
        spdlog::warn("{}", m);
        record_error(m);
    }
    bool moved = gateway_->complete(completions);
    // (Before the ready ops below: a failure of op N + 1 released now is queued ahead of op N,
    // ready in the same step, and reported after it all the same: HostOps queues in seq order.)
    moved |= hand_over_failures();
    if (ready_.empty()) return moved;
    for (auto &run : std::exchange(ready_, {})) {
        if (RingDomain *d = domain_of(run.group)) {
            d->take_ready(std::move(run));
            continue;
        }
        if (const auto *h = groups_.hosts_of(run.group); multi_host() && !(h && h->size() == 1)) {
            // Cannot happen: the domain is made when the group joins and kept while it is here.
            groups_.finished(run.op_id, -EIO, "group " + run.group + ": no ring domain for its hosts", done_);
            continue;
        }
        groups_.set_algorithm(run.op_id, "local");
        EngineWork w;
        w.op_id = run.op_id;
        w.desc = run.desc;
        w.avg_divisor = static_cast<uint32_t>(run.members.size());
        w.offsets = std::move(run.offsets);
        w.out_offsets = std::move(run.out_offsets);
        w.splits = std::move(run.splits);
        if (run.desc.collective != Collective::Allreduce) w.host_ranks.push_back(std::move(run.ranks));
        if (w.desc.collective != Collective::Allreduce && w.host_ranks[0].size() != w.desc.ranks) {
            groups_.finished(run.op_id, -EINVAL,
                             "group " + run.group + " op " + std::to_string(run.seq) + ": a " +
                                 std::string(collective_name(w.desc.collective)) + " over " + std::to_string(w.desc.ranks) +
                                 " ranks in a group of this host only, which has " + std::to_string(w.host_ranks[0].size()),
                             done_);
            continue;
        }
        if (!gateway_->slots_of(run, w.slots)) {
            groups_.finished(run.op_id, -ECONNRESET, run_left(run), done_);
            continue;
        }
        uint64_t total = std::max(w.desc.in_count(), w.desc.out_count()) * dtype_size(w.desc.dtype) * w.slots.size();
        for (const auto &t : w.splits)  // (an all_to_all by split sizes: what its ranks send)
            if (t)
                for (size_t r = 0; r < t->size() / 2; ++r) total += (*t)[r] * dtype_size(w.desc.dtype);
        if (total <= kInlineOpBytes && engine_->in_flight() == 0) {
            // Nothing queued on the progress thread, so this cannot overtake an earlier op.
            EngineResult r = ProgressEngine::execute(w);
            groups_.finished(r.op_id, r.status, r.message, done_);
        } else {
            engine_->post(std::move(w));
        }
    }
    return true;
}

// The slots of an op's local ranks; false if one of them left after the op was matched (its
// group fails the op then, GroupTable::leave, whatever status finished() is given).

// The domain's control plane and progress thread, in this loop (as domains_[index]).
Status Daemon::watch_domain(const RingDomain &d, uint32_t index) {
    if (auto s = epoll_add(epoll_.get(), d.control_fd(), tag(kControl, index)); !s) return s;
    for (uint32_t k = 0; k < d.lanes(); ++k)
        if (auto s = epoll_add(epoll_.get(), d.engine_fd(k), tag(kRingEngine, index << 8 | k)); !s) return s;
    return Ok{};
}

void Daemon::unwatch_domain(const RingDomain &d) {
    epoll_del(epoll_.get(), d.control_fd());
    for (uint32_t k = 0; k < d.lanes(); ++k) epoll_del(epoll_.get(), d.engine_fd(k));
}

std::string Daemon::run_left(const OpRun &run) {
    return "group " + run.group + " op " + std::to_string(run.seq) + ": a local rank left";
}

void Daemon::on_engine_results() {
    // The results (and the slot references they carried back) are released here, on this thread.
    for (auto &r : engine_->take_results())
        if (r.op_id != 0) groups_.finished(r.op_id, r.status, r.message, done_);
}

void Daemon::on_timer() {
    uint64_t expirations;
    (void)!::read(timer_fd_.get(), &expirations, sizeof expirations);
    const auto now = Clock::now();
    gateway_->expire(now);
    groups_.expire(now, done_);
    for (size_t i = 0; i < domains_.size(); ++i)
        if (domains_[i]) domains_[i]->tick(now);
    forget_groups();
    forget_idle_domains();
    logging::flush_repeats();
    // The heap's free memory goes back to the system once no op has ended for kTrimAfter.
    const uint64_t ops = groups_.totals().ops_completed + groups_.totals().ops_failed;
    if (ops != trim_ops_) {
        trim_ops_ = ops;
        quiet_since_ = now;
        trimmed_ = false;
    } else if (!trimmed_ && now - quiet_since_ >= kTrimAfter) {
        ::malloc_trim(0);
        trimmed_ = true;
    }
    // The watchdog keeps ringd alive only while every progress thread is too: one that has had
    // work for ProgressEngine::kStuckAfter without a beat is stuck, and systemd restarts ringd.
    const std::string stuck = stuck_thread(now);
    if (!stuck.empty() && stuck_since_ == Clock::time_point{}) {
        stuck_since_ = now;
        spdlog::critical("{}{}", stuck, watchdog_usec_ ? "; the systemd watchdog is no longer kept alive" : "");
        record_error(stuck);
    } else if (stuck.empty() && stuck_since_ != Clock::time_point{}) {
        spdlog::warn("the stuck progress thread moved again after {:.1f} s",
                     std::chrono::duration<double>(now - stuck_since_).count());
        stuck_since_ = {};
    }
    if (watchdog_usec_ && now >= next_watchdog_ && stuck.empty()) {
        ::sd_notify(0, "WATCHDOG=1");
        next_watchdog_ = now + std::chrono::microseconds(watchdog_usec_ / 2);
    }
}


// Which progress thread is stuck, as a message (empty: none).
std::string Daemon::stuck_thread(Clock::time_point now) const {
    auto secs = [](Clock::duration d) { return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(d).count()); };
    if (const auto d = engine_->stalled_for(now); d > ProgressEngine::kStuckAfter)
        return "the local path's progress thread (ringd-local) has had work for " + secs(d) + " s without moving";
    for (const auto &dom : domains_) {
        if (!dom) continue;
        const auto [lane, d] = dom->most_stalled_lane(now);
        if (d > ProgressEngine::kStuckAfter)
            return "the progress thread of ring lane " + std::to_string(lane) + " (ringd-ring" + std::to_string(lane) +
                   ") of hosts " + (dom->whole_ring() ? std::string("(every host)") : dom->key()) + " has had work for " +
                   secs(d) + " s without moving";
    }
    return {};
}

void Daemon::check_single_host() {
    // A ring of one host listens for no peer, so nothing would notice what a second host will need:
    // this host's address and port, and the secret. Said now (log and status) rather than on the
    // day the ring grows; the host runs on either way.
    auto say = [&](const std::string &what) {
        spdlog::warn("{}; this host runs alone now, but a ring with more hosts would not form", what);
        record_error(what);
    };
    const HostEntry &me = config_.hosts[self_index_];
    addrinfo hints{}, *ai = nullptr;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(me.address.c_str(), std::to_string(me.port).c_str(), &hints, &ai) == 0 && ai) {
        UniqueFd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
        const int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (fd && ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
            const int err = errno;
            say("hosts: " + me.name + "'s address " + me.address + " port " + std::to_string(me.port) + " cannot be bound (" +
                errno_string(err) +
                (err == EADDRNOTAVAIL ? ": not an address of this machine)"
                                      : err == EADDRINUSE ? ": another program listens there)" : ")"));
        }
        ::freeaddrinfo(ai);
    }
    if (!config_.secret_file.empty())
        if (auto s = PeerSecret::load(config_.secret_file); !s) say("auth.secret_file: " + s.error().message);
}

void Daemon::reload() {
    const auto when = [] {
        char b[32];
        const std::time_t t = std::time(nullptr);
        std::strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
        return std::string(b);
    }();
    if (config_path_.empty()) {
        last_reload_ = when + ": refused: ringd was started without a config file to read again";
        spdlog::warn("reload: {}", last_reload_);
        return;
    }
    auto refuse = [&](const std::string &why) {
        last_reload_ = when + ": refused: " + why + "; the running config (version " + config_version_ + ") stays";
        spdlog::error("reload: {}", last_reload_);
        record_error("reload refused: " + why);
    };
    auto fresh = load_config(config_path_);
    if (!fresh) return refuse(fresh.error().message);
    const std::string text = read_text(config_path_);
    std::vector<std::string> changed;
    try {
        changed = changed_keys(started_text_, text);  // against what runs
    } catch (const std::exception &e) {
        return refuse(std::string("the file is not YAML: ") + e.what());
    }
    // What ringd cannot change while it runs: its socket, its transport and the ring's name (and
    // this host must still be in the host list).
    std::vector<std::string> fixed;
    for (const char *k : {"socket", "socket_group", "transport", "cluster"})
        if (std::find(changed.begin(), changed.end(), k) != changed.end()) fixed.push_back(k);
    if (!find_host(*fresh, host_)) fixed.push_back("hosts (this host, " + host_ + ", is not in it)");
    if (!fixed.empty()) return refuse(join(fixed) + " cannot change while ringd runs (restart it for that)");
    // Applied now: the log level and the secret. The other keys wait for a restart, by name.
    std::vector<std::string> applied, pending;
    // The secret is read again whether the file's name changed or only what it holds (the usual
    // rotation): a new one is proved from now on, the old one accepted for auth.rotation_grace.
    // Turning authentication on or off needs a restart (every host at once).
    // A ring of one host has no peers to prove anything to (its secret is not even loaded).
    if (fresh->secret_file.empty() != config_.secret_file.empty()) {
        pending.push_back("auth.secret_file");
    } else if (!fresh->secret_file.empty() && multi_host()) {
        auto next = PeerSecret::load(fresh->secret_file);
        if (!next) return refuse(next.error().message);
        // A third secret while a rotation's grace runs would cut off the hosts still on the
        // first one: refused until the grace ends (going back to the previous secret is fine).
        const bool back = secret_.has_previous() && next->key_id(0) == secret_.key_id(1);
        if (!next->same_key(secret_) && secret_.has_previous() && !back)
            return refuse("auth.secret_file holds a third secret (key id " + key_id_hex(next->key_id(0)) +
                          ") while the rotation from " + key_id_hex(secret_.key_id(1)) + " to " +
                          key_id_hex(secret_.key_id(0)) + " is in its grace (" +
                          std::to_string(std::chrono::duration_cast<std::chrono::seconds>(secret_.previous_left()).count()) +
                          " s left): hosts still on the first would be cut off; reload after the grace");
        if (!next->same_key(secret_)) {
            const auto grace = fresh->rotation_grace;
            secret_.rotate(std::move(*next), PeerSecret::Clock::now() + grace);
            config_.secret_file = fresh->secret_file;
            config_.rotation_grace = grace;
            spdlog::warn("reload: a new secret (key id {}); the previous one ({}) is accepted for {} s more, until every "
                         "host has the new one",
                         key_id_hex(secret_.key_id(0)), key_id_hex(secret_.key_id(1)), grace.count() / 1000);
            applied.push_back("auth.secret_file (a new secret; the previous one accepted for auth.rotation_grace)");
        }
    }
    // What a reload applies is compared with what runs (an earlier reload may have applied it, and
    // a later one may go back to what ringd started with); the rest with the file it started with.
    const bool hosts_differ = !std::equal(fresh->hosts.begin(), fresh->hosts.end(), config_.hosts.begin(), config_.hosts.end(),
                                          [](const HostEntry &a, const HostEntry &b) {
                                              return a.name == b.name && a.address == b.address && a.port == b.port;
                                          });
    // A host's rails (its addresses after the first, their weights) are its links' from the start:
    // a change of them, with or without other changes to the list, waits for a restart.
    bool rails_differ = !fresh->hosts.empty() && !config_.hosts.empty() &&
                        fresh->hosts.front().rail_count() != config_.hosts.front().rail_count();
    for (const auto &h : fresh->hosts)
        for (const auto &o : config_.hosts)
            if (h.name == o.name && (h.rails != o.rails || h.weights != o.weights)) rails_differ = true;
    if (rails_differ) {
        pending.push_back("hosts (rails changed: NICs are set up when ringd starts)");
    } else if (hosts_differ) {
        if (const std::string why = apply_hosts(fresh->hosts); why.empty()) applied.push_back("hosts");
        else pending.push_back("hosts (" + why + ")");
    }
    // The secret (above), and the grace of the next rotation; auth.insecure and auth.data change
    // the connections: at a restart.
    if (fresh->insecure != config_.insecure) pending.push_back("auth.insecure");
    if (fresh->data_mac != config_.data_mac) pending.push_back("auth.data");
    if (fresh->rotation_grace != config_.rotation_grace) {
        config_.rotation_grace = fresh->rotation_grace;
        applied.push_back("auth.rotation_grace");
    }
    if (fresh->log_journal != config_.log_journal) pending.push_back("log.journal");
    if (fresh->log_level != config_.log_level) {
        spdlog::set_level(spdlog::level::from_str(fresh->log_level));
        config_.log_level = fresh->log_level;
        applied.push_back("log.level");
    }
    for (const auto &k : changed) {
        if (k == "hosts" || k == "auth" || k == "log") continue;  // above
        pending.push_back(k);
    }
    config_text_ = text;
    config_version_ = config_hash(text);
    config_pending_ = pending;
    last_reload_ = when + ": version " + config_version_ + "; applied: " + (applied.empty() ? "nothing" : join(applied)) +
                   (pending.empty() ? "" : "; changed in the file, applied at the next restart: " + join(pending));
    if (pending.empty()) spdlog::info("reload: {}", last_reload_);
    else spdlog::warn("reload: {}", last_reload_);
}

void Daemon::record_error(const std::string &message) {
    ++errors_recorded_;
    const auto now = std::chrono::system_clock::now();
    const std::string kind = logging::error_kind(message);
    for (auto &e : recent_errors_)
        if (e.kind == kind) {
            e.last = now;
            e.message = message;
            ++e.count;
            return;
        }
    if (recent_errors_.size() >= kRecentErrors) {  // the kind seen longest ago goes
        auto oldest = std::min_element(recent_errors_.begin(), recent_errors_.end(),
                                       [](const RecentError &a, const RecentError &b) { return a.last < b.last; });
        recent_errors_.erase(oldest);
    }
    recent_errors_.push_back({now, now, kind, message, 1});
}

void Daemon::shutdown() {
    spdlog::info("shutting down");
    ::sd_notify(0, "STOPPING=1");
    gateway_->begin_shutdown();
    groups_.fail_everything("ringd is shutting down", done_);
    settle();
    for (auto &d : domains_)
        if (d) d->shutdown();
    engine_->stop();
    (void)engine_->take_results();
    gateway_->close_all();
    metrics_.reset();  // after the trainers were told; a scrape waiting for this loop gets its 503
}

}  // namespace ringd
