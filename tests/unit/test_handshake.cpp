// The daemon-to-daemon handshake over real 127.0.0.1 TCP connections: success with and without
// a shared secret, and every refusal (wrong secret, one side without a secret, wrong cluster,
// wrong host, a host the listener does not know, wrong version, garbage, oversize frames).
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "common/fd_io.h"
#include "daemon/control/peer_handshake.h"
#include "proto/peer.h"
#include "proto/types.h"
#include "tests/support/net.h"

using namespace ringd;
using State = PeerHandshake::State;

namespace {

bool terminal(State s) { return s == State::Up || s == State::Failed; }

// Drives both ends until each is up or failed.
void drive(PeerHandshake &d, PeerHandshake &l) {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (!(terminal(d.state()) && terminal(l.state())) && Clock::now() < deadline) {
        pollfd p[2] = {{d.fd(), POLLIN, 0}, {l.fd(), POLLIN, 0}};
        if (::poll(p, 2, ms_until(deadline)) <= 0) break;
        if (p[0].revents && !terminal(d.state())) d.advance();
        if (p[1].revents && !terminal(l.state())) l.advance();
        // A failed end closes its socket, as the daemon does, so the other end sees EOF
        // (poll ignores the closed end's -1).
        if (d.state() == State::Failed) d.take_fd();
        if (l.state() == State::Failed) l.take_fd();
    }
}

Status accept_node0(const proto::PeerHello &h) {
    if (h.from != "node0") return make_error(-EACCES, "host '" + h.from + "' is not configured");
    return Ok{};
}

}  // namespace

TEST_CASE("handshake succeeds with a shared secret and without one", "[handshake]") {
    const PeerSecret with = PeerSecret::from_bytes("0123456789abcdef0123456789abcdef");
    const PeerSecret none;
    for (const PeerSecret *secret : {&with, &none}) {
        auto [c, s] = test::tcp_pair(true);
        PeerIdentity a{"demo", "node0", 3, secret, "node0,node1"}, b{"demo", "node1", 5, secret, {}};
        auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Data, 1);
        auto l = PeerHandshake::listen(std::move(s), b, accept_node0);
        drive(d, l);
        REQUIRE(d.state() == State::Up);
        REQUIRE(l.state() == State::Up);
        CHECK(l.hello().from == "node0");
        CHECK(l.hello().kind == proto::ConnKind::Data);
        CHECK(l.hello().stream == 1);
        CHECK(l.hello().generation == 3);
        CHECK(l.hello().domain == "node0,node1");  // covered by both MACs with the rest of the hello
        CHECK(d.peer_generation() == 5);
    }
}

TEST_CASE("handshake refusals say why, on both ends", "[handshake]") {
    const PeerSecret good = PeerSecret::from_bytes("0123456789abcdef0123456789abcdef");
    const PeerSecret bad = PeerSecret::from_bytes("fedcba9876543210fedcba9876543210");
    const PeerSecret none;
    struct Case {
        const char *name;
        const PeerSecret *ds, *ls;
        std::string dcluster, target;
        std::string dself;
        const char *listener_says, *dialer_says;
    };
    const Case cases[] = {
        {"wrong secret", &bad, &good, "demo", "node1", "node0", nullptr, "authentication failed"},
        {"dialer without secret", &none, &good, "demo", "node1", "node0", nullptr, "authentication failed"},
        {"listener without secret", &good, &none, "demo", "node1", "node0", nullptr, "authentication failed"},
        {"wrong cluster", &good, &good, "other", "node1", "node0", "cluster 'other'", nullptr},
        {"wrong host", &good, &good, "demo", "node7", "node0", "hello for host 'node7'", nullptr},
        {"unconfigured host", &good, &good, "demo", "node1", "intruder", "not configured", nullptr},
    };
    for (const Case &k : cases) {
        INFO(k.name);
        auto [c, s] = test::tcp_pair(true);
        PeerIdentity a{k.dcluster, k.dself, 1, k.ds, {}}, b{"demo", "node1", 1, k.ls, {}};
        auto d = PeerHandshake::dial(std::move(c), a, k.target, proto::ConnKind::Control, 0);
        auto l = PeerHandshake::listen(std::move(s), b, [](const proto::PeerHello &h) {
            return h.from == "intruder" ? Status(make_error(-EACCES, "host 'intruder' is not configured")) : Status(Ok{});
        });
        drive(d, l);
        CHECK(d.state() == State::Failed);
        CHECK(l.state() == State::Failed);
        if (k.listener_says) CHECK_THAT(l.error().message, Catch::Contains(k.listener_says));
        if (k.dialer_says) CHECK_THAT(d.error().message, Catch::Contains(k.dialer_says));
    }
}

