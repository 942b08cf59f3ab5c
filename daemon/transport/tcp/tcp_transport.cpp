#include "daemon/transport/tcp/tcp_transport.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/sendfile.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/transport/tcp/tcp_progress.h"
#include "proto/le.h"

namespace ringd {
namespace {

constexpr uint32_t kDataMagic = 0x4D444752;  // bytes 'R' 'G' 'D' 'M'

// One line of a /proc/sys file, or "" when it cannot be read.
std::string read_sysctl(const char *path) {
    std::string line;
    if (FILE *f = std::fopen(path, "re")) {
        char buf[256];
        if (std::fgets(buf, sizeof buf, f)) line = buf;
        std::fclose(f);
    }
    while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
    return line;
}

}  // namespace

TcpTransport::TcpTransport(std::string congestion, bool data_mac, uint64_t socket_buffer, bool zero_copy,
                           uint32_t rail_timeout_ms)
    : epoll_(::epoll_create1(EPOLL_CLOEXEC)), congestion_(std::move(congestion)), data_mac_(data_mac),
      socket_buffer_(static_cast<int>(std::min<uint64_t>(socket_buffer, 1u << 30))), zero_copy_(zero_copy),
      rail_timeout_ms_(rail_timeout_ms), offered_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (epoll_ && offered_) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.ptr = nullptr;  // (streams have theirs)
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, offered_.get(), &ev);
    }
}

Status TcpTransport::offer_rail_streams(uint64_t key, uint32_t rail, std::vector<UniqueFd> fds, std::vector<SessionKeys> keys) {
    if (!offered_) return make_error(-EMFILE, "eventfd failed");
    {
        std::lock_guard lock(offers_mu_);
        offers_.push_back(Offer{key, rail, std::move(fds), std::move(keys)});
    }
    const uint64_t one = 1;
    (void)!::write(offered_.get(), &one, sizeof one);
    return Ok{};
}

void TcpTransport::take_offers() {
    uint64_t n;
    (void)!::read(offered_.get(), &n, sizeof n);
    std::vector<Offer> offers;
    {
        std::lock_guard lock(offers_mu_);
        offers.swap(offers_);
    }
    for (Offer &o : offers) {
        auto it = std::find_if(links_.begin(), links_.end(), [&](const auto &l) { return l->weighted_ && l->key_ == o.key; });
        if (it == links_.end()) continue;  // gone (a new generation): the connections close
        if (auto ok = (*it)->add_rail_streams(o.rail, std::move(o.fds), o.keys); !ok)
            spdlog::warn("data link to {}: new connections for rail {} not taken: {}", (*it)->peer(), o.rail, ok.error().message);
    }
}

std::string TcpTransport::detail() const {
    const std::string mac = std::string(data_mac_ ? ", auth.data: mac" : "") + (zero_copy_ ? ", zero-copy sends" : "");
    if (!congestion_.empty()) return "congestion control " + congestion_ + congestion_note_ + mac;
    const std::string sys = read_sysctl("/proc/sys/net/ipv4/tcp_congestion_control");
    return "congestion control: the system's" + (sys.empty() ? std::string() : " (" + sys + ")") + mac;
}

Status TcpTransport::check_congestion(const std::string &name) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) return make_error(-errno, "socket: " + errno_string(errno));
    if (::setsockopt(fd.get(), IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) == 0)
        return Ok{};
    const int e = errno;
    if (e == ENOENT)
        return make_error(-e, "TCP congestion control '" + name + "' is not in this kernel (available: " +
                                  read_sysctl("/proc/sys/net/ipv4/tcp_available_congestion_control") +
                                  "; a module may need loading: modprobe tcp_" + name + ")");
    if (e == EPERM)
        return make_error(-e, "TCP congestion control '" + name + "' needs CAP_NET_ADMIN or an entry in " +
                                  "net.ipv4.tcp_allowed_congestion_control (now: " +
                                  read_sysctl("/proc/sys/net/ipv4/tcp_allowed_congestion_control") + ")");
    return make_error(-e, "TCP congestion control '" + name + "': " + errno_string(e));
}

TcpTransport::Pick TcpTransport::pick_congestion() {
    auto cubic = check_congestion("cubic");
    if (cubic) return {"cubic", ""};
    return {"reno", cubic.error().message};
}

std::string TcpTransport::socket_buffer_cap(uint64_t bytes) {
    std::string why;
    for (const char *name : {"wmem_max", "rmem_max"}) {
        const std::string v = read_sysctl((std::string("/proc/sys/net/core/") + name).c_str());
        const uint64_t cap = v.empty() ? 0 : std::strtoull(v.c_str(), nullptr, 10);
        if (cap && cap < bytes)
            why += (why.empty() ? "" : "; ") + std::string("net.core.") + name + " is " + v + ": the kernel gives each stream " +
                   v + " bytes";
    }
    return why.empty() ? why : why + " (raise it, or use tcp.socket_buffer: auto)";
}

std::string TcpTransport::congestion_of(int fd) {
    char name[16] = "";  // the kernel's TCP_CA_NAME_MAX
    socklen_t len = sizeof name - 1;
    if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return {};
    return std::string(name, strnlen(name, len));
}

void TcpTransport::prepare_socket(int fd) const {
    if (!congestion_.empty())  // checked at start (check_congestion)
        ::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, congestion_.data(), static_cast<socklen_t>(congestion_.size()));
}

Result<RegionHandle> TcpTransport::do_register(std::byte *base, size_t bytes) {
    if (!base || bytes == 0) return make_error(-EINVAL, "cannot register an empty region");
    return RegionHandle{next_region_++, base, bytes};
}

void TcpTransport::do_deregister(RegionHandle) {}

Result<Link *> TcpTransport::add_link(const std::string &peer, std::vector<UniqueFd> streams,
                                      const std::vector<SessionKeys> &keys, const std::vector<uint32_t> &rails,
                                      const std::vector<double> &weights, uint64_t key, std::atomic<uint64_t> *rail_state) {
    if (!epoll_) return make_error(-EMFILE, "epoll_create1 failed");
    if (streams.empty()) return make_error(-EINVAL, "a link needs at least one stream");
    if (!keys.empty() && keys.size() != streams.size()) return make_error(-EINVAL, "a link needs keys for every stream");
    if (rails.size() != weights.size() || (!rails.empty() && rails.size() != streams.size()))
        return make_error(-EINVAL, "a link of several rails needs every stream's rail and weight");
    for (size_t i = 0; i < rails.size(); ++i)
        if (rails[i] >= kMaxLinkRails || !(weights[i] > 0)) return make_error(-EINVAL, "a stream's rail or weight is out of range");
    if (!rails.empty() && streams.size() > kMaxLinkStreams)
        return make_error(-EINVAL, "a link of several rails has at most " + std::to_string(kMaxLinkStreams) + " streams");
    auto link = std::make_unique<TcpLink>(*this, peer);
    link->weighted_ = !rails.empty();
    link->key_ = key;
    link->published_ = rail_state;
    if (rail_state) rail_state->store(0);
    for (size_t i = 0; i < streams.size(); ++i) {
        const SessionKeys k = data_mac_ && !keys.empty() ? keys[i] : SessionKeys{};
        if (auto s = link->add_stream(std::move(streams[i]), k); !s) return s.error();
        if (!rails.empty()) {
            link->streams_.back()->rail = rails[i];
            link->streams_.back()->weight = weights[i];
            link->rail_count_ = std::max(link->rail_count_, rails[i] + 1);
        }
    }
    if (!link->late_congestion_.empty())
        spdlog::warn("data link to {}: a stream was connected under TCP congestion control {}; the kernel keeps what the "
                     "first one set up at connection time (BBR: its pacing, a timer per burst); ringd sets tcp.congestion "
                     "before it connects, so a route's congctl may be overriding it",
                     peer, link->late_congestion_);
    links_.push_back(std::move(link));
    return static_cast<Link *>(links_.back().get());
}

