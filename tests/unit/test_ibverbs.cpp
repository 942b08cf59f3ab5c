// The ibverbs transport on the software RDMA device: messages of every size between two
// transports (straight into the posted receive, many in flight, more than the FIFO's credits),
// a sender held to the FIFO's credits by a receiver that does not take its messages,
// registration once, and the faults — a receive whose memory went away (bad rkey), a peer that
// dies, a peer with another QP count, no RDMA device (hardware provider here), a memory-lock
// limit too low — each a clear error naming the peer, never a hang — and ring steps that run while
// another thread registers and deregisters regions (trainers joining and leaving).
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>

#include "bench/bench_data.h"
#include "daemon/transport/ibverbs/emulated_device.h"
#include "daemon/transport/ibverbs/ibverbs_transport.h"
#include "tests/support/net.h"
#include "tests/support/skip.h"
#include "tests/support/unprivileged.h"

using namespace ringd;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<IbverbsTransport> emulated(uint32_t qps = 1, uint32_t fifo_entries = 128) {
    IbverbsOptions o;
    o.provider = "emulated";
    o.qps_per_link = qps;
    o.fifo_entries = fifo_entries;
    auto t = IbverbsTransport::create(verbs::emulated_verbs(), o);
    REQUIRE(t.ok());
    return std::move(*t);
}

// Links a <-> b (names as seen from the other side) over a fresh TCP connection, both ends at once.
std::pair<Result<std::vector<Link *>>, Result<std::vector<Link *>>> link_pair(IbverbsTransport &a, IbverbsTransport &b) {
    auto [c, s] = test::tcp_pair();
    std::vector<LinkSetup> ua(1), ub(1);
    ua[0].peer = "hostB";
    ua[0].streams.push_back(std::move(c));
    ub[0].peer = "hostA";
    ub[0].streams.push_back(std::move(s));
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    Result<std::vector<Link *>> lb = make_error(-1, "");
    std::thread other([&] { lb = b.add_links(std::move(ub), deadline); });
    auto la = a.add_links(std::move(ua), deadline);
    other.join();
    return {std::move(la), std::move(lb)};
}

// Polls both transports until `want` events of `kind` arrived on `t` (or a Failed one), 5 s at most.
std::vector<LinkEvent> pump(std::vector<Transport *> all, Transport *t, size_t want, LinkEvent::Kind kind) {
    std::vector<LinkEvent> got;
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < deadline) {
        for (Transport *x : all) {
            std::vector<LinkEvent> ev;
            REQUIRE(x->poll(ev, 1).ok());
            if (x != t) continue;
            for (auto &e : ev) {
                if (e.kind == LinkEvent::Kind::Failed) return {e};
                if (e.kind == kind) got.push_back(e);
            }
        }
        if (got.size() >= want) break;
    }
    return got;
}

}  // namespace

TEST_CASE("ibverbs links carry messages of every size into the posted receives, beyond the FIFO's credits",
          "[ibverbs]") {
    const uint32_t qps = GENERATE(1u, 3u);
    auto a = emulated(qps), b = emulated(qps);
    auto [la, lb] = link_pair(*a, *b);
    REQUIRE((la.ok() && lb.ok()));
    Link *ab = la->front(), *ba = lb->front();
    std::vector<std::byte> src(16 << 20), dst(16 << 20);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 131) >> 3);
    auto rs = a->register_region(src.data(), src.size());
    auto rd = b->register_region(dst.data(), dst.size());
    REQUIRE((rs.ok() && rd.ok()));
    // 300 messages (more than the 128 FIFO entries), sizes 0 B .. 64 KiB, to distinct places.
    std::vector<std::pair<uint64_t, uint64_t>> msgs;  // offset, bytes
    uint64_t at = 0;
    for (uint64_t k = 0; k < 300; ++k) {
        const uint64_t bytes = k % 7 == 0 ? 0 : (k * 977) % (64 << 10);
        msgs.push_back({at, bytes});
        at += bytes;
    }
    REQUIRE(at <= src.size());
    // Receives first for half, then sends, then the rest of the receives (both orders happen).
    for (uint64_t k = 0; k < 150; ++k) REQUIRE(ba->post_recv(*rd, msgs[k].first, msgs[k].second, 1000 + k).ok());
    for (uint64_t k = 0; k < 300; ++k) REQUIRE(ab->post_send(*rs, msgs[k].first, msgs[k].second, 1000 + k).ok());
    for (uint64_t k = 150; k < 300; ++k) REQUIRE(ba->post_recv(*rd, msgs[k].first, msgs[k].second, 1000 + k).ok());
    std::vector<LinkEvent> recvd, sent;
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while ((recvd.size() < 300 || sent.size() < 300) && std::chrono::steady_clock::now() < deadline) {
        std::vector<LinkEvent> ev;
        REQUIRE(a->poll(ev, 1).ok());
        REQUIRE(b->poll(ev, 1).ok());
        for (auto &e : ev) {
            REQUIRE(e.kind != LinkEvent::Kind::Failed);
            (e.kind == LinkEvent::Kind::RecvDone ? recvd : sent).push_back(e);
        }
    }
    REQUIRE(recvd.size() == 300);
    REQUIRE(sent.size() == 300);
    CHECK(std::memcmp(src.data(), dst.data(), at) == 0);
    CHECK(ab->bytes_sent() == at);
    CHECK(ba->bytes_received() == at);
    CHECK(a->stats().registrations == 1);  // the one region; the FIFOs are the link's own
    CHECK(a->detail().find("ringd_emu0 port 1") != std::string::npos);
    CHECK(static_cast<IbverbsLink *>(ab)->qp_count() == qps);
}

