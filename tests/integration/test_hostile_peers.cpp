// Hostile peers against real daemons with a shared secret: connections to the peer port from an
// address that is no host's, from a host's address without the secret or with a wrong one, a
// handshake replayed from an earlier one, a flood of half-open handshakes — each refused and
// logged while an honest group's ops go on, exact, in the same ring generation. Then a
// man-in-the-middle on the link between two hosts that forges, replays and drops frames of the
// established control connection and flips a byte of a data message: each is rejected by its
// MAC (logged, counted), never taken for data; the ring re-forms and the ops go on exact.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <thread>

#include "common/fd_io.h"
#include "daemon/control/peer_handshake.h"
#include "proto/le.h"
#include "proto/peer.h"
#include "tests/support/cluster.h"
#include "tests/support/net.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

namespace {

const std::string kKey = "hostile-peers-test-secret-0123456789";

std::string secret_file(const std::string &key) {
    const std::string path = make_temp_dir() + "/secret";
    std::ofstream(path) << key << "\n";
    ::chmod(path.c_str(), 0600);
    return path;
}

// Whether the daemon closed `fd` within `limit` (EOF or reset; anything it sent is read).
bool closed_within(int fd, std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    for (;;) {
        pollfd p{fd, POLLIN, 0};
        const int t = ms_until(deadline);
        if (t <= 0 || ::poll(&p, 1, t) <= 0) return false;
        char b[4096];
        const ssize_t r = ::recv(fd, b, sizeof b, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
}

// One frame from a blocking socket, before `deadline`.
Result<Frame> read_frame(int fd, std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    std::vector<UniqueFd> fds;
    uint8_t h[proto::kFrameHeaderBytes];
    if (auto s = recv_exact(fd, h, sizeof h, deadline, fds); !s) return s.error();
    auto hdr = proto::decode_frame_header(h, proto::kMaxPeerPayload);
    if (!hdr) return hdr.error();
    Frame f{hdr->type, proto::Bytes(hdr->length), {}};
    if (auto s = recv_exact(fd, f.payload.data(), f.payload.size(), deadline, fds); !s) return s.error();
    return f;
}

// A handshake as host `from` that goes on whatever the listener proves: its hello, then a proof
// made with `secret` (all zero without one). Returns what the listener answers it.
std::string dial_as(uint16_t port, const std::string &from, const PeerSecret &secret) {
    UniqueFd fd = connect_from("127.0.0.1", port);
    const proto::Bytes hello = proto::encode_peer_hello({"test", from, "node1", proto::ConnKind::Control, 0, 1, random_nonce(), ""});
    REQUIRE(send_all(fd.get(), hello).ok());
    auto ch = read_frame(fd.get(), 3s);
    REQUIRE(ch.ok());
    REQUIRE(ch->type == proto::FrameType::PeerChallenge);
    auto c = proto::decode_peer_challenge(ch->payload);
    REQUIRE(c.ok());
    const std::span<const uint8_t> payload(hello.data() + proto::kFrameHeaderBytes, hello.size() - proto::kFrameHeaderBytes);
    REQUIRE(send_all(fd.get(), proto::encode_peer_auth(secret.mac("ringd dialer", payload, c->nonce))).ok());
    auto answer = read_frame(fd.get(), 3s);
    REQUIRE(answer.ok());
    REQUIRE(answer->type == proto::FrameType::Error);
    CHECK(closed_within(fd.get(), 3s));
    return proto::decode_error(answer->payload)->message;
}

uint64_t generation(TestCluster &c, uint32_t i) { return c.status(i)["ring"]["generation"].get<uint64_t>(); }

size_t occurrences(const std::string &s, const std::string &what) {
    size_t n = 0;
    for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
    return n;
}

// Waits until the daemon's log has `text`.
bool log_has(Daemon &d, const std::string &text, std::chrono::milliseconds limit = 5s) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
        if (d.log().find(text) != std::string::npos) return true;
        std::this_thread::sleep_for(20ms);
    }
    return false;
}

}  // namespace

