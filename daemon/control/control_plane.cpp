#include "daemon/control/control_plane.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <ifaddrs.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"

namespace ringd {
namespace {

// Control frames are small but for OpData, which carries a small op's data: at most
// tuning.direct_max_bytes (16 MiB) of it, twice that for f16/bf16 sum/avg (contributions in f32).
constexpr uint32_t kMaxControlPayload = proto::kOpDataHeaderBytes + (32u << 20);

constexpr uint64_t kListenerId = 0;
constexpr auto kRedial = std::chrono::milliseconds(500);
constexpr auto kQuietRepeats = std::chrono::seconds(30);
constexpr int kMissedHeartbeats = 3;

// SO_PRIORITY 6 (TC_PRIO_INTERACTIVE, the highest without CAP_NET_ADMIN: prio's first band) and
// DSCP EF (46) for IPv4 and IPv6 (one of the two does not apply and fails harmlessly).
// The TOS first: setting IP_TOS also sets the socket's priority from it (EF -> 4).
void mark_latency_sensitive(int fd) {
    const int prio = 6, tos = 46 << 2;
    ::setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof tos);
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, sizeof tos);
    ::setsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, sizeof prio);
}
// How long an abort waits for its RingAbort frames (and what is queued before them) to leave,
// blocking the control thread, before the data links close. Long enough for a few MiB on a slow
// link; a peer that does not read gets the rest later, in order.
constexpr auto kAbortFlush = std::chrono::milliseconds(100);

// sockaddr for an IPv4 or IPv6 literal.
bool make_addr(const std::string &ip, uint16_t port, sockaddr_storage &ss, socklen_t &len) {
    std::memset(&ss, 0, sizeof ss);
    auto *v4 = reinterpret_cast<sockaddr_in *>(&ss);
    if (::inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(port);
        len = sizeof *v4;
        return true;
    }
    auto *v6 = reinterpret_cast<sockaddr_in6 *>(&ss);
    if (::inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(port);
        len = sizeof *v6;
        return true;
    }
    return false;
}

std::string ip_of(const sockaddr_storage &ss) {
    char buf[INET6_ADDRSTRLEN] = "?";
    if (ss.ss_family == AF_INET) ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in *>(&ss)->sin_addr, buf, sizeof buf);
    if (ss.ss_family == AF_INET6) ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6 *>(&ss)->sin6_addr, buf, sizeof buf);
    return buf;
}

// Same address, whatever the spelling ("::ffff:10.0.0.1" and "10.0.0.1" included).
bool same_ip(const std::string &a, const std::string &b);

// Whether `ip` is an address of this machine (one a socket can be bound to).
bool address_is_local(const std::string &ip) {
    sockaddr_storage ss;
    socklen_t len;
    if (!make_addr(ip, 0, ss, len)) return false;
    UniqueFd fd(::socket(ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd) return true;  // (cannot tell: the bind of a data stream will)
    return ::bind(fd.get(), reinterpret_cast<sockaddr *>(&ss), len) == 0 || errno != EADDRNOTAVAIL;
}

// The local address of a connected socket ("" when it cannot be read).
std::string local_ip(int fd) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getsockname(fd, reinterpret_cast<sockaddr *>(&ss), &len) != 0) return "";
    return ip_of(ss);
}

// Whether `ip` is one of host `h`'s addresses (any rail).
bool is_host_ip(const HostEntry &h, const std::string &ip) {
    for (uint32_t r = 0; r < h.rail_count(); ++r)
        if (same_ip(h.rail_address(r), ip)) return true;
    return false;
}

bool same_ip(const std::string &a, const std::string &b) {
    auto norm = [](const std::string &s) { return s.rfind("::ffff:", 0) == 0 ? s.substr(7) : s; };
    return norm(a) == norm(b);
}

const char *kind_name(proto::ConnKind k) {
    return k == proto::ConnKind::Control ? "control" : k == proto::ConnKind::Mesh ? "mesh data" : "data";
}

}  // namespace

Result<std::unique_ptr<ControlPlane>> ControlPlane::create(const Config &config, size_t self_index,
                                                           const PeerSecret *secret, Callbacks callbacks,
                                                           std::string domain, bool listen, UniqueFd listener) {
    std::unique_ptr<ControlPlane> cp(new ControlPlane());
    cp->config_ = config;
    cp->domain_ = std::move(domain);
    cp->self_ = static_cast<uint32_t>(self_index);
    cp->n_ = static_cast<uint32_t>(config.hosts.size());
    cp->secret_ = secret ? secret : &cp->no_secret_;
    cp->cb_ = std::move(callbacks);
    for (size_t i = 0; i < config.hosts.size(); ++i) {
        const auto &h = config.hosts[i];
        sockaddr_storage ss;
        socklen_t len;
        if (!make_addr(h.address, h.port, ss, len))
            return make_error(-EINVAL, "hosts[" + std::to_string(i) + "].address: '" + h.address +
                                           "' is not an IPv4 or IPv6 address");
        for (uint32_t r = 1; r < h.rail_count(); ++r) {
            sockaddr_storage rs;
            socklen_t rlen;
            if (!make_addr(h.rail_address(r), h.port, rs, rlen) || rs.ss_family != ss.ss_family)
                return make_error(-EINVAL, "hosts[" + std::to_string(i) + "].address[" + std::to_string(r) + "]: '" +
                                               h.rail_address(r) + "' is not an address of the family of " + h.address);
        }
        if (auto why = proto::check_name("host name", h.name); !why.empty())
            return make_error(-EINVAL, "hosts[" + std::to_string(i) + "].name: " + why);
        Peer p;
        p.host = h;
        p.state = i == self_index ? "self" : "idle";
        cp->peers_.push_back(std::move(p));
    }
    if (auto why = proto::check_name("cluster", config.cluster); !why.empty()) return make_error(-EINVAL, "cluster: " + why);
    // TCP stripes a link over tcp.streams connections; an ibverbs link needs one (bring-up, then
    // liveness); each of the domain's lanes has a link of its own (ring_up hands them over lane by
    // lane, in stream order).
    // Several rails (TCP): tcp.streams per rail, rail r's between the hosts' rail-r addresses;
    // stream s is lane s / (streams x rails)'s, on rail (s / streams) % rails.
    cp->rails_ = config.transport == "tcp" ? config.hosts[self_index].rail_count() : 1;
    const uint32_t streams =
        (config.transport == "tcp" ? config.tcp.streams : 1) * cp->rails_ * std::max<uint32_t>(1, config.tuning.lanes);
    cp->data_out_.assign(streams, 0);
    cp->data_in_.assign(streams, 0);
    cp->epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
    if (!cp->epoll_) return make_error(-errno, "epoll_create1: " + errno_string(errno));
    if (listen && listener) {
        if (auto s = cp->take_listener(std::move(listener)); !s) return s.error();
    } else if (listen) {
        if (auto s = cp->listen(); !s) return s.error();
    }
    if (cp->n_ == 1) {
        // A ring of one host is up from the start; nothing crosses a network.
        cp->ring_up_ = true;
        cp->generation_ = 1;
    }
    return cp;
}

ControlPlane::~ControlPlane() = default;

Status ControlPlane::watch(int fd, uint64_t id, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0 &&
        (errno != EEXIST || ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, fd, &ev) != 0))
        return make_error(-errno, "epoll_ctl: " + errno_string(errno));
    return Ok{};
}

UniqueFd ControlPlane::release_listener() {
    if (!listener_) return {};
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, listener_.get(), nullptr);
    std::vector<uint64_t> accepting;
    for (const auto &[id, c] : conns_)
        if (!c->dialer && c->state == ConnState::Handshaking) accepting.push_back(id);
    for (uint64_t id : accepting) close_conn(id);
    return std::move(listener_);
}

Status ControlPlane::take_listener(UniqueFd listener) {
    listener_ = std::move(listener);
    return watch(listener_.get(), kListenerId, EPOLLIN);
}

void ControlPlane::rename(std::string domain, std::function<Status(const proto::PeerHello &)> foreign_check,
                          std::function<void(UniqueFd, const proto::PeerHello &, const std::string &, const SessionKeys &)> adopt) {
    domain_ = std::move(domain);
    cb_.foreign_check = std::move(foreign_check);
    cb_.adopt = std::move(adopt);
}