TEST_CASE("a listener refuses wrong versions, garbage and oversize frames", "[handshake]") {
    const PeerSecret none;
    PeerIdentity me{"demo", "node1", 1, &none, {}};
    auto attempt = [&](const proto::Bytes &bytes) {
        auto [c, s] = test::tcp_pair(true);
        auto l = PeerHandshake::listen(std::move(s), me, accept_node0);
        REQUIRE(send_all(c.get(), bytes).ok());
        pollfd p{l.fd(), POLLIN, 0};
        const auto deadline = Clock::now() + std::chrono::seconds(5);
        while (!terminal(l.state()) && ::poll(&p, 1, ms_until(deadline)) > 0) l.advance();
        CHECK(l.state() == State::Failed);
        return l.error().message;
    };
    auto hello = proto::encode_peer_hello({"demo", "node0", "node1", proto::ConnKind::Control, 0, 1, {}, {}});
    hello[4] = 1;  // an older ringd's peer protocol
    CHECK_THAT(attempt(hello), Catch::Contains("peer protocol version 1 is not supported"));
    CHECK_THAT(attempt(proto::Bytes(64, 0x5A)), Catch::Contains("magic"));
    auto big = proto::encode_frame(proto::FrameType::PeerHello, {});
    big[4] = 7;
    big[8] = big[9] = big[10] = 0xFF;
    CHECK_THAT(attempt(big), Catch::Contains("exceeds the limit"));
    CHECK_THAT(attempt(proto::encode_peer_auth(proto::Mac{})), Catch::Contains("expected a peer hello"));
}

TEST_CASE("secret files are checked", "[handshake]") {
    char dir[] = "/tmp/ringd-secret.XXXXXX";
    REQUIRE(::mkdtemp(dir));
    const std::string path = std::string(dir) + "/secret";
    std::ofstream(path) << "short\n";
    ::chmod(path.c_str(), 0600);
    CHECK_THAT(PeerSecret::load(path).error().message, Catch::Contains("at least 16"));
    std::ofstream(path) << "0123456789abcdef0123\n";
    CHECK(PeerSecret::load(path).ok());
    ::chmod(path.c_str(), 0644);
    CHECK_THAT(PeerSecret::load(path).error().message, Catch::Contains("readable by everyone"));
    CHECK_FALSE(PeerSecret::load(std::string(dir) + "/missing").ok());
    std::filesystem::remove_all(dir);
}

// ---- Frames after the handshake (daemon/transport/frame_mac.h) ----

namespace {

std::string hex(std::span<const uint8_t> b) {
    std::string s;
    char buf[3];
    for (uint8_t x : b) {
        std::snprintf(buf, sizeof buf, "%02x", x);
        s += buf;
    }
    return s;
}

// Both ends of a handshake that came up with `secret`.
std::pair<SessionKeys, SessionKeys> session(const PeerSecret &secret) {
    auto [c, s] = test::tcp_pair(true);
    PeerIdentity a{"demo", "node0", 1, &secret, {}}, b{"demo", "node1", 1, &secret, {}};
    auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Control, 0);
    auto l = PeerHandshake::listen(std::move(s), b, accept_node0);
    drive(d, l);
    REQUIRE(d.state() == State::Up);
    REQUIRE(l.state() == State::Up);
    return {d.keys(), l.keys()};
}

}  // namespace

