#include "daemon/control/peer_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <sstream>

namespace ringd {

Result<PeerSecret> PeerSecret::load(const std::string &path) {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0)
        return make_error(-errno, "auth.secret_file: cannot read " + path + ": " + std::strerror(errno));
    if (st.st_mode & S_IROTH)
        return make_error(-EPERM, "auth.secret_file: " + path + " is readable by everyone; chmod 0600 or 0640 it");
    std::ifstream in(path, std::ios::binary);
    if (!in) return make_error(-EACCES, "auth.secret_file: cannot read " + path);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string key = ss.str();
    while (!key.empty() && (key.back() == '\n' || key.back() == '\r' || key.back() == ' ' || key.back() == '\t'))
        key.pop_back();
    if (key.size() < 16)
        return make_error(-EINVAL, "auth.secret_file: " + path + " holds " + std::to_string(key.size()) +
                                       " bytes; use at least 16 (e.g. openssl rand -hex 32)");
    return from_bytes(std::move(key));
}

void PeerSecret::rotate(PeerSecret next, Clock::time_point previous_until) {
    previous_ = std::move(key_);
    previous_until_ = previous_until;
    key_ = std::move(next.key_);
}

proto::KeyId PeerSecret::key_id(int which) const {
    proto::KeyId id{};
    if (which == 1 ? !has_previous() : !enabled()) return id;
    const std::string &k = key(which);
    static constexpr std::string_view kLabel = "ringd key id";
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    HMAC(EVP_sha256(), k.data(), static_cast<int>(k.size()), reinterpret_cast<const uint8_t *>(kLabel.data()),
         kLabel.size(), md, &len);
    std::memcpy(id.data(), md, id.size());
    return id;
}

int PeerSecret::match(const proto::KeyId &id) const {
    if (id == proto::KeyId{}) return -1;
    for (int which : {0, 1})
        if (key_id(which) != proto::KeyId{} && key_id(which) == id) return which;
    return -1;
}

proto::Mac PeerSecret::mac(std::string_view role, std::span<const uint8_t> hello_payload, const proto::Nonce &nonce_l,
                           int which) const {
    proto::Mac out{};
    if (!enabled()) return out;
    const std::string &k = key(which);
    std::vector<uint8_t> msg;
    msg.reserve(role.size() + hello_payload.size() + nonce_l.size());
    msg.insert(msg.end(), role.begin(), role.end());
    msg.insert(msg.end(), hello_payload.begin(), hello_payload.end());
    msg.insert(msg.end(), nonce_l.begin(), nonce_l.end());
    unsigned int len = 0;
    HMAC(EVP_sha256(), k.data(), static_cast<int>(k.size()), msg.data(), msg.size(), out.data(), &len);
    return out;
}

int PeerSecret::verify(const proto::Mac &got, std::string_view role, std::span<const uint8_t> hello_payload,
                       const proto::Nonce &nonce_l) const {
    for (int which : {0, 1}) {
        if (which == 1 && !has_previous()) break;
        const proto::Mac want = mac(role, hello_payload, nonce_l, which);
        if (CRYPTO_memcmp(want.data(), got.data(), want.size()) == 0) return which;
    }
    return -1;
}

SessionKeys PeerSecret::session_keys(bool dialer, std::span<const uint8_t> hello_payload, const proto::Nonce &nonce_l,
                                     int which) const {
    SessionKeys k;
    if (!enabled()) return k;
    k.enabled = true;
    const proto::Mac d2l = mac("ringd frames dialer to listener", hello_payload, nonce_l, which);
    const proto::Mac l2d = mac("ringd frames listener to dialer", hello_payload, nonce_l, which);
    static_assert(sizeof(proto::Mac) == sizeof(SessionKey));
    std::memcpy(k.send.data(), (dialer ? d2l : l2d).data(), k.send.size());
    std::memcpy(k.recv.data(), (dialer ? l2d : d2l).data(), k.recv.size());
    return k;
}

std::string key_id_hex(const proto::KeyId &id) {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string s;
    for (uint8_t x : id) {
        s += kDigits[x >> 4];
        s += kDigits[x & 15];
    }
    return s;
}

proto::Nonce random_nonce() {
    proto::Nonce n{};
    if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
        // The CSPRNG failing is not something to run on: a predictable nonce would allow replay.
        std::abort();
    }
    return n;
}

}  // namespace ringd