Status ControlPlane::listen() {
    const auto &me = peers_[self_].host;
    sockaddr_storage ss;
    socklen_t len;
    make_addr(me.address, me.port, ss, len);
    if (rails_ > 1) {
        // Several rails: the port on every address of the host (connections from anything but
        // the configured hosts' addresses are refused at accept), each rail's address checked here.
        for (uint32_t r = 0; r < rails_; ++r)
            if (!address_is_local(me.rail_address(r)))
                return make_error(-EADDRNOTAVAIL, "hosts[" + std::to_string(self_) + "].address[" + std::to_string(r) + "]: " +
                                                      me.rail_address(r) + " is not an address of this machine");
        make_addr(ss.ss_family == AF_INET ? "0.0.0.0" : "::", me.port, ss, len);
    }
    listener_ = UniqueFd(::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    const int one = 1;
    ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (cb_.prepare_socket) cb_.prepare_socket(listener_.get());  // control connections get it too: harmless
    const std::string where = me.address + ":" + std::to_string(me.port);
    if (::bind(listener_.get(), reinterpret_cast<sockaddr *>(&ss), len) != 0)
        return make_error(-errno, "hosts[" + std::to_string(self_) + "]: cannot listen on " + where + ": " + errno_string(errno) +
                                      (errno == EADDRNOTAVAIL ? " (is this address configured on this machine?)" : ""));
    if (::listen(listener_.get(), 64) != 0) return make_error(-errno, "listen on " + where + ": " + errno_string(errno));
    return watch(listener_.get(), kListenerId, EPOLLIN);
}

void ControlPlane::set_state(uint32_t peer, const std::string &state) {
    Peer &p = peers_[peer];
    if (p.state == state) return;
    // Coming up and going down are news; the redial cycle of a peer that stays down
    // (failed -> connecting -> failed, twice a second) is not: its failures are logged, rate
    // limited, by conn_failed, and `ringctl status` shows the link's state.
    const bool news = state == "up" || p.state == "up";
    spdlog::log(news ? spdlog::level::info : spdlog::level::debug, "link to {} (control): {} -> {}", p.host.name, p.state,
                state);
    p.state = state;
}

bool ControlPlane::on_ready() {
    const size_t queued = events_.size();
    epoll_event events[32];
    const int n = ::epoll_wait(epoll_.get(), events, 32, 0);
    for (int i = 0; i < n; ++i) {
        if (events[i].data.u64 == kListenerId) accept_all();
        else on_conn(events[i].data.u64, events[i].events);
    }
    return events_.size() != queued;
}

void ControlPlane::accept_all() {
    for (;;) {
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        UniqueFd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr *>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) return;
        const std::string ip = ip_of(ss);
        bool known = false;
        for (uint32_t i = 0; i < n_; ++i) known = known || (i != self_ && is_host_ip(peers_[i].host, ip));
        if (!known) {
            spdlog::warn("refused a connection from {}: not the address of any host in the config", ip);
            continue;
        }
        // Connections still in their handshake are capped, per address (what the hosts there
        // dial at most: a control connection and their data streams each, twice over for
        // reconnects) and in total, so that a flood of idle connections cannot use up the
        // daemon. Over a cap the oldest such connection (from that address, or of all) is closed
        // for the new one: an honest handshake takes milliseconds, so a flood that holds idle
        // connections cannot keep a host's ringd out.
        size_t from_ip = 0, total = 0, hosts_there = 0;
        uint64_t oldest_from_ip = 0, oldest = 0;
        for (const auto &[cid, conn] : conns_) {  // ordered by id: oldest first
            if (conn->dialer || conn->state != ConnState::Handshaking) continue;
            ++total;
            if (!oldest) oldest = cid;
            if (conn->remote == ip && !from_ip++) oldest_from_ip = cid;
        }
        for (uint32_t i = 0; i < n_; ++i) hosts_there += i != self_ && is_host_ip(peers_[i].host, ip);
        // (Data streams: tcp.streams per rail per lane; ibverbs: one per lane.)
        const size_t per_host = 2 * (1 + data_out_.size()) * domains_;
        const uint64_t victim = from_ip >= hosts_there * per_host                              ? oldest_from_ip
                                : total >= std::max<size_t>(16, (n_ - 1) * per_host) ? oldest
                                                                                       : 0;
        if (victim) {
            ++handshakes_refused_;
            const auto now = Clock::now();
            if (now - last_refusal_log_ >= std::chrono::seconds(1)) {
                last_refusal_log_ = now;
                spdlog::warn("a connection from {}: {} connections from there and {} in all are still in their "
                             "handshake; closed the oldest of them from {} ({} closed so far)",
                             ip, from_ip, total, conns_[victim]->remote, handshakes_refused_);
            }
            close_conn(victim);
        }
        auto c = std::make_unique<Conn>();
        c->id = next_conn_id_++;
        c->state = ConnState::Handshaking;
        c->remote = ip;
        // An honest peer's hello follows at once: an idle connection is not kept long.
        c->deadline = Clock::now() + std::min<Clock::duration>(config_.timeouts.connect, std::chrono::seconds(5));
        const std::string local = rails_ > 1 ? local_ip(fd.get()) : std::string();
        c->hs.emplace(PeerHandshake::listen(std::move(fd), identity(), [this, ip, local](const proto::PeerHello &h) -> Status {
            if (h.domain == domain_) return check_hello(h, ip, local);
            // Another ring domain's: a configured host at its address, then the domain's own
            // checks once its plane has the connection.
            for (uint32_t i = 0; i < n_; ++i) {
                if (peers_[i].host.name != h.from || i == self_) continue;
                if (!is_host_ip(peers_[i].host, ip))
                    return make_error(-EACCES, "host " + h.from + " connected from " + ip + ", its configured address is " +
                                                   peers_[i].host.address);
                if (!cb_.foreign_check) return make_error(-EPROTO, "host " + h.from + " dialed for ring domain " + h.domain);
                return cb_.foreign_check(h);
            }
            return make_error(-EACCES, "host '" + h.from + "' is not in this ring's config");
        }, [this](const proto::PeerHello &h) -> Status { return h.domain == domain_ ? check_runs_on(h) : Status(Ok{}); }));
        const uint64_t id = c->id;
        if (auto s = watch(c->hs->fd(), id, EPOLLIN); !s) continue;
        conns_.emplace(id, std::move(c));
    }
}

// What a connection of this domain must be: from a host of it, at its configured address, a
// control connection from a host earlier in ring order, data streams from the previous host.
Status ControlPlane::check_hello(const proto::PeerHello &h, const std::string &ip, const std::string &local) const {
    for (uint32_t i = 0; i < n_; ++i) {
        if (peers_[i].host.name != h.from) continue;
        if (i == self_) break;
        // The control connection on rail 0, a data stream on its rail.
        const uint32_t stream = h.stream & ~proto::kRejoinStream;
        const bool rejoin = h.kind == proto::ConnKind::Data && (h.stream & proto::kRejoinStream);
        // A control connection on the rail its stream names (several rails: it moves when its rail fails).
        const uint32_t rail = h.kind != proto::ConnKind::Control ? rail_of(stream) : rails_ > 1 ? h.stream : 0;
        if (rail >= peers_[i].host.rail_count() || !same_ip(peers_[i].host.rail_address(rail), ip))
            return make_error(-EACCES, "host " + h.from + " connected from " + ip + ", its configured address" +
                                           (rails_ > 1 ? " on rail " + std::to_string(rail) : std::string()) + " is " +
                                           peers_[i].host.rail_address(std::min(rail, peers_[i].host.rail_count() - 1)));
        if (!local.empty() && !same_ip(peers_[self_].host.rail_address(rail), local))
            return make_error(-EACCES, "host " + h.from + " connected to " + local + " for rail " + std::to_string(rail) +
                                           ", which is " + peers_[self_].host.rail_address(rail) + " here");
        if (h.kind == proto::ConnKind::Control && i > self_)
            return make_error(-EPROTO, "host " + h.from + " dialed a control connection it should accept");
        if (h.kind == proto::ConnKind::Data && (i != prev() || stream >= data_in_.size()))
            return make_error(-EPROTO, "host " + h.from + " offered data stream " + std::to_string(stream) +
                                           "; only the previous host sends data, on " + std::to_string(data_in_.size()) +
                                           " stream(s)");
        if (h.kind == proto::ConnKind::Mesh &&
            (config_.transport != "tcp" || i > self_ || i == prev() || i == next() || stream >= data_in_.size()))
            return make_error(-EPROTO, "host " + h.from + " offered mesh data stream " + std::to_string(stream) +
                                           "; only a host earlier in ring order and not a neighbour dials them, on " +
                                           std::to_string(data_in_.size()) + " stream(s) over TCP");
        if (rejoin && (rails_ < 2 || !ring_up_ || h.generation != generation_))
            return make_error(-EAGAIN, "host " + h.from + " offered a new connection for rail " + std::to_string(rail) +
                                           " of ring generation " + std::to_string(h.generation) + "; this host " +
                                           (ring_up_ ? "runs generation " + std::to_string(generation_) : std::string("has no ring up")));
        return Ok{};
    }
    return make_error(-EACCES, "host '" + h.from + "' is not in " + (domain_.empty() ? "this ring's config" : "ring domain " + domain_));
}

