#include "daemon/control/peer_handshake.h"

#include <openssl/evp.h>

#include "common/fd_io.h"

namespace ringd {
namespace {

constexpr std::string_view kDialerRole = "ringd dialer";
constexpr std::string_view kListenerRole = "ringd listener";
constexpr std::string_view kAcceptRole = "ringd accept";

proto::Bytes cat(const proto::Bytes &a, const proto::Bytes &b) {
    proto::Bytes v = a;
    v.insert(v.end(), b.begin(), b.end());
    return v;
}

}  // namespace

proto::HostsDigest hosts_digest(const std::vector<HostEntry> &hosts) {
    std::string text;
    for (const auto &h : hosts) {
        text += h.name + " " + h.address + " " + std::to_string(h.port);
        // (A host of one rail writes what every release before rails wrote.)
        for (uint32_t r = 1; r < h.rail_count(); ++r) text += " " + h.rail_address(r);
        for (double w : h.weights) text += " w" + std::to_string(w);
        text += "\n";
    }
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_Digest(text.data(), text.size(), md, &len, EVP_sha256(), nullptr);
    proto::HostsDigest d{};
    std::copy(md, md + d.size(), d.begin());
    return d;
}

PeerHandshake PeerHandshake::dial(UniqueFd fd, const PeerIdentity &me, const std::string &peer, proto::ConnKind kind,
                                  uint32_t stream, uint16_t version) {
    PeerHandshake h(std::move(fd), me);
    h.hello_.cluster = me.cluster;
    h.hello_.from = me.self;
    h.hello_.to = peer;
    h.hello_.kind = kind;
    h.hello_.stream = stream;
    h.hello_.generation = me.generation;
    h.hello_.nonce = random_nonce();
    h.hello_.domain = me.domain;
    h.hello_.version = version;
    h.hello_.hosts = me.hosts;
    h.hello_.config_version = me.config_version;
    h.hello_.key = me.secret->key_id(0);
    h.hello_.previous_key = me.secret->key_id(1);
    h.hello_.instance = me.instance;
    const proto::Bytes frame = proto::encode_peer_hello(h.hello_);
    h.hello_payload_.assign(frame.begin() + proto::kFrameHeaderBytes, frame.end());
    h.dialer_ = true;
    h.state_ = State::WaitChallenge;
    if (auto s = send_all(h.fd_.get(), frame); !s) h.fail(s.error().code, "sending hello: " + s.error().message);
    return h;
}

PeerHandshake PeerHandshake::listen(UniqueFd fd, const PeerIdentity &me, HelloCheck check, HelloCheck authenticated) {
    PeerHandshake h(std::move(fd), me);
    h.check_ = std::move(check);
    h.authenticated_ = std::move(authenticated);
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
        if (!f && f.error().code == -EPROTONOSUPPORT && state_ == State::WaitHello) {
            // A hello of a version this ringd does not speak (a newer one): the dialer is told, so
            // that it dials again at an older one.
            (void)send_all(fd_.get(), proto::encode_error({-EPROTONOSUPPORT, f.error().message}));
            return fail(f.error().code, f.error().message);
        }
        if (!f) return fail(f.error().code, f.error().message);
        if (!*f) break;
        on_frame(**f);
    }
    return state_;
}