TEST_CASE("frame MACs are standard GMAC with the frame number as IV", "[handshake][mac]") {
    // AES-256-GCM, zero key, zero IV, no data: the published test vector (McGrew & Viega, test
    // case 13). Frame 0 of a direction has the zero IV.
    FrameMac zero(SessionKey{});
    CHECK(hex(zero.seal({})) == "530f8afbc74536b9a963b4f1c4cb738b");
    CHECK(zero.frames() == 1);
    // Frame 1 has another IV: the same bytes get another tag.
    CHECK(hex(zero.seal({})) != "530f8afbc74536b9a963b4f1c4cb738b");
}

TEST_CASE("a handshake gives each connection and direction keys of its own", "[handshake][mac]") {
    const PeerSecret secret = PeerSecret::from_bytes("0123456789abcdef0123456789abcdef");
    auto [d1, l1] = session(secret);
    REQUIRE(d1.enabled);
    REQUIRE(l1.enabled);
    CHECK(d1.send == l1.recv);
    CHECK(d1.recv == l1.send);
    CHECK(d1.send != d1.recv);
    auto [d2, l2] = session(secret);  // same hosts, same secret: fresh nonces, fresh keys
    CHECK(d2.send != d1.send);
    CHECK(d2.recv != d1.recv);
    auto [dn, ln] = session(PeerSecret());
    CHECK_FALSE(dn.enabled);
    CHECK_FALSE(ln.enabled);
}

TEST_CASE("sealed control frames: forged, replayed, reordered or cross-connection frames fail", "[handshake][mac]") {
    const PeerSecret secret = PeerSecret::from_bytes("0123456789abcdef0123456789abcdef");
    auto [dk, lk] = session(secret);
    SessionMac d(dk), l(lk);
    const proto::Bytes hb1 = proto::encode_heartbeat({7, 1}), hb2 = proto::encode_heartbeat({7, 2});
    auto as_frame = [](const proto::Bytes &wire) {
        auto h = proto::decode_frame_header(std::span(wire).first(proto::kFrameHeaderBytes), 1 << 20);
        REQUIRE(h.ok());
        REQUIRE(h->length + proto::kFrameHeaderBytes == wire.size());
        return Frame{h->type, proto::Bytes(wire.begin() + proto::kFrameHeaderBytes, wire.end()), {}};
    };
    const proto::Bytes w1 = seal_frame(d.send, hb1), w2 = seal_frame(d.send, hb2);
    CHECK(w1.size() == hb1.size() + kTagBytes);

    SECTION("in order: accepted, payload as sent") {
        Frame f1 = as_frame(w1), f2 = as_frame(w2);
        REQUIRE(open_frame(l.recv, f1).ok());
        REQUIRE(open_frame(l.recv, f2).ok());
        CHECK(f1.payload == proto::Bytes(hb1.begin() + proto::kFrameHeaderBytes, hb1.end()));
        CHECK(proto::decode_heartbeat(f2.payload)->seq == 2);
    }
    SECTION("replayed") {
        Frame f1 = as_frame(w1), again = as_frame(w1);
        REQUIRE(open_frame(l.recv, f1).ok());
        auto r = open_frame(l.recv, again);
        REQUIRE_FALSE(r.ok());
        CHECK_THAT(r.error().message, Catch::Contains("fails its MAC check"));
    }
    SECTION("reordered or one dropped") {
        Frame f2 = as_frame(w2);
        CHECK_FALSE(open_frame(l.recv, f2).ok());
    }
    SECTION("one bit flipped anywhere, header included") {
        for (size_t i = 0; i < w1.size(); i += 3) {
            SessionMac fresh(lk);
            proto::Bytes bad = w1;
            bad[i] ^= 0x10;
            auto h = proto::decode_frame_header(std::span(bad).first(proto::kFrameHeaderBytes), 1 << 20);
            if (!h || h->length + proto::kFrameHeaderBytes != bad.size()) continue;  // the reader refuses it already
            Frame f = as_frame(bad);
            INFO("byte " << i);
            CHECK_FALSE(open_frame(fresh.recv, f).ok());
        }
    }
    SECTION("the other direction's, or another connection's") {
        Frame back = as_frame(seal_frame(l.send, hb1));  // listener -> dialer, checked as dialer -> listener
        CHECK_FALSE(open_frame(l.recv, back).ok());
        auto [dk2, lk2] = session(secret);
        SessionMac other(lk2);
        Frame f1 = as_frame(w1);
        CHECK_FALSE(open_frame(other.recv, f1).ok());
    }
    SECTION("a frame without a tag") {
        Frame bare = as_frame(hb1);
        CHECK_FALSE(open_frame(l.recv, bare).ok());
    }
}

