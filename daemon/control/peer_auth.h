// Shared-secret authentication between daemons: HMAC-SHA256 (OpenSSL) over the handshake
// transcript, constant-time comparison, nonces from the OpenSSL CSPRNG.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "daemon/transport/frame_mac.h"
#include "proto/peer.h"

namespace ringd {

class PeerSecret {
public:
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

    // HMAC(secret, role | hello payload | listener nonce); all zero when disabled.
    proto::Mac mac(std::string_view role, std::span<const uint8_t> hello_payload, const proto::Nonce &nonce_l) const;
    // Constant-time check of a MAC received from the peer.
    bool verify(const proto::Mac &got, std::string_view role, std::span<const uint8_t> hello_payload,
                const proto::Nonce &nonce_l) const;
    // The keys of a connection whose handshake succeeded, as the dialer or the listener uses them
    // (daemon/transport/frame_mac.h): HMAC(secret, direction label | hello payload | listener
    // nonce) per direction, so both nonces and every hello field make them the connection's own.
    // Disabled without a secret.
    SessionKeys session_keys(bool dialer, std::span<const uint8_t> hello_payload, const proto::Nonce &nonce_l) const;

private:
    std::string key_;
};

proto::Nonce random_nonce();

}  // namespace ringd
