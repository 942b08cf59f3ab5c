#include "daemon/control/peer_handshake.h"

#include "common/fd_io.h"

namespace ringd {
namespace {

constexpr std::string_view kDialerRole = "ringd dialer";
constexpr std::string_view kListenerRole = "ringd listener";

}  // namespace

PeerHandshake PeerHandshake::dial(UniqueFd fd, const PeerIdentity &me, const std::string &peer, proto::ConnKind kind,
                                  uint32_t stream) {
    PeerHandshake h(std::move(fd), me);
    h.hello_ = proto::PeerHello{me.cluster, me.self, peer, kind, stream, me.generation, random_nonce(), me.domain};
    const proto::Bytes frame = proto::encode_peer_hello(h.hello_);
    h.hello_payload_.assign(frame.begin() + proto::kFrameHeaderBytes, frame.end());
    h.dialer_ = true;
    h.state_ = State::WaitChallenge;
    if (auto s = send_all(h.fd_.get(), frame); !s) h.fail(s.error().code, "sending hello: " + s.error().message);
    return h;
}

PeerHandshake PeerHandshake::listen(UniqueFd fd, const PeerIdentity &me, HelloCheck check) {
    PeerHandshake h(std::move(fd), me);
    h.check_ = std::move(check);
    h.state_ = State::WaitHello;
    return h;
}

PeerHandshake::State PeerHandshake::fail(int code, std::string why) {
    state_ = State::Failed;
    error_ = Error{code, std::move(why)};
    return state_;
}

PeerHandshake::State PeerHandshake::advance() {
    while (state_ != State::Up && state_ != State::Failed) {
        auto f = reader_.read(fd_.get(), proto::kMaxPeerPayload);
        if (!f) return fail(f.error().code, f.error().message);
        if (!*f) break;
        on_frame(**f);
    }
    return state_;
}

PeerHandshake::State PeerHandshake::on_frame(const Frame &f) {
    if (f.type == proto::FrameType::Error) {
        auto e = proto::decode_error(f.payload);
        return fail(e ? e->code : -EPROTO, e ? "peer refused: " + e->message : "bad error frame: " + e.error().message);
    }
    const PeerSecret &secret = *me_.secret;
    switch (state_) {
    case State::WaitHello: {
        if (f.type != proto::FrameType::PeerHello) return fail(-EPROTO, "expected a peer hello");
        auto h = proto::decode_peer_hello(f.payload);
        if (!h) return fail(h.error().code, "bad hello: " + h.error().message);
        if (h->cluster != me_.cluster)
            return fail(-EACCES, "hello for cluster '" + h->cluster + "', this is cluster '" + me_.cluster + "'");
        if (h->to != me_.self) return fail(-EACCES, "hello for host '" + h->to + "', this is '" + me_.self + "'");
        if (auto ok = check_(*h); !ok) return fail(ok.error().code, ok.error().message);
        hello_ = *h;
        hello_payload_ = f.payload;
        nonce_l_ = random_nonce();
        const proto::PeerChallenge c{nonce_l_, secret.mac(kListenerRole, hello_payload_, nonce_l_)};
        if (auto s = send_all(fd_.get(), proto::encode_peer_challenge(c)); !s) return fail(s.error().code, s.error().message);
        state_ = State::WaitAuth;
        return state_;
    }
    case State::WaitAuth: {
        if (f.type != proto::FrameType::PeerAuth) return fail(-EPROTO, "expected peer auth");
        auto m = proto::decode_peer_auth(f.payload);
        if (!m) return fail(m.error().code, m.error().message);
        if (!secret.verify(*m, kDialerRole, hello_payload_, nonce_l_)) {
            (void)send_all(fd_.get(), proto::encode_error({-EACCES, "authentication failed"}));
            return fail(-EACCES, "authentication failed: " + hello_.from + " does not prove the shared secret " +
                                     (secret.enabled() ? "(wrong auth.secret_file?)" : "(it has one; this host has none)"));
        }
        if (auto s = send_all(fd_.get(), proto::encode_peer_accept(me_.generation)); !s)
            return fail(s.error().code, s.error().message);
        state_ = State::Up;
        return state_;
    }
    case State::WaitChallenge: {
        if (f.type != proto::FrameType::PeerChallenge) return fail(-EPROTO, "expected a peer challenge");
        auto c = proto::decode_peer_challenge(f.payload);
        if (!c) return fail(c.error().code, c.error().message);
        if (!secret.verify(c->mac, kListenerRole, hello_payload_, c->nonce))
            return fail(-EACCES, "authentication failed: " + hello_.to + " does not prove the shared secret " +
                                     (secret.enabled() ? "(wrong auth.secret_file?)" : "(it has one; this host has none)"));
        nonce_l_ = c->nonce;
        if (auto s = send_all(fd_.get(), proto::encode_peer_auth(secret.mac(kDialerRole, hello_payload_, nonce_l_))); !s)
            return fail(s.error().code, s.error().message);
        state_ = State::WaitAccept;
        return state_;
    }
    case State::WaitAccept: {
        if (f.type != proto::FrameType::PeerAccept) return fail(-EPROTO, "expected peer accept");
        auto g = proto::decode_peer_accept(f.payload);
        if (!g) return fail(g.error().code, g.error().message);
        peer_generation_ = *g;
        state_ = State::Up;
        return state_;
    }
    case State::Up:
    case State::Failed: break;
    }
    return state_;
}

SessionKeys PeerHandshake::keys() const {
    if (state_ != State::Up) return {};
    return me_.secret->session_keys(dialer_, hello_payload_, nonce_l_);
}

const char *handshake_state_name(PeerHandshake::State s) {
    switch (s) {
    case PeerHandshake::State::WaitChallenge: return "waiting for challenge";
    case PeerHandshake::State::WaitAccept: return "waiting for accept";
    case PeerHandshake::State::WaitHello: return "waiting for hello";
    case PeerHandshake::State::WaitAuth: return "waiting for auth";
    case PeerHandshake::State::Up: return "up";
    case PeerHandshake::State::Failed: return "failed";
    }
    return "?";
}

}  // namespace ringd