TEST_CASE("a frame sealed in place is the frame sealed as a copy, and opens", "[handshake][mac]") {
    const PeerSecret secret = PeerSecret::from_bytes("0123456789abcdef0123456789abcdef");
    auto [dk, lk] = session(secret);
    SessionMac copy(dk), in_place(dk), l(lk);
    proto::OpReport r;
    r.group = "g";
    r.seq = 9;
    r.collective = static_cast<uint32_t>(Collective::AllToAll);
    for (const uint64_t bytes : {uint64_t{0}, uint64_t{1}, uint64_t{4099}, uint64_t{1} << 20}) {
        INFO(bytes << " bytes of data");
        // begin_op_data + the data appended is encode_op_data filled in, with room for the tag.
        proto::Bytes filled = proto::encode_op_data(r, proto::OpDataKind::OneShot, bytes, 2 << 16 | 1);
        proto::Bytes appended = proto::begin_op_data(r, proto::OpDataKind::OneShot, bytes, 2 << 16 | 1);
        REQUIRE(appended.size() == proto::op_data_offset());
        CHECK(appended.capacity() >= proto::op_data_offset() + bytes + kTagBytes);
        for (uint64_t i = 0; i < bytes; ++i) {
            filled[proto::op_data_offset() + i] = static_cast<uint8_t>(i * 7 + 3);
            appended.push_back(static_cast<uint8_t>(i * 7 + 3));
        }
        CHECK(appended == filled);
        const proto::Bytes sealed = seal_frame(copy.send, filled);
        const uint8_t *before = appended.data();
        seal_frame_in_place(in_place.send, appended);
        CHECK(appended == sealed);
        CHECK(appended.data() == before);  // the reserved room held the tag: no reallocation
        auto h = proto::decode_frame_header(std::span(appended).first(proto::kFrameHeaderBytes), 2 << 20);
        REQUIRE(h.ok());
        Frame f{h->type, proto::Bytes(appended.begin() + proto::kFrameHeaderBytes, appended.end()), {}};
        REQUIRE(open_frame(l.recv, f).ok());
        CHECK(f.payload == proto::Bytes(filled.begin() + proto::kFrameHeaderBytes, filled.end()));
    }
}