// A host whose host list differs from this one's (reloaded there and not yet here, or the other
// way round) while this host's ring with it runs on the list it had: a control connection while
// this ring has one from it, or a data stream while the ring is up (its links handed over) or has
// that stream, would take the place of the one it runs on (a peer that connects again is taken for
// one that restarted, or re-forms its links) and end the generation whose ops run on it. It is refused until the lists agree (a
// reload on the other host), or until the connection it would replace is gone.
Status ControlPlane::check_runs_on(const proto::PeerHello &h) const {
    if (h.version < 7 || h.hosts == hosts_digest_) return Ok{};
    for (uint32_t i = 0; i < n_; ++i) {
        if (peers_[i].host.name != h.from) continue;
        auto mesh = mesh_.find(i);
        const bool runs = h.kind == proto::ConnKind::Control ? peers_[i].control != 0
                          : h.kind == proto::ConnKind::Mesh
                              ? ring_up_ || (mesh != mesh_.end() && h.stream < mesh->second.size() && mesh->second[h.stream] != 0)
                              : (h.stream & proto::kRejoinStream) == 0 &&
                                    (ring_up_ || (h.stream < data_in_.size() && data_in_[h.stream] != 0));
        if (!runs) return Ok{};
        return make_error(-EAGAIN, "host " + h.from + "'s host list (config version " +
                                       (h.config_version.empty() ? "?" : h.config_version) + ") differs from this host's (" +
                                       (config_version_ && !config_version_->empty() ? *config_version_ : "?") +
                                       "), and their ring runs on over this host's: the hosts: of both must be the same "
                                       "(a reload on the other) before a ring over the new list forms");
    }
    return Ok{};
}

void ControlPlane::adopt(UniqueFd fd, const proto::PeerHello &h, const std::string &ip, const SessionKeys &keys) {
    if (auto ok = check_hello(h, ip, rails_ > 1 ? local_ip(fd.get()) : std::string()); !ok) {
        spdlog::warn("ring domain {}: refused a connection from {}: {}", domain_, ip, ok.error().message);
        return;
    }
    auto c = std::make_unique<Conn>();
    c->id = next_conn_id_++;
    c->state = ConnState::Handshaking;
    c->remote = ip;
    c->fd = std::move(fd);
    c->keys = keys;
    Conn &ref = *c;
    conns_.emplace(c->id, std::move(c));
    promote_up(ref, h, h.generation, PeerRuns{h.version, h.hosts, h.config_version, h.instance});
}

void ControlPlane::dial(uint32_t peer, proto::ConnKind kind, uint32_t stream, bool rejoin) {
    const auto &h = peers_[peer].host;
    const uint32_t rail = kind != proto::ConnKind::Control ? rail_of(stream) : rails_ > 1 ? peers_[peer].control_rail : 0;
    const std::string &address = h.rail_address(rail);
    sockaddr_storage ss;
    socklen_t len;
    make_addr(address, h.port, ss, len);
    auto c = std::make_unique<Conn>();
    c->id = next_conn_id_++;
    c->dialer = true;
    c->peer = peer;
    c->kind = kind;
    c->stream = stream;
    c->rejoin = rejoin;
    c->remote = address + ":" + std::to_string(h.port);
    c->deadline = Clock::now() + std::min<Clock::duration>(config_.timeouts.connect, std::chrono::seconds(5));
    c->fd = UniqueFd(::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (rails_ > 1 && c->fd) {
        // From this host's address on the same rail: the peer checks it, and the route is the rail's.
        sockaddr_storage local;
        socklen_t local_len;
        make_addr(peers_[self_].host.rail_address(rail), 0, local, local_len);
        const int one = 1;  // the port is chosen at connect, with the peer's address known
        ::setsockopt(c->fd.get(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
        if (::bind(c->fd.get(), reinterpret_cast<sockaddr *>(&local), local_len) != 0) {
            const int err = errno;
            const uint64_t id = c->id;
            conns_.emplace(id, std::move(c));
            if (kind == proto::ConnKind::Data) (rejoin ? rejoin_out_[stream] : data_out_[stream]) = id;
            if (kind == proto::ConnKind::Mesh) mesh_stream(peer, stream) = id;
            return conn_failed(id, "binding " + peers_[self_].host.rail_address(rail) + " for rail " + std::to_string(rail) +
                                       ": " + errno_string(err));
        }
    }
    if (kind == proto::ConnKind::Control) {
        peers_[peer].dialing = true;
        set_state(peer, "connecting");
    }
    // Every connection this host dials runs the data streams' congestion control, as every one it
    // accepts does (the listener's): an all_to_all's data travels on the control connections, and
    // a pacing one (the kernel's default may be BBR) is set up at connect and kept.
    if (cb_.prepare_socket && c->fd) cb_.prepare_socket(c->fd.get());
    const uint64_t id = c->id;
    const int rc = ::connect(c->fd.get(), reinterpret_cast<sockaddr *>(&ss), len);
    const int err = errno;
    const int fd = c->fd.get();
    conns_.emplace(id, std::move(c));
    if (kind == proto::ConnKind::Data) (rejoin ? rejoin_out_[stream] : data_out_[stream]) = id;
    if (kind == proto::ConnKind::Mesh) mesh_stream(peer, stream) = id;
    if (rc != 0 && err != EINPROGRESS) return conn_failed(id, "connect to " + address + ": " + errno_string(err));
    if (auto s = watch(fd, id, EPOLLOUT); !s) return conn_failed(id, s.error().message);
}

void ControlPlane::on_conn(uint64_t id, uint32_t events) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn &c = *it->second;
    if (c.state == ConnState::Connecting) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(c.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) return conn_failed(id, "connect to " + c.remote + ": " + errno_string(err));
        if (!(events & EPOLLOUT)) return;
        // A control connection's "stream": its rail (several rails; 0 otherwise).
        const uint32_t stream = c.kind == proto::ConnKind::Control ? (rails_ > 1 ? peers_[c.peer].control_rail : 0u)
                                                                   : c.stream | (c.rejoin ? proto::kRejoinStream : 0u);
        c.hs.emplace(PeerHandshake::dial(std::move(c.fd), identity(), peers_[c.peer].host.name, c.kind, stream,
                                         peers_[c.peer].speaks));
        c.state = ConnState::Handshaking;
        if (c.kind == proto::ConnKind::Control) set_state(c.peer, "handshaking");
        if (c.hs->state() == PeerHandshake::State::Failed) return conn_failed(id, c.hs->error().message);
        (void)watch(c.hs->fd(), id, EPOLLIN);
        return;
    }
    if (c.state == ConnState::Handshaking) {
        const auto st = c.hs->advance();
        // An older ringd (a rolling upgrade): it said so in an Error frame. Nothing else lowers
        // the version a host is dialed at (a close or reset at the hello is a host that died or
        // restarted meanwhile, or the cap on handshakes in progress: an ordinary failed dial).
        const bool older = st == PeerHandshake::State::Failed && c.dialer && c.hs->refused_version() &&
                           c.hs->hello().version > proto::kPeerProtocolOldest;
        if (older) {
            // Dialed again at once, one version lower.
            Peer &p = peers_[c.peer];
            const uint16_t before = p.speaks;
            p.speaks = std::min<uint16_t>(p.speaks, c.hs->hello().version - 1);
            if (p.speaks != before)  // once per peer, not once per stream that was dialing
                spdlog::info("{}host {} does not speak protocol {} ({}): {} connections to it run at {}", label(), p.host.name,
                         c.hs->hello().version, c.hs->error().message, kind_name(c.kind), p.speaks);
            const bool control = c.kind == proto::ConnKind::Control;
            close_conn(id);
            if (control) {
                p.dialing = false;
                p.next_dial = Clock::now();
            } else {
                next_data_dial_ = Clock::now();
            }
            return;
        }
        if (st == PeerHandshake::State::Failed) return conn_failed(id, c.hs->error().message);
        if (st != PeerHandshake::State::Up) return;
        promote(c);
        // A dialer's reader may already hold what its peer sent right after the accept.
        it = conns_.find(id);
        if (it == conns_.end() || c.state != ConnState::Up || c.kind != proto::ConnKind::Control || c.reader.idle())
            return;
        events = EPOLLIN;
    }
    if (c.kind == proto::ConnKind::Data || c.kind == proto::ConnKind::Mesh) {
        // What arrives on an up data connection is the transport's (ibverbs starts its link
        // bring-up as soon as its own side is up): never read here, only watched for closing.
        if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
            conn_failed(id, "data connection closed");
            return maybe_ring_up();  // no longer ready
        }
        return;
    }
    // An up control connection: heartbeats and engine messages (small ops' data included).
    if ((events & EPOLLOUT) && !flush(c)) return;
    read_control(c, false);
}

