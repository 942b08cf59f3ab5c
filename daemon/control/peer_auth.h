// Shared-secret authentication between daemons: HMAC-SHA256 (OpenSSL) over the handshake
// transcript, constant-time comparison, nonces from the OpenSSL CSPRNG.
#pragma once

#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "daemon/transport/frame_mac.h"
#include "proto/peer.h"

namespace ringd {

// The secret, and during a rotation the one before it: a reload that finds a new secret in
// auth.secret_file makes it the one this host proves itself with, and accepts the previous one
// for auth.rotation_grace more, so that the hosts of a ring can be given the new secret one by
// one without a connection failing (proto/peer.h: the hello names the dialer's key ids, and the
// listener answers with a secret the dialer has). `which`: 0 the secret, 1 the previous one.
class PeerSecret {
public:
    using Clock = std::chrono::steady_clock;
    PeerSecret() = default;  // no authentication: MACs are all zero
    // Reads auth.secret_file: at least 16 bytes after trimming trailing whitespace; a file that
    // others can read is refused.
    static Result<PeerSecret> load(const std::string &path);
    static PeerSecret from_bytes(std::string key) {
        PeerSecret s;
        s.key_ = std::move(key);
        return s;
    }
    bool enabled() const { return !key_.empty(); }
    bool same_key(const PeerSecret &o) const { return key_ == o.key_; }

    // `next` becomes the secret; this one is accepted until `previous_until`.
    void rotate(PeerSecret next, Clock::time_point previous_until);
    // One of the secrets alone (a handshake keeps the one it chose: a reload meanwhile changes
    // nothing of it).
    PeerSecret only(int which) const { return from_bytes(key(which)); }
    // Whether the previous secret is still accepted (its grace has not ended).
    bool has_previous(Clock::time_point now = Clock::now()) const {
        return !previous_.empty() && now < previous_until_;
    }
    // How long the previous secret is still accepted (zero: not at all).
    Clock::duration previous_left(Clock::time_point now = Clock::now()) const {
        return has_previous(now) ? previous_until_ - now : Clock::duration::zero();
    }
    // A secret's id: HMAC(secret, "ringd key id"), 8 bytes (all zero: none). It tells which
    // secret a peer has, and says nothing of the secret itself.
    proto::KeyId key_id(int which = 0) const;
    // Which of this host's secrets matches a peer's key id (-1: none).
    int match(const proto::KeyId &id) const;

    // HMAC(secret, role | hello payload | listener nonce); all zero when disabled.
    proto::Mac mac(std::string_view role, std::span<const uint8_t> hello_payload, const proto::Nonce &nonce_l,
                   int which = 0) const;
    // Constant-time check of a MAC received from the peer, against the secret and (in its grace)
    // the previous one: which of them made it, or -1.
    int verify(const proto::Mac &got, std::string_view role, std::span<const uint8_t> hello_payload,
               const proto::Nonce &nonce_l) const;
    // The keys of a connection whose handshake succeeded, as the dialer or the listener uses them
    // (daemon/transport/frame_mac.h): HMAC(secret, direction label | hello payload | listener
    // nonce) per direction, so both nonces and every hello field make them the connection's own.
    // Disabled without a secret.
    SessionKeys session_keys(bool dialer, std::span<const uint8_t> hello_payload, const proto::Nonce &nonce_l,
                             int which = 0) const;

private:
    const std::string &key(int which) const { return which == 1 ? previous_ : key_; }
    std::string key_;
    std::string previous_;
    Clock::time_point previous_until_{};
};

proto::Nonce random_nonce();
// A key id (or host-list digest) as 16 hex digits.
std::string key_id_hex(const proto::KeyId &id);

}  // namespace ringd
