// ControlPlane: rings of daemons' control planes on 127.0.0.1 (different ports), driven in one
// thread: formation, data sockets to the right neighbours, a host that dies or hangs, the ring
// coming back as a new generation, and refusals (wrong secret, unconfigured address, garbage).
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/control/control_plane.h"
#include "daemon/transport/tcp/tcp_transport.h"
#include "tests/support/net.h"
#include "tests/support/skip.h"

using namespace ringd;
using namespace std::chrono_literals;

namespace {

uint16_t base_port() { return static_cast<uint16_t>(10000 + (::getpid() * 7) % 20000); }  // below the ephemeral range

Config ring_config(uint32_t n, uint16_t port0, int streams = 2, std::chrono::milliseconds heartbeat = 100ms) {
    Config c;
    c.cluster = "test";
    for (uint32_t i = 0; i < n; ++i) c.hosts.push_back({"node" + std::to_string(i), "127.0.0.1", static_cast<uint16_t>(port0 + i), {}, {}});
    c.tcp.streams = static_cast<uint32_t>(streams);
    c.tuning.lanes = 1;  // data streams per link = tcp.streams x lanes
    c.timeouts.heartbeat = heartbeat;
    c.timeouts.connect = 2s;
    return c;
}

struct Host {
    std::unique_ptr<ControlPlane> cp;
    uint64_t ups = 0, downs = 0, generation = 0;
    std::string last_down;
    std::vector<UniqueFd> to_next, from_prev;
    std::vector<SessionKeys> to_next_keys, from_prev_keys;
    std::vector<uint32_t> to_next_rails, from_prev_rails;
    std::vector<DataSockets> mesh;  // kept open, as the engine keeps them
    bool frozen = false;  // a hung host: nobody drives it
    std::vector<std::string> events;  // "frame <type>: <payload bytes>" and "down: <why>", in order
    std::vector<proto::Bytes> frames;  // the payloads of the frames of type OpData it received
};

struct Cluster {
    Config config;
    std::vector<Host> hosts;
    PeerSecret secret;

    std::function<void(int)> prepare;  // Callbacks::prepare_socket of every host

    Cluster(uint32_t n, PeerSecret s = {}, std::chrono::milliseconds heartbeat = 100ms, std::function<void(int)> prep = {})
        : config(ring_config(n, base_port(), 2, heartbeat)), hosts(n), secret(std::move(s)), prepare(std::move(prep)) {
        for (uint32_t i = 0; i < n; ++i) start(i);
    }
    explicit Cluster(Config c) : config(std::move(c)), hosts(config.hosts.size()) {
        for (uint32_t i = 0; i < hosts.size(); ++i) start(i);
    }
    void start(uint32_t i, const PeerSecret *secret_override = nullptr) {
        Host &h = hosts[i];
        h.cp.reset();  // a restart: the old instance's port is free again
        ControlPlane::Callbacks cb;
        cb.ring_up = [&h](uint64_t g, DataSockets out, DataSockets in, std::vector<DataSockets> mesh) {
            ++h.ups;
            h.mesh = std::move(mesh);
            h.generation = g;
            h.to_next_rails = out.rails;
            h.from_prev_rails = in.rails;
            h.to_next = std::move(out.fds);
            h.from_prev = std::move(in.fds);
            h.to_next_keys = std::move(out.keys);
            h.from_prev_keys = std::move(in.keys);
        };
        cb.ring_down = [&h](const std::string &why) {
            ++h.downs;
            h.last_down = why;
            h.events.push_back("down: " + why);
            h.to_next.clear();  // the engine drops its links
            h.from_prev.clear();
            h.mesh.clear();
        };
        cb.message = [&h](uint32_t, Frame &f) {
            if (f.type == proto::FrameType::Heartbeat) return;
            h.events.push_back("frame " + std::to_string(static_cast<int>(f.type)) + ": " + std::to_string(f.payload.size()));
            if (f.type == proto::FrameType::OpData) h.frames.push_back(std::move(f.payload));
        };
        cb.prepare_socket = prepare;
        auto cp = ControlPlane::create(config, i, secret_override ? secret_override : &secret, cb);
        REQUIRE(cp.ok());
        h.cp = std::move(*cp);
        h.frozen = false;
    }
    // Drives every live, unfrozen host until pred() or the deadline.
    bool run_until(const std::function<bool()> &pred, std::chrono::milliseconds limit) {
        const auto deadline = Clock::now() + limit;
        while (!pred()) {
            if (Clock::now() >= deadline) return false;
            std::vector<pollfd> fds;
            std::vector<Host *> who;
            for (auto &h : hosts)
                if (h.cp && !h.frozen) {
                    fds.push_back({h.cp->fd(), POLLIN, 0});
                    who.push_back(&h);
                }
            ::poll(fds.data(), fds.size(), 20);
            for (size_t k = 0; k < fds.size(); ++k) {
                if (fds[k].revents) who[k]->cp->on_ready();
                who[k]->cp->tick(Clock::now());
                who[k]->cp->dispatch();
            }
        }
        return true;
    }
    bool all_up(uint64_t min_generation = 1) {
        for (auto &h : hosts)
            if (!h.cp || !h.cp->ring_up() || h.generation < min_generation) return false;
        return true;
    }
};

}  // namespace

