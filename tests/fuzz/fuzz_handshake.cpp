// libFuzzer: the peer handshake state machine (daemon/control/peer_handshake.h) facing a peer that
// sends arbitrary bytes, in both roles: as the listener (the bytes are the dialer's hello and
// proof) and as the dialer (they are the listener's challenge and accept). With a secret set, no
// input may bring a handshake Up: the fuzzer cannot know the fresh nonce's MAC, so Up would mean
// a check was skipped. The first input byte picks the role.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "daemon/control/peer_handshake.h"

using namespace ringd;

namespace {

const PeerSecret &secret() {
    static const PeerSecret s = PeerSecret::from_bytes("fuzzing-secret-0123456789abcdef");
    return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 32768) return 0;
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) return 0;
    int buf = 1 << 20;
    ::setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    ::setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    PeerIdentity me{"fuzz", "node0", 3, &secret(), ""};
    const bool listener = data[0] & 1;
    PeerHandshake h = listener ? PeerHandshake::listen(UniqueFd(sv[0]), me, [](const proto::PeerHello &) -> Status {
        return Ok{};
    })
                               : PeerHandshake::dial(UniqueFd(sv[0]), me, "node1", proto::ConnKind::Control, 0);
    // The peer's bytes, then its end of the connection.
    size_t off = 1;
    while (off < size) {
        const ssize_t n = ::send(sv[1], data + off, size - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += static_cast<size_t>(n);
    }
    ::shutdown(sv[1], SHUT_WR);
    for (int i = 0; i < 64; ++i) {
        const auto s = h.advance();
        if (s == PeerHandshake::State::Up) __builtin_trap();  // authenticated without the secret
        if (s == PeerHandshake::State::Failed) break;
    }
    ::close(sv[1]);
    return 0;
}