TEST_CASE("a sibling transport (another ring domain's) moves data between regions its parent registered, on "
          "a completion queue of its own",
          "[ibverbs]") {
    auto a = emulated(2), b = emulated(2);
    auto sa = a->sibling(), sb = b->sibling();
    REQUIRE((sa.ok() && sb.ok()));
    auto *as = static_cast<IbverbsTransport *>(sa->get()), *bs = static_cast<IbverbsTransport *>(sb->get());
    std::vector<std::byte> src(4 << 20), dst(4 << 20);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 7) >> 2);
    auto rs = a->register_region(src.data(), src.size());  // registered once, by the parents
    auto rd = b->register_region(dst.data(), dst.size());
    REQUIRE((rs.ok() && rd.ok()));
    auto [la, lb] = link_pair(*as, *bs);
    REQUIRE((la.ok() && lb.ok()));
    for (uint64_t k = 0; k < 8; ++k) {
        REQUIRE(lb->front()->post_recv(*rd, k << 19, 1 << 19, k).ok());
        REQUIRE(la->front()->post_send(*rs, k << 19, 1 << 19, k).ok());
    }
    auto got = pump({as, bs, a.get(), b.get()}, bs, 8, LinkEvent::Kind::RecvDone);
    REQUIRE(got.size() == 8);
    CHECK(got.front().kind == LinkEvent::Kind::RecvDone);
    CHECK(std::memcmp(src.data(), dst.data(), src.size()) == 0);
    CHECK(as->stats().registrations == 0);  // nothing registered twice
    std::vector<LinkEvent> parent;
    REQUIRE(a->poll(parent, 0).ok());
    CHECK(parent.empty());  // the sibling's completions are its own
}