TEST_CASE("a ring forms and its data sockets join each host to its neighbours", "[control]") {
    spdlog::set_level(spdlog::level::warn);
    for (uint32_t n : {2u, 3u, 4u}) {
        Cluster c(n);
        REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
        for (uint32_t i = 0; i < n; ++i) {
            INFO("host " << i << " of " << n << ": " << c.hosts[i].last_down);
            CHECK(c.hosts[i].generation == 1);
            REQUIRE(c.hosts[i].to_next.size() == 2);
            REQUIRE(c.hosts[i].from_prev.size() == 2);
            // Mesh data streams to the hosts that are no neighbours: on 4 hosts, the one opposite.
            REQUIRE(c.hosts[i].mesh.size() == (n == 4 ? 1u : 0u));
            if (n == 4) {
                CHECK(c.hosts[i].mesh[0].peer == (i + 2) % 4);
                CHECK(c.hosts[i].mesh[0].fds.size() == 2);
            }
        }
        // A byte on host i's mesh stream k arrives on the opposite host's mesh stream k, both ways.
        if (n == 4)
            for (uint32_t i = 0; i < n; ++i)
                for (uint32_t k = 0; k < 2; ++k) {
                    const uint8_t b = static_cast<uint8_t>(0x40 + i * 4 + k);
                    REQUIRE(::write(c.hosts[i].mesh[0].fds[k].get(), &b, 1) == 1);
                    uint8_t got = 0;
                    REQUIRE(::read(c.hosts[(i + 2) % 4].mesh[0].fds[k].get(), &got, 1) == 1);
                    CHECK(got == b);
                }
        // A byte written on host i's stream k to next arrives on next's stream k from prev.
        for (uint32_t i = 0; i < n; ++i)
            for (int k = 0; k < 2; ++k) {
                const char b = static_cast<char>('a' + i * 2 + k);
                REQUIRE(::send(c.hosts[i].to_next[k].get(), &b, 1, 0) == 1);
            }
        for (uint32_t i = 0; i < n; ++i) {
            const uint32_t p = (i + n - 1) % n;
            std::vector<char> got;
            for (auto &fd : c.hosts[i].from_prev) {
                pollfd pf{fd.get(), POLLIN, 0};
                REQUIRE(::poll(&pf, 1, 2000) == 1);
                char b;
                REQUIRE(::recv(fd.get(), &b, 1, 0) == 1);
                got.push_back(b);
            }
            std::sort(got.begin(), got.end());
            CHECK(got == std::vector<char>{static_cast<char>('a' + p * 2), static_cast<char>('a' + p * 2 + 1)});
        }
        for (auto &h : c.hosts) {
            auto st = h.cp->status();
            for (const auto &p : st) CHECK((p.self || p.control == "up"));
        }
    }
}