void ControlPlane::read_control(Conn &c, bool draining) {
    const uint64_t id = c.id;
    for (;;) {
        auto f = c.reader.read(c.fd.get(), kMaxControlPayload + (c.mac.enabled() ? kTagBytes : 0));
        if (!f) {
            if (draining) return;
            const int code = f.error().code;
            const bool io = code == -ECONNRESET || code == -ETIMEDOUT || code == -EHOSTUNREACH || code == -ENETUNREACH ||
                            code == -ENETDOWN || code == -EPIPE;
            const std::string why = code == -ECONNRESET ? "connection closed" : f.error().message;
            return io ? control_lost(c.peer, why) : peer_failed(c.peer, why);
        }
        if (!*f) return;
        if (c.mac.enabled())
            if (auto ok = open_frame(c.mac.recv, **f); !ok) {
                ++frames_rejected_;
                if (draining) return;
                spdlog::warn("{}control connection from {} ({}): {}; closing it", label(), peers_[c.peer].host.name,
                             c.remote, ok.error().message);
                return peer_failed(c.peer, "control frame from " + peers_[c.peer].host.name + ": " + ok.error().message);
            }
        peers_[c.peer].last_heard = Clock::now();
        ++c.frames_in;
        if ((*f)->type == proto::FrameType::ControlResume) {
            auto r = proto::decode_control_resume((*f)->payload);
            if (!r) return peer_failed(c.peer, r.error().message);
            if (!draining) on_control_resume(c.peer, r->frames);
            if (conns_.find(id) == conns_.end()) return;
            continue;
        }
        if ((*f)->type == proto::FrameType::Heartbeat) {  // nothing in it for the domain: last_heard is all
            if (auto h = proto::decode_heartbeat((*f)->payload); !h) return peer_failed(c.peer, h.error().message);
            continue;
        }
        if ((*f)->type == proto::FrameType::RingAbort) {
            auto a = proto::decode_ring_abort((*f)->payload);
            if (!a) return peer_failed(c.peer, a.error().message);
            on_ring_abort(*a);
            if (conns_.find(id) == conns_.end()) return;
            continue;
        }
        if ((*f)->type == proto::FrameType::RingReady) {
            auto r = proto::decode_ring_ready((*f)->payload);
            if (!r || self_ != 0) return peer_failed(c.peer, r ? "ring ready sent to a host that does not coordinate" : r.error().message);
            on_ring_ready(c.peer, *r);
            if (conns_.find(id) == conns_.end()) return;
            continue;
        }
        if ((*f)->type == proto::FrameType::RingStart) {
            auto g = proto::decode_ring_start((*f)->payload);
            if (!g || c.peer != 0) return peer_failed(c.peer, g ? "ring start from a host that does not coordinate" : g.error().message);
            on_ring_start(g->generation, g->protocol ? g->protocol : protocol(), g->flags);
            if (conns_.find(id) == conns_.end()) return;
            continue;
        }
        Event e;
        e.kind = Event::Kind::Message;
        e.host = c.peer;
        e.frame = std::move(**f);
        events_.push_back(std::move(e));
    }
}

void ControlPlane::promote(Conn &c) {
    const proto::PeerHello h = c.hs->hello();
    const uint64_t peer_generation = c.dialer ? c.hs->peer_generation() : h.generation;
    const PeerRuns runs{c.hs->version(), c.hs->peer_hosts(), c.hs->peer_config_version(), c.hs->peer_instance()};
    c.keys = c.hs->keys();
    FrameReader reader = c.hs->take_reader();
    c.fd = c.hs->take_fd();
    c.hs.reset();
    if (!c.dialer && h.domain != domain_) {
        // Another domain's connection: to its plane, through the owner (dispatch()).
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
        Event e;
        e.kind = Event::Kind::Adopt;
        e.fd = std::move(c.fd);
        e.hello = h;
        e.why = c.remote;
        e.keys = c.keys;
        conns_.erase(c.id);
        events_.push_back(std::move(e));
        return;
    }
    if (c.kind == proto::ConnKind::Control || !c.dialer) {
        c.reader = std::move(reader);
    } else if (!reader.idle()) {
        // A data connection stays silent until the ring that uses it is up (which needs this
        // end ready first): bytes already here are not a ringd peer's.
        return conn_failed(c.id, "data connection to " + peers_[c.peer].host.name + ": bytes after the handshake");
    }
    promote_up(c, h, peer_generation, runs);
}