Result<std::vector<Link *>> TcpTransport::add_links(std::vector<LinkSetup> links,
                                                    std::chrono::steady_clock::time_point) {
    std::vector<Link *> out;
    for (auto &l : links) {
        auto link = add_link(l.peer, std::move(l.streams), l.keys, l.rails, l.weights, l.key, l.rail_state);
        if (!link) {
            for (Link *done : out) remove_link(done);
            return link.error();
        }
        out.push_back(*link);
    }
    return out;
}

void TcpTransport::remove_link(Link *link) {
    std::erase_if(links_, [&](const auto &l) { return l.get() == link; });
    std::erase_if(ready_, [&](const LinkEvent &e) { return e.link == link; });
}

Status TcpTransport::poll(std::vector<LinkEvent> &out, int timeout_ms) {
    if (!ready_.empty()) timeout_ms = 0;
    epoll_event events[64];
    const int n = ::epoll_wait(epoll_.get(), events, 64, timeout_ms);
    if (n < 0 && errno != EINTR) return make_error(-errno, "epoll_wait: " + errno_string(errno));
    bool offered = false;
    for (int i = 0; i < n; ++i) {
        auto *s = static_cast<TcpLink::Stream *>(events[i].data.ptr);
        if (!s) {
            offered = true;
            continue;
        }
        s->link->on_event(*s, events[i].events);
    }
    // After the batch: an event of a stream's old connection in it is not taken for its new one's.
    if (offered) take_offers();
    const auto now = std::chrono::steady_clock::now();
    const bool check = now >= next_rail_check_;
    if (check) next_rail_check_ = now + std::chrono::milliseconds(100);
    for (auto &l : links_)
        if (l->weighted_ && !l->error()) {
            if (check) l->check_rails();
            if (!l->error()) l->hold_stalled(now);
        }
    out.insert(out.end(), std::make_move_iterator(ready_.begin()), std::make_move_iterator(ready_.end()));
    ready_.clear();
    return Ok{};
}

TcpLink::TcpLink(TcpTransport &t, std::string peer) : Link(std::move(peer)), t_(t) {}

TcpLink::~TcpLink() {
    for (auto &s : streams_)
        if (s->fd) ::epoll_ctl(t_.epoll_.get(), EPOLL_CTL_DEL, s->fd.get(), nullptr);
}

Status TcpLink::add_stream(UniqueFd fd, const SessionKeys &keys) {
    auto s = std::make_unique<Stream>();
    s->link = this;
    if (auto ok = attach(*s, std::move(fd), keys); !ok) return ok;
    streams_.push_back(std::move(s));
    return Ok{};
}

Status TcpLink::attach(Stream &s, UniqueFd fd, const SessionKeys &keys) {
    const int flags = ::fcntl(fd.get(), F_GETFL);
    if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0)
        return make_error(-errno, "fcntl: " + errno_string(errno));
    const int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // fails harmlessly on socketpairs
    // The congestion control is normally the socket's from before it connected (prepare_socket).
    // One switched only now keeps what its first one set up at connection time: BBR's init turns
    // the kernel's internal pacing on, and no other congestion control turns it off again, which
    // made every stream of a 256 MiB op pay a pacing timer per burst (docs/perf.md).
    // A route's `congctl` overrides the socket's choice at connect time (and `congctl lock` any
    // later one): the warning in add_link names what the stream runs.
    const std::string &cc = t_.congestion_;  // checked at start (check_congestion)
    if (const std::string before = TcpTransport::congestion_of(fd.get()); !cc.empty() && !before.empty()) {  // not a socketpair
        if (before != cc) {
            if (::setsockopt(fd.get(), IPPROTO_TCP, TCP_CONGESTION, cc.data(), static_cast<socklen_t>(cc.size())) == 0)
                late_congestion_ = before + ", and only now switched to " + cc;
            else
                late_congestion_ = before + ", and switching to " + cc + " failed (" + errno_string(errno) + ")";
        }
    }
    // A fixed size turns the kernel's autotuning off; left alone, the buffers grow with the
    // connection's bandwidth x delay (up to net.ipv4.tcp_wmem/tcp_rmem's maximum), which on
    // shared cores kept more of the data in cache and cost less CPU per byte (docs/perf.md).
    const int sb = t_.socket_buffer_;
    if (sb > 0) {
        ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDBUF, &sb, sizeof sb);
        ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &sb, sizeof sb);
    }
    // (Several rails: a rail whose peer's kernel acknowledges nothing for tcp.rail_timeout is
    // found down by check_rails. Not TCP_USER_TIMEOUT: the kernel applies it to a zero window too,
    // and a receiver that waits for its trainer with its buffers full is not a rail that failed.)
    s.fd = std::move(fd);
    s.mac = SessionMac(keys);
    s.interest = EPOLLIN;
    s.rcvlowat = 1;
    epoll_event ev{};
    ev.events = s.interest;
    ev.data.ptr = &s;
    if (::epoll_ctl(t_.epoll_.get(), EPOLL_CTL_ADD, s.fd.get(), &ev) != 0) {
        const int e = errno;
        s.fd.reset();
        return make_error(-e, "epoll_ctl: " + errno_string(e));
    }
    return Ok{};
}

Status TcpLink::post_send(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    return post(region, offset, bytes, tag, false);
}

Status TcpLink::post_send_stable(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    return post(region, offset, bytes, tag, t_.zero_copy_ && region.fd >= 0 && bytes >= kZeroCopyMinBytes);
}

Status TcpLink::post(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag, bool by_reference) {
    if (error()) return *error();
    if (offset > region.bytes || bytes > region.bytes - offset)
        return make_error(-ERANGE, "send outside its registered region");
    Stream &s = pick_stream(bytes);
    enqueue(s, region.base + offset, bytes, tag, 0, by_reference ? region.fd : -1, by_reference ? region.fd_offset + offset : 0);
    return Ok{};
}

