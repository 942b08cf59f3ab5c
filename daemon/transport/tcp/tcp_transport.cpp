#include "daemon/transport/tcp/tcp_transport.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/sendfile.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
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

TcpTransport::TcpTransport(std::string congestion, bool data_mac, uint64_t socket_buffer, bool zero_copy)
    : epoll_(::epoll_create1(EPOLL_CLOEXEC)), congestion_(std::move(congestion)), data_mac_(data_mac),
      socket_buffer_(static_cast<int>(std::min<uint64_t>(socket_buffer, 1u << 30))), zero_copy_(zero_copy) {}

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
                                      const std::vector<double> &weights) {
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
    for (size_t i = 0; i < streams.size(); ++i) {
        const SessionKeys k = data_mac_ && !keys.empty() ? keys[i] : SessionKeys{};
        if (auto s = link->add_stream(std::move(streams[i]), k); !s) return s.error();
        if (!rails.empty()) {
            link->streams_.back()->rail = rails[i];
            link->streams_.back()->weight = weights[i];
        }
    }
    link->weighted_ = !rails.empty();
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
        auto link = add_link(l.peer, std::move(l.streams), l.keys, l.rails, l.weights);
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
    for (int i = 0; i < n; ++i) {
        auto *s = static_cast<TcpLink::Stream *>(events[i].data.ptr);
        s->link->on_event(*s, events[i].events);
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
    auto s = std::make_unique<Stream>();
    s->link = this;
    s->fd = std::move(fd);
    s->mac = SessionMac(keys);
    s->interest = EPOLLIN;
    epoll_event ev{};
    ev.events = s->interest;
    ev.data.ptr = s.get();
    if (::epoll_ctl(t_.epoll_.get(), EPOLL_CTL_ADD, s->fd.get(), &ev) != 0)
        return make_error(-errno, "epoll_ctl: " + errno_string(errno));
    streams_.push_back(std::move(s));
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
    // The receiver matches messages to receives by tag on any stream, so any stream will do.
    std::array<StreamLoad, kMaxLinkStreams> load;
    for (size_t i = 0; i < n; ++i) {
        Stream &s = *streams_[i];
        uint64_t backlog = 0;
        for (const SendOp &op : s.sendq) backlog += kHeaderBytes + op.bytes + op.mac_bytes - op.done;
        int outq = 0;
        if (::ioctl(s.fd.get(), SIOCOUTQ, &outq) == 0 && outq > 0) backlog += static_cast<uint64_t>(outq);
        load[i] = {s.rail, s.weight, backlog};
    }
    return *streams_[choose_stream(std::span(load.data(), n), bytes, first)];
}

void TcpLink::enqueue(Stream &s, const std::byte *data, uint64_t bytes, uint64_t tag, uint32_t flags, int fd,
                      uint64_t fd_offset) {
    SendOp op;
    op.tag = tag;
    op.data = data;
    op.bytes = bytes;
    op.fd = fd;
    op.fd_offset = fd_offset;
    op.transport_own = flags != 0;
    proto::le::put<uint32_t>(&op.header[0], kDataMagic);
    proto::le::put<uint32_t>(&op.header[4], (s.mac.enabled() ? kFlagTagged : 0) | flags);
    proto::le::put<uint64_t>(&op.header[8], tag);
    proto::le::put<uint64_t>(&op.header[16], bytes);
    if (s.mac.enabled()) {
        // The payload is final once posted (the engine does not touch it until SendDone).
        op.mac = s.mac.send.seal({std::span<const uint8_t>(op.header, kHeaderBytes),
                                  std::span(reinterpret_cast<const uint8_t *>(op.data), bytes)});
        op.mac_bytes = kTagBytes;
    }
    s.sendq.push_back(op);
    if (s.sendq.size() == 1) write_some(s);  // opportunistic: most sends leave right away
    if (!error()) update_interest(s);
}

void TcpLink::fence(uint32_t op_tag) {
    if (error()) return;
    fences_[op_tag] += static_cast<uint32_t>(streams_.size());
    for (auto &sp : streams_) {
        enqueue(*sp, nullptr, 0, uint64_t{op_tag} << 32, kFlagFence, -1, 0);
        if (error()) return;
    }
}

Status TcpLink::post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    if (error()) return *error();
    if (offset > region.bytes || bytes > region.bytes - offset)
        return make_error(-ERANGE, "receive outside its registered region");
    RecvOp op{region.base + offset, bytes};
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
    if (error()) return;
    if (events & EPOLLOUT) write_some(s);
    if (!error() && (events & (EPOLLIN | EPOLLHUP | EPOLLERR))) read_some(s);
    if (!error()) update_interest(s);
}

void TcpLink::write_some(Stream &s) {
    while (!s.sendq.empty()) {
        SendOp &op = s.sendq.front();
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
                fail(-errno, std::string(op.done < kHeaderBytes ? "send: " : "sendfile: ") + errno_string(errno));
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
                fail(-errno, "send: " + errno_string(errno));
                return;
            }
        }
        op.done += static_cast<uint64_t>(w);
        if (op.done < kHeaderBytes + op.bytes + op.mac_bytes) continue;
        bytes_sent_ += op.bytes;
        bytes_by_rail_[s.rail] += op.bytes;
        if (op.fd >= 0) bytes_by_reference_ += op.bytes;
        if (!op.transport_own) t_.complete({this, LinkEvent::Kind::SendDone, op.tag, {}});
        s.sendq.pop_front();
    }
}