void ControlPlane::promote_up(Conn &c, const proto::PeerHello &h, uint64_t peer_generation, const PeerRuns &runs) {
    if (!c.dialer) {
        for (uint32_t i = 0; i < n_; ++i)
            if (peers_[i].host.name == h.from) c.peer = i;
        c.kind = h.kind;
        c.stream = h.stream & ~proto::kRejoinStream;
        c.rejoin = h.kind == proto::ConnKind::Data && (h.stream & proto::kRejoinStream);
    }
    // A host that restarted counts its generations from 0 again; the ring it forms next must
    // still be newer than any its peers saw, or they would take its ops for a finished
    // generation's. So each ring's generation passes the highest one a peer announced.
    peer_generation_max_ = std::max(peer_generation_max_, peer_generation);
    if (!c.dialer) (void)watch(c.fd.get(), c.id, EPOLLIN);
    c.state = ConnState::Up;
    if (c.kind == proto::ConnKind::Control) c.mac = SessionMac(c.keys);
    const uint64_t id = c.id;
    const uint32_t peer = c.peer;
    Peer &p = peers_[peer];
    const uint64_t known_instance = p.instance;  // before this handshake's
    // What the peer runs, from any of its connections' handshakes (a host that cannot dial this
    // one for want of the right address still dials its data streams, or is dialed): a ringd of
    // 6 says nothing of its host list, one of 7 on says its digest.
    if (runs.version >= 7) {
        p.config_version = runs.config_version;
        p.instance = runs.instance;
        const bool differ = runs.hosts != hosts_digest_;
        if (differ && !p.hosts_differ)
            spdlog::warn("{}host {}'s host list differs from this host's (its config version {}, this host's {}): every "
                         "host of a ring needs the same hosts: (names, addresses, ports, in the same order)",
                         label(), p.host.name, runs.config_version.empty() ? "?" : runs.config_version,
                         config_version_ && !config_version_->empty() ? *config_version_ : "?");
        p.hosts_differ = differ;
    }
    if (c.kind == proto::ConnKind::Control) {
        // Control frames are latency-bound (small ops' data travels on them too): no Nagle, and
        // socket buffers that take a one- or two-shot op's frames at once.
        const int one = 1, buffer = 4 << 20;
        ::setsockopt(c.fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        ::setsockopt(c.fd.get(), SOL_SOCKET, SO_SNDBUF, &buffer, sizeof buffer);
        ::setsockopt(c.fd.get(), SOL_SOCKET, SO_RCVBUF, &buffer, sizeof buffer);
        // Ahead of the data streams where the host's queues and the network have priorities (a
        // prio/mq qdisc takes SO_PRIORITY, switches the DSCP): a small op next to a bulk one
        // does not wait behind its data. Best effort: unprivileged values, failures ignored.
        mark_latency_sensitive(c.fd.get());
        // Several rails: the same ringd process (its instance) on another rail is a control
        // connection that moved there (its rail failed), not a restart: the ring runs on.
        const bool moved = ring_up_ && rails_ > 1 && runs.version >= 7 && runs.instance != 0 && runs.instance == known_instance;
        if (rails_ > 1) {
            const unsigned timeout = static_cast<unsigned>(config_.tcp.rail_timeout.count());
            ::setsockopt(c.fd.get(), IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout, sizeof timeout);
            if (!c.dialer) p.control_rail = h.stream < rails_ ? h.stream : 0;
        }
        if (p.control && p.control != id) {
            // The peer came back (restart) while we still had its old connection, or (moved) its
            // connection's rail failed before this host noticed.
            const uint64_t old = p.control;
            p.control = 0;
            if (moved) salvage(p, *conns_.at(old));
            close_conn(old);
            if (ring_up_ && !moved) abort_ring("host " + p.host.name + " reconnected (restarted?)");
        } else if (ring_up_ && !moved && p.failover_until != Clock::time_point{}) {
            abort_ring("host " + p.host.name + " restarted while its control connection was moving to another rail");
        }
        const bool was_moving = p.failover_until != Clock::time_point{};
        p.failover_until = {};
        if (!moved) {
            p.held.clear();
            p.held_bytes = 0;
            p.prev_log.clear();
        }
        p.control = id;
        p.dialing = false;
        p.protocol = runs.version;
        p.down_since = Clock::time_point::max();
        if (peer < peer_ready_.size()) peer_ready_[peer] = 0;  // it says so again on this connection
        p.last_error.clear();
        p.last_heard = Clock::now();
        set_state(peer, "up");
        if (moved) {
            // First on it: what this host read of the old connection; the peer answers alike, and
            // until its answer comes what this host sends waits (send(): resume_pending).
            spdlog::info("{}control connection to {}: on rail {} now; {} frame(s) read from the one it replaces", label(),
                         p.host.name, p.control_rail, p.prev_frames_in);
            p.resume_pending = true;
            p.resume_deadline = Clock::now() + kMissedHeartbeats * config_.timeouts.heartbeat;
            (void)send_now(peer, proto::encode_control_resume({p.prev_frames_in}));
        } else if (was_moving) {
            spdlog::info("{}control connection to {}: back, from another ringd process", label(), p.host.name);
        }
    } else if (c.rejoin) {
        (void)watch(c.fd.get(), id, EPOLLRDHUP);
        if (!c.dialer) {
            if (auto old = rejoin_in_.find(c.stream); old != rejoin_in_.end() && old->second != id) close_conn(old->second);
            rejoin_in_[c.stream] = id;
        }
        spdlog::debug("data stream {} {} {} (rail {}): up again", c.stream, c.dialer ? "to" : "from", p.host.name, rail_of(c.stream));
        return maybe_rail_up(c.stream, c.dialer);
    } else if (c.kind == proto::ConnKind::Mesh) {
        (void)watch(c.fd.get(), id, EPOLLRDHUP);
        if (!c.dialer) {
            // (A generation below 12 does not use them: one made while it formed may come in now.)
            if (ring_up_ && generation_protocol_ >= proto::kMeshProtocol) abort_ring("host " + p.host.name + " re-formed its mesh data links");
            uint64_t &slot = mesh_stream(peer, c.stream);
            if (slot && slot != id) close_conn(slot);
            slot = id;
        }
        spdlog::debug("mesh data stream {} {} {}: up", c.stream, c.dialer ? "to" : "from", p.host.name);
    } else if (c.dialer) {
        (void)watch(c.fd.get(), id, EPOLLRDHUP);
        spdlog::debug("data stream {} to {}: up", c.stream, p.host.name);
    } else {
        if (ring_up_) abort_ring("host " + p.host.name + " re-formed its data links");
        if (data_in_[c.stream]) close_conn(data_in_[c.stream]);
        data_in_[c.stream] = id;
        (void)watch(c.fd.get(), id, EPOLLRDHUP);
        spdlog::debug("data stream {} from {}: up", c.stream, p.host.name);
    }
    maybe_ring_up();
}

bool ControlPlane::links_up(bool mesh) const {
    for (uint32_t i = 0; i < n_; ++i)
        if (i != self_ && !peers_[i].control) return false;
    for (uint64_t id : data_out_)
        if (!id || conns_.at(id)->state != ConnState::Up) return false;
    for (uint64_t id : data_in_)
        if (!id) return false;
    for (uint32_t j = 0; j < n_ && mesh; ++j) {
        if (!mesh_with(j)) continue;
        auto m = mesh_.find(j);
        if (m == mesh_.end()) return false;
        for (uint64_t id : m->second)
            if (!id || conns_.at(id)->state != ConnState::Up) return false;
    }
    return true;
}

bool ControlPlane::mesh_with(uint32_t peer) const {
    // (Every host at 12, as far as this one's control connections say: a ring with an older host
    // runs its generation below 12, where mesh streams would only be made to be left unused.)
    if (config_.transport != "tcp" || n_ <= 3 || peer >= n_ || peer == self_ || peer == next() || peer == prev()) return false;
    for (uint32_t i = 0; i < n_; ++i)  // (protocol() counts only the hosts connected now)
        if (i != self_ && !peers_[i].control) return false;
    return peers_[peer].protocol >= proto::kMeshProtocol && protocol() >= proto::kMeshProtocol;
}

uint64_t &ControlPlane::mesh_stream(uint32_t peer, uint32_t stream) {
    auto &v = mesh_[peer];
    if (v.size() != data_out_.size()) v.resize(data_out_.size(), 0);
    return v.at(stream);
}

// Tells the coordinator whether this host's links of the next ring are up, when that changes.
void ControlPlane::maybe_ring_up() {
    if (ring_up_ || n_ == 1) return;
    const bool up = links_up();
    if (up == links_ready_) return;
    links_ready_ = up;
    tell_ready();
}

void ControlPlane::tell_ready() {
    next_ready_ = Clock::now() + std::chrono::milliseconds(200);
    if (self_ == 0) return maybe_start();
    if (!peers_[0].control) return;
    // What this host can run the generation at, to a coordinator that reads it (9 on).
    const uint16_t says = peers_[0].protocol >= proto::kGenerationProtocolVersion ? protocol() : 0;
    // And, from 13 on, whether its wire.schedule keeps compressed allreduces on the ring.
    const uint16_t flags = says >= proto::kExchangeProtocol && !config_.wire.exchange ? proto::kGenerationRingOnly : 0;
    (void)send(0, proto::encode_ring_ready({announced_generation(), links_ready_, says, flags}));
}

void ControlPlane::on_ring_ready(uint32_t peer, const proto::RingReady &r) {
    peer_ready_.resize(n_, 0);
    peer_seen_.resize(n_, 0);
    peer_protocol_.resize(n_, 0);
    peer_flags_.resize(n_, 0);
    peer_ready_[peer] = r.ready;
    peer_flags_[peer] = r.flags;
    peer_seen_[peer] = std::max(peer_seen_[peer], r.generation);
    // A host of 8 does not say: it runs at most its connection to this one's version.
    peer_protocol_[peer] = r.protocol ? std::min(r.protocol, peers_[peer].protocol) : peers_[peer].protocol;
    maybe_start();
}

// The coordinator starts the ring once every host's links are up, as a generation newer than
// any a host has seen, at the oldest protocol any of its hosts runs a connection at.
void ControlPlane::maybe_start() {
    if (self_ != 0 || ring_up_ || !links_ready_) return;
    peer_ready_.resize(n_, 0);
    peer_seen_.resize(n_, 0);
    peer_protocol_.resize(n_, 0);
    peer_flags_.resize(n_, 0);
    uint64_t newest = announced_generation();
    uint16_t protocol = this->protocol();
    bool ring_only = !config_.wire.exchange;  // (any host's wire.schedule: ring)
    for (uint32_t i = 1; i < n_; ++i) {
        if (!peer_ready_[i]) return;
        newest = std::max(newest, peer_seen_[i]);
        protocol = std::min(protocol, peer_protocol_[i]);
        ring_only = ring_only || (peer_flags_[i] & proto::kGenerationRingOnly);
    }
    const uint16_t flags = protocol >= proto::kExchangeProtocol && ring_only ? proto::kGenerationRingOnly : 0;
    const uint64_t g = newest + 1;
    peer_ready_.assign(n_, 0);  // used up: a host says so again for the next generation
    for (uint32_t i = 1; i < n_; ++i)
        if (peers_[i].control)
            (void)send(i, proto::encode_ring_start({g,
                                                    peers_[i].protocol >= proto::kGenerationProtocolVersion ? protocol : uint16_t{0},
                                                    flags}));
    on_ring_start(g, protocol, flags);
}

void ControlPlane::on_ring_start(uint64_t g, uint16_t protocol, uint16_t flags) {
    if (ring_up_ && g == generation_) return;
    if (ring_up_) abort_ring("the coordinator started ring generation " + std::to_string(g));
    if (g <= aborted_max_) return;  // a host ended it already (its RingAbort came first)
    if (!links_up(protocol >= proto::kMeshProtocol)) {
        // This host's links broke after it said they were up: the generation ends everywhere.
        aborted_max_ = g;
        const std::string why = "host " + peers_[self_].host.name + ": its links to the ring were not up any more";
        spdlog::warn("{}ring generation {} aborted: {}", label(), g, why);
        send_to_all(proto::encode_ring_abort({g, why}));
        links_ready_ = false;
        return;
    }
    DataSockets out, in;
    for (uint64_t &id : data_out_) {
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, conns_.at(id)->fd.get(), nullptr);
        out.rails.push_back(rail_of(static_cast<uint32_t>(&id - data_out_.data())));
        out.fds.push_back(std::move(conns_.at(id)->fd));
        out.keys.push_back(conns_.at(id)->keys);
        conns_.erase(id);
        id = 0;
    }
    for (uint64_t &id : data_in_) {
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, conns_.at(id)->fd.get(), nullptr);
        in.rails.push_back(rail_of(static_cast<uint32_t>(&id - data_in_.data())));
        in.fds.push_back(std::move(conns_.at(id)->fd));
        in.keys.push_back(conns_.at(id)->keys);
        conns_.erase(id);
        id = 0;
    }
    // Mesh data streams: handed over in a generation that runs all_to_all on them (every host
    // speaks 12). Others stay here until the generation ends (abort_ring closes them, and each
    // generation makes its own): closed now, the peer could see them go before its own RingStart
    // and take its links for broken.
    std::vector<DataSockets> mesh;
    for (auto &[peer, ids] : mesh_) {
        const bool use = protocol >= proto::kMeshProtocol && mesh_with(peer);
        if (!use) continue;
        DataSockets d;
        d.peer = peer;
        for (uint64_t &id : ids) {
            if (!id) continue;
            ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, conns_.at(id)->fd.get(), nullptr);
            d.rails.push_back(rail_of(static_cast<uint32_t>(&id - ids.data())));
            d.fds.push_back(std::move(conns_.at(id)->fd));
            d.keys.push_back(conns_.at(id)->keys);
            conns_.erase(id);
            id = 0;
        }
        mesh.push_back(std::move(d));
    }
    ring_up_ = true;
    links_ready_ = false;
    generation_ = g;
    generation_protocol_ = protocol;
    generation_exchange_ = protocol >= proto::kExchangeProtocol && !(flags & proto::kGenerationRingOnly);
    spdlog::info("{}ring up: generation {}, {} hosts, protocol {}{}", label(), generation_, n_, protocol,
                 protocol >= proto::kExchangeProtocol && !generation_exchange_ ? " (compressed allreduces on the ring)" : "");
    Event e;
    e.kind = Event::Kind::RingUp;
    e.generation = generation_;
    e.to_next = std::move(out);
    e.from_prev = std::move(in);
    e.mesh = std::move(mesh);
    events_.push_back(std::move(e));
}

