#include "daemon/daemon.h"

#include <grp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <fcntl.h>
#include <systemd/sd-daemon.h>

#include <algorithm>
#include <random>
#include <set>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/ipc/slot.h"

namespace ringd {
namespace {

enum Kind : uint32_t { kListener = 1, kSignal, kTimer, kEngine, kClientSock, kClientDoorbell, kControl };

constexpr uint64_t tag(Kind k, MemberId id = 0) { return (uint64_t{k} << 32) | id; }
constexpr auto kTick = std::chrono::milliseconds(100);
constexpr auto kHelloTimeout = std::chrono::seconds(5);
constexpr size_t kExtraConnections = 64;  // handshaking / ringctl connections beyond max_slots
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

Result<std::unique_ptr<Daemon>> Daemon::create(Config config, std::string host) {
    std::unique_ptr<Daemon> d(new Daemon());
    d->config_ = std::move(config);
    d->host_ = std::move(host);
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
    spare_fd_ = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));

    cuda_ = probe_cuda();
    auto t = make_transport(config_);
    if (!t) return t.error();
    transport_ = std::move(*t);
    NetworkTransport *net = nullptr;
    RingOptions ring_options;
    ring_options.chunk_bytes = config_.tuning.chunk_bytes;
    ring_options.depth = config_.tuning.depth;
    ring_options.spin_us = config_.poll == PollMode::Busy ? -1 : config_.poll == PollMode::Event ? 0 : 50;
    if (multi_host()) {
        // Receive staging for the ring and its f32 work area (f16/bf16 sums and averages),
        // registered once for the daemon's lifetime.
        net = transport_.get();
        const uint64_t staging_bytes = RingAllreduce::staging_bytes(ring_options);
        staging_mem_.reset(new (std::nothrow) std::byte[staging_bytes]);
        if (!staging_mem_) return make_error(-ENOMEM, "cannot set up the ring's staging memory");
        auto reg = transport_->register_region(staging_mem_.get(), staging_bytes);
        if (!reg) return reg.error();
        staging_ = RegisteredRegion(transport_.get(), *reg);
    }
    auto e = ProgressEngine::start(net, staging_.handle(), ring_options, config_.timeouts.op);
    if (!e) return e.error();
    engine_ = std::move(*e);
    if (multi_host()) {
        if (auto s = setup_ring(); !s) return s;
    }

    if (auto s = listen_socket(); !s) return s;
    for (auto [fd, k] : {std::pair{listener_.get(), kListener}, {signal_fd_.get(), kSignal},
                         {timer_fd_.get(), kTimer}, {engine_->result_fd(), kEngine}})
        if (auto s = epoll_add(epoll_.get(), fd, tag(k)); !s) return s;
    if (control_)
        if (auto s = epoll_add(epoll_.get(), control_->fd(), tag(kControl)); !s) return s;

    if (::sd_watchdog_enabled(0, &watchdog_usec_) <= 0) watchdog_usec_ = 0;
    return Ok{};
}

Status Daemon::listen_socket() {
    const std::string &path = config_.socket;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    struct stat st{};
    if (::lstat(path.c_str(), &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) return make_error(-EEXIST, "socket: " + path + " exists and is not a socket");
        UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (::connect(probe.get(), reinterpret_cast<sockaddr *>(&addr), sizeof addr) == 0)
            return make_error(-EADDRINUSE, "socket: another ringd is already listening on " + path);
        ::unlink(path.c_str());  // stale socket of a daemon that died
    }
    listener_ = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!listener_) return make_error(-errno, "socket: " + errno_string(errno));
    const mode_t old = ::umask(0117);  // the socket is created 0660: no window with wider access
    const int rc = ::bind(listener_.get(), reinterpret_cast<sockaddr *>(&addr), sizeof addr);
    const int bind_errno = errno;
    ::umask(old);
    if (rc != 0) return make_error(-bind_errno, "socket: cannot bind " + path + ": " + errno_string(bind_errno));
    if (!config_.socket_group.empty()) {
        group *g = ::getgrnam(config_.socket_group.c_str());
        if (!g) return make_error(-ENOENT, "socket_group: group '" + config_.socket_group + "' does not exist");
        if (::chown(path.c_str(), static_cast<uid_t>(-1), g->gr_gid) != 0)
            return make_error(-errno, "socket_group: cannot give " + path + " to group " + config_.socket_group + ": " +
                                          errno_string(errno));
    }
    if (::listen(listener_.get(), 128) != 0) return make_error(-errno, "listen on " + path + ": " + errno_string(errno));
    return Ok{};
}