TEST_CASE("a sender has at most the FIFO's credits of messages written toward a receiver that has not taken them",
          "[ibverbs]") {
    // 4 credits; 3 x 4 + 1 messages of different sizes, each to its own place in the receiver's
    // region, whose every other byte is a guard. The receiver's NIC takes writes on its own; only
    // its transport's poll() sees them arrive and frees their FIFO entries for new ClearToSends.
    const uint32_t credits = 4, qps = GENERATE(1u, 2u);
    INFO(qps << " QP(s) per link");
    auto a = emulated(qps, credits), b = emulated(qps, credits);
    auto [la, lb] = link_pair(*a, *b);
    REQUIRE((la.ok() && lb.ok()));
    Link *ab = la->front(), *ba = lb->front();
    const uint64_t n = 3 * credits + 1, salt = 0x5eed;
    std::vector<std::pair<uint64_t, uint64_t>> msgs;  // offset (same in both regions), bytes
    uint64_t at = 64;
    for (uint64_t k = 0; k < n; ++k) {
        msgs.push_back({at, 100 + 37 * k});  // over the inline limit: real data writes
        at += msgs.back().second + 64;       // 64 guard bytes between messages
    }
    std::vector<std::byte> src(at), dst(at);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(bench::mix64(i) >> 40);
    bench::guard_fill(dst.data(), 0, dst.size(), salt);
    auto rs = a->register_region(src.data(), src.size());
    auto rd = b->register_region(dst.data(), dst.size());
    REQUIRE((rs.ok() && rd.ok()));
    // Bytes of dst that hold message k (and nothing else does): the first `arrived` messages are
    // in place, every other byte is still its guard.
    auto check_dst = [&](uint64_t arrived) {
        uint64_t wrong = 0, guard = 0, next = 0;
        for (uint64_t k = 0; k < n; ++k) {
            const auto [off, bytes] = msgs[k];
            guard += bench::guard_damage(dst.data(), next, off, salt);
            if (k < arrived) wrong += std::memcmp(src.data() + off, dst.data() + off, bytes) != 0;
            else guard += bench::guard_damage(dst.data(), off, off + bytes, salt);
            next = off + bytes;
        }
        guard += bench::guard_damage(dst.data(), next, dst.size(), salt);
        INFO(arrived << " message(s) expected in place");
        CHECK(wrong == 0);
        CHECK(guard == 0);
    };
    // Polls `who` (the others not at all) until `until` returns true or for `ms`; returns the
    // SendDone tags from a and the RecvDone tags on b, in the order they came.
    std::vector<uint64_t> sent, recvd;
    auto pump_for = [&](std::vector<IbverbsTransport *> who, int ms, auto until) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        while (!until() && std::chrono::steady_clock::now() < deadline) {
            for (IbverbsTransport *x : who) {
                std::vector<LinkEvent> ev;
                REQUIRE(x->poll(ev, 1).ok());
                for (auto &e : ev) {
                    INFO(e.error.message);
                    REQUIRE(e.kind != LinkEvent::Kind::Failed);
                    (e.kind == LinkEvent::Kind::SendDone ? sent : recvd).push_back(e.tag);
                }
            }
        }
    };
    const auto never = [] { return false; };

    // 1. Every send posted, no receive: nothing may be written.
    for (uint64_t k = 0; k < n; ++k) REQUIRE(ab->post_send(*rs, msgs[k].first, msgs[k].second, 100 + k).ok());
    pump_for({a.get()}, 300, never);
    CHECK(sent.empty());
    check_dst(0);

    // 2. Every receive posted, but the receiver takes no completion: exactly `credits` messages
    //    are written (their ClearToSends went out), the rest wait for credits.
    for (uint64_t k = 0; k < n; ++k) REQUIRE(ba->post_recv(*rd, msgs[k].first, msgs[k].second, 100 + k).ok());
    pump_for({a.get()}, 5000, [&] { return sent.size() >= credits; });
    pump_for({a.get()}, 300, never);  // and no more come, however long the sender polls
    CHECK(sent.size() == credits);
    check_dst(credits);

    // 3. The receiver takes its completions: credit by credit, everything arrives, exact.
    pump_for({a.get(), b.get()}, 10000, [&] { return sent.size() >= n && recvd.size() >= n; });
    REQUIRE(sent.size() == n);
    REQUIRE(recvd.size() == n);
    // One QP delivers in order; several complete in order per QP only.
    if (qps > 1) {
        std::sort(sent.begin(), sent.end());
        std::sort(recvd.begin(), recvd.end());
    }
    for (uint64_t k = 0; k < n; ++k) {
        CHECK(sent[k] == 100 + k);
        CHECK(recvd[k] == 100 + k);
    }
    check_dst(n);
}

TEST_CASE("a write into memory the receiver deregistered fails both ends as a remote access error, named", "[ibverbs]") {
    auto a = emulated(), b = emulated();
    auto [la, lb] = link_pair(*a, *b);
    REQUIRE((la.ok() && lb.ok()));
    std::vector<std::byte> src(4096), dst(4096);
    auto rs = a->register_region(src.data(), src.size());
    RegisteredRegion rd(b.get(), *b->register_region(dst.data(), dst.size()));
    REQUIRE(lb->front()->post_recv(rd.handle(), 0, 4096, 7).ok());
    rd.reset();  // the receive's rkey is stale now
    REQUIRE(la->front()->post_send(*rs, 0, 4096, 7).ok());
    auto ev = pump({a.get()}, a.get(), 1, LinkEvent::Kind::SendDone);  // the peer's NIC works unpolled
    REQUIRE(ev.size() == 1);
    CHECK(ev[0].kind == LinkEvent::Kind::Failed);
    CHECK_THAT(ev[0].error.message, Catch::Contains("link to hostB") && Catch::Contains("remote access error"));
    CHECK(la->front()->error().has_value());
    CHECK_FALSE(la->front()->post_send(*rs, 0, 16, 8).ok());  // sticky
    // The responder's QP failed too: its receive is flushed, its link names the requester.
    auto evb = pump({b.get()}, b.get(), 1, LinkEvent::Kind::RecvDone);
    REQUIRE(evb.size() == 1);
    CHECK(evb[0].kind == LinkEvent::Kind::Failed);
    CHECK_THAT(evb[0].error.message, Catch::Contains("link to hostA"));
}