PeerHandshake::State PeerHandshake::on_frame(const Frame &f) {
    if (f.type == proto::FrameType::Error) {
        auto e = proto::decode_error(f.payload);
        refused_version_ = e && e->code == -EPROTONOSUPPORT && dialer_ && state_ == State::WaitChallenge;
        return fail(e ? e->code : -EPROTO, e ? "peer refused: " + e->message : "bad error frame: " + e.error().message);
    }
    const PeerSecret &secret = *me_.secret;
    switch (state_) {
    case State::WaitHello: {
        // A refused hello is answered with the reason (the dialer logs it; one of 7 or later
        // tells it apart from a ringd of 6 that closes at a hello it cannot read).
        const auto refuse = [&](int code, const std::string &why) {
            (void)send_all(fd_.get(), proto::encode_error({code, why}));
            return fail(code, why);
        };
        if (f.type != proto::FrameType::PeerHello) return fail(-EPROTO, "expected a peer hello");
        auto h = proto::decode_peer_hello(f.payload, f.version);
        if (!h) return refuse(h.error().code, "bad hello: " + h.error().message);
        if (h->cluster != me_.cluster)
            return refuse(-EACCES, "hello for cluster '" + h->cluster + "', this is cluster '" + me_.cluster + "'");
        if (h->to != me_.self) return refuse(-EACCES, "hello for host '" + h->to + "', this is '" + me_.self + "'");
        if (auto ok = check_(*h); !ok) return refuse(ok.error().code, ok.error().message);
        hello_ = *h;
        hello_payload_ = f.payload;
        // The secret to prove this host with: one the dialer has (a hello of 7 names its key
        // ids; one of 6 comes from a host with one secret, the one it has is tried as ours).
        which_ = 0;
        if (hello_.version >= 7 && secret.enabled() && hello_.key != proto::KeyId{}) {
            which_ = secret.match(hello_.key);
            if (which_ < 0) which_ = secret.match(hello_.previous_key);
            if (which_ < 0) {
                std::string ours = key_id_hex(secret.key_id(0));
                if (secret.has_previous()) ours += " (and " + key_id_hex(secret.key_id(1)) + " until its rotation grace ends)";
                const std::string why = "authentication failed: " + hello_.from + " has another secret (its key id " +
                                        key_id_hex(hello_.key) + ", this host's " + ours + "; wrong auth.secret_file?)";
                (void)send_all(fd_.get(), proto::encode_error({-EACCES, "authentication failed: this host (" + me_.self +
                                                                            ") has another secret (key id " + ours + ")"}));
                return fail(-EACCES, why);
            }
        }
        chosen_ = secret.only(which_);
        nonce_l_ = random_nonce();
        const proto::PeerChallenge c{nonce_l_, chosen_.mac(kListenerRole, hello_payload_, nonce_l_)};
        if (auto s = send_all(fd_.get(), proto::encode_peer_challenge(c)); !s) return fail(s.error().code, s.error().message);
        state_ = State::WaitAuth;
        return state_;
    }
    case State::WaitAuth: {
        if (f.type != proto::FrameType::PeerAuth) return fail(-EPROTO, "expected peer auth");
        auto m = proto::decode_peer_auth(f.payload);
        if (!m) return fail(m.error().code, m.error().message);
        if (chosen_.verify(*m, kDialerRole, hello_payload_, nonce_l_) != 0) {
            (void)send_all(fd_.get(), proto::encode_error({-EACCES, "authentication failed"}));
            return fail(-EACCES, "authentication failed: " + hello_.from + " does not prove the shared secret " +
                                     (secret.enabled() ? "(wrong auth.secret_file?)" : "(it has one; this host has none)"));
        }
        if (authenticated_)
            if (auto ok = authenticated_(hello_); !ok) {
                (void)send_all(fd_.get(), proto::encode_error({ok.error().code, ok.error().message}));
                return fail(ok.error().code, ok.error().message);
            }
        proto::PeerAccept a{me_.generation, hello_.version, me_.hosts, me_.config_version, me_.instance, {}};
        if (a.version >= 7) a.mac = chosen_.mac(kAcceptRole, cat(hello_payload_, proto::peer_accept_fields(a)), nonce_l_);
        if (auto s = send_all(fd_.get(), proto::encode_peer_accept(a)); !s) return fail(s.error().code, s.error().message);
        peer_hosts_ = hello_.hosts;
        peer_config_version_ = hello_.config_version;
        peer_instance_ = hello_.instance;
        state_ = State::Up;
        return state_;
    }
    case State::WaitChallenge: {
        if (f.type != proto::FrameType::PeerChallenge) return fail(-EPROTO, "expected a peer challenge");
        auto c = proto::decode_peer_challenge(f.payload);
        if (!c) return fail(c.error().code, c.error().message);
        which_ = secret.verify(c->mac, kListenerRole, hello_payload_, c->nonce);
        if (which_ >= 0) chosen_ = secret.only(which_);
        if (which_ < 0)
            return fail(-EACCES, "authentication failed: " + hello_.to + " does not prove the shared secret " +
                                     (secret.enabled() ? "(wrong auth.secret_file?)" : "(it has one; this host has none)"));
        nonce_l_ = c->nonce;
        if (auto s = send_all(fd_.get(), proto::encode_peer_auth(chosen_.mac(kDialerRole, hello_payload_, nonce_l_))); !s)
            return fail(s.error().code, s.error().message);
        state_ = State::WaitAccept;
        return state_;
    }
    case State::WaitAccept: {
        if (f.type != proto::FrameType::PeerAccept) return fail(-EPROTO, "expected peer accept");
        if (f.version != (hello_.version >= 7 ? hello_.version : proto::kPeerBaseVersion))
            return fail(-EPROTO, "peer accept of version " + std::to_string(f.version) + " for a hello of " +
                                     std::to_string(hello_.version));
        auto g = proto::decode_peer_accept(f.payload, f.version);
        if (!g) return fail(g.error().code, g.error().message);
        if (g->version >= 7 && chosen_.verify(g->mac, kAcceptRole, cat(hello_payload_, proto::peer_accept_fields(*g)), nonce_l_) != 0)
            return fail(-EACCES, "the peer accept from " + hello_.to + " fails its MAC check (changed on the way?)");
        peer_generation_ = g->generation;
        peer_hosts_ = g->hosts;
        peer_config_version_ = g->config_version;
        peer_instance_ = g->instance;
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
    return chosen_.session_keys(dialer_, hello_payload_, nonce_l_);
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