bool TcpLink::receive_into(Stream &s, void *at, size_t want, size_t &got) {
    const ssize_t r = ::recv(s.fd.get(), at, want, MSG_DONTWAIT);
    if (r == 0) {
        fail(-ECONNRESET, "connection closed by peer");
        return false;
    }
    if (r < 0) {
        if (errno != EAGAIN && errno != EINTR) fail(-errno, "receive: " + errno_string(errno));
        return false;
    }
    got += static_cast<size_t>(r);
    return true;
}

void TcpLink::wake_at(Stream &s, size_t want) {
    if (error()) return;
    const int v = static_cast<int>(std::clamp<size_t>(want, 1, kMaxWakeBytes));
    if (v == s.rcvlowat) return;
    ::setsockopt(s.fd.get(), SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);  // a hint: failing only costs wake-ups
    s.rcvlowat = v;
}

void TcpLink::read_some(Stream &s) {
    for (;;) {
        if (!s.have_header) {
            if (!receive_into(s, s.header + s.header_got, kHeaderBytes - s.header_got, s.header_got)) return wake_at(s, 1);
            if (s.header_got < kHeaderBytes) continue;
            if (proto::le::get<uint32_t>(&s.header[0]) != kDataMagic)
                return fail(-EPROTO, "bad data header (not a ringd peer, or a corrupted stream)");
            const uint32_t flags = proto::le::get<uint32_t>(&s.header[4]);
            const uint32_t want = s.mac.enabled() ? kFlagTagged : 0;
            s.in_flags = flags & (kFlagFence | kFlagFenceAck);
            if ((flags & ~(kFlagFence | kFlagFenceAck)) != want || s.in_flags == (kFlagFence | kFlagFenceAck))
                return fail(-EPROTO, flags & ~(kFlagTagged | kFlagFence | kFlagFenceAck) || s.in_flags == (kFlagFence | kFlagFenceAck)
                                         ? "bad data header flags (not a ringd peer, or a corrupted stream)"
                                     : want ? "data without MACs from a host that should tag it (auth.data must be the same on every host)"
                                            : "data with MACs from a host configured otherwise (auth.data must be the same on every host)");
            s.tag = proto::le::get<uint64_t>(&s.header[8]);
            s.bytes = proto::le::get<uint64_t>(&s.header[16]);
            s.got = 0;
            s.have_header = true;
            if (s.in_flags) {
                // A fence or its ack: empty, read whatever is posted or dropped.
                if (s.bytes != 0) return fail(-EPROTO, "a fence with a payload (not a ringd peer, or a corrupted stream)");
                s.cur = RecvOp{s.scratch.data(), 0};
                s.discard = true;
                continue;
            }
            if (dropped(s.tag)) {
                if (!start_discard(s)) return;
                continue;
            }
            auto it = posted_.find(s.tag);
            if (it == posted_.end()) return;  // stall until post_recv(tag)
            if (it->second.bytes != s.bytes)
                return fail(-EPROTO, "message " + std::to_string(s.tag) + " has " + std::to_string(s.bytes) +
                                         " bytes, the receive expects " + std::to_string(it->second.bytes));
            s.cur = it->second;
            posted_.erase(it);
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
        if (!s.discard) {
            bytes_received_ += s.bytes;
            t_.complete({this, LinkEvent::Kind::RecvDone, s.tag, {}});
        }
        const uint32_t in_flags = std::exchange(s.in_flags, 0);
        const uint64_t in_tag = s.tag;
        s.discard = false;
        s.cur.reset();
        s.have_header = false;
        s.header_got = 0;
        if (in_flags == kFlagFence) {
            // Everything of the op the peer sent on this stream before its fence is read here.
            enqueue(s, nullptr, 0, in_tag, kFlagFenceAck, -1, 0);
            if (error()) return;
        } else if (in_flags == kFlagFenceAck) {
            auto f = fences_.find(static_cast<uint32_t>(in_tag >> 32));
            if (f != fences_.end() && --f->second == 0) fences_.erase(f);
        }
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
    s.cur = RecvOp{s.scratch.data(), s.bytes};
    s.discard = true;
    return true;
}

void TcpLink::set_floor(uint32_t op_tag) {
    if (error()) return;
    if (has_floor_ && !solo_tag_before(floor_, op_tag)) return;
    has_floor_ = true;
    floor_ = op_tag;
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
    for (auto &sp : streams_) {
        Stream &s = *sp;
        if (s.cur && !s.discard && static_cast<uint32_t>(s.tag >> 32) == op_tag && !start_discard(s)) return;
    }
}

bool TcpLink::sending(uint32_t op_tag) const {
    if (fences_.count(op_tag)) return true;
    for (const auto &sp : streams_)
        for (const auto &op : sp->sendq)
            if (static_cast<uint32_t>(op.tag >> 32) == op_tag) return true;
    return false;
}

void TcpLink::update_interest(Stream &s) {
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
        for (const auto &op : s.sendq) t_.complete({this, LinkEvent::Kind::Failed, op.tag, e});
        s.sendq.clear();
        if (s.cur) t_.complete({this, LinkEvent::Kind::Failed, s.tag, e});
        s.cur.reset();
        ::epoll_ctl(t_.epoll_.get(), EPOLL_CTL_DEL, s.fd.get(), nullptr);
        s.fd.reset();
    }
    for (const auto &[tag, op] : posted_) t_.complete({this, LinkEvent::Kind::Failed, tag, e});
    posted_.clear();
    // Also when nothing was pending: the owner learns that the link is gone.
    t_.complete({this, LinkEvent::Kind::Failed, 0, e});
}

}  // namespace ringd