void ControlPlane::on_ring_abort(const proto::RingAbort &a) {
    aborted_max_ = std::max(aborted_max_, a.generation);
    if (self_ == 0) peer_ready_.assign(n_, 0);  // every host re-forms its links, and says so again
    if (ring_up_ && a.generation >= generation_) abort_ring(a.reason, false);
}

void ControlPlane::send_to_all(const proto::Bytes &frame) {
    for (uint32_t i = 0; i < n_; ++i)
        if (i != self_ && peers_[i].control) (void)send(i, frame);
}

void ControlPlane::close_conn(uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn &c = *it->second;
    const int fd = c.hs ? c.hs->fd() : c.fd.get();
    if (fd >= 0) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
    for (auto &d : data_out_)
        if (d == id) d = 0;
    for (auto &d : data_in_)
        if (d == id) d = 0;
    if (c.kind == proto::ConnKind::Mesh)
        if (auto m = mesh_.find(c.peer); m != mesh_.end())
            for (auto &d : m->second)
                if (d == id) d = 0;
    if (c.rejoin) {
        auto &m = c.dialer ? rejoin_out_ : rejoin_in_;
        if (auto r = m.find(c.stream); r != m.end() && r->second == id) m.erase(r);
    }
    if (c.kind == proto::ConnKind::Control && c.dialer && peers_[c.peer].control != id) peers_[c.peer].dialing = false;
    conns_.erase(it);
}

void ControlPlane::conn_failed(uint64_t id, const std::string &why) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn &c = *it->second;
    const std::string who = c.dialer ? peers_[c.peer].host.name : c.remote;
    // The same failure again and again (a peer that is down, a domain a peer has not made yet) is
    // logged once per kQuietRepeats; the repeats go to the debug level.
    const auto now = Clock::now();
    const std::string what = who + ": " + why;
    auto &last = recent_failures_[what];
    const bool repeat = last != Clock::time_point{} && now - last < kQuietRepeats;
    if (!repeat) last = now;
    if (recent_failures_.size() > 256) recent_failures_.clear();
    // (An accepted connection's kind is known once its hello came.)
    spdlog::log(repeat ? spdlog::level::debug : spdlog::level::warn, "{}{} connection {} {}: {}", label(),
                c.dialer || c.state == ConnState::Up ? kind_name(c.kind) : "peer", c.dialer ? "to" : "from", who, why);
    if (c.dialer && c.kind == proto::ConnKind::Control) {
        // The version is learnt afresh on the next connection (a host that was down may come
        // back upgraded; one that refused a version may have been restarted on a newer one).
        Peer &p = peers_[c.peer];
        p.speaks = proto::kPeerProtocolVersion;
        p.last_error = why;
        p.next_dial = Clock::now() + kRedial;
        if (p.failover_until != Clock::time_point{}) {
            // Moving: the next rail, at once.
            p.control_rail = (p.control_rail + 1) % rails_;
            p.next_dial = Clock::now() + std::chrono::milliseconds(100);
        } else {
            set_state(c.peer, "failed");
        }
    } else if (c.dialer && c.rejoin) {
        rejoin_next_dial_[c.stream] = Clock::now() + kRedial;
    } else if (c.dialer) {
        next_data_dial_ = Clock::now() + kRedial;
        peers_[c.peer].last_error = why;
    }
    close_conn(id);
}

void ControlPlane::peer_failed(uint32_t peer, const std::string &why) {
    Peer &p = peers_[peer];
    p.speaks = proto::kPeerProtocolVersion;  // it may come back upgraded
    p.protocol = 0;
    if (p.control) p.down_since = Clock::now();
    spdlog::warn("host {}: {}", p.host.name, why);
    p.last_error = why;
    if (p.control) close_conn(p.control);
    p.control = 0;
    p.dialing = false;
    p.next_dial = Clock::now() + kRedial;
    set_state(peer, "failed");
    if (peer < peer_ready_.size()) peer_ready_[peer] = 0;
    if (ring_up_) abort_ring("host " + p.host.name + ": " + why);
    else maybe_ring_up();  // no longer ready
}

void ControlPlane::abort_ring(const std::string &why, bool tell_peers) {
    pending_link_failure_.reset();
    if (!ring_up_ || n_ == 1) return;
    ring_up_ = false;
    aborted_max_ = std::max(aborted_max_, generation_);
    if (self_ == 0) peer_ready_.assign(n_, 0);
    spdlog::warn("{}ring generation {} aborted: {}", label(), generation_, why);
    if (tell_peers) {
        // Through each connection's queue, behind the frames already in it: written past a
        // partly sent frame it would tear that frame. Flushed before the data links close (the
        // others then fail their ops with this reason rather than their link's); whatever the
        // deadline leaves queued goes out later, in order.
        const auto frame = proto::encode_ring_abort({generation_, why});
        for (uint32_t i = 0; i < n_; ++i)
            if (peers_[i].control) (void)send(i, frame);
        flush_all(Clock::now() + kAbortFlush);
    }
    // A control connection that moved: nothing of this generation needs its frames again.
    for (auto &p : peers_)
        if (p.resume_pending || p.failover_until != Clock::time_point{} || !p.prev_log.empty()) end_resume(p);
    // Data connections of the next generation are made afresh by everyone.
    close_rejoins();
    for (uint64_t id : data_out_)
        if (id) close_conn(id);
    for (uint64_t id : data_in_)
        if (id) close_conn(id);
    for (auto &[peer, ids] : mesh_)
        for (uint64_t id : std::vector<uint64_t>(ids))
            if (id) close_conn(id);
    next_data_dial_ = Clock::now() + kRedial;
    Event e;
    e.kind = Event::Kind::RingDown;
    e.why = why;
    events_.push_back(std::move(e));
}

bool ControlPlane::dispatch() {
    if (dispatching_ || events_.empty()) return false;
    dispatching_ = true;
    while (!events_.empty()) {
        Event e = std::move(events_.front());
        events_.pop_front();
        switch (e.kind) {
        case Event::Kind::RingUp:
            if (cb_.ring_up) cb_.ring_up(e.generation, std::move(e.to_next), std::move(e.from_prev), std::move(e.mesh));
            break;
        case Event::Kind::RingDown:
            if (cb_.ring_down) cb_.ring_down(e.why);
            break;
        case Event::Kind::Message:
            if (cb_.message) cb_.message(e.host, e.frame);
            break;
        case Event::Kind::Adopt:
            if (cb_.adopt) cb_.adopt(std::move(e.fd), e.hello, e.why, e.keys);
            break;
        case Event::Kind::RailStreams:
            if (cb_.rail_streams)
                cb_.rail_streams(e.generation, e.lane, e.rail, e.outgoing, std::move(e.outgoing ? e.to_next : e.from_prev));
            break;
        }
    }
    dispatching_ = false;
    return true;
}

void ControlPlane::data_link_failed(const std::string &why, bool seen_here) {
    if (!ring_up_) return;
    if (seen_here) return abort_ring(why);
    if (pending_link_failure_) return;
    pending_link_failure_.emplace(Clock::now() + std::chrono::milliseconds(300), why);
}