int Daemon::run() {
    spdlog::info("ringd {} host {} listening on {} (transport {}, {} max slots of up to {} bytes)", RINGD_VERSION,
                 host_, config_.socket, transport_->name(), config_.memory.max_slots, config_.memory.slot_bytes);
    if (const std::string d = transport_->detail(); !d.empty()) spdlog::info("transport {}: {}", transport_->name(), d);
    ::sd_notify(0, "READY=1\nSTATUS=listening");
    if (cuda_.built)
        spdlog::info("CUDA: {} device(s){}", cuda_.devices, cuda_.error.empty() ? "" : " (" + cuda_.error + ")");
    if (watchdog_usec_) {
        spdlog::info("systemd watchdog on: every {} ms", watchdog_usec_ / 2000);
        ::sd_notify(0, "WATCHDOG=1");
        next_watchdog_ = Clock::now() + std::chrono::microseconds(watchdog_usec_ / 2);
    }
    epoll_event events[64];
    while (running_) {
        const int n = ::epoll_wait(epoll_.get(), events, 64, -1);  // the timerfd bounds every wait
        if (n < 0) {
            if (errno == EINTR) continue;
            spdlog::critical("epoll_wait: {}", errno_string(errno));
            break;
        }
        for (int i = 0; i < n && running_; ++i) {
            const auto kind = static_cast<Kind>(events[i].data.u64 >> 32);
            const auto id = static_cast<MemberId>(events[i].data.u64 & 0xffffffffu);
            switch (kind) {
            case kListener: on_accept(); break;
            case kSignal: {
                signalfd_siginfo si{};
                (void)!::read(signal_fd_.get(), &si, sizeof si);
                spdlog::info("signal {} received", si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
                running_ = false;
                break;
            }
            case kTimer: on_timer(); break;
            case kEngine: on_engine_results(); break;
            case kClientSock: on_client_readable(id); break;
            case kClientDoorbell: on_doorbell(id); break;
            case kControl: control_->on_ready(); break;
            }
        }
        settle();
    }
    shutdown();
    return 0;
}

void Daemon::on_accept() {
    for (;;) {
        UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) {
            if (errno == EAGAIN || errno == EINTR) return;
            if ((errno == EMFILE || errno == ENFILE) && spare_fd_) {
                // Out of fds: free the spare one to accept and close the connection, so that the
                // listener does not stay readable forever.
                spdlog::warn("out of file descriptors; refusing a connection");
                record_error("out of file descriptors; a connection was refused");
                spare_fd_.reset();
                UniqueFd victim(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
                victim.reset();
                spare_fd_ = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
                return;
            }
            spdlog::warn("accept: {}", errno_string(errno));
            return;
        }
        ucred cred{};
        socklen_t len = sizeof cred;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len);
        const auto &uids = config_.allow_uids;
        const auto &gids = config_.allow_gids;
        const bool allowed = (uids.empty() && gids.empty()) ||
                             std::find(uids.begin(), uids.end(), cred.uid) != uids.end() ||
                             std::find(gids.begin(), gids.end(), cred.gid) != gids.end();
        if (!allowed) {
            const std::string why = "uid " + std::to_string(cred.uid) + " gid " + std::to_string(cred.gid) +
                                    " is not in allow_uids/allow_gids";
            spdlog::warn("refused pid {}: {}", cred.pid, why);
            record_error("refused pid " + std::to_string(cred.pid) + ": " + why);
            (void)send_all(fd.get(), proto::encode_error({-EACCES, why}));
            continue;
        }
        if (clients_.size() >= config_.memory.max_slots + kExtraConnections) {
            spdlog::warn("refused pid {}: too many connections ({})", cred.pid, clients_.size());
            (void)send_all(fd.get(), proto::encode_error({-EBUSY, "ringd has too many connections"}));
            continue;
        }
        const MemberId id = next_id_++;
        spdlog::debug("client {} connected: pid {} uid {} gid {}", id, cred.pid, cred.uid, cred.gid);
        if (auto s = epoll_add(epoll_.get(), fd.get(), tag(kClientSock, id)); !s) {
            spdlog::warn("client {}: {}", id, s.error().message);
            continue;
        }
        clients_.emplace(id, std::make_unique<ClientConn>(id, std::move(fd), cred, Clock::now() + kHelloTimeout));
    }
}

