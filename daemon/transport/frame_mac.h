// Frame authentication on an established connection between daemons.
//
// The peer handshake (proto/peer.h) proves the shared secret; with one configured it also gives
// each connection two keys of its own, one per direction, derived from the secret, the whole
// hello and both nonces (PeerSecret::session_keys). From then on every frame on the connection
// carries a 16-byte tag: AES-256-GCM used as a MAC (GMAC — the frame is authenticated, not
// encrypted) under the direction's key, with the frame's number in that direction (counted from 0
// by both ends, never sent) as the IV. A frame that is forged, replayed, reordered, dropped or
// taken from another connection or direction fails its check, and the connection is closed.
//
//   control frames  header (length includes the tag) | payload | tag        seal_frame/open_frame
//   TCP data        24-byte data header | payload | tag    (auth.data: mac, TcpTransport)
//
// Without a secret nothing is tagged: SessionKeys::enabled is false.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>

#include "common/frame_reader.h"
#include "proto/frame.h"

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;

namespace ringd {

inline constexpr size_t kSessionKeyBytes = 32;
inline constexpr size_t kTagBytes = 16;
using SessionKey = std::array<uint8_t, kSessionKeyBytes>;
using Tag = std::array<uint8_t, kTagBytes>;

// The keys of one connection, as this end uses them.
struct SessionKeys {
    bool enabled = false;
    SessionKey send{}, recv{};
};

// One direction of one connection. Not thread-safe: one thread seals (or opens) at a time.
class FrameMac {
public:
    FrameMac() = default;  // disabled: seal/open must not be called
    explicit FrameMac(const SessionKey &key);
    FrameMac(FrameMac &&o) noexcept;
    FrameMac &operator=(FrameMac &&o) noexcept;
    FrameMac(const FrameMac &) = delete;
    FrameMac &operator=(const FrameMac &) = delete;
    ~FrameMac();

    bool enabled() const { return ctx_ != nullptr; }
    // The tag of the next frame, made of `parts` in order; counts the frame.
    Tag seal(std::initializer_list<std::span<const uint8_t>> parts);
    // Whether `tag` is the next frame's (constant-time compare); counts the frame either way.
    bool open(std::initializer_list<std::span<const uint8_t>> parts, const Tag &tag);
    uint64_t frames() const { return seq_; }

private:
    Tag compute(std::initializer_list<std::span<const uint8_t>> parts);
    EVP_CIPHER_CTX *ctx_ = nullptr;
    uint64_t seq_ = 0;
};

// Both directions of a connection.
struct SessionMac {
    SessionMac() = default;
    explicit SessionMac(const SessionKeys &k);
    bool enabled() const { return send.enabled(); }
    FrameMac send, recv;
};

// A control frame (header + payload, as encoded) with its tag: the header's length grows by
// kTagBytes and the tag, over the new header and the payload, follows the payload.
proto::Bytes seal_frame(FrameMac &mac, std::span<const uint8_t> frame);
// The same on the frame itself: no copy of it (the tag is appended; an encoder that reserves
// kTagBytes of capacity past the frame spares the vector a move too).
void seal_frame_in_place(FrameMac &mac, proto::Bytes &frame);
// Checks and strips the tag of a frame read with a cap kTagBytes above the payload's; the error
// says what was wrong (the connection is to be closed).
Status open_frame(FrameMac &mac, Frame &frame);

}  // namespace ringd