TEST_CASE("rails: each data stream joins the two hosts' addresses of its rail; the control connection stays on rail 0",
          "[control][rails]") {
    spdlog::set_level(spdlog::level::warn);
    // Rail 0 on 127.0.0.1 (a port per host), rail 1 on 127.0.1.(i + 1): loopback addresses, so a
    // stream that did not bind its own rail's address would come from 127.0.0.1 and be refused.
    Config cfg = ring_config(3, base_port());
    cfg.tuning.lanes = 2;
    for (uint32_t i = 0; i < 3; ++i) cfg.hosts[i].rails = {"127.0.1." + std::to_string(i + 1)};
    Cluster c(cfg);
    REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
    auto addr = [](int fd, bool peer) {
        sockaddr_in a{};
        socklen_t len = sizeof a;
        REQUIRE((peer ? ::getpeername(fd, reinterpret_cast<sockaddr *>(&a), &len) : ::getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len)) == 0);
        char b[INET_ADDRSTRLEN];
        ::inet_ntop(AF_INET, &a.sin_addr, b, sizeof b);
        return std::string(b);
    };
    for (uint32_t i = 0; i < 3; ++i) {
        const Host &h = c.hosts[i];
        // lanes x rails x streams, in that order.
        REQUIRE(h.to_next.size() == 8);
        REQUIRE(h.from_prev.size() == 8);
        CHECK(h.to_next_rails == std::vector<uint32_t>{0, 0, 1, 1, 0, 0, 1, 1});
        CHECK(h.from_prev_rails == h.to_next_rails);
        const uint32_t next = (i + 1) % 3, prev = (i + 2) % 3;
        for (size_t k = 0; k < 8; ++k) {
            INFO("host " << i << " stream " << k);
            const bool rail1 = h.to_next_rails[k] == 1;
            CHECK(addr(h.to_next[k].get(), false) == (rail1 ? "127.0.1." + std::to_string(i + 1) : "127.0.0.1"));
            CHECK(addr(h.to_next[k].get(), true) == (rail1 ? "127.0.1." + std::to_string(next + 1) : "127.0.0.1"));
            CHECK(addr(h.from_prev[k].get(), true) == (rail1 ? "127.0.1." + std::to_string(prev + 1) : "127.0.0.1"));
        }
    }
}

namespace {
std::string first_line(const char *path) {
    std::ifstream f(path);
    std::string line;
    std::getline(f, line);
    return line;
}
}  // namespace

TEST_CASE("every socket between the hosts has the transport's congestion control from before it connects",
          "[control]") {
    // A congestion control set only once the connection is up keeps what the one it started with
    // set up (BBR, this VM's default: the kernel's internal pacing). So the data sockets must be
    // born with the transport's: set on the dialer before connect, and on the listener, whose
    // accepted connections inherit it. The control connections too: an all_to_all's data travels
    // on them (on BBR, through a token-bucket shaper, it took 1.25-1.35x the link's time, on the
    // data streams' congestion control 1.03x). One other than the system's default shows where it
    // came from.
    spdlog::set_level(spdlog::level::warn);
    const std::string system = first_line("/proc/sys/net/ipv4/tcp_congestion_control");
    std::string want;
    std::istringstream available(first_line("/proc/sys/net/ipv4/tcp_available_congestion_control"));
    for (std::string name; available >> name;)
        if (name != system && TcpTransport::check_congestion(name) && (want.empty() || name == "reno")) want = name;
    if (want.empty()) RINGD_SKIP("only one TCP congestion control (" << system << ") may be set here: nothing to tell apart");
    INFO("system default " << system << ", the transport's " << want);
    const TcpTransport transport(want);
    int prepared = 0, connected_before = 0;
    Cluster c(3, {}, 100ms, [&](int fd) {
        ++prepared;
        sockaddr_storage peer{};
        socklen_t len = sizeof peer;
        if (::getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &len) == 0) ++connected_before;
        transport.prepare_socket(fd);
    });
    REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
    CHECK(prepared >= 3 * (1 + 2) + 3);  // every listener, every data stream and control connection dialed
    CHECK(connected_before == 0);
    for (uint32_t i = 0; i < 3; ++i)
        for (uint32_t j = 0; j < 3; ++j)
            if (i != j) {
                const int fd = c.hosts[i].cp->control_fd(j);
                REQUIRE(fd >= 0);
                CHECK(TcpTransport::congestion_of(fd) == want);  // dialed by one of the two, accepted by the other
            }
    for (auto &h : c.hosts) {
        REQUIRE(h.to_next.size() == 2);
        REQUIRE(h.from_prev.size() == 2);
        for (auto &fd : h.to_next) CHECK(TcpTransport::congestion_of(fd.get()) == want);    // dialed
        for (auto &fd : h.from_prev) CHECK(TcpTransport::congestion_of(fd.get()) == want);  // accepted
    }
}