void Daemon::on_client_readable(MemberId id) {
    for (;;) {
        auto it = clients_.find(id);
        if (it == clients_.end()) return;
        ClientConn &c = *it->second;
        auto f = c.read_frame();
        if (!f) {
            drop(id, f.error(), f.error().code != -ECONNRESET);
            return;
        }
        if (!*f) return;
        const Frame &frame = **f;
        if (c.state() == ClientConn::State::Handshake && frame.type == proto::FrameType::Hello) {
            auto h = proto::decode_hello(frame.payload);
            if (!h) {
                drop(id, h.error(), true);
                return;
            }
            handle_hello(c, *h);
        } else if (c.state() == ClientConn::State::Handshake && frame.type == proto::FrameType::StatusRequest) {
            if (auto r = proto::decode_status_request(frame.payload); !r) {
                drop(id, r.error(), true);
                return;
            }
            send_status(c);
            drop(id, Error{0, "status sent"}, false);
            return;
        } else if (frame.type == proto::FrameType::Error) {
            auto e = proto::decode_error(frame.payload);
            drop(id, e ? Error{-ECONNRESET, "client reported: " + e->message} : e.error(), false);
            return;
        } else {
            drop(id,
                 make_error(-EPROTO, "unexpected frame type " + std::to_string(static_cast<int>(frame.type)) +
                                         (c.state() == ClientConn::State::Joined ? " after joining" : " before hello")),
                 true);
            return;
        }
    }
}