TEST_CASE("a peer that goes away fails the link at once, naming it", "[ibverbs]") {
    auto a = emulated(), b = emulated();
    auto [la, lb] = link_pair(*a, *b);
    REQUIRE((la.ok() && lb.ok()));
    std::vector<std::byte> buf(4096);
    auto r = a->register_region(buf.data(), buf.size());
    REQUIRE(la->front()->post_recv(*r, 0, 4096, 1).ok());
    const auto start = std::chrono::steady_clock::now();
    b.reset();  // the peer's transport, QPs and device are gone
    std::vector<LinkEvent> ev;
    while (ev.empty() && std::chrono::steady_clock::now() - start < 5s) REQUIRE(a->poll(ev, 100).ok());
    REQUIRE_FALSE(ev.empty());
    CHECK(ev[0].kind == LinkEvent::Kind::Failed);
    CHECK_THAT(ev[0].error.message, Catch::Contains("hostB"));
    CHECK(std::chrono::steady_clock::now() - start < 2s);
}

TEST_CASE("peers with different QP counts per link refuse the link with a clear error", "[ibverbs]") {
    auto a = emulated(1), b = emulated(2);
    auto [la, lb] = link_pair(*a, *b);
    REQUIRE_FALSE(la.ok());
    CHECK_THAT(la.error().message, Catch::Contains("qps_per_link must match"));
    REQUIRE_FALSE(lb.ok());
}

TEST_CASE("without an RDMA device the hardware provider fails at once, saying what to do", "[ibverbs]") {
    int n = 0;
    ibv_device **list = ibv_get_device_list(&n);
    if (list) ibv_free_device_list(list);
    if (n > 0) RINGD_SKIP("this machine has an RDMA device: no 'no device' error to see");
    IbverbsOptions o;
    auto t = IbverbsTransport::create(verbs::hardware_verbs(), o);
    REQUIRE_FALSE(t.ok());
    CHECK(t.error().code == -ENODEV);
    CHECK_THAT(t.error().message, Catch::Contains("no RDMA device") && Catch::Contains("ibv_devices") &&
                                      Catch::Contains("transport: tcp"));
}

TEST_CASE("a memory-lock limit too low for registration is reported with the fix", "[ibverbs]") {
    // In a child without CAP_IPC_LOCK and with a 64 KiB RLIMIT_MEMLOCK, as for a non-root daemon.
    const auto msg = test::run_as_nobody([] {
        rlimit lim{64 << 10, 64 << 10};
        ::setrlimit(RLIMIT_MEMLOCK, &lim);
        IbverbsOptions o;
        auto t = IbverbsTransport::create(verbs::emulated_verbs(), o);
        if (!t) return t.error().message;
        std::vector<std::byte> big(1 << 20);
        auto r = (*t)->register_region(big.data(), big.size());
        return r ? std::string("registered") : r.error().message;
    });
    if (!msg) RINGD_SKIP("not root: cannot drop to a user without CAP_IPC_LOCK");
    CHECK_THAT(*msg, Catch::Contains("memory-lock limit is too low") && Catch::Contains("LimitMEMLOCK=infinity"));
}

TEST_CASE("a peer that sends garbage or nothing at bring-up is refused with a clear error, before the deadline",
          "[ibverbs]") {
    auto a = emulated();
    SECTION("garbage") {
        auto [c, s] = test::tcp_pair();
        const char junk[64] = "GET / HTTP/1.1\r\nHost: ringd\r\n\r\n";
        REQUIRE(::write(s.get(), junk, sizeof junk) == static_cast<ssize_t>(sizeof junk));
        std::vector<LinkSetup> u(1);
        u[0].peer = "stranger";
        u[0].streams.push_back(std::move(c));
        auto l = a->add_links(std::move(u), std::chrono::steady_clock::now() + 5s);
        REQUIRE_FALSE(l.ok());
        CHECK_THAT(l.error().message, Catch::Contains("link to stranger") && Catch::Contains("QP info"));
    }
    SECTION("nothing (a peer with another transport)") {
        auto [c, s] = test::tcp_pair();
        std::vector<LinkSetup> u(1);
        u[0].peer = "tcp-host";
        u[0].streams.push_back(std::move(c));
        const auto start = std::chrono::steady_clock::now();
        auto l = a->add_links(std::move(u), start + 300ms);
        REQUIRE_FALSE(l.ok());
        CHECK_THAT(l.error().message, Catch::Contains("link to tcp-host") && Catch::Contains("waiting for the peer's QP info"));
        CHECK(std::chrono::steady_clock::now() - start < 2s);
    }
    // The transport is still fine for a proper peer.
    auto b = emulated();
    auto [la, lb] = link_pair(*a, *b);
    CHECK((la.ok() && lb.ok()));
}