size_t TcpLink::choose_stream(std::span<const StreamLoad> streams, uint64_t bytes, size_t first) {
    const size_t n = streams.size();
    std::array<uint64_t, kMaxLinkRails> rail_backlog{};
    std::array<size_t, kMaxLinkRails> rail_best{};
    std::array<bool, kMaxLinkRails> seen{};
    for (size_t k = 0; k < n; ++k) {
        const size_t i = (first + k) % n;
        const StreamLoad &s = streams[i];
        rail_backlog[s.rail] += s.backlog;
        if (!seen[s.rail] || s.backlog < streams[rail_best[s.rail]].backlog) rail_best[s.rail] = i;
        seen[s.rail] = true;
    }
    size_t best = first % n;
    double best_done = 0;
    bool any = false;
    for (size_t k = 0; k < n; ++k) {  // the rails in the order their streams come from `first`
        const StreamLoad &s = streams[(first + k) % n];
        if (!seen[s.rail]) continue;
        seen[s.rail] = false;
        const double done = static_cast<double>(rail_backlog[s.rail] + bytes) / s.weight;
        if (!any || done < best_done) {
            best = rail_best[s.rail];
            best_done = done;
            any = true;
        }
    }
    return best;
}

TcpLink::Stream &TcpLink::pick_stream(uint64_t bytes) {
    const size_t n = streams_.size();
    const size_t first = next_stream_++ % n;
    if (!weighted_) return *streams_[first];
    // The receiver matches messages to receives by tag on any stream, so any stream of a rail
    // that is up will do (the streams in turn from `first`, for choose_stream's ties).
    std::array<StreamLoad, kMaxLinkStreams> load;
    std::array<uint32_t, kMaxLinkStreams> which;
    size_t m = 0;
    for (size_t k = 0; k < n; ++k) {
        const size_t i = (first + k) % n;
        Stream &s = *streams_[i];
        if (!s.up()) continue;
        uint64_t backlog = 0;
        for (const SendOp &op : s.sendq) backlog += kHeaderBytes + op.bytes + op.mac_bytes - op.done;
        int outq = 0;
        if (::ioctl(s.fd.get(), SIOCOUTQ, &outq) == 0 && outq > 0) backlog += static_cast<uint64_t>(outq);
        load[m] = {s.rail, s.weight, backlog};
        which[m++] = static_cast<uint32_t>(i);
    }
    if (m == 0) return *streams_[first];  // (the link has failed: every rail is down)
    return *streams_[which[choose_stream(std::span(load.data(), m), bytes, 0)]];
}

void TcpLink::enqueue(Stream &s, const std::byte *data, uint64_t bytes, uint64_t tag, uint32_t flags, int fd,
                      uint64_t fd_offset, std::vector<std::byte> owned, size_t at) {
    SendOp op;
    op.tag = tag;
    op.owned = std::move(owned);
    op.data = op.owned.empty() ? data : op.owned.data();
    op.bytes = op.owned.empty() ? bytes : op.owned.size();
    op.fd = fd;
    op.fd_offset = fd_offset;
    op.transport_own = flags != 0;
    if (s.sendq.empty() && s.inflight.empty()) s.pending_since = std::chrono::steady_clock::now();
    if (flags == kFlagFence) s.fence_ops.push_back(static_cast<uint32_t>(tag >> 32));
    proto::le::put<uint32_t>(&op.header[0], kDataMagic);
    proto::le::put<uint32_t>(&op.header[4], (s.mac.enabled() ? kFlagTagged : 0) | flags);
    proto::le::put<uint64_t>(&op.header[8], tag);
    proto::le::put<uint64_t>(&op.header[16], op.bytes);
    if (s.mac.enabled()) op.mac_bytes = kTagBytes;  // (made by start())
    if (at >= s.sendq.size()) {
        s.sendq.push_back(std::move(op));
    } else {
        if (at == 0 && s.sendq.front().started) at = 1;
        s.sendq.insert(s.sendq.begin() + static_cast<std::ptrdiff_t>(at), std::move(op));
    }
    if (s.sendq.size() == 1) write_some(s);  // opportunistic: most sends leave right away
    if (!error()) update_interest(s);
}

void TcpLink::start(Stream &s, SendOp &op) {
    op.started = true;
    if (!op.transport_own) op.seq = s.sent_seq++;
    // The payload is final once posted (the engine does not touch it until SendDone).
    if (s.mac.enabled())
        op.mac = s.mac.send.seal({std::span<const uint8_t>(op.header, kHeaderBytes),
                                  std::span(reinterpret_cast<const uint8_t *>(op.data), op.bytes)});
}

void TcpLink::fence(uint32_t op_tag) {
    if (error()) return;
    // On every stream that is up (a rail that goes down meanwhile takes its streams' fences off,
    // those sent and those not).
    for (auto &sp : streams_) {
        if (!sp->up()) continue;
        ++fences_[op_tag];
        enqueue(*sp, nullptr, 0, uint64_t{op_tag} << 32, kFlagFence, -1, 0);
        if (error()) return;
    }
}

Status TcpLink::post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    if (error()) return *error();
    if (offset > region.bytes || bytes > region.bytes - offset)
        return make_error(-ERANGE, "receive outside its registered region");
    RecvOp op{region.base + offset, bytes};
    // Read already, while a rail was down (held).
    if (auto h = held_.find(tag); h != held_.end()) {
        if (h->second.data.size() != bytes) {
            fail(-EPROTO, "message " + std::to_string(tag) + " has " + std::to_string(h->second.data.size()) +
                              " bytes, the receive expects " + std::to_string(bytes));
            return *error();
        }
        if (bytes) std::memcpy(op.data, h->second.data.data(), bytes);
        held_bytes_ -= bytes;
        held_.erase(h);
        bytes_received_ += bytes;
        t_.complete({this, LinkEvent::Kind::RecvDone, tag, {}});
        return Ok{};
    }
    // A stream may already hold this message's header, waiting for exactly this receive.
    for (auto &sp : streams_) {
        Stream &s = *sp;
        if (s.have_header && !s.cur && s.tag == tag) {
            if (s.bytes != bytes) {
                fail(-EPROTO, "message " + std::to_string(tag) + " has " + std::to_string(s.bytes) +
                                  " bytes, the receive expects " + std::to_string(bytes));
                return *error();
            }
            s.cur = op;
            read_some(s);
            if (!error()) update_interest(s);
            return Ok{};
        }
    }
    if (!posted_.emplace(tag, op).second) return make_error(-EEXIST, "receive " + std::to_string(tag) + " posted twice");
    return Ok{};
}