TEST_CASE("secret rotation: whichever end reloaded, both ends choose one secret they share and derive the same "
          "keys; a secret the other end does not have is refused naming both key ids",
          "[handshake]") {
    const PeerSecret old_only = PeerSecret::from_bytes("0123456789abcdef-the-old-secret");
    PeerSecret rotated = PeerSecret::from_bytes("0123456789abcdef-the-old-secret");
    rotated.rotate(PeerSecret::from_bytes("fedcba9876543210-the-new-secret"), Clock::now() + std::chrono::hours(1));
    const PeerSecret new_only = PeerSecret::from_bytes("fedcba9876543210-the-new-secret");
    const PeerSecret third = PeerSecret::from_bytes("a-third-secret-nobody-else-has");
    struct Case {
        const char *name;
        const PeerSecret *ds, *ls;
        uint16_t version;
        bool up;
    };
    const Case cases[] = {
        {"the listener reloaded", &old_only, &rotated, 7, true},
        {"the dialer reloaded", &rotated, &old_only, 7, true},
        {"both reloaded", &rotated, &rotated, 7, true},
        {"a restarted dialer with the new one only", &new_only, &rotated, 7, true},
        {"a restarted listener with the new one only", &rotated, &new_only, 7, true},
        {"after the grace: old against new", &old_only, &new_only, 7, false},
        {"a third secret", &third, &rotated, 7, false},
        {"a hello of 9 (7's handshake)", &rotated, &rotated, 9, true},
    };
    for (const Case &k : cases) {
        INFO(k.name);
        auto [c, s] = test::tcp_pair(true);
        PeerIdentity a{"demo", "node0", 1, k.ds, {}}, b{"demo", "node1", 1, k.ls, {}};
        auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Control, 0, k.version);
        auto l = PeerHandshake::listen(std::move(s), b, accept_node0);
        drive(d, l);
        CHECK((d.state() == State::Up) == k.up);
        CHECK((l.state() == State::Up) == k.up);
        if (k.up) {
            CHECK(d.version() == k.version);
            const SessionKeys dk = d.keys(), lk = l.keys();
            CHECK(dk.send == lk.recv);
            CHECK(dk.recv == lk.send);
        } else {
            CHECK_THAT(l.error().message, Catch::Contains("has another secret (its key id " + key_id_hex(k.ds->key_id(0))));
            CHECK_THAT(d.error().message, Catch::Contains("has another secret (key id " + key_id_hex(k.ls->key_id(0))));
        }
    }
}

TEST_CASE("a version-7 accept changed on the way fails its MAC check at the dialer", "[handshake]") {
    const PeerSecret secret = PeerSecret::from_bytes("0123456789abcdef0123456789abcdef");
    for (const bool tamper : {false, true}) {
        INFO("tampered: " << tamper);
        auto [c, s] = test::tcp_pair(true);
        PeerIdentity a{"demo", "node0", 1, &secret, {}};
        auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Control, 0);
        // The listener's side by hand: the hello, a correct challenge, the auth, then the accept.
        FrameReader r;
        auto next = [&]() -> Frame {
            const auto deadline = Clock::now() + std::chrono::seconds(5);
            pollfd p{s.get(), POLLIN, 0};
            while (Clock::now() < deadline) {
                auto f = r.read(s.get(), proto::kMaxPeerPayload);
                REQUIRE(f.ok());
                if (*f) return std::move(**f);
                ::poll(&p, 1, 100);
                if (d.state() != State::Up && d.state() != State::Failed) d.advance();
            }
            FAIL("no frame");
            return {};
        };
        const Frame hello = next();
        const proto::Nonce nonce_l{};
        REQUIRE(send_all(s.get(), proto::encode_peer_challenge({nonce_l, secret.mac("ringd listener", hello.payload, nonce_l)})).ok());
        (void)next();  // the dialer's auth
        proto::PeerAccept acc{9, proto::kPeerProtocolVersion, {}, "abc", 5, {}};
        proto::Bytes covered = hello.payload;
        const proto::Bytes fields = proto::peer_accept_fields(acc);
        covered.insert(covered.end(), fields.begin(), fields.end());
        acc.mac = secret.mac("ringd accept", covered, nonce_l);
        if (tamper) acc.generation = 1ull << 39;  // what a man in the middle would plant
        REQUIRE(send_all(s.get(), proto::encode_peer_accept(acc)).ok());
        const auto deadline = Clock::now() + std::chrono::seconds(5);
        while (d.state() != State::Up && d.state() != State::Failed && Clock::now() < deadline) {
            pollfd p{d.fd(), POLLIN, 0};
            ::poll(&p, 1, 100);
            d.advance();
        }
        if (tamper) {
            CHECK(d.state() == State::Failed);
            CHECK_THAT(d.error().message, Catch::Contains("fails its MAC check"));
        } else {
            CHECK(d.state() == State::Up);
            CHECK(d.peer_generation() == 9);
            CHECK(d.peer_instance() == 5);
        }
    }
}

