// The software RDMA device's NIC (emulated_device.h): the TX thread executes posted work
// requests on each QP's requester connection; the RX thread accepts requester connections of
// remote QPs, executes their WRITEs into registered memory and answers, and reads the answers to
// this context's own requests.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "daemon/transport/ibverbs/emulated_internal.h"

#if defined(__SANITIZE_THREAD__)
#define RINGD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define RINGD_TSAN 1
#endif
#endif
#ifdef RINGD_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace ringd::verbs::emu {
namespace {

// What the wire orders, for ThreadSanitizer. Tests run both ends of a link in one process, and
// TSan cannot see that bytes sent on one end of a TCP connection are received at the other end:
// it would take everything ordered by the wire — a WRITE's data placed before the requester's
// completion (the acknowledgement follows it), a source buffer reused after its send completed —
// for a race. In sanitizer builds each connection is a sync object, released by every send and
// acquired by every receive on either end (what TSan does by itself for a pipe); elsewhere these
// do nothing.
#ifdef RINGD_TSAN
void *wire_sync(int fd) {
    sockaddr_in a{}, b{};
    socklen_t la = sizeof a, lb = sizeof b;
    ::getsockname(fd, reinterpret_cast<sockaddr *>(&a), &la);
    ::getpeername(fd, reinterpret_cast<sockaddr *>(&b), &lb);
    auto end = [](const sockaddr_in &s) { return (uint64_t{s.sin_addr.s_addr} << 16) | s.sin_port; };
    const uint64_t x = std::min(end(a), end(b)), y = std::max(end(a), end(b));
    static char syncs[4096];  // connections that share one are ordered more than they need to be
    return &syncs[(x * 0x9e3779b97f4a7c15ull ^ y) % sizeof syncs];
}
void wire_sent(int fd) { __tsan_release(wire_sync(fd)); }
void wire_received(int fd) { __tsan_acquire(wire_sync(fd)); }
#else
void wire_sent(int) {}
void wire_received(int) {}
#endif

// The IB RNR timer encoding (min_rnr_timer), in microseconds.
constexpr uint32_t kRnrTimerUs[32] = {655360, 10,   20,   30,   40,    60,    80,    120,   160,   240,   320,
                                      480,    640,  960,  1280, 1920,  2560,  3840,  5120,  7680,  10240, 15360,
                                      20480,  30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520};

// How long a request may wait for its acknowledgement: the local ACK timeout (4.096 us x
// 2^timeout) for each of 1 + retry_cnt transmissions; at least 2 s, since this NIC's answers
// depend on the peer process being scheduled. timeout 0 = forever.
Clock::duration ack_timeout(const EmuQp &qp) {
    if (qp.timeout == 0) return Clock::duration::max() / 2;
    const double one = 4.096e-6 * static_cast<double>(1ull << std::min<uint8_t>(qp.timeout, 31));
    const double total = std::max(2.0, one * (qp.retry_cnt + 1));
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(total));
}

bool gid_to_ipv4(const ibv_gid &g, sockaddr_in &out) {
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (std::memcmp(g.raw, prefix, 12) != 0) return false;  // link-local or IPv6: not routable here
    out = sockaddr_in{};
    out.sin_family = AF_INET;
    std::memcpy(&out.sin_addr, g.raw + 12, 4);
    return true;
}

// Writes all of [p, p+n) to a non-blocking socket, waiting at most `limit` for room.
bool send_all(int fd, const void *p, size_t n, int limit_ms = 1000) {
    const auto *b = static_cast<const uint8_t *>(p);
    wire_sent(fd);
    while (n > 0) {
        const ssize_t w = ::send(fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            b += w;
            n -= static_cast<size_t>(w);
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            pollfd pf{fd, POLLOUT, 0};
            if (::poll(&pf, 1, limit_ms) <= 0) return false;
        } else {
            return false;
        }
    }
    return true;
}

// ---- TX ----