void TcpLink::on_event(Stream &s, uint32_t events) {
    if (error() || !s.up()) return;
    if (weighted_ && (events & (EPOLLERR | EPOLLHUP))) {
        // Also when the stream is left unread (its next message has no receive yet).
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(s.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        return stream_failed(s, err ? -err : -ECONNRESET, err ? "socket: " + errno_string(err) : "connection closed by peer");
    }
    if (events & EPOLLOUT) write_some(s);
    if (!error() && s.up() && (events & (EPOLLIN | EPOLLHUP | EPOLLERR))) read_some(s);
    if (!error()) update_interest(s);
}

void TcpLink::write_some(Stream &s) {
    while (!s.sendq.empty()) {
        SendOp &op = s.sendq.front();
        if (!op.started) start(s, op);
        iovec iov[3];
        int n = 0;
        if (op.done < kHeaderBytes) iov[n++] = {op.header + op.done, kHeaderBytes - op.done};
        const uint64_t pdone = op.done > kHeaderBytes ? op.done - kHeaderBytes : 0;
        if (op.bytes > pdone) iov[n++] = {const_cast<std::byte *>(op.data) + pdone, op.bytes - pdone};
        const uint64_t mdone = op.done > kHeaderBytes + op.bytes ? op.done - kHeaderBytes - op.bytes : 0;
        if (op.mac_bytes > mdone) iov[n++] = {op.mac.data() + mdone, op.mac_bytes - mdone};
        ssize_t w = 0;
        if (op.fd >= 0 && op.done < kHeaderBytes + op.bytes) {
            // By reference: the header (MSG_MORE: it goes out with the payload's first pages),
            // then the payload's pages from the file; the tag, if any, as usual after them.
            if (op.done < kHeaderBytes) {
                w = ::send(s.fd.get(), op.header + op.done, kHeaderBytes - op.done, MSG_NOSIGNAL | MSG_DONTWAIT | MSG_MORE);
            } else {
                off_t at = static_cast<off_t>(op.fd_offset + pdone);
                w = ::sendfile(s.fd.get(), op.fd, &at, std::min<uint64_t>(op.bytes - pdone, 1u << 30));
                if (w == 0) {
                    fail(-EIO, "sendfile: the region's file ends before the message");
                    return;
                }
            }
            if (w < 0) {
                if (errno == EAGAIN || errno == EINTR) return;
                const int e = errno;
                stream_failed(s, -e, std::string(op.done < kHeaderBytes ? "send: " : "sendfile: ") + errno_string(e));
                return;
            }
            op.done += static_cast<uint64_t>(w);
            continue;
        }
        if (n > 0) {
            msghdr msg{};
            msg.msg_iov = iov;
            msg.msg_iovlen = static_cast<size_t>(n);
            w = ::sendmsg(s.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w < 0) {
                if (errno == EAGAIN || errno == EINTR) return;
                const int e = errno;
                stream_failed(s, -e, "send: " + errno_string(e));
                return;
            }
        }
        op.done += static_cast<uint64_t>(w);
        if (op.done < kHeaderBytes + op.bytes + op.mac_bytes) continue;
        bytes_sent_ += op.bytes;
        bytes_by_rail_[s.rail] += op.bytes;
        if (op.fd >= 0) bytes_by_reference_ += op.bytes;
        if (!op.transport_own) {
            if (weighted_)
                s.inflight.push_back(std::move(op));  // SendDone when the peer's ack says it has it
            else
                t_.complete({this, LinkEvent::Kind::SendDone, op.tag, {}});
        }
        s.sendq.pop_front();
    }
}

bool TcpLink::receive_into(Stream &s, void *at, size_t want, size_t &got) {
    const ssize_t r = ::recv(s.fd.get(), at, want, MSG_DONTWAIT);
    if (r == 0) {
        stream_failed(s, -ECONNRESET, "connection closed by peer");
        return false;
    }
    if (r < 0) {
        const int e = errno;
        if (e != EAGAIN && e != EINTR) stream_failed(s, -e, "receive: " + errno_string(e));
        return false;
    }
    got += static_cast<size_t>(r);
    return true;
}

void TcpLink::wake_at(Stream &s, size_t want) {
    if (error() || !s.up()) return;
    const int v = static_cast<int>(std::clamp<size_t>(want, 1, kMaxWakeBytes));
    if (v == s.rcvlowat) return;
    ::setsockopt(s.fd.get(), SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);  // a hint: failing only costs wake-ups
    s.rcvlowat = v;
}

void TcpLink::read_some(Stream &s) {
    read_messages(s);
    // One ack for what this call read (several rails): the peer's SendDone of those messages.
    if (s.ack_due && !error() && s.up()) {
        s.ack_due = false;
        enqueue(s, nullptr, 0, s.recvd, kFlagAck, -1, 0);
    }
}

void TcpLink::read_messages(Stream &s) {
    for (;;) {
        if (error() || !s.up()) return;
        if (!s.have_header) {
            if (!receive_into(s, s.header + s.header_got, kHeaderBytes - s.header_got, s.header_got)) return wake_at(s, 1);
            if (s.header_got < kHeaderBytes) continue;
            if (proto::le::get<uint32_t>(&s.header[0]) != kDataMagic)
                return fail(-EPROTO, "bad data header (not a ringd peer, or a corrupted stream)");
            const uint32_t flags = proto::le::get<uint32_t>(&s.header[4]);
            const uint32_t want = s.mac.enabled() ? kFlagTagged : 0;
            s.in_flags = flags & kTransportFlags;
            // At most one kind of the transport's own; acks and notices only between rails.
            const bool bad_kind = (s.in_flags & (s.in_flags - 1)) != 0 || (!weighted_ && (s.in_flags & (kFlagAck | kFlagRail | kFlagMark)));
            if ((flags & ~kTransportFlags) != want || bad_kind)
                return fail(-EPROTO, flags & ~(kFlagTagged | kTransportFlags) || bad_kind
                                         ? "bad data header flags (not a ringd peer, or a corrupted stream)"
                                     : want ? "data without MACs from a host that should tag it (auth.data must be the same on every host)"
                                            : "data with MACs from a host configured otherwise (auth.data must be the same on every host)");
            s.tag = proto::le::get<uint64_t>(&s.header[8]);
            s.bytes = proto::le::get<uint64_t>(&s.header[16]);
            s.got = 0;
            s.have_header = true;
            if (s.in_flags == kFlagRail) {
                // A rail notice: a count per stream of the rail, read whole.
                if (s.bytes == 0 || s.bytes % 8 || s.bytes > 8 * kMaxLinkStreams)
                    return fail(-EPROTO, "a rail notice of " + std::to_string(s.bytes) + " bytes (not a ringd peer, or a corrupted stream)");
                if (s.scratch.size() < s.bytes) s.scratch.resize(s.bytes);
                s.cur = RecvOp{s.scratch.data(), s.bytes};
                s.discard = true;
                continue;
            }
            if (s.in_flags) {
                // A fence, its ack, an ack or a resend mark: empty, read whatever is posted or dropped.
                if (s.bytes != 0) return fail(-EPROTO, "a fence, ack or mark with a payload (not a ringd peer, or a corrupted stream)");
                s.cur = RecvOp{s.scratch.data(), 0};
                s.discard = true;
                continue;
            }
            if (dropped(s.tag)) {
                if (!start_discard(s)) return;
                continue;
            }
            auto it = posted_.find(s.tag);
            if (it == posted_.end()) {
                // Since a rail went down, a message that was sent again may come behind later
                // ones on a stream: while a receive waits for one, those are read ahead into the
                // link's memory rather than left in the stream (try_hold).
                const auto now = std::chrono::steady_clock::now();
                if (!s.reading_ahead) s.stalled_since = now;  // (read ahead after hold_after: goes on)
                if (!try_hold(s, now)) return;                // stall until post_recv(tag)
            } else {
                if (it->second.bytes != s.bytes)
                    return fail(-EPROTO, "message " + std::to_string(s.tag) + " has " + std::to_string(s.bytes) +
                                             " bytes, the receive expects " + std::to_string(it->second.bytes));
                s.cur = it->second;
                posted_.erase(it);
                s.reading_ahead = false;
            }
        }
        if (!s.cur) return;  // header waiting for its receive
        if (s.got < s.bytes) {
            if (!receive_into(s, s.cur->data + s.got, s.bytes - s.got, s.got)) return wake_at(s, s.bytes - s.got);
            if (s.got < s.bytes) continue;
        }
        if (s.mac.enabled()) {
            if (s.mac_got < kTagBytes) {
                if (!receive_into(s, s.mac_in.data() + s.mac_got, kTagBytes - s.mac_got, s.mac_got)) return wake_at(s, 1);
                if (s.mac_got < kTagBytes) continue;
            }
            s.mac_got = 0;
            if (!s.mac.recv.open({std::span<const uint8_t>(s.header, kHeaderBytes),
                                  std::span(reinterpret_cast<const uint8_t *>(s.cur->data), s.bytes)},
                                 s.mac_in))
                return fail(-EACCES, "data message " + std::to_string(s.tag) + " from " + peer() +
                                         " fails its MAC check (forged, replayed, reordered or corrupted)");
        }
        const uint32_t in_flags = std::exchange(s.in_flags, 0);
        const uint64_t in_tag = s.tag;
        const bool was_held = s.holding;
        if (in_flags == 0 && weighted_) {
            ++s.recvd;  // read (or dropped): the peer need not send it again
            s.ack_due = true;
        }
        if (s.holding) {
            s.holding = false;
            auto it = posted_.find(in_tag);  // posted while it was being read
            if (dropped(in_tag)) {
                held_bytes_ -= s.bytes;
            } else if (it != posted_.end()) {
                if (it->second.bytes != s.bytes)
                    return fail(-EPROTO, "message " + std::to_string(in_tag) + " has " + std::to_string(s.bytes) +
                                             " bytes, the receive expects " + std::to_string(it->second.bytes));
                if (s.bytes) std::memcpy(it->second.data, s.hold.data(), s.bytes);
                posted_.erase(it);
                held_bytes_ -= s.bytes;
                bytes_received_ += s.bytes;
                t_.complete({this, LinkEvent::Kind::RecvDone, in_tag, {}});
            } else {
                held_.emplace(in_tag, Held{std::move(s.hold)});
            }
            s.hold = {};
        } else if (!s.discard) {
            bytes_received_ += s.bytes;
            t_.complete({this, LinkEvent::Kind::RecvDone, s.tag, {}});
        }
        s.discard = false;
        s.cur.reset();
        s.have_header = false;
        s.header_got = 0;
        if (in_flags == kFlagFence) {
            // Everything of the op the peer sent on this stream before its fence is read here.
            enqueue(s, nullptr, 0, in_tag, kFlagFenceAck, -1, 0);
        } else if (in_flags == kFlagFenceAck) {
            if (!s.fence_ops.empty()) s.fence_ops.pop_front();
            auto f = fences_.find(static_cast<uint32_t>(in_tag >> 32));
            if (f != fences_.end() && --f->second == 0) fences_.erase(f);
        } else if (in_flags == kFlagAck) {
            on_ack(s, in_tag);
        } else if (in_flags == kFlagRail) {
            on_notice(s, in_tag, s.bytes);
        } else if (in_flags == kFlagMark) {
            --s.marks_due;
        }
        // A message read ahead: the other streams' turn (epoll reports this one again), so that
        // one the peer keeps filling does not take all of kMaxHeldBytes while what a receive
        // waits for is behind another.
        if (was_held) return wake_at(s, 1);
    }
}

bool TcpLink::start_discard(Stream &s) {
    if (s.bytes > kMaxDiscardBytes) {
        fail(-EPROTO, "message " + std::to_string(s.tag) + " of a cancelled op has " + std::to_string(s.bytes) +
                          " bytes, more than a ring message can");
        return false;
    }
    if (s.scratch.size() < s.bytes) s.scratch.resize(s.bytes);
    if (s.cur && s.got) std::memcpy(s.scratch.data(), s.cur->data, s.got);
    if (s.holding) {  // read ahead, and dropped now: its memory goes back
        held_bytes_ -= s.bytes;
        s.holding = false;
        s.hold = {};
    }
    s.cur = RecvOp{s.scratch.data(), s.bytes};
    s.discard = true;
    return true;
}

void TcpLink::set_floor(uint32_t op_tag) {
    if (error()) return;
    if (has_floor_ && !solo_tag_before(floor_, op_tag)) return;
    has_floor_ = true;
    floor_ = op_tag;
    std::erase_if(held_, [&](const auto &h) {
        if (!dropped(h.first)) return false;
        held_bytes_ -= h.second.data.size();
        return true;
    });
    for (auto &sp : streams_) {
        Stream &s = *sp;
        if (!s.have_header || s.cur || !dropped(s.tag)) continue;
        if (!start_discard(s)) return;
        read_some(s);
        if (error()) return;
        update_interest(s);
    }
}

void TcpLink::cancel_receives(uint32_t op_tag) {
    if (error()) return;
    for (auto it = posted_.begin(); it != posted_.end();)
        it = static_cast<uint32_t>(it->first >> 32) == op_tag ? posted_.erase(it) : std::next(it);
    std::erase_if(held_, [&](const auto &h) {
        if (static_cast<uint32_t>(h.first >> 32) != op_tag) return false;
        held_bytes_ -= h.second.data.size();
        return true;
    });
    for (auto &sp : streams_) {
        Stream &s = *sp;
        if (s.cur && !s.discard && static_cast<uint32_t>(s.tag >> 32) == op_tag && !start_discard(s)) return;
    }
}

bool TcpLink::sending(uint32_t op_tag) const {
    if (fences_.count(op_tag)) return true;
    for (const auto &sp : streams_) {
        for (const auto &op : sp->sendq)
            if (static_cast<uint32_t>(op.tag >> 32) == op_tag) return true;
        for (const auto &op : sp->inflight)
            if (static_cast<uint32_t>(op.tag >> 32) == op_tag) return true;
    }
    return false;
}

std::string TcpLink::describe() const {
    std::string d = "posted " + std::to_string(posted_.size()) + ", held " + std::to_string(held_.size()) + " (" +
                    std::to_string(held_bytes_) + " bytes" + (hold_ ? "" : ", not holding") + "), rails down " +
                    std::to_string(rails_down_) + ";";
    for (size_t i = 0; i < streams_.size(); ++i) {
        const Stream &s = *streams_[i];
        d += " [" + std::to_string(i) + " rail " + std::to_string(s.rail) + (s.up() ? "" : " down") + ": send " +
             std::to_string(s.sendq.size()) + ", unacked " + std::to_string(s.inflight.size()) + ", read " +
             std::to_string(s.recvd);
        if (s.marks_due) d += ", marks due " + std::to_string(s.marks_due);
        if (s.have_header)
            d += ", in " + std::to_string(s.tag) + (s.holding ? " (held)" : s.discard ? " (dropped)" : !s.cur ? " (no receive)" : "") +
                 " " + std::to_string(s.got) + "/" + std::to_string(s.bytes);
        if (s.up()) d += s.interest & EPOLLIN ? ", reading" : ", not reading";
        d += "]";
    }
    return d;
}

void TcpLink::update_interest(Stream &s) {
    if (!s.up()) return;
    uint32_t want = 0;
    if (!s.sendq.empty()) want |= EPOLLOUT;
    if (!s.have_header || s.cur) want |= EPOLLIN;  // a stalled stream is left unread
    if (want == s.interest) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.ptr = &s;
    ::epoll_ctl(t_.epoll_.get(), EPOLL_CTL_MOD, s.fd.get(), &ev);
    s.interest = want;
}

void TcpLink::fail(int code, const std::string &why) {
    if (error()) return;
    const Error e = set_error(code, why);
    for (auto &sp : streams_) {
        Stream &s = *sp;
        for (const auto &op : s.sendq)
            if (!op.transport_own) t_.complete({this, LinkEvent::Kind::Failed, op.tag, e});
        s.sendq.clear();
        for (const auto &op : s.inflight) t_.complete({this, LinkEvent::Kind::Failed, op.tag, e});
        s.inflight.clear();
        if (s.cur && !s.discard && !s.holding) t_.complete({this, LinkEvent::Kind::Failed, s.tag, e});
        s.cur.reset();
        if (s.up()) ::epoll_ctl(t_.epoll_.get(), EPOLL_CTL_DEL, s.fd.get(), nullptr);
        s.fd.reset();
    }
    held_.clear();
    held_bytes_ = 0;
    for (const auto &[tag, op] : posted_) t_.complete({this, LinkEvent::Kind::Failed, tag, e});
    posted_.clear();
    // Also when nothing was pending: the owner learns that the link is gone.
    t_.complete({this, LinkEvent::Kind::Failed, 0, e});
}


void TcpLink::stream_failed(Stream &s, int code, const std::string &why) {
    if (!weighted_) return fail(code, why);
    rail_down(s.rail, code, why);
}

void TcpLink::rail_down(uint32_t r, int code, const std::string &why) {
    if (error() || r >= rail_count_ || !rail_up(r)) return;
    rails_down_ |= 1u << r;
    hold_ = true;
    publish();
    RailState &st = rail_state_[r];
    st.sent_counts = st.got_counts = st.resent = false;
    st.peer_counts.clear();
    st.why = why;
    st.my_counts.clear();
    st.notice_epoch = st.epoch;
    st.notice_rail = -1;
    for_rail(r, [&](Stream &s) {
        st.my_counts.push_back(s.recvd);  // what this end read of the failed connections, for good
        if (s.up()) ::epoll_ctl(t_.epoll_.get(), EPOLL_CTL_DEL, s.fd.get(), nullptr);
        s.fd.reset();
        s.interest = 0;
        // A receive being filled waits for its message again (sent again on another rail).
        if (s.cur && !s.discard && !s.holding) posted_.emplace(s.tag, *s.cur);
        if (s.holding) held_bytes_ -= s.bytes;
        s.holding = false;
        s.hold = {};
        s.cur.reset();
        s.have_header = false;
        s.header_got = 0;
        s.got = 0;
        s.mac_got = 0;
        s.discard = false;
        s.in_flags = 0;
        s.ack_due = false;
        s.marks_due = 0;
        s.reading_ahead = false;
        // Fence acks that were to come on it will not: what the fence waited for is sent again
        // (and acknowledged) on the other rails, or the peer has it.
        for (uint32_t op : s.fence_ops) {
            auto f = fences_.find(op);
            if (f != fences_.end() && --f->second == 0) fences_.erase(f);
        }
        s.fence_ops.clear();
        // The transport's own messages belonged to the connection; a payload message that was
        // partly written goes again whole.
        std::erase_if(s.sendq, [](const SendOp &op) { return op.transport_own; });
        for (SendOp &op : s.sendq) {
            op.done = 0;
            op.started = false;
        }
    });
    const uint32_t all = rail_count_ >= 32 ? ~0u : (1u << rail_count_) - 1;
    if ((rails_down_ & all) == all) {
        // A peer that no rail reaches any more (timed out, unreachable) is this end's to name.
        const bool unreachable = code == -ETIMEDOUT || code == -EHOSTUNREACH;
        const bool cut_off = code == -ENETUNREACH || code == -ENETDOWN;  // this host's NICs
        return fail(unreachable ? -EHOSTUNREACH : code,
                    "rail " + std::to_string(r) + ": " + why + " (every rail of the link is down" +
                        (unreachable ? ": the host is unreachable)" : cut_off ? ": this host reaches no network on any rail)" : ")"));
    }
    spdlog::warn("data link to {}: rail {} down: {}; its messages go on the other rails until it is back", peer(), r, why);
    // The peer sends again, once the notices are exchanged, behind a resend mark on each stream
    // that is up; until that is read, what comes before it is read ahead of its receives (held),
    // so that neither a message sent again nor the peer's notice can wait behind it.
    for (auto &sp : streams_)
        if (sp->up()) ++sp->marks_due;
    st.sent_counts = true;
    send_notice(r);
    // Notices that went on this rail's streams: again, as they were (the peer takes the first of
    // each for its epoch and ignores repeats).
    for (uint32_t q = 0; q < rail_count_ && !error(); ++q)
        if (q != r && rail_state_[q].notice_rail == static_cast<int32_t>(r)) send_notice(q);
    if (!error() && rail_state_[r].got_counts && !rail_up(r)) resend(r);
    hold_stalled(std::chrono::steady_clock::now());  // those waiting now too
}

uint64_t TcpLink::socket_bytes() const {
    uint64_t total = 0;
    for (const auto &sp : streams_) {
        if (!sp->up()) continue;
        int snd = 0, rcv = 0;
        socklen_t len = sizeof snd;
        if (::getsockopt(sp->fd.get(), SOL_SOCKET, SO_SNDBUF, &snd, &len) == 0 && snd > 0) total += static_cast<uint64_t>(snd);
        len = sizeof rcv;
        if (::getsockopt(sp->fd.get(), SOL_SOCKET, SO_RCVBUF, &rcv, &len) == 0 && rcv > 0) total += static_cast<uint64_t>(rcv);
    }
    return total;
}

bool TcpLink::try_hold(Stream &s, std::chrono::steady_clock::time_point now) {
    if (!s.up() || !s.have_header || s.cur || s.in_flags || s.bytes > kMaxDiscardBytes || held_.count(s.tag) ||
        posted_.count(s.tag))
        return false;
    const bool want = s.marks_due > 0;  // ahead of the peer's resend mark
    if (!want && now - s.stalled_since < t_.hold_after_) return false;
    if (held_bytes_ + s.bytes > kMaxHeldBytes) {
        if (!want) return false;
        const uint64_t most = std::max(kMaxWantedBytes, 2 * socket_bytes());
        if (held_bytes_ + s.bytes > most) {
            fail(-ENOBUFS, "more than " + std::to_string(most >> 20) + " MiB from " + peer() +
                               " came ahead of its resend mark after a rail went down (more than its sockets hold)");
            return false;
        }
        if (!held_past_)
            spdlog::warn("data link to {}: {} MiB read ahead of their receives and the resend mark still to come; "
                         "reading on past {} MiB",
                         peer(), held_bytes_ >> 20, kMaxHeldBytes >> 20);
        held_past_ = true;
    } else if (held_bytes_ + s.bytes <= kMaxHeldBytes / 2) {
        held_past_ = false;
    }
    if (!want) s.reading_ahead = true;
    s.hold.assign(s.bytes, std::byte{0});
    held_bytes_ += s.bytes;
    ++held_messages_;
    s.cur = RecvOp{s.hold.data(), s.bytes};
    s.holding = true;
    return true;
}

void TcpLink::check_rails() {
    for (auto &sp : streams_) {
        if (error()) return;
        Stream &s = *sp;
        if (!s.up() || (s.sendq.empty() && s.inflight.empty())) continue;
        const auto waiting = std::chrono::steady_clock::now() - s.pending_since;
        if (waiting < std::chrono::milliseconds(t_.rail_timeout_ms_)) continue;
        int outq = 0;
        TcpProgress tp;
        if (::ioctl(s.fd.get(), SIOCOUTQ, &outq) != 0 || outq <= 0 || !tcp_progress(s.fd.get(), tp)) continue;  // (not TCP)
        // Bytes in the socket for as long as the rail's timeout, nothing acknowledged since, and
        // either segments on the wire or a window open to send them (an unsent queue behind an
        // open window: the local NIC is down): a path that is gone. A peer that is slow to read
        // closes its window, and its kernel acknowledges the window probes.
        if (tp.last_ack_ms >= t_.rail_timeout_ms_ && (tp.unacked > 0 || (tp.have_window && tp.peer_window > 0)))
            stream_failed(s, -ETIMEDOUT, "no acknowledgement from " + peer() + " for " + std::to_string(tp.last_ack_ms) +
                                             " ms (tcp.rail_timeout)");
    }
}

void TcpLink::hold_stalled(std::chrono::steady_clock::time_point now) {
    for (auto &sp : streams_) {
        if (error()) return;
        Stream &s = *sp;
        if (!s.up() || !s.have_header || s.cur || !try_hold(s, now)) continue;
        read_some(s);
        if (!error()) update_interest(s);
    }
}

void TcpLink::send_notice(uint32_t r) {
    RailState &st = rail_state_[r];
    std::vector<std::byte> counts(8 * st.my_counts.size());
    for (size_t i = 0; i < st.my_counts.size(); ++i)
        proto::le::put<uint64_t>(reinterpret_cast<uint8_t *>(counts.data() + 8 * i), st.my_counts[i]);
    // On the stream with the fewest messages the peer has not read: the notice is read the
    // sooner (one the peer has read everything of is not waiting for a receive there).
    Stream *to = nullptr;
    size_t least = SIZE_MAX;
    for (auto &sp : streams_) {
        if (!sp->up() || sp->rail == r) continue;  // (a repeat, once the rail is back: not on it)
        size_t unread = sp->inflight.size();
        for (const SendOp &op : sp->sendq) unread += op.transport_own ? 0 : 1;
        if (unread < least) {
            least = unread;
            to = sp.get();
        }
    }
    if (!to) return;
    const uint64_t tag = r | (uint64_t{st.notice_epoch} << 32);
    st.notice_rail = static_cast<int32_t>(to->rail);
    enqueue(*to, nullptr, 0, tag, kFlagRail, -1, 0, std::move(counts), 0);  // ahead of what is queued
}

void TcpLink::on_notice(Stream &s, uint64_t tag, uint64_t bytes) {
    const uint32_t r = static_cast<uint32_t>(tag & 0xffffffffu), epoch = static_cast<uint32_t>(tag >> 32);
    size_t n = 0;
    for_rail(r, [&](Stream &) { ++n; });
    const bool current = r < rail_count_ && (epoch == rail_state_[r].epoch || epoch == rail_state_[r].epoch + 1);
    // (A repeat about connections of the rail that were replaced since may come on the new ones.)
    if (r >= rail_count_ || (current && r == s.rail) || bytes != 8 * n)
        return fail(-EPROTO, "a rail notice for rail " + std::to_string(r) + " of " + std::to_string(bytes) +
                                 " bytes on rail " + std::to_string(s.rail) + " (not a ringd peer, or a corrupted stream)");
    std::vector<uint64_t> counts(n);
    for (size_t i = 0; i < n; ++i) counts[i] = proto::le::get<uint64_t>(reinterpret_cast<const uint8_t *>(s.scratch.data() + 8 * i));
    if (epoch == rail_state_[r].epoch + 1) {
        // About the rail's next connections, which the peer has and this end does not have yet:
        // taken once they are here (maybe_attach).
        rail_state_[r].early = std::move(counts);
        return;
    }
    if (epoch != rail_state_[r].epoch) return;  // about connections of the rail that were replaced since
    counts_in(r, std::move(counts));
}

void TcpLink::counts_in(uint32_t r, std::vector<uint64_t> counts) {
    if (rail_up(r)) rail_down(r, -ENETDOWN, peer() + " found it down");
    if (error() || rail_up(r)) return;
    RailState &st = rail_state_[r];
    if (st.got_counts) return;
    st.peer_counts = std::move(counts);
    st.got_counts = true;
    if (st.sent_counts) resend(r);
}

void TcpLink::resend(uint32_t r) {
    RailState &st = rail_state_[r];
    if (st.resent) return;
    st.resent = true;
    std::vector<SendOp> again;
    size_t i = 0;
    bool bad = false;
    for_rail(r, [&](Stream &s) {
        const uint64_t have = i < st.peer_counts.size() ? st.peer_counts[i] : 0;
        ++i;
        if (have > s.sent_seq) bad = true;
        for (SendOp &op : s.inflight) {
            if (op.seq < have)
                t_.complete({this, LinkEvent::Kind::SendDone, op.tag, {}});  // the peer has it; its ack was lost
            else
                again.push_back(std::move(op));
        }
        for (SendOp &op : s.sendq)
            if (!op.transport_own) again.push_back(std::move(op));
        s.inflight.clear();
        s.sendq.clear();
    });
    if (bad) return fail(-EPROTO, "the peer's notice for rail " + std::to_string(r) + " counts messages never sent on it");
    // A resend mark on every stream that is up, ahead of everything not yet written: the peer
    // reads each stream ahead of its receives (while one waits) only until its mark.
    for (auto &sp : streams_) {
        if (!sp->up()) continue;
        enqueue(*sp, nullptr, 0, 0, kFlagMark, -1, 0, {}, 0);
        if (error()) return;
    }
    // Each goes where the ring would have posted it among the messages still queued behind the
    // marks (before the first one of a later tag, or the fence of its op or a later one): the
    // peer posts its receives in that order, and one behind later messages would wait for the
    // peer to read those ahead of their receives. Of the streams, on the one whose peer reads it
    // the soonest: the fewest bytes ahead of it, written and not read or queued, at its rail's
    // weight (what is written stays ahead of it whatever goes first here).
    auto before = [](uint64_t a, uint64_t b) {  // in the order the ops run (solo tags wrap)
        const uint32_t oa = static_cast<uint32_t>(a >> 32), ob = static_cast<uint32_t>(b >> 32);
        if (oa != ob) return solo_tag(oa) && solo_tag(ob) ? solo_tag_before(oa, ob) : oa < ob;
        return static_cast<uint32_t>(a) < static_cast<uint32_t>(b);
    };
    std::stable_sort(again.begin(), again.end(), [&](const SendOp &a, const SendOp &b) { return before(a.tag, b.tag); });
    auto place = [&](const Stream &s, uint64_t tag, uint64_t &ahead) {
        for (const SendOp &q : s.inflight) ahead += q.bytes;
        size_t at = 0;
        for (; at < s.sendq.size(); ++at) {
            const SendOp &q = s.sendq[at];
            const bool fence = q.transport_own && (proto::le::get<uint32_t>(&q.header[4]) & kFlagFence);
            if (!q.started && (fence ? !before(q.tag, tag & ~uint64_t{0xffffffffu}) : !q.transport_own && before(tag, q.tag)))
                break;
            ahead += q.bytes - std::min(q.bytes, q.done);
        }
        return at;
    };
    uint64_t bytes = 0;
    for (SendOp &op : again) {
        if (error()) return;
        Stream *to = nullptr;
        size_t at = 0;
        double soonest = 0;
        for (auto &sp : streams_) {
            if (!sp->up()) continue;
            uint64_t ahead = 0;
            const size_t i = place(*sp, op.tag, ahead);
            const double t = static_cast<double>(ahead) / sp->weight;
            if (!to || t < soonest) {
                to = sp.get();
                at = i;
                soonest = t;
            }
        }
        if (!to) return;  // (every rail is down: the link has failed)
        enqueue(*to, op.data, op.bytes, op.tag, 0, op.fd, op.fd_offset, {}, at);
        ++resent_messages_;
        resent_bytes_ += op.bytes;
        bytes += op.bytes;
    }
    if (error()) return;
    publish();  // resynced: new connections may come
    if (!again.empty())
        spdlog::info("data link to {}: rail {}: {} message(s) ({} bytes) that {} did not have sent again on the other rails",
                     peer(), r, again.size(), bytes, peer());
    maybe_attach(r);
}

void TcpLink::on_ack(Stream &s, uint64_t count) {
    if (count > s.sent_seq)
        return fail(-EPROTO, "an ack for " + std::to_string(count) + " messages, of " + std::to_string(s.sent_seq) +
                                 " sent (not a ringd peer, or a corrupted stream)");
    while (!s.inflight.empty() && s.inflight.front().seq < count) {
        t_.complete({this, LinkEvent::Kind::SendDone, s.inflight.front().tag, {}});
        s.inflight.pop_front();
    }
}

Status TcpLink::add_rail_streams(uint32_t r, std::vector<UniqueFd> fds, const std::vector<SessionKeys> &keys) {
    if (error()) return *error();
    if (!weighted_ || r >= rail_count_) return make_error(-EINVAL, "link to " + peer() + " has no rail " + std::to_string(r));
    if (rail_up(r)) return make_error(-EALREADY, "rail " + std::to_string(r) + " of the link to " + peer() + " is up");
    size_t n = 0;
    for_rail(r, [&](Stream &) { ++n; });
    if (fds.size() != n || (!keys.empty() && keys.size() != n))
        return make_error(-EINVAL, "rail " + std::to_string(r) + " has " + std::to_string(n) + " streams, not " +
                                       std::to_string(fds.size()));
    RailState &st = rail_state_[r];
    st.pending = std::move(fds);
    st.pending_keys = keys;
    maybe_attach(r);
    return Ok{};
}

void TcpLink::maybe_attach(uint32_t r) {
    RailState &st = rail_state_[r];
    if (error() || rail_up(r) || !st.sent_counts || !st.got_counts || st.pending.empty()) return;
    size_t i = 0;
    Status ok = Ok{};
    for_rail(r, [&](Stream &s) {
        const SessionKeys k = t_.data_mac_ && i < st.pending_keys.size() ? st.pending_keys[i] : SessionKeys{};
        if (ok) ok = attach(s, std::move(st.pending[i]), k);
        s.sent_seq = 0;
        s.recvd = 0;
        s.marks_due = 0;
        s.reading_ahead = false;
        ++i;
    });
    st.pending.clear();
    st.pending_keys.clear();
    st.sent_counts = st.got_counts = st.resent = false;
    st.peer_counts.clear();
    ++st.epoch;
    rails_down_ &= ~(1u << r);
    publish();
    if (!ok) rail_down(r, ok.error().code, "its new connections: " + ok.error().message);
    else spdlog::info("data link to {}: rail {} up again", peer(), r);
    if (st.early && !error()) {
        // The peer found the new connections down already.
        std::vector<uint64_t> counts = std::move(*st.early);
        st.early.reset();
        counts_in(r, std::move(counts));
    }
}

}  // namespace ringd

namespace ringd {

void TcpLink::publish() {
    if (!published_) return;
    uint32_t resynced = 0;
    for (uint32_t r = 0; r < rail_count_; ++r)
        if (rail_resynced(r)) resynced |= 1u << r;
    published_->store(uint64_t{rails_down_} | (uint64_t{resynced} << 32));
}

}  // namespace ringd
