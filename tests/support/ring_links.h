// A ring of hosts in one process, for the engine's tests: one transport per host (each driven
// by its own thread), linked next to previous. kind: loopback | tcp (`streams` per link, real
// 127.0.0.1 sockets) | ibverbs (the software RDMA device, `streams` QPs per link).
#pragma once

#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/engine/ring_engine.h"
#include "daemon/transport/loopback/loopback_transport.h"
#include "daemon/transport/tcp/tcp_transport.h"
#ifdef RINGD_HAVE_IBVERBS
#include "daemon/transport/ibverbs/emulated_device.h"
#include "daemon/transport/ibverbs/ibverbs_transport.h"
#endif
#include "tests/support/net.h"

namespace ringd::test {

inline std::string host(uint32_t r) { return "node" + std::to_string(r); }

// A ring of n hosts in one process.
struct Ring {
    uint32_t n;
    std::vector<std::unique_ptr<Transport>> transports;
    std::vector<RingPosition> pos;
    std::vector<std::vector<Link *>> links_of;  // every link a rank owns

    // kind: loopback | tcp (`streams` per link) | ibverbs (emulated device, `streams` QPs per link)
    // zero_copy: TCP's (tcp.zero_copy). rails (TCP): `streams` per rail per link, weights alike.
    Ring(uint32_t hosts, const std::string &kind, int streams = 2, bool zero_copy = true, uint32_t rails = 1)
        : n(hosts), pos(hosts), links_of(hosts), rails_(rails), per_rail_(static_cast<uint32_t>(streams)), sending_(hosts) {
        for (uint32_t r = 0; r < n; ++r) {
            if (kind == "loopback") transports.push_back(std::make_unique<LoopbackTransport>());
#ifdef RINGD_HAVE_IBVERBS
            else if (kind == "ibverbs") {
                IbverbsOptions o;
                o.provider = "emulated";
                o.qps_per_link = static_cast<uint32_t>(streams);
                auto t = IbverbsTransport::create(verbs::emulated_verbs(), o);
                REQUIRE(t.ok());
                transports.push_back(std::move(*t));
            }
#endif
            else transports.push_back(std::make_unique<TcpTransport>("", false, 0, zero_copy, 500));
            pos[r].rank = r;
            pos[r].size = n;
        }
        if (n == 1) return;
        // Link r -> r+1 (one link per neighbouring pair; with two hosts a single link).
        const uint32_t pairs = n == 2 ? 1 : n;
        for (uint32_t r = 0; r < pairs; ++r) {
            const uint32_t q = (r + 1) % n;
            Link *a, *b;
            if (kind == "loopback") {
                auto [x, y] = LoopbackTransport::connect(static_cast<LoopbackTransport &>(*transports[r]), host(r),
                                                         static_cast<LoopbackTransport &>(*transports[q]), host(q));
                a = x;
                b = y;
            } else {
                std::vector<UniqueFd> sa, sb;
                std::vector<uint32_t> stream_rails;
                for (int i = 0; i < streams * static_cast<int>(rails); ++i) {
                    auto [c, s] = tcp_pair();
                    if (rails > 1) sending_[r].emplace_back(::dup(c.get()));  // (a dup keeps the connection open)
                    sa.push_back(std::move(c));
                    sb.push_back(std::move(s));
                    stream_rails.push_back(static_cast<uint32_t>(i / streams));
                }
                // Both ends at once: a transport may exchange something first (ibverbs does).
                const int conns = kind == "ibverbs" ? 1 : streams * static_cast<int>(rails);
                sa.resize(static_cast<size_t>(conns));
                sb.resize(static_cast<size_t>(conns));
                auto &ta = static_cast<NetworkTransport &>(*transports[r]);
                auto &tb = static_cast<NetworkTransport &>(*transports[q]);
                const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
                Result<std::vector<Link *>> la = make_error(-1, ""), lb = make_error(-1, "");
                std::vector<LinkSetup> ua(1), ub(1);
                ua[0] = {host(q), std::move(sa)};
                ub[0] = {host(r), std::move(sb)};
                if (rails > 1) {
                    ua[0].rails = ub[0].rails = stream_rails;
                    ua[0].weights = ub[0].weights = std::vector<double>(stream_rails.size(), 1.0);
                }
                std::thread other([&] { lb = tb.add_links(std::move(ub), deadline); });
                la = ta.add_links(std::move(ua), deadline);
                other.join();
                INFO((la.ok() ? std::string() : la.error().message) << " / " << (lb.ok() ? std::string() : lb.error().message));
                REQUIRE((la.ok() && lb.ok()));
                a = la->front();
                b = lb->front();
            }
            pos[r].next = a;
            pos[q].prev = b;
            links_of[r].push_back(a);
            links_of[q].push_back(b);
        }
        if (n == 2) {
            pos[0].prev = pos[0].next;
            pos[1].next = pos[1].prev;
        }
    }
    // TCP: the connections of rail `rail` of host r's link to its next host fail at both ends
    // (as when the NIC goes: a reset, the kernel's timeout). Any thread.
    void take_down(uint32_t r, uint32_t rail) {
        for (uint32_t i = rail * per_rail_; i < (rail + 1) * per_rail_ && i < sending_[r].size(); ++i)
            ::shutdown(sending_[r][i].get(), SHUT_RDWR);
    }

private:
    uint32_t rails_ = 1, per_rail_ = 1;
    std::vector<std::vector<UniqueFd>> sending_;  // dup()s of each host's streams to its next host
};

// One op on every host of the ring at once, each on a thread of its own with an engine of its
// own: host r runs op(r) (its RingOp, filled but for nothing the engine owns). Every host's
// status, by ring position; each host's deadline `limit` from now.
template <class MakeOp>
std::vector<Status> run_on_every_host(Ring &ring, const RingOptions &opt, MakeOp op,
                                      std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::vector<Status> results(ring.n, Ok{});
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < ring.n; ++r)
        threads.emplace_back([&, r] {
            RingEngine e(*ring.transports[r], opt);
            const RingOp o = op(r);
            results[r] = e.run(ring.pos[r], o, std::chrono::steady_clock::now() + limit);
        });
    for (auto &t : threads) t.join();
    return results;
}

}  // namespace ringd::test