// Opens the requester connection of an RTS QP: to the destination GID's address, port = dlid.
int connect_qp(uint32_t src_qpn, uint32_t dest_qpn, const ibv_gid &dgid, uint16_t dlid, uint8_t rnr_retry) {
    sockaddr_in a{};
    if (!gid_to_ipv4(dgid, a)) return -1;
    a.sin_port = htons(dlid);
    UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!s) return -1;
    const int one = 1, buf = 4 << 20;
    ::setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::setsockopt(s.get(), SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    ::setsockopt(s.get(), SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    if (::connect(s.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
        if (errno != EINPROGRESS) return -1;
        pollfd pf{s.get(), POLLOUT, 0};
        int err = 0;
        socklen_t len = sizeof err;
        if (::poll(&pf, 1, 2000) != 1 || ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)
            return -1;
    }
    const WireHello h{kWireMagic, src_qpn, dest_qpn, rnr_retry, {}};
    if (!send_all(s.get(), &h, sizeof h, 2000)) return -1;
    return s.release();
}

struct Gather {
    iovec iov[kMaxSge + 1];
    int n = 0;
    std::shared_ptr<EmuMr> mrs[kMaxSge];
};

// Completes an acknowledged (or refused) send; ctx->mu held.
void finish_send(EmuQp *qp, const SendWqe &w, uint8_t syndrome) {
    if (syndrome == kAck) {
        complete_send(qp, w, IBV_WC_SUCCESS);
        return;
    }
    complete_send(qp, w,
                  syndrome == kNakAccess ? IBV_WC_REM_ACCESS_ERR
                  : syndrome == kNakRnr  ? IBV_WC_RNR_RETRY_EXC_ERR
                                         : IBV_WC_REM_INV_REQ_ERR);
    qp_to_error(qp);
}

// Sends one request (header + payload) while holding each source region's DMA lock only around
// non-blocking socket calls.
bool transmit(EmuContext *c, int fd, const WireRequest &req, Gather &g, const SendWqe &w) {
    size_t off = 0;
    const size_t total = sizeof req + w.length;
    g.iov[0] = {const_cast<WireRequest *>(&req), sizeof req};
    while (off < total) {
        // The iovecs from `off` on.
        iovec v[kMaxSge + 1];
        int nv = 0;
        size_t skip = off;
        for (int i = 0; i < g.n; ++i) {
            if (skip >= g.iov[i].iov_len) {
                skip -= g.iov[i].iov_len;
                continue;
            }
            v[nv++] = {static_cast<uint8_t *>(g.iov[i].iov_base) + skip, g.iov[i].iov_len - skip};
            skip = 0;
        }
        std::shared_lock<std::shared_mutex> locks[kMaxSge];
        bool dead = false;
        for (uint32_t i = 0; i < w.num_sge; ++i) {
            locks[i] = std::shared_lock(g.mrs[i]->mu);
            dead |= g.mrs[i]->dead;
        }
        if (dead) return false;  // deregistered under a posted send: a local protection error
        msghdr m{};
        m.msg_iov = v;
        m.msg_iovlen = static_cast<size_t>(nv);
        wire_sent(fd);
        const ssize_t r = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        for (auto &l : locks)
            if (l.owns_lock()) l.unlock();
        if (r > 0) {
            off += static_cast<size_t>(r);
            continue;
        }
        if (r < 0 && errno != EAGAIN && errno != EINTR) return false;
        pollfd pf{fd, POLLOUT, 0};
        if (::poll(&pf, 1, 100) < 0 && errno != EINTR) return false;
        std::lock_guard lock(c->mu);
        if (c->stopping) return false;
    }
    return true;
}

// Executes up to `budget` of a QP's posted sends; true if some are left.
bool run_send_queue(EmuContext *c, const std::shared_ptr<EmuQp> &qp, int budget) {
    int fd;
    {
        std::unique_lock lock(c->mu);
        if (qp->dead || qp->qp.state != IBV_QPS_RTS || qp->sq.empty()) return false;
        if (qp->out_fd < 0) {
            const uint32_t src = qp->qp.qp_num, dest = qp->dest_qpn;
            const ibv_gid dgid = qp->dgid;
            const uint16_t dlid = qp->dlid;
            const uint8_t rnr = qp->rnr_retry;
            lock.unlock();
            const int s = connect_qp(src, dest, dgid, dlid, rnr);
            lock.lock();
            if (s < 0 || qp->dead || qp->qp.state != IBV_QPS_RTS) {
                if (s >= 0) ::close(s);
                if (qp->qp.state == IBV_QPS_RTS && !qp->sq.empty()) {
                    // Nobody answers at that address: the transport retries run out.
                    SendWqe w = qp->sq.front();
                    qp->sq.pop_front();
                    complete_send(qp.get(), w, IBV_WC_RETRY_EXC_ERR);
                    qp_to_error(qp.get());
                }
                return false;
            }
            qp->out_fd = s;
            auto conn = std::make_unique<RxConn>();
            conn->fd = UniqueFd(::fcntl(s, F_DUPFD_CLOEXEC, 0));
            conn->outbound = true;
            conn->qp = qp;
            c->new_conns.push_back(std::move(conn));
            lock.unlock();
            wake_rx(c);
            lock.lock();
        }
        fd = qp->out_fd;
    }
    for (int k = 0; k < budget; ++k) {
        SendWqe w;
        Gather g;
        WireRequest req{};
        {
            std::lock_guard lock(c->mu);
            if (qp->dead || qp->qp.state != IBV_QPS_RTS || qp->sq.empty()) return false;
            w = qp->sq.front();
            qp->sq.pop_front();
            // Local protection: every SGE inside a region of this PD registered with its lkey.
            g.n = 1;
            bool ok = true;
            if (w.is_inline) {
                g.iov[g.n++] = {w.inline_data, w.length};
            } else {
                for (uint32_t i = 0; i < w.num_sge && ok; ++i) {
                    const ibv_sge &s = w.sge[i];
                    auto it = c->mrs.find(s.lkey);
                    ok = it != c->mrs.end() && it->second->mr.pd == qp->qp.pd;
                    if (!ok) break;
                    const auto base = reinterpret_cast<uint64_t>(it->second->mr.addr);
                    ok = s.addr >= base && s.length <= it->second->mr.length &&
                         s.addr - base <= it->second->mr.length - s.length;
                    g.mrs[i] = it->second;
                    g.iov[g.n++] = {reinterpret_cast<void *>(s.addr), s.length};
                }
            }
            if (!ok) {
                complete_send(qp.get(), w, IBV_WC_LOC_PROT_ERR);
                qp_to_error(qp.get());
                return false;
            }
            w.seq = qp->next_seq++;
            w.sent_at = Clock::now();
            // The RX thread keeps the acknowledgement deadline of the oldest request in flight.
            if (qp->inflight.empty()) wake_rx(c);
            qp->inflight.push_back(w);
            qp->in_transmit = true;
            qp->in_transmit_seq = w.seq;
            req.opcode = w.opcode;
            req.imm = w.imm;
            req.seq = w.seq;
            req.rkey = w.rkey;
            req.remote_addr = w.remote_addr;
            req.length = w.length;
        }
        const bool sent = transmit(c, fd, req, g, w);
        std::lock_guard lock(c->mu);
        // The source is read: an error completion that came meanwhile goes out now.
        qp->in_transmit = false;
        if (qp->after_transmit) {
            auto [done, status] = *qp->after_transmit;
            qp->after_transmit.reset();
            complete_send(qp.get(), done, status);
        }
        if (sent) {
            // Only this thread appends, so the request is the newest in flight unless the
            // acknowledgement timeout or an error took it already.
            if (!qp->inflight.empty() && qp->inflight.back().seq == w.seq) qp->inflight.back().on_wire = true;
            if (!qp->dead && !qp->inflight.empty() && qp->inflight.front().seq == w.seq &&
                qp->inflight.front().response >= 0) {
                SendWqe done = qp->inflight.front();
                qp->inflight.pop_front();
                finish_send(qp.get(), done, static_cast<uint8_t>(done.response));
            }
            continue;
        }
        if (!qp->dead && qp->qp.state == IBV_QPS_RTS) {
            // The wire broke (the peer is gone) or the source region went away under the send.
            const bool local = std::any_of(g.mrs, g.mrs + w.num_sge, [](auto &m) { return m && m->dead; });
            if (!qp->inflight.empty()) {
                SendWqe first = qp->inflight.front();
                qp->inflight.pop_front();
                complete_send(qp.get(), first, local ? IBV_WC_LOC_PROT_ERR : IBV_WC_RETRY_EXC_ERR);
            }
            qp_to_error(qp.get());
        }
        return false;
    }
    std::lock_guard lock(c->mu);
    return !qp->sq.empty();
}

}  // namespace

void wake_rx(EmuContext *c) {
    const uint64_t one = 1;
    (void)!::write(c->rx_wake.get(), &one, sizeof one);
}

void tx_main(EmuContext *c) {
    std::vector<std::shared_ptr<EmuQp>> work;
    for (;;) {
        {
            std::unique_lock lock(c->mu);
            c->tx_cv.wait(lock, [&] { return c->stopping || c->tx_work; });
            if (c->stopping) return;
            c->tx_work = false;
            work.clear();
            for (auto &[n, qp] : c->qps)
                if (!qp->sq.empty() && qp->qp.state == IBV_QPS_RTS) work.push_back(qp);
        }
        bool more = false;
        for (auto &qp : work) more |= run_send_queue(c, qp, 16);  // round robin between QPs
        work.clear();
        if (more) {
            std::lock_guard lock(c->mu);
            c->tx_work = true;
        }
    }
}

// ---- RX ----
namespace {

class Rx {
public:
    explicit Rx(EmuContext *c) : c_(c), scratch_(64 << 10) {}
    void run();

private:
    void add(std::unique_ptr<RxConn> conn);
    void drop(int fd);
    void set_reading(RxConn &k, bool on);
    void accept_all();
    void on_readable(RxConn &k);
    bool read_responses(RxConn &k);
    bool read_requests(RxConn &k);
    bool begin_payload(RxConn &k);
    bool finish_request(RxConn &k);
    bool respond(RxConn &k, uint8_t syndrome);
    void check_rnr_waits();

    EmuContext *c_;
    std::unordered_map<int, std::unique_ptr<RxConn>> conns_;
    std::vector<uint8_t> scratch_;
};

void Rx::add(std::unique_ptr<RxConn> conn) {
    const int fd = conn->fd.get();
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    if (::epoll_ctl(c_->rx_epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return;
    conns_.emplace(fd, std::move(conn));
}

void Rx::drop(int fd) {
    ::epoll_ctl(c_->rx_epoll.get(), EPOLL_CTL_DEL, fd, nullptr);
    conns_.erase(fd);
}

void Rx::set_reading(RxConn &k, bool on) {
    epoll_event ev{};
    ev.events = on ? EPOLLIN | EPOLLRDHUP : 0;
    ev.data.fd = k.fd.get();
    ::epoll_ctl(c_->rx_epoll.get(), EPOLL_CTL_MOD, k.fd.get(), &ev);
}

void Rx::accept_all() {
    for (;;) {
        const int s = ::accept4(c_->listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (s < 0) return;
        const int one = 1, buf = 4 << 20;
        ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        ::setsockopt(s, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
        auto k = std::make_unique<RxConn>();
        k->fd = UniqueFd(s);
        add(std::move(k));
    }
}

bool Rx::respond(RxConn &k, uint8_t syndrome) {
    const WireResponse r{syndrome, {}, k.req.seq};
    return send_all(k.fd.get(), &r, sizeof r);
}

// Answers to our own requests, in order.
bool Rx::read_responses(RxConn &k) {
    for (;;) {
        const ssize_t r = ::recv(k.fd.get(), k.buf + k.got, sizeof(WireResponse) - k.got, MSG_DONTWAIT);
        if (r > 0) wire_received(k.fd.get());
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
            std::lock_guard lock(c_->mu);
            EmuQp *qp = k.qp.get();
            if (!qp->dead && qp->qp.state == IBV_QPS_RTS) {
                // The responder is gone: what was on the wire is never acknowledged.
                if (!qp->inflight.empty()) {
                    SendWqe w = qp->inflight.front();
                    qp->inflight.pop_front();
                    complete_send_after_read(qp, w, IBV_WC_RETRY_EXC_ERR);
                    qp_to_error(qp);
                }
            }
            return false;
        }
        if (r < 0) return true;
        k.got += static_cast<size_t>(r);
        if (k.got < sizeof(WireResponse)) continue;
        k.got = 0;
        WireResponse resp;
        std::memcpy(&resp, k.buf, sizeof resp);
        std::lock_guard lock(c_->mu);
        EmuQp *qp = k.qp.get();
        if (qp->dead || qp->inflight.empty() || qp->inflight.front().seq != resp.seq) continue;
        if (!qp->inflight.front().on_wire) {
            qp->inflight.front().response = resp.syndrome;  // the TX thread completes it
            continue;
        }
        SendWqe w = qp->inflight.front();
        qp->inflight.pop_front();
        finish_send(qp, w, resp.syndrome);
    }
}

// A request's header is in: check it as the responder's NIC would, then take its payload.
bool Rx::begin_payload(RxConn &k) {
    std::memcpy(&k.req, k.buf, sizeof k.req);
    k.got = 0;
    k.in_payload = true;
    k.payload_done = 0;
    k.target.reset();
    k.pending_nak = kAck;
    std::lock_guard lock(c_->mu);
    EmuQp *qp = k.qp.get();
    if (qp->dead || (qp->qp.state != IBV_QPS_RTR && qp->qp.state != IBV_QPS_RTS)) {
        k.pending_nak = 0xff;  // a QP that cannot receive drops the packet: no answer at all
        return true;
    }
    if ((k.req.opcode != kWrite && k.req.opcode != kWriteImm) || k.req.length > kMaxMessage) {
        k.pending_nak = kNakInvalid;
        return true;
    }
    if (k.req.length > 0) {
        auto it = c_->mrs.find(k.req.rkey);
        const EmuMr *mr = it == c_->mrs.end() ? nullptr : it->second.get();
        const auto base = mr ? reinterpret_cast<uint64_t>(mr->mr.addr) : 0;
        if (!mr || mr->mr.pd != qp->qp.pd || !(mr->access & IBV_ACCESS_REMOTE_WRITE) ||
            !(qp->access & IBV_ACCESS_REMOTE_WRITE) || k.req.remote_addr < base || k.req.length > mr->mr.length ||
            k.req.remote_addr - base > mr->mr.length - k.req.length) {
            k.pending_nak = kNakAccess;
            return true;
        }
        k.target = it->second;
    }
    if (k.req.opcode == kWriteImm && qp->rq.empty()) {
        // Receiver not ready: RNR NAKs, retried by the requester rnr_retry times (7: forever).
        k.rnr_wait = true;
        qp->rnr_waiting = true;
        const uint64_t us = uint64_t{kRnrTimerUs[qp->min_rnr_timer & 31]} * (k.peer_rnr_retry + 1u);
        k.rnr_until = k.peer_rnr_retry == 7 ? Clock::time_point::max() : Clock::now() + std::chrono::microseconds(us);
        set_reading(k, false);
    }
    return true;
}

bool Rx::finish_request(RxConn &k) {
    k.in_payload = false;
    k.target.reset();
    if (k.pending_nak == 0xff) return true;
    if (k.pending_nak != kAck) {
        if (k.pending_nak == kNakAccess) {
            std::lock_guard lock(c_->mu);
            if (!k.qp->dead) qp_to_error(k.qp.get());  // the responder QP fails too
        }
        return respond(k, k.pending_nak);
    }
    if (k.req.opcode == kWriteImm) {
        std::lock_guard lock(c_->mu);
        EmuQp *qp = k.qp.get();
        if (qp->dead || qp->rq.empty()) return true;  // flushed meanwhile: dropped
        ibv_wc wc = make_wc(qp, qp->rq.front(), IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM);
        qp->rq.pop_front();
        wc.byte_len = k.req.length;
        wc.imm_data = k.req.imm;
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.src_qp = qp->dest_qpn;
        push_cqe(qp->rcq, wc);
    }
    return respond(k, kAck);
}

bool Rx::read_requests(RxConn &k) {
    for (;;) {
        if (k.rnr_wait) return true;
        ssize_t r;
        if (!k.have_hello) {
            r = ::recv(k.fd.get(), k.buf + k.got, sizeof(WireHello) - k.got, MSG_DONTWAIT);
        } else if (!k.in_payload) {
            r = ::recv(k.fd.get(), k.buf + k.got, sizeof(WireRequest) - k.got, MSG_DONTWAIT);
        } else {
            const uint64_t left = k.req.length - k.payload_done;
            if (left == 0) {
                if (!finish_request(k)) return false;
                continue;
            }
            if (k.target) {
                // `target` outlives the locks: k.target.reset() below may drop the last reference
                // to a region deregistered meanwhile, whose mutex `dma` still holds.
                const std::shared_ptr<EmuMr> target = k.target;
                std::shared_lock qp_dma(k.qp->dma_mu);
                std::shared_lock dma(target->mu);
                if (k.qp->dma_off) {
                    k.target.reset();  // the QP failed or went away: the rest is dropped
                    k.pending_nak = 0xff;
                    continue;
                }
                if (target->dead) {
                    k.target.reset();  // deregistered under the write
                    k.pending_nak = kNakAccess;
                    continue;
                }
                auto *dst = reinterpret_cast<uint8_t *>(k.req.remote_addr) + k.payload_done;
                r = ::recv(k.fd.get(), dst, left, MSG_DONTWAIT);
            } else {
                r = ::recv(k.fd.get(), scratch_.data(), std::min<uint64_t>(left, scratch_.size()), MSG_DONTWAIT);
            }
            if (r > 0) {
                wire_received(k.fd.get());
                k.payload_done += static_cast<uint64_t>(r);
                continue;
            }
        }
        if (r > 0) wire_received(k.fd.get());
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return false;
        if (r < 0) return true;
        if (k.in_payload) continue;
        k.got += static_cast<size_t>(r);
        if (!k.have_hello) {
            if (k.got < sizeof(WireHello)) continue;
            k.got = 0;
            WireHello h;
            std::memcpy(&h, k.buf, sizeof h);
            sockaddr_in peer{};
            socklen_t len = sizeof peer;
            ::getpeername(k.fd.get(), reinterpret_cast<sockaddr *>(&peer), &len);
            std::lock_guard lock(c_->mu);
            auto it = c_->qps.find(h.dest_qpn);
            if (h.magic != kWireMagic || it == c_->qps.end()) return false;
            // Only the QP this one was connected to (RTR) may write to it.
            sockaddr_in want{};
            EmuQp *qp = it->second.get();
            if ((qp->qp.state != IBV_QPS_RTR && qp->qp.state != IBV_QPS_RTS) || qp->dest_qpn != h.src_qpn ||
                !gid_to_ipv4(qp->dgid, want) || want.sin_addr.s_addr != peer.sin_addr.s_addr)
                return false;
            k.qp = it->second;
            k.peer_rnr_retry = h.rnr_retry;
            k.have_hello = true;
            continue;
        }
        if (k.got < sizeof(WireRequest)) continue;
        if (!begin_payload(k)) return false;
    }
}

void Rx::on_readable(RxConn &k) {
    const bool ok = k.outbound ? read_responses(k) : read_requests(k);
    if (!ok) drop(k.fd.get());
}

void Rx::check_rnr_waits() {
    std::vector<int> ready;
    {
        std::lock_guard lock(c_->mu);
        const auto now = Clock::now();
        for (auto &[fd, k] : conns_) {
            if (!k->rnr_wait) continue;
            EmuQp *qp = k->qp.get();
            if (qp->dead) {
                ready.push_back(fd);
                continue;
            }
            if (!qp->rq.empty() || qp->qp.state == IBV_QPS_ERR) {
                k->rnr_wait = false;
            } else if (now >= k->rnr_until) {
                k->rnr_wait = false;
                k->pending_nak = kNakRnr;  // the requester's RNR retries are used up
                k->target.reset();
            } else {
                continue;
            }
            ready.push_back(fd);
        }
        // post_recv wakes this thread only for QPs that have a request waiting.
        for (auto &[n, qp] : c_->qps) qp->rnr_waiting = false;
        for (auto &[fd, k] : conns_)
            if (k->rnr_wait && k->qp) k->qp->rnr_waiting = true;
    }
    for (int fd : ready) {
        auto it = conns_.find(fd);
        if (it == conns_.end()) continue;
        if (it->second->qp->dead) {
            drop(fd);
            continue;
        }
        set_reading(*it->second, true);
        on_readable(*it->second);
    }
}

// Fails requests whose acknowledgement is overdue; returns the ms until the next deadline
// (-1: none).
int check_ack_timeouts(EmuContext *c) {
    std::lock_guard lock(c->mu);
    const auto now = Clock::now();
    Clock::duration next = Clock::duration::max();
    for (auto &[n, qp] : c->qps) {
        if (qp->inflight.empty() || qp->qp.state != IBV_QPS_RTS) continue;
        const auto due = qp->inflight.front().sent_at + ack_timeout(*qp);
        if (now >= due) {
            SendWqe w = qp->inflight.front();
            qp->inflight.pop_front();
            complete_send_after_read(qp.get(), w, IBV_WC_RETRY_EXC_ERR);
            qp_to_error(qp.get());
        } else {
            next = std::min(next, due - now);
        }
    }
    if (next == Clock::duration::max()) return -1;
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next).count()) + 1;
}

void Rx::run() {
    epoll_event evs[64];
    for (;;) {
        int timeout = check_ack_timeouts(c_);
        const auto now = Clock::now();
        for (auto &[fd, k] : conns_) {
            if (!k->rnr_wait || k->rnr_until == Clock::time_point::max()) continue;
            const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(k->rnr_until - now).count() + 1;
            const int t = static_cast<int>(std::clamp<int64_t>(ms, 0, 1000));
            timeout = timeout < 0 ? t : std::min(timeout, t);
        }
        const int n = ::epoll_wait(c_->rx_epoll.get(), evs, 64, timeout);
        for (int i = 0; i < n; ++i) {
            const int fd = evs[i].data.fd;
            if (fd == c_->listener.get()) {
                accept_all();
            } else if (fd == c_->rx_wake.get()) {
                uint64_t v;
                (void)!::read(fd, &v, sizeof v);
                std::vector<std::unique_ptr<RxConn>> fresh;
                std::vector<int> gone;
                {
                    std::lock_guard lock(c_->mu);
                    if (c_->stopping) return;
                    fresh.swap(c_->new_conns);
                    for (auto &[cfd, k] : conns_)
                        if (k->qp && k->qp->dead) gone.push_back(cfd);
                }
                for (int g : gone) drop(g);
                for (auto &k : fresh) add(std::move(k));
            } else {
                auto it = conns_.find(fd);
                if (it != conns_.end()) on_readable(*it->second);
            }
        }
        check_rnr_waits();
    }
}

}  // namespace

void rx_main(EmuContext *c) {
    Rx rx(c);
    rx.run();
}

}  // namespace ringd::verbs::emu