void ControlPlane::heartbeat_now(uint64_t generation) {
    heartbeat_generation_ = generation;
    for (uint32_t i = 0; i < n_; ++i)
        if (peers_[i].control) (void)send(i, proto::encode_heartbeat({generation, ++peers_[i].heartbeat_seq}));
}

void ControlPlane::tick(Clock::time_point now) {
    if (n_ == 1) return;
    for (auto &p : peers_)  // the clock of hosts_down() starts when this plane runs
        if (!p.control && p.down_since == Clock::time_point{}) p.down_since = now;
    if (pending_link_failure_ && now >= pending_link_failure_->first) {
        const std::string why = std::move(pending_link_failure_->second);  // abort_ring resets the optional
        abort_ring(why);
    }
    for (uint32_t i = self_ + 1; i < n_; ++i)
        if (!peers_[i].control && !peers_[i].dialing && now >= peers_[i].next_dial) dial(i, proto::ConnKind::Control, 0);
    if (!ring_up_ && now >= next_data_dial_)
        for (uint32_t s = 0; s < data_out_.size(); ++s)
            if (!data_out_[s]) dial(next(), proto::ConnKind::Data, s);
    if (!ring_up_ && now >= next_data_dial_)
        for (uint32_t j = self_ + 1; j < n_; ++j)
            if (mesh_with(j))
                for (uint32_t s = 0; s < data_out_.size(); ++s)
                    if (!mesh_stream(j, s)) dial(j, proto::ConnKind::Mesh, s);
    // While the ring forms, this host's readiness is repeated (a RingReady that crossed a
    // RingAbort on its way was forgotten by the coordinator).
    maybe_ring_up();
    if (!ring_up_ && links_ready_ && now >= next_ready_) tell_ready();
    // Deadlines of connections that are still being set up.
    std::vector<std::pair<uint64_t, std::string>> late;
    for (const auto &[id, c] : conns_)
        if (c->state != ConnState::Up && now > c->deadline)
            late.emplace_back(id, c->state == ConnState::Connecting ? "connect timed out" : "handshake timed out");
    for (const auto &[id, why] : late) conn_failed(id, why);
    // Heartbeats out, and silence in.
    const auto hb = config_.timeouts.heartbeat;
    if (now >= next_heartbeat_) {
        next_heartbeat_ = now + hb;
        for (uint32_t i = 0; i < n_; ++i)
            if (peers_[i].control) (void)send(i, proto::encode_heartbeat({heartbeat_generation_, ++peers_[i].heartbeat_seq}));
    }
    for (uint32_t i = 0; i < n_; ++i)
        if (peers_[i].control && now - peers_[i].last_heard > kMissedHeartbeats * hb)
            control_lost(i, "no heartbeat for " + std::to_string(kMissedHeartbeats * hb.count()) + " ms (hung or unreachable)");
    if (rails_ > 1)
        for (auto &p : peers_)
            if (p.control) trim_sent_log(*conns_.at(p.control));
    for (uint32_t i = 0; i < n_; ++i)
        if (peers_[i].resume_pending && now >= peers_[i].resume_deadline)
            peer_failed(i, "its control connection moved to rail " + std::to_string(peers_[i].control_rail) +
                               " but it did not say what it read of the one it replaced");
    // Control connections being moved to another rail that did not come back in time.
    for (uint32_t i = 0; i < n_; ++i) {
        Peer &p = peers_[i];
        if (p.failover_until == Clock::time_point{} || p.control || now < p.failover_until) continue;
        p.failover_until = {};
        p.held.clear();
        p.held_bytes = 0;
        const std::string why = p.failover_why + "; its control connection did not come back on any rail within " +
                                std::to_string(kMissedHeartbeats * hb.count()) + " ms";
        p.last_error = why;
        set_state(i, "failed");
        if (ring_up_) abort_ring("host " + p.host.name + ": " + why);
    }
}

void ControlPlane::trim_sent_log(Conn &c) {
    int unacked = 0;
    if (c.sent_log.empty() || ::ioctl(c.fd.get(), SIOCOUTQ, &unacked) != 0) return;
    // (the socket's queue may still hold the end of the handshake, which written_bytes does not count)
    const uint64_t u = static_cast<uint64_t>(std::max(unacked, 0));
    const uint64_t acked = c.written_bytes > u ? c.written_bytes - u : 0;
    while (!c.sent_log.empty() && c.sent_log.front().end <= acked) c.sent_log.pop_front();
}

void ControlPlane::salvage(Peer &p, Conn &c) {
    // Received: every whole frame still in this end's socket (the peer's ControlResume-to-be
    // counts on it), then nothing more: the connection closes.
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    trim_sent_log(c);
    read_control(c, true);
    // Sent: whatever the peer's kernel did not acknowledge may go again, once the peer says how
    // many frames it read (what it acknowledged, it reads: it drains its end as this one did).
    p.prev_frames_in = c.frames_in;
    p.prev_log = std::move(c.sent_log);
    c.sent_log.clear();
    c.outq.clear();
    c.out_bytes = 0;
}

void ControlPlane::on_control_resume(uint32_t peer, uint64_t frames) {
    Peer &p = peers_[peer];
    if (!p.resume_pending) return;  // (a connection that replaced none: nothing to resume)
    p.resume_pending = false;
    uint64_t again = 0;
    std::deque<Conn::Logged> log = std::move(p.prev_log);
    p.prev_log.clear();
    std::deque<proto::Bytes> held = std::move(p.held);
    p.held.clear();
    p.held_bytes = 0;
    for (auto &l : log)
        if (l.index >= frames) {
            ++again;
            if (auto s = send_now(peer, std::move(l.frame)); !s) return;
        }
    for (auto &f : held)
        if (auto s = send_now(peer, std::move(f)); !s) return;
    spdlog::info("{}control connection to {}: resumed; {} frame(s) it had not read sent again, {} held meanwhile sent", label(),
                 p.host.name, again, held.size());
}

void ControlPlane::end_resume(Peer &p) {
    p.failover_until = {};
    p.resume_pending = false;
    p.prev_log.clear();
    std::deque<proto::Bytes> held = std::move(p.held);
    p.held.clear();
    p.held_bytes = 0;
    const uint32_t peer = static_cast<uint32_t>(&p - peers_.data());
    if (p.control)
        for (auto &f : held) (void)send_now(peer, std::move(f));
}

void ControlPlane::control_lost(uint32_t peer, const std::string &why) {
    Peer &p = peers_[peer];
    if (rails_ < 2 || !ring_up_ || p.instance == 0 || !p.control || p.failover_until != Clock::time_point{} || p.resume_pending)
        return peer_failed(peer, why);
    // What it received is taken; what the peer did not get goes on the next connection.
    if (auto it = conns_.find(p.control); it != conns_.end()) salvage(p, *it->second);
    if (!p.control) return;  // (a frame read meanwhile ended it)
    const uint32_t from = p.control_rail;
    p.control_rail = (p.control_rail + 1) % rails_;
    spdlog::warn("{}control connection to {} on rail {} lost ({}): it moves to rail {}; the ring runs on", label(), p.host.name,
                 from, why, p.control_rail);
    close_conn(p.control);
    p.control = 0;
    p.dialing = false;
    p.next_dial = Clock::now();
    p.down_since = Clock::now();
    p.failover_why = why;
    p.failover_until = Clock::now() + kMissedHeartbeats * config_.timeouts.heartbeat;
    set_state(peer, "moving");
}

Status ControlPlane::send(uint32_t host_index, proto::Bytes frame) {
    Peer &p = peers_.at(host_index);
    if ((!p.control && p.failover_until != Clock::time_point{}) || p.resume_pending) {
        // Its control connection is moving to another rail: sent once it is there.
        if (p.held_bytes + frame.size() > kMaxBacklog) return make_error(-EPIPE, "control connection to " + p.host.name + " is congested");
        p.held_bytes += frame.size();
        p.held.push_back(std::move(frame));
        return Ok{};
    }
    return send_now(host_index, std::move(frame));
}

Status ControlPlane::send_now(uint32_t host_index, proto::Bytes frame) {
    Peer &p = peers_.at(host_index);
    if (!p.control) return make_error(-ENOTCONN, "no control connection to " + p.host.name);
    Conn &c = *conns_.at(p.control);
    if (rails_ > 1) {
        c.logged_bytes += frame.size() + (c.mac.enabled() ? kTagBytes : 0);
        c.sent_log.push_back(Conn::Logged{c.frames_out++, c.logged_bytes, frame});
        if (c.sent_log.size() % 256 == 0) trim_sent_log(c);
    }
    if (c.mac.enabled()) seal_frame_in_place(c.mac.send, frame);
    return send_bytes(host_index, c, std::move(frame));
}