TEST_CASE("a host that dies takes the ring down everywhere, naming it; it re-forms when the host is back", "[control]") {
    spdlog::set_level(spdlog::level::off);
    Cluster c(3);
    REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
    c.hosts[2].cp.reset();  // killed: its sockets close
    const auto start = Clock::now();
    REQUIRE(c.run_until([&] { return c.hosts[0].downs == 1 && c.hosts[1].downs == 1; }, 5s));
    CHECK(Clock::now() - start < 2s);
    CHECK_THAT(c.hosts[0].last_down, Catch::Contains("node2"));
    CHECK_THAT(c.hosts[1].last_down, Catch::Contains("node2"));
    c.start(2);  // restarted
    REQUIRE(c.run_until([&] { return c.all_up(2); }, 10s));
    for (uint32_t i = 0; i < 3; ++i) CHECK(c.hosts[i].generation == 2);  // agreed: the same on every host
}

TEST_CASE("a restarted coordinator's ring is newer than any generation the others used", "[control]") {
    spdlog::set_level(spdlog::level::off);
    Cluster c(3);
    REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
    c.hosts[0].cp.reset();  // the first host (the coordinator) killed
    REQUIRE(c.run_until([&] { return c.hosts[1].downs == 1 && c.hosts[2].downs == 1; }, 5s));
    c.start(0);
    REQUIRE(c.run_until([&] { return c.all_up(2); }, 10s));
    // Past generation 1, which the others announced (the restarted coordinator counts from 0).
    for (uint32_t i = 0; i < 3; ++i) CHECK(c.hosts[i].generation == 2);
}

TEST_CASE("a hung host is caught by missed heartbeats", "[control]") {
    spdlog::set_level(spdlog::level::off);
    Cluster c(3);
    REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
    c.hosts[1].frozen = true;  // like SIGSTOP: sockets open, nothing answered
    const auto start = Clock::now();
    REQUIRE(c.run_until([&] { return c.hosts[0].downs == 1 && c.hosts[2].downs == 1; }, 5s));
    CHECK(Clock::now() - start < 1500ms);  // 3 heartbeats of 100 ms, plus ticks
    CHECK_THAT(c.hosts[0].last_down, Catch::Contains("node1") && Catch::Contains("heartbeat"));
    c.hosts[1].frozen = false;  // SIGCONT: it notices, and everything re-forms
    REQUIRE(c.run_until([&] { return c.all_up(2); }, 10s));
}

TEST_CASE("a host with the wrong secret never joins; the reason is recorded", "[control]") {
    spdlog::set_level(spdlog::level::off);
    Cluster c(2, PeerSecret::from_bytes("0123456789abcdef0123456789abcdef"));
    const PeerSecret wrong = PeerSecret::from_bytes("fedcba9876543210fedcba9876543210");
    c.start(1, &wrong);
    CHECK_FALSE(c.run_until([&] { return c.hosts[0].cp->ring_up() || c.hosts[1].cp->ring_up(); }, 1500ms));
    CHECK_THAT(c.hosts[0].cp->status()[1].last_error, Catch::Contains("authentication failed"));
}

