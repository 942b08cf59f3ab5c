#include "daemon/transport/frame_mac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "proto/le.h"
#include "proto/peer.h"

namespace ringd {
namespace {

[[noreturn]] void crypto_failed(const char *what) {
    // Not something to run on: a MAC that cannot be computed is no check at all.
    std::fprintf(stderr, "ringd: OpenSSL %s failed\n", what);
    std::abort();
}

}  // namespace

FrameMac::FrameMac(const SessionKey &key) : ctx_(EVP_CIPHER_CTX_new()) {
    if (!ctx_) crypto_failed("EVP_CIPHER_CTX_new");
    if (EVP_EncryptInit_ex(ctx_, EVP_aes_256_gcm(), nullptr, key.data(), nullptr) != 1) crypto_failed("EVP_EncryptInit_ex");
}

FrameMac::FrameMac(FrameMac &&o) noexcept : ctx_(std::exchange(o.ctx_, nullptr)), seq_(std::exchange(o.seq_, 0)) {}

FrameMac &FrameMac::operator=(FrameMac &&o) noexcept {
    if (this != &o) {
        if (ctx_) EVP_CIPHER_CTX_free(ctx_);
        ctx_ = std::exchange(o.ctx_, nullptr);
        seq_ = std::exchange(o.seq_, 0);
    }
    return *this;
}

FrameMac::~FrameMac() {
    if (ctx_) EVP_CIPHER_CTX_free(ctx_);
}

Tag FrameMac::compute(std::initializer_list<std::span<const uint8_t>> parts) {
    // 96-bit IV: 4 zero bytes and the frame number. The key is the connection's and the
    // direction's alone, so an IV is never used twice under one key.
    uint8_t iv[12] = {};
    proto::le::put<uint64_t>(&iv[4], seq_++);
    if (EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, iv) != 1) crypto_failed("EVP_EncryptInit_ex (IV)");
    int len = 0;
    for (const auto &p : parts) {
        // Additional data only: GHASH over it, nothing encrypted. OpenSSL takes an int length.
        size_t off = 0;
        while (off < p.size()) {
            const int n = static_cast<int>(std::min<size_t>(p.size() - off, 1u << 30));
            if (EVP_EncryptUpdate(ctx_, nullptr, &len, p.data() + off, n) != 1) crypto_failed("EVP_EncryptUpdate");
            off += static_cast<size_t>(n);
        }
    }
    uint8_t none[16];
    if (EVP_EncryptFinal_ex(ctx_, none, &len) != 1) crypto_failed("EVP_EncryptFinal_ex");
    Tag t{};
    if (EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, static_cast<int>(t.size()), t.data()) != 1)
        crypto_failed("EVP_CTRL_GCM_GET_TAG");
    return t;
}

Tag FrameMac::seal(std::initializer_list<std::span<const uint8_t>> parts) { return compute(parts); }

bool FrameMac::open(std::initializer_list<std::span<const uint8_t>> parts, const Tag &tag) {
    const Tag want = compute(parts);
    return CRYPTO_memcmp(want.data(), tag.data(), want.size()) == 0;
}

SessionMac::SessionMac(const SessionKeys &k) {
    if (!k.enabled) return;
    send = FrameMac(k.send);
    recv = FrameMac(k.recv);
}

proto::Bytes seal_frame(FrameMac &mac, std::span<const uint8_t> frame) {
    proto::Bytes out;
    out.reserve(frame.size() + kTagBytes);
    out.assign(frame.begin(), frame.end());
    seal_frame_in_place(mac, out);
    return out;
}

static_assert(proto::kFrameSealRoom == kTagBytes, "encoders reserve room for the tag");

void seal_frame_in_place(FrameMac &mac, proto::Bytes &frame) {
    const size_t n = frame.size();
    const auto type = static_cast<proto::FrameType>(proto::le::get<uint16_t>(&frame[6]));
    proto::put_frame_header(frame.data(), type, static_cast<uint32_t>(n - proto::kFrameHeaderBytes + kTagBytes));
    const Tag t = mac.seal({std::span<const uint8_t>(frame.data(), n)});
    frame.insert(frame.end(), t.begin(), t.end());
}

Status open_frame(FrameMac &mac, Frame &f) {
    if (f.payload.size() < kTagBytes)
        return make_error(-EPROTO, "frame without its MAC (" + std::to_string(f.payload.size()) + " bytes)");
    uint8_t header[proto::kFrameHeaderBytes];
    proto::put_frame_header(header, f.type, static_cast<uint32_t>(f.payload.size()));
    const size_t n = f.payload.size() - kTagBytes;
    Tag tag;
    std::memcpy(tag.data(), f.payload.data() + n, kTagBytes);
    if (!mac.open({std::span<const uint8_t>(header), std::span<const uint8_t>(f.payload.data(), n)}, tag))
        return make_error(-EACCES, "frame " + std::to_string(mac.frames() - 1) +
                                       " fails its MAC check (forged, replayed, reordered or corrupted)");
    f.payload.resize(n);
    return Ok{};
}

}  // namespace ringd