void Daemon::handle_hello(ClientConn &c, const proto::Hello &h) {
    const MemberId id = c.id();
    if (h.slot_bytes > config_.memory.slot_bytes) {
        drop(id, make_error(-E2BIG, "slot of " + std::to_string(h.slot_bytes) + " bytes exceeds memory.slot_bytes (" +
                                        std::to_string(config_.memory.slot_bytes) + ")"), true);
        return;
    }
    if (live_slots_ >= config_.memory.max_slots) {
        drop(id, make_error(-EBUSY, "all " + std::to_string(config_.memory.max_slots) +
                                        " slots are in use (memory.max_slots)"), true);
        return;
    }
    if (auto ok = groups_.check_join(h.group, h.local_rank, h.local_size); !ok) {
        drop(id, ok.error(), true);
        return;
    }
    auto slot = Slot::create("ringd-" + h.group + "-" + std::to_string(h.local_rank), h.slot_bytes, *transport_);
    if (!slot) {
        drop(id, slot.error(), true);
        return;
    }
    UniqueFd doorbell(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    UniqueFd completion(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!doorbell || !completion) {
        drop(id, make_error(-errno, "eventfd: " + errno_string(errno)), true);
        return;
    }
    const auto &geo = (*slot)->geometry();
    proto::Welcome w;
    w.client_id = id;
    w.sq_depth = geo.sq_depth;
    w.cq_depth = geo.cq_depth;
    w.op_timeout_ms = static_cast<uint32_t>(std::min<int64_t>(config_.timeouts.op.count(), UINT32_MAX));
    w.map_bytes = geo.map_bytes;
    w.data_offset = geo.data_offset;
    w.data_bytes = geo.data_bytes;
    const int fds[proto::kWelcomeFds] = {(*slot)->memfd(), doorbell.get(), completion.get()};
    if (auto s = send_all(c.sock(), proto::encode_welcome(w), fds); !s) {
        drop(id, s.error(), false);
        return;
    }
    if (auto s = epoll_add(epoll_.get(), doorbell.get(), tag(kClientDoorbell, id)); !s) {
        drop(id, s.error(), true);
        return;
    }
    (void)groups_.join(id, h.group, h.local_rank, h.local_size);  // checked above, same thread
    c.joined(std::move(*slot), std::move(doorbell), std::move(completion), h.group, h.local_rank);
    ++live_slots_;
    spdlog::info("{} joined (local_size {}, slot {} bytes)", c.describe(), h.local_size, h.slot_bytes);
    // A new group asks the hosts to agree on its incarnation (settle, flush_reports).
}

void Daemon::send_status(ClientConn &c) {
    (void)send_all(c.sock(), proto::encode_status_reply(status_json()));
}

void Daemon::on_doorbell(MemberId id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    uint64_t rings;
    (void)!::read(it->second->doorbell_fd(), &rings, sizeof rings);
    take_submissions(id);
}

// Submissions that waited for credits, taken once completions freed them (a step of settle,
// never from inside the completion).
bool Daemon::take_held_submissions() {
    if (credit_waiters_.empty()) return false;
    while (!credit_waiters_.empty()) {
        const MemberId id = *credit_waiters_.begin();
        credit_waiters_.erase(credit_waiters_.begin());
        take_submissions(id);
    }
    return true;
}

void Daemon::take_submissions(MemberId id) {
    auto it = clients_.find(id);
    if (it == clients_.end() || it->second->state() != ClientConn::State::Joined) return;
    ClientConn &c = *it->second;
    std::vector<proto::SubmitDesc> descs;
    if (auto s = c.take_submissions(descs); !s) {
        drop(id, s.error(), true);
        return;
    }
    std::vector<Completion> &completions = done_;
    const auto now = Clock::now();
    for (const auto &d : descs) {
        if (!running_) {  // submitted while shutting down
            completions.push_back({id, d.seq, -ESHUTDOWN, "ringd is shutting down"});
            continue;
        }
        if (d.seq != c.expected_seq()) {
            completions.push_back({id, d.seq, -EINVAL,
                                   "op " + std::to_string(d.seq) + " is out of sequence (expected " +
                                       std::to_string(c.expected_seq()) + ")"});
            continue;
        }
        c.accept_seq();
        auto s = proto::validate_submit(d, c.slot()->data_bytes(), cuda_.built);
        if (!s) {
            groups_.reject(id, d.seq, s.error().code, s.error().message, completions);
            continue;
        }
        groups_.submit(id, *s, now, completions, ready_);
    }
}

// Applies what the last events caused, one step after another until nothing moves: completions
// to the clients, ops that became ready, reports, frames to this host's own coordinator, the
// control plane's events (ring up and down, the peers' frames) in the order they happened. No step
// calls back into the one that caused it: each leaves its results in done_, ready_, the inbox or
// the control plane's queue for a later step.
void Daemon::settle() {
    constexpr int kRounds = 64;  // anything left goes on at the next tick
    for (int round = 0; round < kRounds; ++round) {
        // This host's own work first (as it came in), then what the peers sent meanwhile.
        bool moved = take_held_submissions();
        moved |= complete_and_start();
        if (multi_host() && coord_known_) moved |= flush_reports_now();
        moved |= deliver_self_frames();
        if (control_) moved |= control_->dispatch();
        if (!moved) return;
    }
}

// Completions to the clients; ops every local rank submitted go on to the other hosts (several
// hosts) or to the engine (one host). Returns whether anything moved.
bool Daemon::complete_and_start() {
    bool moved = false;
    std::vector<std::pair<MemberId, Error>> bad;
    std::set<std::string> failures;
    const std::vector<Completion> completions = std::exchange(done_, {});
    moved |= !completions.empty();
    for (const auto &cm : completions) {
        if (cm.status != 0) failures.insert(cm.message);
        auto it = clients_.find(cm.member);
        if (it == clients_.end() || it->second->state() != ClientConn::State::Joined) continue;
        if (auto s = it->second->complete(cm.seq, cm.status, cm.message); !s) bad.emplace_back(cm.member, s.error());
        else if (it->second->submissions_held()) credit_waiters_.insert(cm.member);
    }
    for (const auto &m : failures) {
        spdlog::warn("{}", m);
        record_error(m);
    }
    for (auto &[id, e] : bad) drop(id, e, true);
    if (multi_host()) return queue_host_ops() || moved;  // also takes this host's local failures
    (void)groups_.take_failures();  // one host: nobody else needs to hear of them
    if (ready_.empty()) return moved;
    for (auto &run : std::exchange(ready_, {})) {
        EngineWork w;
        w.op_id = run.op_id;
        w.dtype = run.dtype;
        w.op = run.op;
        w.count = run.count;
        w.avg_divisor = static_cast<uint32_t>(run.members.size());
        w.offsets = std::move(run.offsets);
        if (!slots_of(run, w.slots)) {
            groups_.finished(run.op_id, -ECONNRESET, run_left(run), done_);
            continue;
        }
        const uint64_t total = run.count * dtype_size(run.dtype) * run.members.size();
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
bool Daemon::slots_of(const OpRun &run, std::vector<std::shared_ptr<Slot>> &slots) const {
    for (MemberId m : run.members) {
        auto it = clients_.find(m);
        if (it == clients_.end() || it->second->state() != ClientConn::State::Joined) return false;
        slots.push_back(it->second->slot());
    }
    return true;
}

std::string Daemon::run_left(const OpRun &run) {
    return "group " + run.group + " op " + std::to_string(run.seq) + ": a local rank left";
}

void Daemon::on_engine_results() {
    std::vector<Completion> &completions = done_;
    std::string link_failure;
    for (auto &r : engine_->take_results()) {
        const bool ring_ending = r.link_failed && control_ && r.generation == local_generation_;
        if (ring_ending) link_failure = r.message;
        if (r.op_id == 0) continue;
        if (auto e = ended_ring_.find(r.op_id); e != ended_ring_.end()) {
            // Its generation ended while it ran: its trainers hear of it only now that the
            // progress thread is done with their slots.
            groups_.finished(r.op_id, -ECONNABORTED, e->second, completions);
            ended_ring_.erase(e);
        } else if (ring_ending && coord_known_) {
            // An op that ended with its link stays running until the generation's end fails it
            // with the reason that names the host at fault.
            held_ring_.insert(r.op_id);
        } else {
            running_ring_.erase(r.op_id);
            groups_.finished(r.op_id, r.status, r.message, completions);
        }
    }
    // The results (and the slot references they carried back) are released here, on this thread.
    if (!link_failure.empty()) control_->data_link_failed(link_failure);
}

void Daemon::on_timer() {
    uint64_t expirations;
    (void)!::read(timer_fd_.get(), &expirations, sizeof expirations);
    const auto now = Clock::now();
    std::vector<MemberId> late;
    for (const auto &[id, c] : clients_)
        if (c->state() == ClientConn::State::Handshake && c->hello_deadline() <= now) late.push_back(id);
    for (MemberId id : late) drop(id, make_error(-ETIMEDOUT, "no hello within 5 s"), true);
    groups_.expire(now, done_);
    if (control_) {
        control_->tick(now);
        expire_host_ops(now);
        const double dt = std::chrono::duration<double>(now - rate_at_).count();
        if (dt >= 1.0) {
            const uint64_t out = engine_->bytes_to_next(), in = engine_->bytes_from_prev();
            rate_next_ = static_cast<double>(out - rate_bytes_next_) / dt;
            rate_prev_ = static_cast<double>(in - rate_bytes_prev_) / dt;
            rate_bytes_next_ = out;
            rate_bytes_prev_ = in;
            rate_at_ = now;
        }
    }
    if (watchdog_usec_ && now >= next_watchdog_) {
        ::sd_notify(0, "WATCHDOG=1");
        next_watchdog_ = now + std::chrono::microseconds(watchdog_usec_ / 2);
    }
}

void Daemon::drop(MemberId id, const Error &why, bool tell_client) {
    auto node = clients_.extract(id);
    if (node.empty()) return;
    std::unique_ptr<ClientConn> c = std::move(node.mapped());
    if (tell_client) (void)send_all(c->sock(), proto::encode_error({why.code < 0 ? why.code : -EIO, why.message}));
    epoll_del(epoll_.get(), c->sock());
    if (c->state() == ClientConn::State::Joined) {
        epoll_del(epoll_.get(), c->doorbell_fd());  // the client holds the same eventfd: remove explicitly
        --live_slots_;
        if (why.code == -ECONNRESET) {
            spdlog::info("{} left", c->describe());
        } else {
            spdlog::warn("{} dropped: {}", c->describe(), why.message);
            record_error(c->describe() + " dropped: " + why.message);
        }
        groups_.leave(id, done_);
    } else if (why.code != 0 && why.code != -ECONNRESET) {
        spdlog::warn("{} dropped: {}", c->describe(), why.message);
        record_error(c->describe() + " dropped: " + why.message);
    }
}

void Daemon::record_error(const std::string &message) {
    recent_errors_.push_back({std::chrono::system_clock::now(), message});
    while (recent_errors_.size() > kRecentErrors) recent_errors_.pop_front();
}

void Daemon::shutdown() {
    spdlog::info("shutting down");
    ::sd_notify(0, "STOPPING=1");
    epoll_del(epoll_.get(), listener_.get());
    listener_.reset();
    ::unlink(config_.socket.c_str());
    // Submissions whose doorbell was not handled yet are answered too.
    std::vector<MemberId> joined;
    for (const auto &[id, c] : clients_)
        if (c->state() == ClientConn::State::Joined) joined.push_back(id);
    for (MemberId id : joined) on_doorbell(id);
    groups_.fail_everything("ringd is shutting down", done_);
    settle();
    if (control_) engine_->ring_down(local_generation_);  // a ring op in progress returns at once
    engine_->stop();
    (void)engine_->take_results();
    clients_.clear();
}

}  // namespace ringd
