#include "common/status_client.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
#include <vector>

#include "common/fd_io.h"
#include "proto/frame.h"

namespace ringd {

Result<std::string> fetch_status(const std::string &path, int timeout_ms, uint32_t flags) {
    UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof addr.sun_path) return make_error(-ENAMETOOLONG, "socket path is too long");
    std::strcpy(addr.sun_path, path.c_str());
    if (::connect(sock.get(), reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0)
        return make_error(-errno, "cannot connect to ringd at " + path + ": " + errno_string(errno));
    return fetch_status_over(sock.get(), timeout_ms, flags);
}

Result<std::string> fetch_status_over(int sock_fd, int timeout_ms, uint32_t flags) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    // A ringd that refuses this caller (allow_uids/allow_gids) says why and closes at once: the
    // request may then fail to go (EPIPE) while the reason waits in the socket, so it is read
    // either way.
    const auto sent = send_all(sock_fd, proto::encode_status_request({flags}));
    std::vector<UniqueFd> fds;
    uint8_t hdr[proto::kFrameHeaderBytes];
    if (!sent) {
        if (recv_exact(sock_fd, hdr, sizeof hdr, Clock::now() + std::chrono::seconds(1), fds)) {
            auto h = proto::decode_frame_header(std::span(hdr, sizeof hdr), proto::kMaxDaemonPayload);
            std::vector<uint8_t> payload(h ? h->length : 0);
            if (h && h->type == proto::FrameType::Error &&
                recv_exact(sock_fd, payload.data(), payload.size(), Clock::now() + std::chrono::seconds(1), fds)) {
                if (auto e = proto::decode_error(payload)) return make_error(e->code, "ringd refused: " + e->message);
            }
        }
        return sent.error();
    }
    if (auto s = recv_exact(sock_fd, hdr, sizeof hdr, deadline, fds); !s) return s.error();
    auto h = proto::decode_frame_header(std::span(hdr, sizeof hdr), proto::kMaxDaemonPayload);
    if (!h) return h.error();
    std::vector<uint8_t> payload(h->length);
    if (auto s = recv_exact(sock_fd, payload.data(), payload.size(), deadline, fds); !s) return s.error();
    if (h->type == proto::FrameType::Error) {
        auto e = proto::decode_error(payload);
        return make_error(e ? e->code : -EPROTO, e ? "ringd refused: " + e->message : e.error().message);
    }
    if (h->type != proto::FrameType::StatusReply) return make_error(-EPROTO, "unexpected reply from ringd");
    return proto::decode_status_reply(payload);
}

}  // namespace ringd