TEST_CASE("strangers, hosts without the secret, a replayed handshake and a half-open flood are refused and "
          "logged; the ring and its ops are not disturbed",
          "[hostile][auth]") {
    TestCluster c(2, ClusterOptions{"5s", "", "auth: {secret_file: " + secret_file(kKey) + "}\n", "64MiB"});
    REQUIRE(c.wait_up());
    Clients honest = connect_all(c, "honest", 1, 8 << 20);
    uint64_t seed = 1;
    auto honest_ops = [&] {
        allreduce_checked(honest, DType::F32, ReduceOp::Sum, 1000, seed++);      // on the control connections
        allreduce_checked(honest, DType::F32, ReduceOp::Avg, 1 << 20, seed++);   // a ring op
    };
    honest_ops();
    const uint64_t g0 = generation(c, 0), g1 = generation(c, 1);
    const uint16_t port = static_cast<uint16_t>(c.port(1));

    SECTION("an address that is no host's") {
        UniqueFd s = connect_from("127.0.0.2", port);
        const auto hello = proto::encode_peer_hello({"test", "node0", "node1", proto::ConnKind::Control, 0, 1, {}, ""});
        (void)send_all(s.get(), hello);
        CHECK(closed_within(s.get(), 3s));
        CHECK(log_has(*c.d[1], "refused a connection from 127.0.0.2"));
    }
    SECTION("a host's address, no secret or a wrong one") {
        CHECK_THAT(dial_as(port, "node0", PeerSecret()), Catch::Contains("authentication failed"));
        CHECK_THAT(dial_as(port, "node0", PeerSecret::from_bytes("not-the-secret-0123456789")),
                   Catch::Contains("authentication failed"));
        CHECK(log_has(*c.d[1], "does not prove the shared secret"));
    }
    SECTION("a handshake replayed: the dialer's proof for an earlier challenge") {
        // An eavesdropper's copy of a handshake: a hello and the proof for the challenge of its
        // connection. (Made here with the secret, then never sent on that connection.)
        const PeerSecret secret = PeerSecret::from_bytes(kKey);
        proto::PeerHello h{"test", "node0", "node1", proto::ConnKind::Control, 0, 1, random_nonce(), ""};
        const proto::Bytes hello = proto::encode_peer_hello(h);
        const std::span<const uint8_t> payload(hello.data() + proto::kFrameHeaderBytes, hello.size() - proto::kFrameHeaderBytes);
        UniqueFd first = connect_from("127.0.0.1", port);
        REQUIRE(send_all(first.get(), hello).ok());
        auto ch1 = read_frame(first.get(), 3s);
        REQUIRE(ch1.ok());
        REQUIRE(ch1->type == proto::FrameType::PeerChallenge);
        const auto c1 = proto::decode_peer_challenge(ch1->payload);
        REQUIRE(c1.ok());
        const proto::Mac proof = secret.mac("ringd dialer", payload, c1->nonce);
        first.reset();
        // The replay: same hello, the earlier proof. The listener's challenge is fresh.
        UniqueFd again = connect_from("127.0.0.1", port);
        REQUIRE(send_all(again.get(), hello).ok());
        auto ch2 = read_frame(again.get(), 3s);
        REQUIRE(ch2.ok());
        const auto c2 = proto::decode_peer_challenge(ch2->payload);
        REQUIRE(c2.ok());
        CHECK(c2->nonce != c1->nonce);
        REQUIRE(send_all(again.get(), proto::encode_peer_auth(proof)).ok());
        auto answer = read_frame(again.get(), 3s);
        REQUIRE(answer.ok());
        CHECK(answer->type == proto::FrameType::Error);
        CHECK(closed_within(again.get(), 3s));
        CHECK(log_has(*c.d[1], "does not prove the shared secret"));
    }
    SECTION("a flood of half-open handshakes") {
        std::vector<UniqueFd> flood;
        const auto hello = proto::encode_peer_hello({"test", "node0", "node1", proto::ConnKind::Control, 0, 1, {}, ""});
        for (int i = 0; i < 200; ++i) {
            flood.push_back(connect_from("127.0.0.1", port));
            (void)::send(flood.back().get(), hello.data(), hello.size() / 2, MSG_NOSIGNAL);  // half a hello, then nothing
        }
        honest_ops();  // meanwhile
        for (auto &s : flood) CHECK(closed_within(s.get(), 10s));  // the cap, or the handshake deadline
        CHECK(c.status(1)["ring"]["handshakes_refused"].get<uint64_t>() > 0);
    }
    honest_ops();
    CHECK(generation(c, 0) == g0);  // never re-formed
    CHECK(generation(c, 1) == g1);
    CHECK(c.status(1)["ring"]["frames_rejected"].get<uint64_t>() == 0);
}

namespace {

// A TCP relay in front of a host's peer port that can tamper with what the host before it in
// the ring sends: frames of the established control connection (forge: one bit of a frame
// flipped; replay: a frame sent again; drop: a frame left out), or a data message's payload.
class Mitm {
public:
    enum class Act { None, Forge, Replay, Drop, FlipData };