TEST_CASE("unconfigured addresses and garbage on the peer port are refused; the ring is unaffected", "[control]") {
    spdlog::set_level(spdlog::level::off);
    Cluster c(2);
    REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
    const uint16_t port = c.config.hosts[0].port;
    auto closed = [&](int fd) {
        bool eof = false;
        c.run_until([&] {
            char b[256];
            const ssize_t r = ::recv(fd, b, sizeof b, MSG_DONTWAIT);
            eof = r == 0 || (r < 0 && errno != EAGAIN);
            return eof;
        }, 3s);
        return eof;
    };
    UniqueFd stranger = test::connect_from("127.0.0.2", port);  // not any host's address
    CHECK(closed(stranger.get()));
    UniqueFd garbage = test::connect_from("127.0.0.1", port);
    const std::string junk(300, 'x');
    (void)!::send(garbage.get(), junk.data(), junk.size(), MSG_NOSIGNAL);
    CHECK(closed(garbage.get()));
    UniqueFd silent = test::connect_from("127.0.0.1", port);  // says nothing: dropped at the handshake deadline
    CHECK(closed(silent.get()));
    CHECK(c.hosts[0].cp->ring_up());
    CHECK(c.hosts[0].downs == 0);
}

TEST_CASE("RingAbort behind a queued frame: the peer decodes the queued frames intact, then the abort", "[control]") {
    // Frames that the peer's socket cannot take at once are partly written and partly queued on
    // the connection; then the ring aborts. The RingAbort must go behind what is queued: written
    // in the middle of a partly sent frame, the peer would read a torn frame and drop the
    // connection for bad bytes instead of learning why the ring ended.
    spdlog::set_level(spdlog::level::off);
    Cluster c(2, {}, 10s);  // no heartbeat is missed while a host is held still
    REQUIRE(c.run_until([&] { return c.all_up(); }, 10s));
    Host &h0 = c.hosts[0], &h1 = c.hosts[1];
    // 1. The peer holds still; more than both ends' socket buffers can hold (the control plane
    //    asks for 4 MiB each; the kernel doubles that, capped at net.core.[wr]mem_max) goes out
    //    in the largest frames a control connection carries: the rest waits in the queue.
    auto sysctl = [](const char *path) {
        uint64_t v = 0;
        std::ifstream(path) >> v;
        return v;
    };
    const uint64_t in_flight = 2 * std::min<uint64_t>(4 << 20, sysctl("/proc/sys/net/core/wmem_max")) +
                               2 * std::min<uint64_t>(4 << 20, sysctl("/proc/sys/net/core/rmem_max"));
    const size_t frame_bytes = 16 << 20, frames = in_flight / frame_bytes + 2;
    h1.frozen = true;
    std::vector<proto::Bytes> sent;
    for (size_t f = 0; f < frames; ++f) {
        proto::Bytes payload(frame_bytes);
        for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>((i * 131 + f * 7) >> 5);
        REQUIRE(h0.cp->send(1, proto::encode_frame(proto::FrameType::OpData, payload)).ok());
        sent.push_back(std::move(payload));
    }
    // 2. The peer reads what arrived (room in the socket again) while this host is held still:
    //    nothing flushes its queue, whose first frame is partly sent.
    h0.frozen = true;
    h1.frozen = false;
    c.run_until([] { return false; }, 200ms);
    REQUIRE(h1.frames.size() < frames);
    // 3. A data link fails here; past the 300 ms grace for a peer's RingAbort (but before the
    //    host dials the next generation's data links), it aborts the ring and tells its peer why.
    h0.cp->data_link_failed("test: data link broke");
    h0.cp->tick(Clock::now() + 350ms);
    h0.cp->dispatch();
    REQUIRE(h0.downs == 1);
    // 4. Both run again: the peer gets every frame, exact, and then the abort with its reason.
    h0.frozen = false;
    REQUIRE(c.run_until([&] { return h1.downs >= 1; }, 10s));
    INFO("host 1 saw: " << Catch::Detail::stringify(h1.events));
    REQUIRE(h1.events.size() == frames + 1);
    for (size_t f = 0; f < frames; ++f)
        CHECK(h1.events[f] == "frame " + std::to_string(static_cast<int>(proto::FrameType::OpData)) + ": " +
                                  std::to_string(frame_bytes));
    REQUIRE(h1.frames.size() == frames);
    for (size_t f = 0; f < frames; ++f) CHECK(h1.frames[f] == sent[f]);
    CHECK_THAT(h1.last_down, Catch::Contains("test: data link broke"));
    // The control connection survived; the ring re-forms.
    REQUIRE(c.run_until([&] { return c.all_up(2); }, 10s));
    CHECK(h0.cp->status()[1].control == "up");
}
