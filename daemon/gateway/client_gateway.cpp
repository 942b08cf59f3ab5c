#include "daemon/gateway/client_gateway.h"

#include <grp.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/cuda/cuda_service.h"
#include "daemon/ipc/slot.h"

namespace ringd {
namespace {

constexpr auto kHelloTimeout = std::chrono::seconds(5);
constexpr size_t kExtraConnections = 64;  // handshaking / ringctl connections beyond max_slots

}  // namespace

ClientGateway::ClientGateway(const Config &config, uint32_t self_index, NetworkTransport &transport, GroupTable &groups,
                             CudaService *cuda, std::string no_cuda, Hooks hooks, std::vector<Completion> &done,
                             std::vector<OpRun> &ready)
    : config_(config), self_(self_index), transport_(transport), groups_(groups), cuda_(cuda), no_cuda_(std::move(no_cuda)),
      hooks_(std::move(hooks)), done_(done), ready_(ready), spare_fd_(::open("/dev/null", O_RDONLY | O_CLOEXEC)) {}

Status ClientGateway::listen() {
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

void ClientGateway::on_accept() {
    for (;;) {
        UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) {
            if (errno == EAGAIN || errno == EINTR) return;
            if ((errno == EMFILE || errno == ENFILE) && spare_fd_) {
                // Out of fds: free the spare one to accept and close the connection, so that the
                // listener does not stay readable forever.
                spdlog::warn("out of file descriptors; refusing a connection");
                hooks_.record_error("out of file descriptors; a connection was refused");
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
            hooks_.record_error("refused pid " + std::to_string(cred.pid) + ": " + why);
            (void)send_all(fd.get(), proto::encode_error({-EACCES, why}));
            continue;
        }
        if (clients_.size() >= config_.memory.max_slots + kExtraConnections) {
            spdlog::warn("refused pid {}: too many connections ({})", cred.pid, clients_.size());
            (void)send_all(fd.get(), proto::encode_error({-EBUSY, "ringd has too many connections"}));
            continue;
        }
        if (const size_t mine = count_of(cred.uid, false); cred.uid != 0 && mine >= config_.limits.connections_per_uid) {
            const std::string why = "uid " + std::to_string(cred.uid) + " has " + std::to_string(mine) +
                                    " connections to ringd, its limit (limits.connections_per_uid)";
            // Said once a second at most: a uid at its limit must not flood the log.
            if (const auto now = Clock::now(); now - last_limit_log_ >= std::chrono::seconds(1)) {
                last_limit_log_ = now;
                spdlog::warn("refused pid {}: {}", cred.pid, why);
                hooks_.record_error("refused pid " + std::to_string(cred.pid) + ": " + why);
            }
            (void)send_all(fd.get(), proto::encode_error({-EBUSY, why}));
            continue;
        }
        const MemberId id = next_id_++;
        spdlog::debug("client {} connected: pid {} uid {} gid {}", id, cred.pid, cred.uid, cred.gid);
        if (auto s = hooks_.watch(fd.get(), id, false); !s) {
            spdlog::warn("client {}: {}", id, s.error().message);
            continue;
        }
        clients_.emplace(id, std::make_unique<ClientConn>(id, std::move(fd), cred, Clock::now() + kHelloTimeout));
    }
}

// Root is not limited per uid (memory.max_slots and the connection cap still hold). Slots: the
// data areas the uid's joined clients hold (one however many clients share it, also after the
// client that made it has gone).
size_t ClientGateway::count_of(uint32_t uid, bool slots) const {
    if (!slots) {
        size_t n = 0;
        for (const auto &[id, c] : clients_) n += c->cred().uid == uid;
        return n;
    }
    std::set<const void *> areas;
    for (const auto &[id, c] : clients_)
        if (c->cred().uid == uid && c->state() == ClientConn::State::Joined) areas.insert(c->slot_lease().get());
    return areas.size();
}

void ClientGateway::on_readable(MemberId id) {
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
        Frame &frame = **f;
        if (!frame.fds.empty() && frame.type != proto::FrameType::CudaRegister) {
            drop(id, make_error(-EPROTO, "file descriptors came with a frame that takes none"), true);
            return;
        }
        if (c.state() == ClientConn::State::Joined &&
            (frame.type == proto::FrameType::CudaRegister || frame.type == proto::FrameType::CudaUnregister)) {
            handle_cuda_frame(c, frame);
        } else if (c.state() == ClientConn::State::Handshake &&
                   (frame.type == proto::FrameType::Hello || frame.type == proto::FrameType::HelloShared)) {
            auto h = frame.type == proto::FrameType::Hello ? proto::decode_hello(frame.payload)
                                                           : proto::decode_hello_shared(frame.payload);
            if (!h) {
                drop(id, h.error(), true);
                return;
            }
            handle_hello(c, *h);
        } else if (c.state() == ClientConn::State::Handshake && frame.type == proto::FrameType::StatusRequest) {
            auto r = proto::decode_status_request(frame.payload);
            if (!r) {
                drop(id, r.error(), true);
                return;
            }
            if (r->flags != 0 && c.cred().uid != 0 && c.cred().uid != ::geteuid()) {
                const char *what = r->flags == proto::kStatusDrain     ? "drain"
                                   : r->flags == proto::kStatusUndrain ? "undrain"
                                                                       : "reload";
                drop(id, make_error(-EPERM, std::string("only root or ringd's own user may ") + what + " this host (uid " +
                                                std::to_string(c.cred().uid) + ")"),
                     true);
                return;
            }
            if (r->flags == proto::kStatusReload && hooks_.reload) hooks_.reload(c.describe());
            if (r->flags == proto::kStatusDrain || r->flags == proto::kStatusUndrain) {
                const bool drain = r->flags == proto::kStatusDrain;
                if (drained_ != drain)
                    spdlog::warn("host {} {} by {}", config_.hosts[self_].name,
                                 drain ? "drained: it takes no new groups, running ones go on" : "undrained: it takes new groups again",
                                 c.describe());
                drained_ = drain;
            }
            (void)send_all(c.sock(), proto::encode_status_reply(hooks_.status_json(c.cred().uid)));
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

void ClientGateway::handle_hello(ClientConn &c, const proto::Hello &h) {
    const MemberId id = c.id();
    // HelloShared: the data area of a joined client of the same process (same pid and uid: a
    // process shares its own memory only), which holds the host's slot (memory.max_slots) for all
    // of them; this one adds queues only.
    std::shared_ptr<Slot> base;
    std::shared_ptr<void> lease;
    if (h.share_with != 0) {
        auto it = clients_.find(h.share_with);
        const ClientConn *owner = it == clients_.end() ? nullptr : it->second.get();
        // pid 0: a client outside ringd's pid namespace, which SO_PEERCRED cannot tell apart.
        if (!owner || owner->state() != ClientConn::State::Joined || c.cred().pid == 0 ||
            owner->cred().pid != c.cred().pid || owner->cred().uid != c.cred().uid) {
            drop(id, make_error(-EPERM, "client " + std::to_string(h.share_with) +
                                            " is not a joined client of this process: its slot cannot be shared"), true);
            return;
        }
        base = owner->slot();
        lease = owner->slot_lease();
    }
    if (!base && h.slot_bytes > config_.memory.slot_bytes) {
        drop(id, make_error(-E2BIG, "slot of " + std::to_string(h.slot_bytes) + " bytes exceeds memory.slot_bytes (" +
                                        std::to_string(config_.memory.slot_bytes) + ")"), true);
        return;
    }
    if (!base && *live_slots_ >= config_.memory.max_slots) {
        drop(id, make_error(-EBUSY, "all " + std::to_string(config_.memory.max_slots) +
                                        " slots are in use (memory.max_slots)"), true);
        return;
    }
    if (const size_t mine = count_of(c.cred().uid, true); !base && c.cred().uid != 0 && mine >= config_.limits.slots_per_uid) {
        drop(id, make_error(-EBUSY, "uid " + std::to_string(c.cred().uid) + " holds " + std::to_string(mine) +
                                        " slots, its limit (limits.slots_per_uid)"), true);
        return;
    }
    if (drained_ && groups_.local_id(h.group) == 0) {
        drop(id, make_error(-EAGAIN, "host " + config_.hosts[self_].name + " is drained (ringctl drain): it takes no new "
                                         "groups, so group " + h.group + " cannot start here; use other hosts, or wait "
                                         "for ringctl undrain"), true);
        return;
    }
    // The group's op timeout: what its trainers ask for, up to timeouts.op_max (said once per
    // group and timeout: a long job's ranks reconnect often).
    std::chrono::milliseconds op_timeout = h.op_timeout_ms ? std::chrono::milliseconds(h.op_timeout_ms) : config_.timeouts.op;
    if (op_timeout > config_.timeouts.op_max) {
        op_timeout = config_.timeouts.op_max;
        if (clamp_told_.insert(h.group + "/" + std::to_string(h.op_timeout_ms)).second) {
            if (clamp_told_.size() > 4096) clamp_told_.clear();
            spdlog::warn("group {} asks for an op timeout of {} ms, more than timeouts.op_max: its ops run with {} ms",
                         h.group, h.op_timeout_ms, op_timeout.count());
        }
    }
    if (auto ok = groups_.check_join(h.group, h.local_rank, h.local_size, c.cred().uid, op_timeout, GroupRank{h.rank, h.ranks});
        !ok) {
        drop(id, ok.error(), true);
        return;
    }
    // The group's hosts: this host among them, the same list from every local rank.
    auto hosts = group_hosts(config_, h.hosts);
    if (!hosts) {
        drop(id, make_error(hosts.error().code, "group " + h.group + ": " + hosts.error().message), true);
        return;
    }
    // A group over every host whose hosts a reload grew joins where its run is (its first ranks'
    // hosts, kept by the reload) when a later rank names none either.
    const bool every_host = h.hosts.find_first_not_of(' ') == std::string::npos;
    if (const auto *declared = groups_.hosts_of(h.group); declared && every_host && groups_.every_host(h.group))
        *hosts = *declared;
    const std::string names = host_names(config_, *hosts);
    if (std::find(hosts->begin(), hosts->end(), self_) == hosts->end()) {
        drop(id, make_error(-EINVAL, "group " + h.group + "'s hosts are " + names + ": host " + config_.hosts[self_].name +
                                         " is not one of them (join on one of those hosts)"), true);
        return;
    }
    if (const auto *declared = groups_.hosts_of(h.group); declared && *declared != *hosts) {
        drop(id, make_error(-EINVAL, "group " + h.group + "'s trainers on host " + config_.hosts[self_].name +
                                         " declare different hosts: " + host_names(config_, *declared) +
                                         " (the first one), this one " + names), true);
        return;
    }
    if (hooks_.open_domain)
        if (auto ok = hooks_.open_domain(*hosts); !ok) {
            drop(id, make_error(ok.error().code, "group " + h.group + " over hosts " + names + ": " + ok.error().message), true);
            return;
        }
    const std::string name = "ringd-" + h.group + "-" + std::to_string(h.local_rank);
    std::string why;
    const int node = base || !hooks_.slot_node ? -1 : hooks_.slot_node(c.cred().pid, why);
    std::string placed;
    auto slot = base ? Slot::share(name, base) : Slot::create(name, h.slot_bytes, transport_, node, &placed);
    if (!slot) {
        drop(id, slot.error(), true);
        return;
    }
    if (!base) (*slot)->set_placement(node, node >= 0 ? why + ": " + placed : why);
    UniqueFd doorbell(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    UniqueFd completion(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!doorbell || !completion) {
        drop(id, make_error(-errno, "eventfd: " + errno_string(errno)), true);
        return;
    }
    if (hooks_.before_welcome) hooks_.before_welcome();
    const auto &geo = (*slot)->geometry();
    proto::Welcome w;
    w.client_id = id;
    w.sq_depth = geo.sq_depth;
    w.cq_depth = geo.cq_depth;
    w.op_timeout_ms = static_cast<uint32_t>(std::min<int64_t>(op_timeout.count(), UINT32_MAX));  // the group's
    w.map_bytes = geo.map_bytes;
    w.data_offset = geo.data_offset;
    w.data_bytes = geo.data_bytes;
    const int fds[proto::kWelcomeFds] = {(*slot)->memfd(), doorbell.get(), completion.get()};
    if (auto s = send_all(c.sock(), proto::encode_welcome(w), fds); !s) {
        drop(id, s.error(), false);
        return;
    }
    if (auto s = hooks_.watch(doorbell.get(), id, true); !s) {
        drop(id, s.error(), true);
        return;
    }
    (void)groups_.join(id, h.group, h.local_rank, h.local_size, c.cred().uid, *hosts, op_timeout, every_host,
                       GroupRank{h.rank, h.ranks});  // checked above
    if (!lease) {
        // The host's slot count: until the last client using this data area is gone.
        ++*live_slots_;
        // It points at the data area's slot (count_of tells the uid's data areas apart by it).
        lease = std::shared_ptr<void>(static_cast<void *>(slot->get()), [count = live_slots_](void *) { --*count; });
    }
    c.joined(std::move(*slot), std::move(doorbell), std::move(completion), h.group, h.local_rank, std::move(lease));
    if (h.share_with)
        spdlog::info("{} joined (local_size {}, the slot of client {})", c.describe(), h.local_size, h.share_with);
    else
        spdlog::info("{} joined (local_size {}, slot {} bytes)", c.describe(), h.local_size, h.slot_bytes);
    // A new group asks the hosts to agree on its incarnation (settle, flush_reports).
}

// Registration answers go back on the socket; a bad request is that client's error only.
void ClientGateway::handle_cuda_frame(ClientConn &c, Frame &frame) {
    proto::CudaReply reply;
    if (frame.type == proto::FrameType::CudaRegister) {
        auto r = proto::decode_cuda_register(frame.payload);
        if (!r) {
            drop(c.id(), r.error(), true);
            return;
        }
        if (!cuda_) {
            reply.status = -ENODEV;
            reply.message = no_cuda_;
        } else if (auto reg = cuda_->register_memory(c.id(), c.slot(), *r, std::move(frame.fds)); !reg) {
            reply.status = reg.error().code;
            reply.message = reg.error().message;
        } else {
            reply.reg = *reg;
            spdlog::debug("{} registered {} bytes of device memory as {}", c.describe(), r->bytes, *reg);
        }
    } else {
        auto reg = proto::decode_cuda_unregister(frame.payload);
        if (!reg) {
            drop(c.id(), reg.error(), true);
            return;
        }
        reply.reg = *reg;
        if (!cuda_) {
            reply.status = -ENODEV;
            reply.message = no_cuda_;
        } else if (auto now = cuda_->unregister(c.id(), *reg); !now) {
            reply.status = now.error().code;
            reply.message = now.error().message;
        } else if (!*now) {
            return;  // answered once ringd closed the mapping an op still used (send_late_replies)
        }
    }
    if (reply.status != 0) spdlog::info("{}: CUDA registration refused: {}", c.describe(), reply.message);
    if (auto s = send_all(c.sock(), proto::encode_cuda_reply(reply)); !s) drop(c.id(), s.error(), false);
}

void ClientGateway::on_doorbell(MemberId id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    // Not read back: the doorbell is watched edge-triggered (Daemon), each ring its own event. A
    // client that rings it up to the eventfd's limit only makes its own next ring fail.
    take_submissions(id);
}

bool ClientGateway::take_held_submissions() {
    if (credit_waiters_.empty()) return false;
    while (!credit_waiters_.empty()) {
        const MemberId id = *credit_waiters_.begin();
        credit_waiters_.erase(credit_waiters_.begin());
        take_submissions(id);
    }
    return true;
}

void ClientGateway::take_submissions(MemberId id) {
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
        if (shutting_down_) {  // submitted while shutting down
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
        auto queue = staging_.find(id);
        if (d.flags & proto::kSubmitRefused) {
            // The rank cannot run this op (it does not fit its slot): every rank of the group fails
            // it, naming this one, and the group goes on with the next (in order behind its device
            // ops still staging).
            auto why = proto::refusal(d, c.slot()->data_bytes());
            const int32_t code = !why ? why.error().code : d.count ? -E2BIG : -ECANCELED;
            const std::string text = why ? *why : why.error().message;
            if (queue == staging_.end()) {
                groups_.reject(id, d.seq, code, text, completions, static_cast<bool>(why));
            } else {
                Staged st{proto::Submission{}, now, Staged::Failed, false, make_error(code, text), static_cast<bool>(why)};
                st.s.seq = d.seq;
                queue->second.push_back(std::move(st));
            }
            continue;
        }
        auto s = proto::validate_submit(d, c.slot()->data_bytes(), true, config_.wire.format);
        if (s)  // (an all_to_all's split sizes: copied out of the slot once, here)
            if (auto t = proto::take_splits(*s, c.slot()->data(), c.slot()->data_bytes(), true); !t) s = t.error();
        if (!s) {
            if (queue == staging_.end()) {
                groups_.reject(id, d.seq, s.error().code, s.error().message, completions);
            } else {
                Staged st{proto::Submission{}, now, Staged::Failed, false, s.error()};
                st.s.seq = d.seq;
                queue->second.push_back(std::move(st));
            }
            continue;
        }
        if (s->cuda) {
            Staged st{*s, now, Staged::Waiting, false, Error{}};
            if (!cuda_) {
                st.state = Staged::Failed;
                st.error = make_error(-ENODEV, "op " + std::to_string(d.seq) + ": " + no_cuda_);
            } else if (std::string why = groups_.collective_refused(id, *s); !why.empty()) {
                // (Before the stage-in: its copies are one per rank it says.)
                st.state = Staged::Failed;
                st.error = make_error(-EINVAL, why);
            } else if (auto in = cuda_->stage_in(id, *s, groups_.member_rank(id)); !in) {
                st.state = Staged::Failed;
                st.error = in.error();
            }
            if (st.state == Staged::Failed) {  // nothing queued for it: a stream waiting for it may go on
                if (cuda_) cuda_->release_done(id, *c.slot(), d.seq);
                else c.slot()->header().cuda_done[d.seq % proto::kQueueDepth].store(static_cast<uint32_t>(d.seq),
                                                                                    std::memory_order_release);
            }
            staging_[id].push_back(std::move(st));
            continue;
        }
        if (queue != staging_.end()) {
            queue->second.push_back(Staged{*s, now, Staged::Ready, false, Error{}});
            continue;
        }
        groups_.submit(id, *s, now, completions, ready_);
    }
    pump(id);
}

void ClientGateway::pump(MemberId id) {
    auto it = staging_.find(id);
    if (it == staging_.end()) return;
    auto &q = it->second;
    while (!q.empty() && q.front().state != Staged::Waiting) {
        Staged &st = q.front();
        // The op's deadline counts from its submission, stage-in included (end to end).
        if (st.state == Staged::Ready) groups_.submit(id, st.s, st.accepted, done_, ready_);
        else groups_.reject(id, st.s.seq, st.error.code, st.error.message, done_, st.refused);
        q.pop_front();
    }
    if (q.empty()) staging_.erase(it);
}

void ClientGateway::on_cuda_events() {
    if (!cuda_) return;
    for (const CudaStageEvent &e : cuda_->take_events()) {
        if (e.kind == CudaStageEvent::StagedOut) {  // the result is in the device buffer (or why not)
            done_.push_back({e.member, e.seq, e.error.code, e.error.message});
            continue;
        }
        auto it = staging_.find(e.member);
        if (it == staging_.end()) continue;
        for (Staged &st : it->second)
            if (st.s.seq == e.seq && st.state == Staged::Waiting) {
                st.state = st.timed_out || e.error.code != 0 ? Staged::Failed : Staged::Ready;
                if (st.timed_out)
                    st.error = make_error(-ETIMEDOUT, "op " + std::to_string(e.seq) +
                                                          ": the device buffer was never marked ready (the trainer's "
                                                          "stream did not reach the op within timeouts.op)");
                else if (e.error.code != 0)
                    st.error = e.error;
                break;
            }
        pump(e.member);
    }
    send_late_replies();
}

void ClientGateway::send_late_replies() {
    for (auto [id, reg] : cuda_->take_unregistered()) {
        auto it = clients_.find(id);
        if (it == clients_.end()) continue;
        if (auto s = send_all(it->second->sock(), proto::encode_cuda_reply({0, reg, {}})); !s) drop(id, s.error(), false);
    }
}

bool ClientGateway::slots_of(const OpRun &run, std::vector<std::shared_ptr<Slot>> &slots) const {
    for (MemberId m : run.members) {
        auto it = clients_.find(m);
        if (it == clients_.end() || it->second->state() != ClientConn::State::Joined) return false;
        slots.push_back(it->second->slot());
    }
    return true;
}

std::pair<uint64_t, uint64_t> ClientGateway::copies() const {
    uint64_t in = copied_in_gone_, out = copied_out_gone_;
    for (const auto &[id, c] : clients_)
        if (c->slot()) {
            in += c->slot()->header().copied_in.load(std::memory_order_relaxed);
            out += c->slot()->header().copied_out.load(std::memory_order_relaxed);
        }
    return {in, out};
}

std::vector<ClientGateway::SlotPlace> ClientGateway::slot_places() const {
    std::vector<SlotPlace> out;
    for (const auto &[id, c] : clients_)
        if (c->slot() && c->state() == ClientConn::State::Joined)
            out.push_back({c->group(), c->local_rank(), c->cred().pid, c->slot()->node(), c->slot()->placement()});
    return out;
}

void ClientGateway::drop(MemberId id, const Error &why, bool tell_client) {
    auto node = clients_.extract(id);
    if (node.empty()) return;
    std::unique_ptr<ClientConn> c = std::move(node.mapped());
    if (c->slot()) {
        copied_in_gone_ += c->slot()->header().copied_in.load(std::memory_order_relaxed);
        copied_out_gone_ += c->slot()->header().copied_out.load(std::memory_order_relaxed);
    }
    if (tell_client) (void)send_all(c->sock(), proto::encode_error({why.code < 0 ? why.code : -EIO, why.message}));
    hooks_.unwatch(c->sock());
    staging_.erase(id);
    if (cuda_) cuda_->client_gone(id);
    if (c->state() == ClientConn::State::Joined) {
        hooks_.unwatch(c->doorbell_fd());  // the client holds the same eventfd: remove explicitly
        if (why.code == -ECONNRESET) {
            spdlog::info("{} left", c->describe());
        } else {
            spdlog::warn("{} dropped: {}", c->describe(), why.message);
            hooks_.record_error(c->describe() + " dropped: " + why.message);
        }
        groups_.leave(id, done_);
    } else if (why.code != 0 && why.code != -ECONNRESET) {
        spdlog::warn("{} dropped: {}", c->describe(), why.message);
        hooks_.record_error(c->describe() + " dropped: " + why.message);
    }
}

void ClientGateway::expire(Clock::time_point now) {
    std::vector<MemberId> late;
    for (const auto &[id, c] : clients_)
        if (c->state() == ClientConn::State::Handshake && c->hello_deadline() <= now) late.push_back(id);
    for (MemberId id : late) drop(id, make_error(-ETIMEDOUT, "no hello within 5 s"), true);
    // Device buffers never marked ready: ringd's stream is let go, and the op fails once staged.
    for (auto &[id, q] : staging_)
        for (Staged &st : q)
            if (st.state == Staged::Waiting && !st.timed_out && now - st.accepted >= config_.timeouts.op) {
                st.timed_out = true;
                if (cuda_) cuda_->release_ready(id, st.s.seq);
            }
    if (cuda_) {
        cuda_->tick(now);
        send_late_replies();
    }
}

bool ClientGateway::complete(const std::vector<Completion> &completions) {
    if (completions.empty()) return false;
    std::vector<std::pair<MemberId, Error>> bad;
    for (auto cm : completions) {
        if (cuda_ && cuda_->owns_completion(cm.member, cm.seq)) {
            if (cm.status != 0) {
                cuda_->finish(cm.member, cm.seq);
            } else if (auto s = cuda_->stage_out(cm.member, cm.seq); s) {
                continue;  // delivered when the result is back in the device buffer
            } else {
                cm.status = s.error().code;
                cm.message = s.error().message;
            }
        }
        auto it = clients_.find(cm.member);
        if (it == clients_.end() || it->second->state() != ClientConn::State::Joined) continue;
        if (auto s = it->second->complete(cm.seq, cm.status, cm.message); !s) bad.emplace_back(cm.member, s.error());
        else if (it->second->submissions_held()) credit_waiters_.insert(cm.member);
    }
    for (auto &[id, e] : bad) drop(id, e, true);
    if (cuda_) send_late_replies();
    return true;
}

void ClientGateway::begin_shutdown() {
    shutting_down_ = true;
    hooks_.unwatch(listener_.get());
    listener_.reset();
    ::unlink(config_.socket.c_str());
    // Submissions whose doorbell was not handled yet are answered too.
    std::vector<MemberId> joined;
    for (const auto &[id, c] : clients_)
        if (c->state() == ClientConn::State::Joined) joined.push_back(id);
    for (MemberId id : joined) take_submissions(id);
}

}  // namespace ringd