    // Listens on a free port of 127.0.0.1 (port()); relays to `target` once set.
    Mitm() {
        listener_ = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        REQUIRE(::bind(listener_.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) == 0);
        REQUIRE(::listen(listener_.get(), 64) == 0);
        socklen_t len = sizeof a;
        REQUIRE(::getsockname(listener_.get(), reinterpret_cast<sockaddr *>(&a), &len) == 0);
        port_ = ntohs(a.sin_port);
        acceptor_ = std::thread([this] { accept_loop(); });
    }
    uint16_t port() const { return port_; }
    void set_target(uint16_t target) { target_ = target; }
    ~Mitm() {
        stop_ = true;
        ::shutdown(listener_.get(), SHUT_RDWR);
        {
            std::lock_guard<std::mutex> g(mu_);
            for (auto &fd : open_) ::shutdown(fd->get(), SHUT_RDWR);
        }
        acceptor_.join();
        for (auto &t : relays_) t.join();
    }
    void arm(Act a) { act_ = a; }
    bool done() const { return act_ == Act::None; }

private:
    void accept_loop() {
        while (!stop_) {
            UniqueFd in(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
            if (!in) return;
            while (target_ == 0 && !stop_) std::this_thread::sleep_for(10ms);
            // No Catch assertion here (not the test's thread): a failed connect closes the relay.
            UniqueFd out(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
            sockaddr_in t{};
            t.sin_family = AF_INET;
            t.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            t.sin_port = htons(target_);
            if (::connect(out.get(), reinterpret_cast<sockaddr *>(&t), sizeof t) != 0) continue;
            auto a = std::make_shared<UniqueFd>(std::move(in)), b = std::make_shared<UniqueFd>(std::move(out));
            std::lock_guard<std::mutex> g(mu_);
            open_.push_back(a);  // kept open (only shut down) until the relay goes: no fd number reused under it
            open_.push_back(b);
            relays_.emplace_back([this, a, b] { upstream(a->get(), b->get()); });
            relays_.emplace_back([this, a, b] { plain(b->get(), a->get()); });
        }
    }
    static bool write_all(int fd, const uint8_t *p, size_t n) {
        while (n > 0) {
            const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
            if (w <= 0) return false;
            p += w;
            n -= static_cast<size_t>(w);
        }
        return true;
    }
    static void close_both(int from, int to) {
        ::shutdown(to, SHUT_RDWR);
        ::shutdown(from, SHUT_RDWR);
    }
    void plain(int from, int to) {
        uint8_t b[65536];
        for (;;) {
            const ssize_t r = ::recv(from, b, sizeof b, 0);
            if (r <= 0 || !write_all(to, b, static_cast<size_t>(r))) break;
        }
        close_both(from, to);
    }
    // Whole frames (handshake, then control frames) or, on a data connection after its
    // handshake, whole data messages (24-byte header, payload, 16-byte tag), each passed on,
    // tampered with when armed.
    void upstream(int from, int to) {
        std::vector<uint8_t> buf, last;
        uint8_t b[65536];
        int frames = 0;
        bool control = false, data = false;
        for (;;) {
            const ssize_t r = ::recv(from, b, sizeof b, 0);
            if (r <= 0) break;
            buf.insert(buf.end(), b, b + r);
            for (;;) {
                size_t len;
                if (!data) {
                    if (buf.size() < 16) break;
                    len = 16 + proto::le::get<uint32_t>(&buf[8]);
                } else {
                    if (buf.size() < 24) break;
                    len = 24 + proto::le::get<uint64_t>(&buf[16]) + (proto::le::get<uint32_t>(&buf[4]) & 1 ? 16 : 0);
                }
                if (buf.size() < len) break;
                std::vector<uint8_t> m(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(len));
                buf.erase(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(len));
                // The hello says which connection this is: kind after the three names.
                if (frames == 0) control = proto::le::get<uint32_t>(&m[16 + 3 * proto::kNameBytes]) == 0;
                bool pass = true;
                std::vector<uint8_t> extra;
                const Act a = act_;
                if (control && frames >= 2 && (a == Act::Forge || a == Act::Drop || (a == Act::Replay && !last.empty()))) {
                    if (a == Act::Forge) m[m.size() - kTagBytes - 1] ^= 0x01;  // the payload's last byte
                    if (a == Act::Replay) extra = last;
                    if (a == Act::Drop) pass = false;
                    act_ = Act::None;
                }
                if (data && a == Act::FlipData && len > 24 + kTagBytes + 64) {
                    m[24 + 64] ^= 0x01;
                    act_ = Act::None;
                }
                if (pass && !write_all(to, m.data(), m.size())) return close_both(from, to);
                if (!extra.empty() && !write_all(to, extra.data(), extra.size())) return close_both(from, to);
                if (control && frames >= 2) last = m;
                if (++frames == 2 && !control) data = true;  // hello and auth, then data messages
            }
        }
        close_both(from, to);
    }

    std::atomic<uint16_t> target_{0};
    uint16_t port_ = 0;
    UniqueFd listener_;
    std::thread acceptor_;
    std::vector<std::thread> relays_;
    std::mutex mu_;
    std::vector<std::shared_ptr<UniqueFd>> open_;
    std::atomic<bool> stop_{false};
    std::atomic<Act> act_{Act::None};
};

}  // namespace

TEST_CASE("a man in the middle: forged, replayed and dropped control frames and a flipped data byte are rejected "
          "by their MACs, never taken; the ring re-forms and the ops go on exact",
          "[hostile][auth]") {
    Mitm mitm;
    ClusterOptions o{"5s", "", "auth: {secret_file: " + secret_file(kKey) + ", data: mac}\n", "64MiB"};
    o.relayed = 1;  // node0 reaches node1 through the relay: its control connection and data streams
    o.relay_port = mitm.port();
    TestCluster c(2, o);
    mitm.set_target(static_cast<uint16_t>(c.port(1)));
    REQUIRE(c.wait_up());
    Clients honest = connect_all(c, "honest", 1, 8 << 20);
    uint64_t seed = 1;
    allreduce_checked(honest, DType::F32, ReduceOp::Sum, 1000, seed++);
    allreduce_checked(honest, DType::F32, ReduceOp::Sum, 1 << 20, seed++);
    uint64_t rejected = 0;
    for (const auto act : {Mitm::Act::Forge, Mitm::Act::Replay, Mitm::Act::Drop}) {
        INFO("act " << static_cast<int>(act));
        const uint64_t g = generation(c, 1);
        const size_t seen = occurrences(c.d[1]->log(), "fails its MAC check");
        mitm.arm(act);  // the next control frame node0 sends (a heartbeat within a second)
        const auto deadline = Clock::now() + 5s;
        while (!mitm.done() && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
        REQUIRE(mitm.done());
        // The frame after a dropped one fails; the next heartbeat comes within a second.
        ++rejected;
        const auto until = Clock::now() + 5s;
        while (c.status(1)["ring"]["frames_rejected"].get<uint64_t>() < rejected && Clock::now() < until)
            std::this_thread::sleep_for(20ms);
        CHECK(c.status(1)["ring"]["frames_rejected"].get<uint64_t>() == rejected);
        CHECK(occurrences(c.d[1]->log(), "fails its MAC check") > seen);
        REQUIRE(c.wait_ring(1, g + 1));  // the connection was dropped; the ring re-formed
        REQUIRE(c.wait_ring(0, g + 1));
        allreduce_checked(honest, DType::F32, ReduceOp::Sum, 1000, seed++);
        allreduce_checked(honest, DType::F32, ReduceOp::Avg, 1 << 20, seed++);
    }
    // A data message of a ring op (node0 -> node1, on a data stream) with one payload bit flipped:
    // with auth.data: mac the op fails on the MAC check, it does not complete with a wrong value.
    {
        const uint64_t g = generation(c, 1);
        mitm.arm(Mitm::Act::FlipData);
        CheckedOp op = submit_checked(honest, DType::F32, ReduceOp::Sum, 1 << 20, seed++);
        std::string errors;
        for (size_t r = 0; r < honest.size(); ++r) {
            const int rc = ringd_wait(honest[r]->get(), op.tickets[r], 20000);
            CHECK(rc != 0);  // no rank completes it
            if (rc != 0) errors += std::string(ringd_last_error(honest[r]->get())) + "\n";
        }
        CHECK(mitm.done());
        CHECK_THAT(errors, Catch::Contains("fails its MAC check"));
        REQUIRE(c.wait_ring(1, g + 1));
        REQUIRE(c.wait_ring(0, g + 1));
        allreduce_checked(honest, DType::F32, ReduceOp::Sum, 1000, seed++);
        allreduce_checked(honest, DType::F32, ReduceOp::Avg, 1 << 20, seed++);
    }
}