Status ControlPlane::send_bytes(uint32_t host_index, Conn &c, proto::Bytes frame) {
    Peer &p = peers_.at(host_index);
    size_t off = 0;
    if (c.outq.empty()) {
        const ssize_t n = ::send(c.fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            const std::string why = errno_string(errno);
            if (rails_ > 1 && ring_up_ && p.instance != 0 && p.failover_until == Clock::time_point{}) {
                // (in the connection's sent log: it goes on the connection on the next rail)
                control_lost(host_index, "send: " + why);
                return Ok{};
            }
            peer_failed(host_index, "send: " + why);
            return make_error(-EPIPE, why);
        }
        if (n > 0) c.written_bytes += static_cast<uint64_t>(n);
        if (n == static_cast<ssize_t>(frame.size())) return Ok{};
        off = n > 0 ? static_cast<size_t>(n) : 0;
    }
    c.out_bytes += frame.size() - off;
    c.outq.push_back(std::move(frame));
    if (c.outq.size() == 1) c.out_off = off;
    if (c.out_bytes > kMaxBacklog) {
        peer_failed(host_index, "control connection backlog over " + std::to_string(kMaxBacklog >> 20) +
                                    " MiB: the host is not keeping up");
        return make_error(-EPIPE, "control connection to " + p.host.name + " is congested");
    }
    if (c.outq.size() == 1) (void)watch(c.fd.get(), c.id, EPOLLIN | EPOLLOUT);
    return Ok{};
}

uint64_t ControlPlane::queued_bytes(uint32_t host_index) const {
    if (host_index >= peers_.size() || !peers_[host_index].control) return 0;
    auto it = conns_.find(peers_[host_index].control);
    return it == conns_.end() ? 0 : it->second->out_bytes;
}

int ControlPlane::control_fd(uint32_t host_index) const {
    if (host_index >= peers_.size() || !peers_[host_index].control) return -1;
    auto it = conns_.find(peers_[host_index].control);
    return it == conns_.end() ? -1 : it->second->fd.get();
}

bool ControlPlane::flush(Conn &c) {
    while (!c.outq.empty()) {
        const proto::Bytes &f = c.outq.front();
        const ssize_t n = ::send(c.fd.get(), f.data() + c.out_off, f.size() - c.out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
            control_lost(c.peer, "send: " + errno_string(errno));
            return false;
        }
        c.out_off += static_cast<size_t>(n);
        c.written_bytes += static_cast<uint64_t>(n);
        c.out_bytes -= static_cast<uint64_t>(n);
        if (c.out_off < f.size()) return true;
        c.outq.pop_front();
        c.out_off = 0;
    }
    (void)watch(c.fd.get(), c.id, EPOLLIN);
    return true;
}

void ControlPlane::flush_all(Clock::time_point deadline) {
    for (;;) {
        std::vector<pollfd> fds;
        std::vector<uint32_t> who;
        for (uint32_t i = 0; i < n_; ++i) {
            if (!peers_[i].control) continue;
            const Conn &c = *conns_.at(peers_[i].control);
            if (c.outq.empty()) continue;
            fds.push_back({c.fd.get(), POLLOUT, 0});
            who.push_back(i);
        }
        if (fds.empty()) return;
        const int timeout = ms_until(deadline);
        if (timeout <= 0) return;
        const int n = ::poll(fds.data(), fds.size(), timeout);
        if (n < 0 && errno != EINTR) return;
        for (size_t k = 0; k < fds.size(); ++k) {
            if (!fds[k].revents) continue;
            // flush() fails a peer whose connection broke; that closes the connection (not ours
            // to look at any more), and the ring is already down, so nothing re-enters here.
            if (peers_[who[k]].control) (void)flush(*conns_.at(peers_[who[k]].control));
        }
    }
}

std::vector<ControlPlane::PeerStatus> ControlPlane::status() const {
    std::vector<PeerStatus> out;
    const auto now = Clock::now();
    for (uint32_t i = 0; i < n_; ++i) {
        const Peer &p = peers_[i];
        PeerStatus s{p.host.name, p.host.address, p.host.port, i == self_, p.state, p.last_error, -1,
                     p.control ? p.protocol : uint16_t{0}, p.config_version, p.hosts_differ};
        if (p.last_heard != Clock::time_point{}) s.last_heard_s = std::chrono::duration<double>(now - p.last_heard).count();
        out.push_back(std::move(s));
    }
    return out;
}

PeerIdentity ControlPlane::identity() const {
    return PeerIdentity{config_.cluster, peers_[self_].host.name, announced_generation(), secret_, domain_, hosts_digest_,
                        config_version_ ? *config_version_ : std::string(), instance_};
}

std::vector<uint64_t> ControlPlane::instances() const {
    std::vector<uint64_t> v(n_, 0);
    for (uint32_t i = 0; i < n_; ++i) v[i] = i == self_ ? instance_ : peers_[i].instance;
    return v;
}

uint16_t ControlPlane::protocol() const {
    uint16_t v = proto::kPeerProtocolVersion;
    for (uint32_t i = 0; i < n_; ++i)
        if (i != self_ && peers_[i].control) v = std::min(v, peers_[i].protocol);
    return v;
}

std::vector<std::pair<std::string, std::string>> ControlPlane::hosts_down(Clock::time_point now) const {
    std::vector<std::pair<std::string, std::string>> v;
    for (uint32_t i = 0; i < n_; ++i) {
        const Peer &p = peers_[i];
        if (i == self_ || p.control || p.down_since == Clock::time_point{} || p.down_since == Clock::time_point::max()) continue;
        const bool dialed = i > self_;  // the earlier host dials the control connection
        const Clock::duration after =
            dialed ? Clock::duration(kDownAfter) : std::max<Clock::duration>(kDownAfter, kMissedHeartbeats * config_.timeouts.heartbeat);
        if (now - p.down_since < after || (dialed && p.last_error.empty())) continue;
        v.emplace_back(p.host.name, p.last_error.empty() ? "it has not connected" : p.last_error);
    }
    return v;
}

std::vector<std::string> ControlPlane::hosts_differ() const {
    std::vector<std::string> v;
    for (uint32_t i = 0; i < n_; ++i)
        if (i != self_ && peers_[i].hosts_differ) v.push_back(peers_[i].host.name);
    return v;
}

}  // namespace ringd

namespace ringd {

void ControlPlane::redial_rail(uint32_t lane, uint32_t rail, Clock::time_point now) {
    if (!ring_up_ || rails_ < 2 || rail >= rails_ || n_ < 2) return;
    const uint32_t per = per_rail();
    for (uint32_t j = 0; j < per; ++j) {
        const uint32_t s = (lane * rails_ + rail) * per + j;
        if (s >= data_out_.size() || rejoin_out_.count(s)) continue;
        if (auto t = rejoin_next_dial_.find(s); t != rejoin_next_dial_.end() && now < t->second) continue;
        dial(next(), proto::ConnKind::Data, s, true);
    }
}

void ControlPlane::maybe_rail_up(uint32_t stream, bool to_next) {
    auto &m = to_next ? rejoin_out_ : rejoin_in_;
    const uint32_t per = per_rail(), lane = lane_of(stream), rail = rail_of(stream);
    const uint32_t first = (lane * rails_ + rail) * per;
    for (uint32_t s = first; s < first + per; ++s) {
        auto it = m.find(s);
        if (it == m.end() || conns_.at(it->second)->state != ConnState::Up) return;
    }
    Event e;
    e.kind = Event::Kind::RailStreams;
    e.generation = generation_;
    e.lane = lane;
    e.rail = rail;
    e.outgoing = to_next;
    DataSockets &d = to_next ? e.to_next : e.from_prev;
    for (uint32_t s = first; s < first + per; ++s) {
        const uint64_t id = m.at(s);
        Conn &c = *conns_.at(id);
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
        d.fds.push_back(std::move(c.fd));
        d.keys.push_back(c.keys);
        d.rails.push_back(rail);
        conns_.erase(id);
        m.erase(s);
        rejoin_next_dial_.erase(s);
    }
    spdlog::info("{}data streams of rail {} {} {}: connected again", label(), rail, to_next ? "to" : "from",
                 peers_[to_next ? next() : prev()].host.name);
    events_.push_back(std::move(e));
}

void ControlPlane::close_rejoins() {
    std::vector<uint64_t> ids;
    for (const auto &[s, id] : rejoin_out_) ids.push_back(id);
    for (const auto &[s, id] : rejoin_in_) ids.push_back(id);
    for (uint64_t id : ids) close_conn(id);
    rejoin_out_.clear();
    rejoin_in_.clear();
    rejoin_next_dial_.clear();
}

}  // namespace ringd