TEST_CASE("registration churn: regions come and go on one thread while ring ops run over ibverbs on another",
          "[ibverbs][churn]") {
    // The daemon's threads in miniature: a "control thread" registers and deregisters regions
    // (slots of trainers joining and leaving) on both transports while the "progress thread"
    // (this one) runs ring steps — every message posted, polled and checked — over their link.
    // Nothing but the registrations' own calls may be shared: under ThreadSanitizer (./dev tsan)
    // a post that looks its region up in the transport's table races with the churn.
    auto a = emulated(), b = emulated();
    auto [la, lb] = link_pair(*a, *b);
    REQUIRE((la.ok() && lb.ok()));
    Link *ab = la->front(), *ba = lb->front();
    constexpr uint64_t kMsgs = 16, kBytes = 4096 + 100;  // per direction and step; over the inline limit
    std::vector<std::byte> src_a(kMsgs * kBytes), dst_a(src_a.size()), src_b(src_a.size()), dst_b(src_a.size());
    RegisteredRegion rsa(a.get(), *a->register_region(src_a.data(), src_a.size()));
    RegisteredRegion rda(a.get(), *a->register_region(dst_a.data(), dst_a.size()));
    RegisteredRegion rsb(b.get(), *b->register_region(src_b.data(), src_b.size()));
    RegisteredRegion rdb(b.get(), *b->register_region(dst_b.data(), dst_b.size()));

    std::atomic<bool> stop{false};
    std::atomic<uint64_t> churned{0};
    std::string churn_error;  // read after join
    std::thread control([&] {
        // Up to 8 live "slots" per transport, the oldest dropped as each new one comes.
        std::vector<std::vector<std::byte>> mem(16, std::vector<std::byte>(64 << 10));
        std::deque<RegisteredRegion> live;
        for (uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
            IbverbsTransport &t = k % 2 ? *b : *a;
            auto r = t.register_region(mem[k % mem.size()].data(), mem[k % mem.size()].size());
            if (!r) {
                churn_error = r.error().message;
                return;
            }
            live.emplace_back(&t, *r);
            if (live.size() > 8) live.pop_front();
            churned.fetch_add(1, std::memory_order_relaxed);
        }
    });
    struct StopAndJoin {  // also when a REQUIRE below ends the test case early
        std::atomic<bool> &stop;
        std::thread &t;
        ~StopAndJoin() {
            stop = true;
            if (t.joinable()) t.join();
        }
    } stop_and_join{stop, control};

    uint64_t step = 0;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    for (; (step < 20 || churned.load() < 200) && std::chrono::steady_clock::now() < deadline; ++step) {
        // Fresh data every step, so that a message that did not arrive shows.
        for (size_t i = 0; i < src_a.size(); ++i) {
            src_a[i] = static_cast<std::byte>(bench::mix64(step * 2 * src_a.size() + i) >> 40);
            src_b[i] = static_cast<std::byte>(bench::mix64((step * 2 + 1) * src_a.size() + i) >> 40);
        }
        for (uint64_t k = 0; k < kMsgs; ++k) {
            const uint64_t tag = step * kMsgs + k;
            REQUIRE(ab->post_recv(rda.handle(), k * kBytes, kBytes, tag).ok());
            REQUIRE(ba->post_recv(rdb.handle(), k * kBytes, kBytes, tag).ok());
            REQUIRE(ab->post_send(rsa.handle(), k * kBytes, kBytes, tag).ok());
            REQUIRE(ba->post_send(rsb.handle(), k * kBytes, kBytes, tag).ok());
        }
        uint64_t done = 0;  // 4 events per message: a send and a receive at each end
        while (done < 4 * kMsgs && std::chrono::steady_clock::now() < deadline) {
            for (IbverbsTransport *x : {a.get(), b.get()}) {
                std::vector<LinkEvent> ev;
                REQUIRE(x->poll(ev, 1).ok());
                for (auto &e : ev) {
                    INFO(e.error.message);
                    REQUIRE(e.kind != LinkEvent::Kind::Failed);
                    ++done;
                }
            }
        }
        INFO("ring step " << step);
        REQUIRE(done == 4 * kMsgs);
        REQUIRE(std::memcmp(src_a.data(), dst_b.data(), src_a.size()) == 0);
        REQUIRE(std::memcmp(src_b.data(), dst_a.data(), src_b.size()) == 0);
    }
    stop = true;
    control.join();
    CHECK(churn_error.empty());
    INFO(step << " ring steps, " << churned.load() << " registrations");
    CHECK(step >= 20);
    CHECK(churned.load() >= 200);  // the churn overlapped the steps
}