// Only the peer's own word lowers the version a dialer tries: an Error frame saying it does not
// speak the hello's version. A listener that closes or resets the connection at the hello (a
// host being killed, restarted, or over its cap on handshakes) says nothing of its version.
TEST_CASE("a dialer learns an older peer only from its refusal, never from a close or reset at the hello",
          "[handshake]") {
    const PeerSecret none;
    PeerIdentity a{"demo", "node0", 1, &none, {}}, b{"demo", "node1", 1, &none, {}};
    const auto dial_until_done = [](PeerHandshake &d) {
        pollfd p{d.fd(), POLLIN, 0};
        const auto deadline = Clock::now() + std::chrono::seconds(5);
        while (!terminal(d.state()) && ::poll(&p, 1, ms_until(deadline)) > 0) d.advance();
        REQUIRE(d.state() == State::Failed);
    };
    SECTION("a real listener refuses a hello of 6 in an Error frame: a refusal") {
        auto [c, s] = test::tcp_pair(true);
        auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Control, 0, 6);
        auto l = PeerHandshake::listen(std::move(s), b, accept_node0);
        drive(d, l);
        REQUIRE(d.state() == State::Failed);
        CHECK(d.refused_version());
        CHECK(d.error().code == -EPROTONOSUPPORT);
        CHECK_THAT(d.error().message, Catch::Contains("speaks 7 to " + std::to_string(proto::kPeerProtocolVersion)));
    }
    SECTION("a peer of an older release says so (its Error frame): a refusal") {
        auto [c, s] = test::tcp_pair(true);
        auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Control, 0);
        REQUIRE(send_all(s.get(), proto::encode_error({-EPROTONOSUPPORT, "peer protocol version 9 is not supported"})).ok());
        dial_until_done(d);
        CHECK(d.refused_version());
    }
    SECTION("a peer closes at the hello: a failed dial, not a refusal") {
        auto [c, s] = test::tcp_pair(true);
        auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Control, 0);
        s.reset();
        dial_until_done(d);
        CHECK_FALSE(d.refused_version());
    }
    SECTION("a peer resets the connection in the middle of the hello: a failed dial, not a refusal") {
        auto [c, s] = test::tcp_pair(true);
        auto d = PeerHandshake::dial(std::move(c), a, "node1", proto::ConnKind::Control, 0);
        uint8_t part[20];
        pollfd p{s.get(), POLLIN, 0};
        REQUIRE(::poll(&p, 1, 5000) == 1);
        REQUIRE(::recv(s.get(), part, sizeof part, 0) == sizeof part);  // the header and a little of the hello
        const linger rst{1, 0};
        REQUIRE(::setsockopt(s.get(), SOL_SOCKET, SO_LINGER, &rst, sizeof rst) == 0);
        s.reset();
        dial_until_done(d);
        CHECK_FALSE(d.refused_version());
    }
    SECTION("another refusal (a wrong cluster) is not one of version") {
        auto [c, s] = test::tcp_pair(true);
        PeerIdentity other{"other", "node0", 1, &none, {}};
        auto d = PeerHandshake::dial(std::move(c), other, "node1", proto::ConnKind::Control, 0);
        auto l = PeerHandshake::listen(std::move(s), b, accept_node0);
        drive(d, l);
        REQUIRE(d.state() == State::Failed);
        CHECK_FALSE(d.refused_version());
    }
}
